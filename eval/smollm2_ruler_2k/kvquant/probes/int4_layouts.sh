#!/usr/bin/env bash
# The int4-layout probe of eval/README.md (issue 26): int4 / int4_g32 / int4_kivi on niah_multikey_1 (and
# niah_multivalue, not reached), the full cache and KVzip r=0.5, 4 samples. Run from the repository root.
python -m kvjax.eval --model ../shared/fixtures/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
  --tasks niah_multikey_1 niah_multivalue --policies kvzip --compression-ratios 0.5 --kv-quant int4 int4_kivi int4_g32 \
  --context-length 2048 --num-samples 4 --batch-size 4 --seed 42 --out runs/probe_int4_layouts
