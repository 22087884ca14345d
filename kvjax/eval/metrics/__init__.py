"""Metrics: RULER substring match, LongBench's official metrics, math equivalence, ROUGE, fidelity.

`score_prediction` dispatches on a task's metric name and returns a dict whose ``score`` is in
[0, 1] (the task score is its mean x 100); other keys are secondary numbers for the report.
"""

from __future__ import annotations

from typing import Any

from kvjax.eval.metrics.fidelity import kl_divergence, top1_agreement
from kvjax.eval.metrics.longbench import METRICS as LONGBENCH_METRICS
from kvjax.eval.metrics.longbench import longbench_score
from kvjax.eval.metrics.math import extract_answer, math_equal, math_score
from kvjax.eval.metrics.rouge import rouge1_f, rouge_l_f
from kvjax.eval.metrics.ruler import clean_prediction, string_match_all, string_match_part

METRIC_NAMES = ("string_match_all", "string_match_part", "rouge1", "math", "fidelity", *LONGBENCH_METRICS)


def score_prediction(metric: str, task: str, prediction: str, sample: dict[str, Any]) -> dict[str, Any]:
    """Scores one generated answer of ``sample`` (a task sample dict) with ``metric``."""
    answers = sample["answers"]
    if metric == "string_match_all":
        return {"score": string_match_all(prediction, answers)}
    if metric == "string_match_part":
        return {"score": string_match_part(prediction, answers)}
    if metric == "rouge1":
        phrase = sample.get("metadata", {}).get("key_phrase", answers[0])
        return {"score": max(rouge1_f(prediction, a) for a in answers),
                "substring": float(phrase.lower() in prediction.lower())}
    if metric == "math":
        return {"score": math_score(prediction, answers), "extracted": extract_answer(prediction)}
    if metric in LONGBENCH_METRICS:
        name = task.split("/", 1)[-1]
        classes = sample.get("metadata", {}).get("all_classes") or []
        return {"score": longbench_score(name, metric, prediction, answers, classes)}
    raise ValueError(f"metric must be one of {METRIC_NAMES} (fidelity is scored from logits), got {metric!r}")


__all__ = [
    "METRIC_NAMES", "clean_prediction", "extract_answer", "kl_divergence", "longbench_score", "math_equal",
    "math_score", "rouge1_f", "rouge_l_f", "score_prediction", "string_match_all", "string_match_part",
    "top1_agreement",
]
