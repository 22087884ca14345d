"""Token ids for the fidelity task: text sampled from the model itself.

For a model without a tokenizer (the stories260K fixture) this is its only text; for a model with one
(SmolLM2) it is text no adapter trained on (LookaheadKV's training prompts are the project's generated
tasks over built-in prose, which the fidelity task's own default text is made of). Sequences sampled at
temperature 1 from BOS, each BOS + tokens up to its EOS (or `--length` tokens), concatenated.

    python eval/fidelity/make_ids.py ../shared/fixtures/stories260K-hf eval/fidelity/stories260K_ids.json
    python eval/fidelity/make_ids.py ../shared/fixtures/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
        eval/fidelity/smollm2_ids.json --tokens 20480 --length 1280
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import numpy as np

import kvjax


def sample_ids(model_path: str, num_tokens: int, seed: int = 0, batch: int = 16, length: int | None = None
               ) -> list[int]:
    model = kvjax.load_model(model_path)
    bos = model.config.bos_token_id
    limit = model.config.max_position_embeddings - 1
    if length is not None:
        if not 0 < length <= limit:
            raise ValueError(f"length must be in (0, {limit}] (the model's positions), got {length}")
        limit = length
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
    ap.add_argument("--length", type=int, default=None,
                    help="tokens sampled per sequence at most (default: the model's positions - 1)")
    args = ap.parse_args()
    ids = sample_ids(args.model, args.tokens, args.seed, length=args.length)
    pathlib.Path(args.out).write_text(json.dumps(ids))
    print(f"wrote {len(ids)} token ids to {args.out}")


if __name__ == "__main__":
    main()
