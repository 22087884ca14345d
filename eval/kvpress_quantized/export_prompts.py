"""Exports the RULER samples that `python -m kvjax.eval --config configs/eval_smollm2_ruler_2k.yaml`
builds (same generators, tokenizer, chat overhead, seed, context length) as JSONL, for the kvpress side
(run_kvpress.py, in its own venv). Each line: task, sample id, context, question, answer_prefix, system,
answers, max_new_tokens, stop, and kvjax's own question-agnostic split (compressed text + ids, fed-after
text + ids) so that the kvpress side can check it tokenizes the same prompt.

    python eval/kvpress_quantized/export_prompts.py --tasks niah_single_1 niah_single_2 --num-samples 4 \
        --out eval/kvpress_quantized/prompts.jsonl

Scoring (main env, kvjax's metrics, the same truncation at the task's stop strings as kvjax.eval):

    python eval/kvpress_quantized/export_prompts.py --score eval/kvpress_quantized/predictions.jsonl \
        --prompts eval/kvpress_quantized/prompts.jsonl --out eval/kvpress_quantized/scored.jsonl
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from kvjax.data.prompts import build_prompt, chat_overhead, encode_prompt
from kvjax.eval.cli import load_config
from kvjax.eval.metrics import score_prediction
from kvjax.eval.runner import _truncate_at_stop
from kvjax.eval.tasks import TASKS, generate_task
from kvjax.models.gguf import GGUFFile
from kvjax.models.gguf_tokenizer import build_tokenizer


def export(args) -> None:
    cfg = load_config(args.config)
    model = pathlib.Path(cfg["model"])
    f = GGUFFile(model)
    tok = build_tokenizer(f.metadata, name=str(f.path))  # the tokenizer kvjax.load_model gives this GGUF
    overhead = chat_overhead(tok)
    rows = []
    for task in args.tasks:
        made = generate_task(task, tok, int(cfg["context_length"]), args.num_samples, seed=int(cfg["seed"]),
                             overhead=overhead, data={}, words=cfg.get("words", "builtin"))
        for s in made:
            parts = build_prompt(s, tok, query_aware=False)
            ctx, q = encode_prompt(parts, tok)
            rows.append({"task": task, "id": s["id"], "metric": TASKS[task].metric, "context": s["context"],
                         "question": s["question"], "answer_prefix": s["answer_prefix"], "system": s.get("system"),
                         "answers": s["answers"], "max_new_tokens": s["max_new_tokens"], "stop": s.get("stop"),
                         "kvjax_compressed": parts.compressed, "kvjax_question": parts.question,
                         "kvjax_context_ids": ctx, "kvjax_question_ids": q, "metadata": s.get("metadata") or {}})
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    print(f"{len(rows)} samples -> {args.out}", file=sys.stderr)


def score(args) -> None:
    samples = {(r["task"], r["id"]): r for r in map(json.loads, open(args.prompts))}
    out = []
    for p in map(json.loads, open(args.score)):
        s = samples[(p["task"], p["id"])]
        pred = _truncate_at_stop(p["text"], s.get("stop"))
        sc = score_prediction(s["metric"], p["task"], pred, s)
        out.append({**p, "prediction": pred, "answers": s["answers"], "score": sc["score"]})
    with open(args.out, "w") as fh:
        for r in out:
            fh.write(json.dumps(r) + "\n")
    by = {}
    for r in out:
        by.setdefault((r["press"], r["cache"]), []).append(r["score"])
    for k, v in sorted(by.items()):
        print(f"{k[0]:>12} {k[1]:>8} n={len(v)} score={100 * sum(v) / len(v):.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="eval_smollm2_ruler_2k")
    ap.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2"])
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--score", help="predictions JSONL of run_kvpress.py: score it instead of exporting")
    ap.add_argument("--prompts", help="the exported prompts (with --score)")
    a = ap.parse_args()
    score(a) if a.score else export(a)
