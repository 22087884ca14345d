"""How much of the needle each policy keeps on the bundled model (eval/README, "Default run").

For 4 niah_single_1 samples at 1,024 tokens, compresses the prompt at r=0.25 with `kvjax.engine.compress`,
question-agnostic and query-aware, and prints the fraction of the needle's value tokens kept, averaged over
KV heads (and per layer).

    python eval/default/needle_kept.py
"""

import numpy as np

import kvjax
from kvjax.data.prompts import build_prompt, encode_prompt
from kvjax.engine import compress
from kvjax.eval.tasks import generate_task


def main() -> None:
    model = kvjax.load_model("kvjax/assets/model")
    tok = model.tokenizer
    samples = generate_task("niah_single_1", tok, 1024, 4, seed=42)
    for query_aware in (False, True):
        for policy in ("snapkv", "snapkv_kvpress", "streaming_llm"):
            per_layer = []
            for s in samples:
                ids, _ = encode_prompt(build_prompt(s, tok, query_aware), tok)
                value = tok.encode(" " + s["answers"][0], add_special_tokens=False)[1:]  # the digits
                start = next(i for i in range(len(ids)) if ids[i:i + len(value)] == value)
                needle = set(range(start, start + len(value)))
                cache = compress(model, [ids], policy=policy, compression_ratio=0.25)
                pos, valid = np.asarray(cache.pos)[:, 0], np.asarray(cache.valid)[:, 0]  # [L, Hkv, C]
                per_layer.append([np.mean([len(needle & set(pos[l, h][valid[l, h]].tolist())) / len(needle)
                                           for h in range(pos.shape[1])]) for l in range(pos.shape[0])])
            layers = np.mean(per_layer, axis=0)
            mode = "query-aware" if query_aware else "question-agnostic"
            print(f"{mode:17s} {policy:15s} needle kept {layers.mean():.2f}  per layer {np.round(layers, 2)}")


if __name__ == "__main__":
    main()
