"""kvpress 0.5.5's pipeline with transformers' QuantizedCache on the exported kvjax RULER prompts.
Runs in the kvpress venv (see README.md), not in kvjax's environment:

    /work/venv_kvpress/bin/python eval/kvpress_quantized/run_kvpress.py \
        --prompts eval/kvpress_quantized/prompts.jsonl --out eval/kvpress_quantized/predictions.jsonl

Model: SmolLM2-135M-Instruct from the GGUF fixture, loaded by transformers (dequantized to float32).
Settings: press in {none, knorm (KnormPress 0.5)} x cache in {none (DynamicCache), quanto int4, quanto int2}
(QuantizedCache(backend="quanto", nbits, q_group_size=64, residual_length=128), transformers' defaults).
Greedy, max_new_tokens = the sample's (128, as kvjax.eval), question-agnostic (kvpress's `question=`).

Bytes per decode step: transformers' QuantizedLayer.update is wrapped to record, at every 1-token update
(a decode step), what the layer holds before it: n_q quantized tokens (codes: n_q*H*D*nbits/8 bytes per K and
V; scales and shifts: their element count x 2 bytes, at 16 bits) and n_r residual tokens (16 bits). On that
step the layer dequantizes all n_q tokens and concatenates them with the residual and the new token into a
full-size tensor, which attention reads: (n_q + n_r + 1)*H*D*2 bytes per K and V at 16 bits. Recorded per
sample (mean over decode steps, summed over layers):
  attn_read16   : the K/V tensors attention reads (dequantized, 16 bits, every token)
  deq_read16    : what the dequantization reads (codes + scales/shifts)
  stored16      : what the cache stores (codes + scales/shifts + residual at 16 bits)
  total_read16  : deq_read16 + residual read by the concatenation + attn_read16
For DynamicCache: attn_read16 = stored16 = total_read16 = n*H*D*2 per K and V.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, QuantizedCache, pipeline
from transformers import cache_utils

import kvpress  # noqa: F401  (registers the pipeline)
from kvpress import KnormPress, SnapKVPress

FIXTURE = "/work/shared/fixtures/smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

STEPS: list[dict] = []  # one dict per (decode step, layer) of the current sample


def _qbytes16(q) -> tuple[int, int]:
    """(code bytes, scale+shift bytes at 16 bits) of a quanto QBitsTensor."""
    nbits = q.qtype.bits
    codes = q.numel() * nbits // 8
    aux = sum(t.numel() * 2 for t in (getattr(q, "_scale", None), getattr(q, "_shift", None)) if t is not None)
    return codes, aux


_orig_q_update = cache_utils.QuantizedLayer.update
_orig_d_update = cache_utils.DynamicLayer.update


def _q_update(self, key_states, value_states, cache_kwargs=None):
    if self.is_initialized and key_states.shape[-2] == 1:
        _, h, _, d = key_states.shape
        nq = self._quantized_keys.shape[-2]
        nr = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        ck, ak = _qbytes16(self._quantized_keys)
        cv, av = _qbytes16(self._quantized_values)
        deq = ck + ak + cv + av
        attn = 2 * (nq + nr + 1) * h * d * 2
        resid = 2 * nr * h * d * 2
        STEPS.append({"nq": nq, "nr": nr, "attn_read16": attn, "deq_read16": deq, "stored16": deq + resid,
                      "total_read16": deq + resid + attn})
    return _orig_q_update(self, key_states, value_states, cache_kwargs)


def _d_update(self, key_states, value_states, cache_kwargs=None):
    if self.is_initialized and key_states.shape[-2] == 1 and not isinstance(self, cache_utils.QuantizedLayer):
        _, h, n, d = self.keys.shape
        b = 2 * (n + 1) * h * d * 2
        STEPS.append({"nq": 0, "nr": n, "attn_read16": b, "deq_read16": 0, "stored16": 2 * n * h * d * 2,
                      "total_read16": b})
    return _orig_d_update(self, key_states, value_states, cache_kwargs)


cache_utils.QuantizedLayer.update = _q_update
cache_utils.DynamicLayer.update = _d_update


def summarize(n_layers: int) -> dict:
    if not STEPS:
        return {}
    steps = len(STEPS) // n_layers
    out = {"decode_steps": steps}
    for k in ("attn_read16", "deq_read16", "stored16", "total_read16"):
        out[k] = int(round(sum(s[k] for s in STEPS) / steps))  # per step, all layers
    out["nq_first"] = STEPS[0]["nq"]
    out["nr_first"] = STEPS[0]["nr"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--presses", nargs="+", default=["none", "knorm"])
    ap.add_argument("--caches", nargs="+", default=["none", "int4", "int2"])
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--backend", default="quanto")
    ap.add_argument("--limit", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(FIXTURE, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, gguf_file=GGUF, dtype=torch.float32).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    n_layers = model.config.num_hidden_layers
    samples = [json.loads(l) for l in open(a.prompts)]
    if a.limit:
        samples = samples[: a.limit]
    out_path = pathlib.Path(a.out)
    done = set()
    if out_path.exists():
        done = {(r["id"], r["press"], r["cache"]) for r in map(json.loads, open(out_path))}
    fh = open(out_path, "a")
    for s in samples:
        ids = pipe.preprocess(s["context"], [s["question"]], s["answer_prefix"], max_context_length=10**9)
        same = (ids["context_ids"][0].tolist() == s["kvjax_context_ids"]
                and ids["questions_ids"][0][0].tolist() == s["kvjax_question_ids"])
        for press_name in a.presses:
            for cache_name in a.caches:
                if (s["id"], press_name, cache_name) in done:
                    continue
                press = {"none": None, "knorm": KnormPress(compression_ratio=a.ratio),
                         "snapkv": SnapKVPress(compression_ratio=a.ratio)}[press_name]
                cache = (DynamicCache() if cache_name == "none" else
                         QuantizedCache(backend=a.backend, config=model.config, nbits=int(cache_name[3:])))
                STEPS.clear()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    text = pipe(s["context"], question=s["question"], answer_prefix=s["answer_prefix"], press=press,
                                cache=cache, max_new_tokens=s["max_new_tokens"])["answer"]
                row = {"task": s["task"], "id": s["id"], "press": press_name, "cache": cache_name,
                       "backend": a.backend if cache_name != "none" else None, "ratio": a.ratio if press else None,
                       "text": text, "same_ids_as_kvjax": same, "context_tokens": len(s["kvjax_context_ids"]),
                       "seconds": round(time.perf_counter() - t0, 2), **summarize(n_layers)}
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                print(s["id"], press_name, cache_name, row["seconds"], repr(text[:60]), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
