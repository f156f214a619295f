cd /tmp/h26p
V='{"selector": {"name": "collision_rerank", "votes": "head_max"'
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/h26p/snap /work/main/.venv/bin/python -m kvpolicy eval --model gemma3 --device cpu \
  --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery --lengths 8192 --budgets 512 --seeds 0,1 \
  --presets t8,cf0.4 \
  --variant "cf0.4=pariskv:$V, \"candidate_fraction\": 0.4}}" --variant "t8=pariskv:$V, \"tiers\": 8}}" \
  --out /work/main/docs/eval/pariskv_gemma/session26/variants_8k_b
echo done
