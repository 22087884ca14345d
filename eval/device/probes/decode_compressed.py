"""Probe: is decoding over a compressed cache slower than over the full one at 32K? (the device check)

Both H200 device reports show SnapKV and LookaheadKV at r=0.5 decoding 32K prompts at 8.6-12.3 ms per
token where the full cache takes 4.3 (at 8K the compressed caches are faster, 3.2 against 4.1). The decode
programs of the two settings are the same up to the cache's capacity (their optimised CPU HLO differs only in
shapes), and the report's decode time is a difference of two calls of ~0.3-0.8 s over 63 tokens. This times
many more tokens: `kvjax.generate` with max_new_tokens = 64 and 512 in one compiled loop (decode_tokens=512),
the difference over 448 tokens, median of `--repeats` alternating runs, on the device bench's 1.1B model:
full 32K, full 16K (the capacity SnapKV r=0.5 keeps at 32K), SnapKV r=0.5 at 32K, SnapKV r=0.5 at 8K.

    python eval/device/probes/decode_compressed.py [--tiny] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

from kvjax import generate
from kvjax.bench.device import SIZES, build_model, prompt_ids
from kvjax.bench.prefill import alternating_medians


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    sz = dict(SIZES["tiny" if args.tiny else "full"])
    scale = 32 if args.tiny else 1
    sz["context_cap"] = 32768 // scale + 512  # positions for the prompt and the decoded tokens
    model = build_model(sz)
    short, long = 64, 512
    settings = [("full", 32768 // scale, {}), ("full", 16384 // scale, {}),
                ("snapkv r=0.5", 32768 // scale, dict(policy="snapkv", compression_ratio=0.5)),
                ("snapkv r=0.5", 8192 // scale, dict(policy="snapkv", compression_ratio=0.5))]
    rows = []
    for label, length, kw in settings:
        prompt = prompt_ids(length, sz["vocab"])
        start = time.time()

        def gen(n: int, kw=kw, prompt=prompt):
            return generate(model, [prompt], max_new_tokens=n, decode_tokens=long, stop_tokens=[], **kw)

        out = gen(long)
        t_short, t_long = alternating_medians([lambda: gen(short), lambda: gen(long)], args.repeats)
        row = dict(setting=label, prompt=length, kept=int(out.kept[0]), ms_per_token=(t_long - t_short) /
                   (long - short) * 1e3, call_short_s=t_short, call_long_s=t_long, wall_s=time.time() - start)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
