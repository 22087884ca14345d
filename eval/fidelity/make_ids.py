"""Token ids for the fidelity task on a model without a tokenizer (the stories260K fixture).

The fixture ships no tokenizer, so its fidelity text is its own: stories sampled from it at
temperature 1 from BOS, each story BOS + tokens up to its EOS, concatenated.

    python eval/fidelity/make_ids.py ../shared/fixtures/stories260K-hf eval/fidelity/stories260K_ids.json
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import numpy as np

import kvjax


def sample_ids(model_path: str, num_tokens: int, seed: int = 0, batch: int = 16) -> list[int]:
    model = kvjax.load_model(model_path)
    bos = model.config.bos_token_id
    limit = model.config.max_position_embeddings - 1
    ids: list[int] = []
    key = jax.random.PRNGKey(seed)
    while len(ids) < num_tokens:
        key, sub = jax.random.split(key)
        out = kvjax.generate(model, [[bos]] * batch, max_new_tokens=limit, temperature=1.0, key=sub)
        for row, n in zip(out.tokens, out.lengths):
            ids += [bos] + np.asarray(row[:n]).tolist()
    return ids[:num_tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ids = sample_ids(args.model, args.tokens, args.seed)
    pathlib.Path(args.out).write_text(json.dumps(ids))
    print(f"wrote {len(ids)} token ids to {args.out}")


if __name__ == "__main__":
    main()
