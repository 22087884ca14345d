"""LongBench v1's official metrics (`metrics.py`, `eval.py`; docs/benchmarks.md §3.4), re-implemented.

Each metric maps (prediction, one reference) to [0, 1]; `longbench_score` applies the official
aggregation for one sample: the first line only for trec / triviaqa / samsum / lsht, then the
maximum over the references.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

from kvjax.eval.metrics.rouge import rouge_l_f

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation, drop the articles a / an / the, collapse whitespace (SQuAD style)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def qa_f1(prediction: str, reference: str) -> float:
    """Token-multiset F1 of the normalised strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(ref)
    return 2 * p * r / (p + r)


def rouge(prediction: str, reference: str) -> float:
    """ROUGE-L F of the `rouge` package (see `metrics.rouge.rouge_l_f`)."""
    return rouge_l_f(prediction, reference)


def classification(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    """trec's score: 1/#matched classes when the gold class is among the classes named in the prediction.

    As the official code does, matches that are substrings of the gold label (but not equal to
    it) are removed while iterating over the same list, which skips the element after each removal.
    """
    matches = [c for c in all_classes if c in prediction]
    for term in matches:  # mutating while iterating: kept on purpose, it is the official behaviour
        if term in reference and term != reference:
            matches.remove(term)
    return 1.0 / len(matches) if reference in matches else 0.0


def _number_ratio(prediction: str, gold: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(n == gold for n in numbers) / len(numbers)


def retrieval(prediction: str, reference: str) -> float:
    """passage_retrieval_en: share of the numbers in the prediction equal to N of "Paragraph N"."""
    found = re.findall(r"Paragraph (\d+)", reference)
    if not found:
        raise ValueError(f"retrieval reference must contain 'Paragraph N', got {reference!r}")
    return _number_ratio(prediction, found[0])


def count(prediction: str, reference: str) -> float:
    """passage_count: share of the numbers in the prediction equal to the gold count."""
    return _number_ratio(prediction, str(reference))


def fuzz_ratio(a: str, b: str) -> int:
    """`fuzzywuzzy.fuzz.ratio` (pure-Python path): 100 if equal, 0 if one is empty, else round(100 * difflib ratio)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim(prediction: str, reference: str) -> float:
    """lcc / repobench-p: fuzz ratio of the first line without a backtick, ``#`` or ``//``, over 100."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, reference) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1, "rouge": rouge, "classification": classification,
    "retrieval": retrieval, "count": count, "code_sim": code_sim,
}
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def longbench_score(task: str, metric: str, prediction: str, references: Sequence[str],
                    all_classes: Sequence[str] | None = None) -> float:
    """One sample's score in [0, 1]: first line for trec/triviaqa/samsum/lsht, then max over references."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRICS[metric]
    best = 0.0
    for ref in references:
        value = fn(prediction, ref, all_classes or []) if metric == "classification" else fn(prediction, ref)
        best = max(best, value)
    return best
