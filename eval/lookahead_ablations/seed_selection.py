"""Can a held-out, non-RULER score pick a recipe's best training seed? (issue 27)

The recipes' seeds differ by up to 18 points on RULER, and the training objective on held-out prompts does not
tell them apart (validation_loss.md). This probe scores each adapter by what it keeps, not by what the 135M model
answers (it rarely quotes a record right even with the full cache): on held-out prompts of the lines families
(data seed `--seed`, neither a training seed nor the eval's), the share of the answer records' codes
(`--part code`, the values they end in) or whole records that the question-agnostic cache keeps at
`--compression-ratio` (mean over layers, KV heads, records and prompts; no decoding); or (`--part answer`) what the
compression costs the right answer: the reference answer teacher-forced after the question, its mean log-likelihood
per token with the compressed cache minus with the full cache (nats; 0 = nothing lost), on the same families; or
(`--part fidelity`) on held-out prose, a family neither in training nor in RULER: minus the eval's fidelity KL(full ||
compressed) over 32 teacher-forced next tokens after a 2,016-token window. Each adapter's RULER 2K agnostic score (results/NAME, the same 44 samples) is printed beside it, and
the rank correlation over the adapters, and per recipe whether the probe's best seed is RULER's best.

    python eval/lookahead_ablations/seed_selection.py --runs runs/lookahead_ablations > eval/lookahead_ablations/seed_selection.md
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

import kvjax
from kvjax.data.base import encode, reference_answer
from kvjax.data.prompts import build_prompt, chat_overhead, encode_prompt
from kvjax.eval.metrics import kl_divergence
from kvjax.eval.tasks import generate_task
from kvjax.lookahead import load
from kvjax.policies.lookahead import LookaheadKV

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ablations import SEED_GROUPS, _scores  # noqa: E402
from value_coverage import MODEL, value_spans  # noqa: E402


def kept_share(cache, b: int, span: range) -> float:
    """Share of `span`'s tokens kept in row b of a compressed cache, mean over layers and KV heads."""
    pos, valid = np.asarray(cache.pos[:, b]), np.asarray(cache.valid[:, b])  # [L, H, C]
    idx = np.asarray(span)
    return float(np.mean([np.isin(idx, pos[l, h][valid[l, h]]).mean()
                          for l in range(pos.shape[0]) for h in range(pos.shape[1])]))


def answer_logprob(model, contexts: list[list[int]], rests: list[list[int]], answers: list[list[int]], *,
                   policy=None, compression_ratio: float | None = None) -> np.ndarray:
    """[N] mean log-probability per token of each answer, teacher-forced after its context (compressed by
    `policy` at `compression_ratio`, or whole) and the fed-after part `rests` (question, answer prefix)."""
    out = []
    for i in range(0, len(contexts), 4):
        conts = [r + a for r, a in zip(rests[i:i + 4], answers[i:i + 4])]
        logits = kvjax.engine.continuation_logits(model, contexts[i:i + 4], conts, policy=policy,
                                                  compression_ratio=compression_ratio)
        for lg, r, a in zip(logits, rests[i:i + 4], answers[i:i + 4]):
            logp = lg - np.logaddexp.reduce(lg, axis=-1, keepdims=True)
            # row j predicts continuation token j + 1: the answer's tokens are predicted by rows len(r) - 1 ...
            rows = np.arange(len(r) - 1, len(r) + len(a) - 1)
            out.append(float(logp[rows, a].mean()))
    return np.asarray(out)


