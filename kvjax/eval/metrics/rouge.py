"""Two ROUGE variants, re-implemented without dependencies.

`rouge_l_f` follows the `rouge` PyPI package 1.0.1 (pltrdy), which LongBench calls as
``Rouge().get_scores([pred], [ref], avg=True)["rouge-l"]["f"]``: texts are cut into sentences at
every ``.``, whitespace-normalised, split on single spaces; ROUGE-L is the summary-level union
LCS with *sets* of words (the package's default ``exclusive=True``) and F = 2PR / (P + R + 1e-8).
The package raises on an empty hypothesis or reference, which LongBench scores as 0; so does
this function. (The package's LCS back-tracking is recursive and overflows Python's stack on a
single sentence of about 1,000 words, which LongBench then also scores 0; this one is iterative.)

`rouge1_f` follows Google's `rouge-score` ``rouge1`` without stemming: lowercase, every run of
characters outside ``[a-z0-9]`` is a separator, unigram multiset overlap, F = 2PR / (P + R).
"""

from __future__ import annotations

import re
from collections import Counter


def _sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def _words(sentences: list[str]) -> list[str]:
    return [w for s in sentences for w in s.split(" ")]


def _lcs_words(x: list[str], y: list[str]) -> set[str]:
    """The words of the LCS of ``x`` and ``y`` chosen by the package's back-tracking (ties go to ``y``)."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(table[i - 1][j], table[i][j - 1])
    out, i, j = set(), n, m
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            out.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def rouge_l_f(hypothesis: str, reference: str) -> float:
    """ROUGE-L F of the `rouge` package (summary level, word sets); 0.0 where the package raises."""
    hyp, ref = _sentences(hypothesis), _sentences(reference)
    if not hyp or not ref:
        return 0.0
    m = len(set(_words(ref)))
    n = len(set(_words(hyp)))
    union: set[str] = set()
    llcs = 0
    for ref_sentence in ref:
        before = len(union)
        ref_words = ref_sentence.split(" ")
        for hyp_sentence in hyp:
            union |= _lcs_words(ref_words, hyp_sentence.split(" "))
        llcs += len(union) - before
    r, p = llcs / m, llcs / n
    return 2.0 * ((p * r) / (p + r + 1e-8))


_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def _rouge_score_tokens(text: str) -> list[str]:
    return _NON_ALNUM.sub(" ", text.lower()).split()


def rouge1_f(prediction: str, target: str) -> float:
    """ROUGE-1 F of `rouge-score` (no stemmer): unigram multiset overlap; 0.0 if either side is empty."""
    pred, tgt = Counter(_rouge_score_tokens(prediction)), Counter(_rouge_score_tokens(target))
    overlap = sum((pred & tgt).values())
    if overlap == 0:
        return 0.0
    p, r = overlap / sum(pred.values()), overlap / sum(tgt.values())
    return 2 * p * r / (p + r)
