"""RULER's substring metrics (docs/benchmarks.md §1.9, `scripts/eval/synthetic/constants.py`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(prediction: str) -> str:
    """RULER's clean-up: control characters become newlines, then surrounding whitespace is stripped."""
    return _CONTROL.sub("\n", prediction).strip()


def _hits(prediction: str, references: Sequence[str]) -> list[bool]:
    if not references:
        raise ValueError("references must be a non-empty list of strings")
    pred = clean_prediction(prediction).lower()
    return [r.lower() in pred for r in references]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of references that occur, case-insensitively, as substrings of the prediction."""
    hits = _hits(prediction, references)
    return sum(hits) / len(hits)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any reference occurs, case-insensitively, as a substring of the prediction, else 0.0."""
    return float(any(_hits(prediction, references)))
