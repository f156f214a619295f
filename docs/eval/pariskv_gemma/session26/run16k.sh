cd /tmp/h26p
V='{"selector": {"name": "collision_rerank", "votes": "head_max"'
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/h26p/snap /work/main/.venv/bin/python -m kvpolicy eval --model gemma3 --device cpu \
  --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery --lengths 16384 --budgets 512 --seeds 0,1 \
  --presets pariskv,t8,cf0.5 \
  --variant "cf0.5=pariskv:$V, \"candidate_fraction\": 0.5}}" --variant "t8=pariskv:$V, \"tiers\": 8}}" \
  --out /work/main/docs/eval/pariskv_gemma/session26/check_16k
echo done
