"""Which entries policies keep on the fixture's text: the share of BOS entries and of the last 32
positions kept, over every layer, KV head and context (the table in eval/README.md).

    python eval/fidelity/kept_entries.py ../shared/fixtures/stories260K-hf eval/fidelity/stories260K_ids.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import kvjax

POLICIES = ("knorm_kvpress", "knorm", "snapkv_kvpress", "h2o", "random", "streaming_llm")


def kept_shares(model: kvjax.Model, contexts: list[list[int]], policy: str, ratio: float) -> tuple[float, float]:
    """(BOS entries kept, last-32 positions kept), each a mean over contexts, layers and KV heads."""
    cache = kvjax.engine.compress(model, contexts, policy=policy, compression_ratio=ratio)
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)  # [L, B, H, C]
    bos, recent = [], []
    for b, ctx in enumerate(contexts):
        bos_at = [i for i, t in enumerate(ctx) if t == model.config.bos_token_id]
        for l in range(pos.shape[0]):
            for h in range(pos.shape[2]):
                kept = pos[l, b, h][valid[l, b, h]]
                bos.append(np.isin(bos_at, kept).mean())
                recent.append(np.isin(np.arange(len(ctx) - 32, len(ctx)), kept).mean())
    return float(np.mean(bos)), float(np.mean(recent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("ids", help="token ids (JSON list), as make_ids.py writes them")
    ap.add_argument("--contexts", type=int, default=4)
    ap.add_argument("--length", type=int, default=480)
    ap.add_argument("--compression-ratio", type=float, default=0.25)
    args = ap.parse_args()
    model = kvjax.load_model(args.model)
    ids = json.loads(open(args.ids).read())
    contexts = [ids[i * args.length:(i + 1) * args.length] for i in range(args.contexts)]
    print("| policy | BOS entries kept | last 32 tokens kept |\n|---|---:|---:|")
    for policy in POLICIES:
        bos, recent = kept_shares(model, contexts, policy, args.compression_ratio)
        print(f"| {policy} | {bos:.2f} | {recent:.2f} |")


if __name__ == "__main__":
    main()
