cd /work/run_wt
export PYTHONPATH=/work/run_wt KVJAX_COMPILATION_CACHE=/work/runs/jaxcache
nice -n 10 python -m kvjax.eval --model ../shared/fixtures/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
  --tasks niah_multikey_1 niah_multivalue --policies kvzip --compression-ratios 0.5 --kv-quant int4 int4_kivi int4_g32 \
  --context-length 2048 --num-samples 4 --batch-size 4 --seed 42 --no-progress --out /work/runs/probe4/out
