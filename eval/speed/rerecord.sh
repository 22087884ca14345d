#!/usr/bin/env bash
# Issue 28's speed table, re-recorded in one go on a quiet machine (pause every other job first).
# Each bench writes its own report under eval/speed/<date>/; eval/speed/README.md summarises them.
#   bash eval/speed/rerecord.sh [OUT_DIR] [KVPRESS_PYTHON]
# About 35 minutes on 2 CPU cores. A part that fails prints a line and the next part runs.
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-eval/speed/$(date -u +%Y-%m-%d)}
KVPRESS=${2:-}
mkdir -p "$OUT"
run() {  # name, command...: time it, keep its output, go on on failure
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  local t0=$SECONDS
  if "$@" > "$OUT/$name.log" 2>&1; then
    echo "   done in $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
  else
    echo "   FAILED (exit $?) after $((SECONDS - t0)) s: see $OUT/$name.log" | tee -a "$OUT/log.txt"
  fi
}
uptime | tee -a "$OUT/log.txt"
# KVzip and column mass (H2O's observed attention) over the plain prefill, 4K / 8K
run overhead python -m kvjax.bench overhead --policies kvzip,h2o_prefill --lengths 4096,8192 --repeats 3 \
    --out "$OUT/overhead.md"
# column mass at 4K / 16K on the 8-layer bench model, beside transformers' sdpa
run prefill python -m kvjax.bench prefill --lengths 4096 16384 --repeats 3 --out "$OUT/prefill.md"
# one whole request vs kvpress, warm and cold
if [[ -n "$KVPRESS" ]]; then
  run e2e python -m kvjax.bench e2e --kvpress-python "$KVPRESS" --out "$OUT/e2e.md"
else
  run e2e python -m kvjax.bench e2e --out "$OUT/e2e.md"
fi
# a mixed batch vs one by one: SnapKV + 32 tokens, and the full cache + 1 token
run batch_snapkv python -m kvjax.bench batch --repeats 3 --out "$OUT/batch_snapkv.md"
run batch_full python -m kvjax.bench batch --policy none --new-tokens 1 --repeats 3 --out "$OUT/batch_full.md"
# the default eval, cold (an empty persistent compilation cache, which it fills) then warm (the same cache)
CACHE=$(mktemp -d)
run eval_cold /usr/bin/time -v python -m kvjax.eval --compilation-cache "$CACHE" --no-progress --out "$OUT/eval_cold"
run eval_warm /usr/bin/time -v python -m kvjax.eval --compilation-cache "$CACHE" --no-progress --out "$OUT/eval_warm"
rm -rf "$CACHE"
uptime | tee -a "$OUT/log.txt"
