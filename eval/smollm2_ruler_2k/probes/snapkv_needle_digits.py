"""Which of a needle's digit tokens SnapKV keeps on SmolLM2, question-agnostic vs query-aware (r=0.5)."""
import numpy as np
import kvjax
from kvjax import engine
from kvjax.eval.tasks import generate_task
from kvjax.eval.engine import _split_ids
from kvjax.data.prompts import chat_overhead
M = "../shared/fixtures/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
model = kvjax.load_model(M)
tok = model.tokenizer
samples = generate_task("niah_single_1", tok, 2048, 4, seed=42, overhead=chat_overhead(tok))
for qa in (False, True):
    ctxs, qs = _split_ids(samples, tok, qa)
    for s, ctx in zip(samples, ctxs):
        needle = tok.encode(s["answers"][0], add_special_tokens=False)
        # find the needle's token run in the context
        at = next((i for i in range(len(ctx) - len(needle)) if ctx[i:i + len(needle)] == needle), None)
        if at is None:
            needle = tok.encode(" " + s["answers"][0], add_special_tokens=False)
            at = next((i for i in range(len(ctx) - len(needle)) if ctx[i:i + len(needle)] == needle), None)
        cache = engine.compress(model, [ctx], policy="snapkv", compression_ratio=0.5)
        pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)  # [L, B, H, S]
        frac = [float(np.mean([(at + j) in set(pp[vv].tolist()) for pp, vv in zip(pos.reshape(-1, pos.shape[-1]), valid.reshape(-1, valid.shape[-1]))])) for j in range(len(needle))]
        print("query_aware" if qa else "agnostic", s["answers"][0], "at", at, "of", len(ctx), "tokens", [tok.decode([t]) for t in needle], "kept:", [round(f, 2) for f in frac])