def fidelity(model, contexts: list[list[int]], conts: list[list[int]], full: list[np.ndarray], *, policy,
             compression_ratio: float) -> np.ndarray:
    """[N] KL(full || compressed) per window, mean over its continuation tokens (nats)."""
    out = []
    for i in range(0, len(contexts), 4):
        logits = kvjax.engine.continuation_logits(model, contexts[i:i + 4], conts[i:i + 4], policy=policy,
                                                  compression_ratio=compression_ratio)
        out += [kl_divergence(f, c) for f, c in zip(full[i:i + 4], logits)]
    return np.asarray(out)


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="the ablations' training workdirs (NAME/export)")
    ap.add_argument("--groups", nargs="+", default=list(SEED_GROUPS)[1:], choices=list(SEED_GROUPS))
    ap.add_argument("--tasks", nargs="+", default=["records_recall", "record_recall"])
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5000, help="data seed of the held-out prompts")
    ap.add_argument("--compression-ratio", type=float, default=0.75)
    ap.add_argument("--part", choices=("record", "code", "answer", "fidelity"), default="code",
                    help="the spans scored: each answer record whole, or its code alone (the value a record ends in); "
                         "answer: the reference answer's log-likelihood lost to compression; fidelity: next-token KL "
                         "on held-out prose (--tasks ignored)")
    ap.add_argument("--cache", type=pathlib.Path, default=None,
                    help="a JSON file of probe values by measure and adapter: read (adapters found there are not "
                         "measured again) and extended")
    args = ap.parse_args()
    model = kvjax.load_model(MODEL)
    tok = model.tokenizer
    contexts, spans, rests, answers = [], [], [], []
    for task in args.tasks if args.part != "fidelity" else ():
        for s in generate_task(task, tok, 2048, args.num_samples, seed=args.seed, overhead=chat_overhead(tok)):
            ctx, rest = encode_prompt(build_prompt(s, tok, query_aware=False), tok)
            contexts.append(ctx)
            rests.append(rest)
            answers.append(encode(tok, reference_answer(s)))
            if args.part != "answer":
                values = [a if args.part == "record" else a.rstrip(".").split()[-1] for a in s["answers"]]
                spans.append(value_spans(ctx, tok, values))
    r = args.compression_ratio
    head = f"Held-out prompts: {', '.join(args.tasks)} x {args.num_samples} (data seed {args.seed}), 2,048 tokens; "
    if args.part == "fidelity":
        windows = generate_task("fidelity", tok, 2048, args.num_samples, seed=args.seed)
        contexts = [w["metadata"]["context_ids"] for w in windows]
        rests = [w["metadata"]["continuation_ids"] for w in windows]
        full = kvjax.engine.continuation_logits(model, contexts, rests)
        print(f"Held-out prose: {args.num_samples} fidelity windows (data seed {args.seed}) of 2,016 + 32 tokens; "
              f"probe = minus KL(full || compressed) at r={r}, nats per next token, mean over windows (higher: "
              "closer to the full cache); RULER = the adapter's RULER 2K agnostic score at r=0.5 / 0.75 (44 "
              "samples).\n")
    elif args.part == "answer":
        full = answer_logprob(model, contexts, rests, answers)
        print(head + f"probe = the reference answer's mean log-likelihood per token with the cache compressed "
              f"question-agnostic at r={r} minus with the full cache ({full.mean():.3f} nats/token), mean over "
              "prompts (higher: less lost); RULER = the adapter's RULER 2K agnostic score at r=0.5 / 0.75 (44 "
              "samples).\n")
    else:
        what = "codes" if args.part == "code" else "tokens"
        print(head + f"probe = share of the answer records' {what} kept question-agnostic at r={r} (mean over "
              f"layers, KV heads, records, prompts); RULER = the adapter's RULER 2K agnostic score at r=0.5 / 0.75 "
              f"(44 samples).\n")
    print("| adapter | probe | RULER r=0.5 | RULER r=0.75 |\n|---|---:|---:|---:|")
    rows = {}
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    measure = f"{args.part} r={r} seed={args.seed} n={args.num_samples}" + (
        "" if args.part == "fidelity" else f" tasks={','.join(args.tasks)}")
    done = cache.setdefault(measure, {})
    for group in args.groups:
        for name in SEED_GROUPS[group]:
            if name in rows:  # a member of two groups (the init and order groups share seed 0)
                continue
            ruler = {k: 100 * np.mean(list(v.values())) for k, v in _scores(name).items() if k != "full"}
            if name in done:  # measured before on the same prompts (--cache)
                rows[name] = (done[name], ruler.get("r=0.5", np.nan), ruler.get("r=0.75", np.nan))
                print(f"| {name} | {rows[name][0]:.4f} | {rows[name][1]:.1f} | {rows[name][2]:.1f} |", flush=True)
                continue
            policy = LookaheadKV(adapter=load(pathlib.Path(args.runs) / name / "export"))
            kept = []
            if args.part == "answer":
                kept = answer_logprob(model, contexts, rests, answers, policy=policy, compression_ratio=r) - full
            elif args.part == "fidelity":
                kept = -fidelity(model, contexts, rests, full, policy=policy, compression_ratio=r)
            for i in range(0, len(contexts), 4) if args.part in ("record", "code") else ():
                kv = kvjax.engine.compress(model, contexts[i:i + 4], policy=policy, compression_ratio=r)
                kept += [kept_share(kv, b, sp) for b, ss in enumerate(spans[i:i + 4]) for sp in ss]
            rows[name] = (float(np.mean(kept)), ruler.get("r=0.5", np.nan), ruler.get("r=0.75", np.nan))
            print(f"| {name} | {rows[name][0]:.4f} | {rows[name][1]:.1f} | {rows[name][2]:.1f} |", flush=True)
            if args.cache:
                done[name] = rows[name][0]
                args.cache.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    names = [n for n in rows if not np.isnan(rows[n][1] + rows[n][2])]  # those RULER scored
    print()
    for k, setting in ((1, "r=0.5"), (2, "r=0.75")):
        print(f"- Spearman rank correlation of the probe with RULER {setting} over the {len(names)} adapters: "
              f"{spearman([rows[n][0] for n in names], [rows[n][k] for n in names]):+.2f}")
    for group in args.groups:
        members = [n for n in SEED_GROUPS[group] if n in names]
        if not members:
            continue
        by_probe = max(members, key=lambda n: rows[n][0])
        by_ruler = max(members, key=lambda n: rows[n][1] + rows[n][2])
        print(f"- {group}: the probe picks {by_probe}, RULER's best (sum of both ratios) is {by_ruler}")


if __name__ == "__main__":
    main()
