cd /tmp/h26p
V='{"selector": {"name": "collision_rerank", "votes": "head_max"'
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/h26p/snap /work/main/.venv/bin/python -m kvpolicy eval --model gemma3 --device cpu \
  --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery --lengths 8192 --budgets 512 --seeds 0,1 \
  --presets pariskv,cf0.3,cf0.35,cf0.5 \
  --variant "cf0.3=pariskv:$V, \"candidate_fraction\": 0.3}}" \
  --variant "cf0.35=pariskv:$V, \"candidate_fraction\": 0.35}}" \
  --variant "cf0.5=pariskv:$V, \"candidate_fraction\": 0.5}}" \
  --out /work/main/docs/eval/pariskv_gemma/session26/variants_8k_a
echo done
