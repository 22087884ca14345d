"""How much of each answer value a policy keeps, question-agnostic, on RULER's needle tasks (issue 27).

For every sample the answer values' tokens are located in the compressed context (the first occurrence of
each value), and the probe reports, per policy and pooling, the share of those tokens kept (mean over layers
and KV heads), split into the value's first and second half: a scorer that finds a needle but keeps only
its first tokens (the OOD adapter on UUIDs) shows a high first half and a low second half.

    python eval/lookahead_ablations/value_coverage.py --adapter runs/lookahead_ablations/data_codes/export \\
        --tasks niah_single_3 niah_multivalue --num-samples 4 --compression-ratio 0.5 \\
        --pooling 15:0 15:7 15:0:16 15:0:0:30:0.5 --policies kvzip snapkv
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import kvjax
from kvjax.data.prompts import build_prompt, chat_overhead, encode_prompt
from kvjax.eval.tasks import generate_task
from kvjax.lookahead import load
from kvjax.policies.lookahead import LookaheadKV

MODEL = "../shared/fixtures/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def value_spans(ids: list[int], tokenizer, values: list[str]) -> list[range]:
    """Token ranges of each value's first occurrence in the decoded context (tokens overlapping it)."""
    pieces = [tokenizer.decode([t]) for t in ids]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    text = "".join(pieces)
    spans = []
    for v in values:
        at = text.find(v)
        if at < 0:
            raise ValueError(f"value {v!r} not found in the context")
        first = int(np.searchsorted(starts, at, side="right") - 1)
        last = int(np.searchsorted(starts, at + len(v), side="left"))
        spans.append(range(first, last))
    return spans


def coverage(cache, b: int, span: range, lead: int = 0) -> tuple[float, ...]:
    """(share of the span's first half kept, of its second half), mean over layers and KV heads; with `lead` > 0,
    first the share of the `lead` tokens before the span (a needle's key: "... numbers for rare-napkin is:")."""
    pos, valid = np.asarray(cache.pos[:, b]), np.asarray(cache.valid[:, b])  # [L, H, C]
    idx = np.asarray(span)
    half = max(1, len(idx) // 2)
    parts = [idx[:half], idx[half:]]
    if lead:
        parts.insert(0, np.arange(max(0, span.start - lead), span.start))
    out = []
    for part in parts:
        kept = [np.isin(part, pos[l, h][valid[l, h]]).mean() for l in range(pos.shape[0]) for h in range(pos.shape[1])]
        out.append(float(np.mean(kept)) if len(part) else float("nan"))
    return tuple(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapter", required=True, help="a trained LookaheadKV adapter folder (its export)")
    ap.add_argument("--tasks", nargs="+", default=["niah_single_3", "niah_multivalue", "niah_multikey_1"])
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--samples", type=int, nargs="*", help="only these sample indices (< --num-samples)")
    ap.add_argument("--lead", type=int, default=0, help="also report the share kept of the LEAD tokens before "
                    "each value (its key), as the first of three numbers")
    ap.add_argument("--compression-ratio", type=float, default=0.5)
    ap.add_argument("--pooling", nargs="+", default=["7:0", "15:0", "15:7", "31:15"],
                    help="KERNEL:POOL_OFFSET[:BRIDGE[:TAIL:TAIL_WEIGHT]] to score the adapter with (LookaheadConfig's "
                         "fields)")
    ap.add_argument("--policies", nargs="*", default=["kvzip"], help="training-free policies to compare")
    args = ap.parse_args()
    model = kvjax.load_model(MODEL)
    tok = model.tokenizer
    adapter = load(args.adapter)
    policies = {}
    for spec in args.pooling:
        fields = spec.split(":")
        kernel, offset, bridge, tail = ([int(x) for x in fields[:4]] + [0, 0])[:4]
        weight = float(fields[4]) if len(fields) > 4 else adapter.config.tail_weight
        conf = dataclasses.replace(adapter.config, kernel=kernel, pool_offset=offset, bridge=bridge, tail=tail,
                                   tail_weight=weight)
        policies[f"lookahead_kv {spec}"] = LookaheadKV(adapter=adapter.replace(config=conf))
    policies.update({p: p for p in args.policies})
    lead = f"the {args.lead} tokens before it / " if args.lead else ""
    print(f"r = {args.compression_ratio}; share of value tokens kept ({lead}first half / second half), mean over "
          "layers, KV heads and samples\n")
    print("| task | " + " | ".join(policies) + " |\n|---|" + "---:|" * len(policies))
    for task in args.tasks:
        samples = generate_task(task, tok, 2048, args.num_samples, overhead=chat_overhead(tok))
        if args.samples:
            samples = [samples[i] for i in args.samples]
        contexts, spans = [], []
        for s in samples:
            ctx, _ = encode_prompt(build_prompt(s, tok, query_aware=False), tok)
            contexts.append(ctx)
            spans.append(value_spans(ctx, tok, list(s["answers"])))
        row = []
        for policy in policies.values():
            cache = kvjax.engine.compress(model, contexts, policy=policy, compression_ratio=args.compression_ratio)
            cov = np.array([coverage(cache, b, sp, args.lead) for b, ss in enumerate(spans) for sp in ss])
            row.append(" / ".join(f"{c:.2f}" for c in cov.mean(axis=0)))
        print(f"| {task} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
