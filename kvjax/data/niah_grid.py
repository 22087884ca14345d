"""Needle-in-a-haystack over a (length x depth) grid, KVCache-Factory variant (§2.2), and passkey (§2.4).

``niah_grid``: one sample per (length, depth) cell. The haystack is the essay file when given
(``data["essay"]``), else the built-in prose (or the RULER noise sentence with
``haystack="noise"``), cut to whole sentences so the complete prompt fits the cell's length. The
needle goes at the sentence boundary at or before ``depth`` percent of the haystack's tokens
(depth 100 appends it). Scored by ROUGE-1 F and exact substring; the report draws a heatmap.
``passkey``: a 5-digit key in the noise haystack at a random line, scored by exact match.
"""

from __future__ import annotations

import bisect
import itertools

from kvjax.data import templates as T
from kvjax.data.base import Options, Sample, count_tokens, fit_units, fitted_sample, sample_rng
from kvjax.data.haystacks import essay_words, insert_lines, split_sentences
from kvjax.data.words import NOISE_SENTENCE

GRID_MAX_NEW_TOKENS = 30
PASSKEY_MAX_NEW_TOKENS = 16
HAYSTACKS = ("essay", "noise")
# The needle's answer part, for the secondary exact-substring score.
KEY_PHRASE = "eat a sandwich and sit in Dolores Park on a sunny day"


def default_lengths(context_length: int) -> list[int]:
    """Four lengths up to ``context_length``: 1/4, 1/2, 3/4 and all of it."""
    return sorted({max(64, context_length * j // 4) for j in (1, 2, 3, 4)})


DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 25.0, 50.0, 75.0, 100.0)


def _haystack_sentences(n_words: int, haystack: str, essay_path: str | None) -> list[str]:
    if haystack == "noise":
        return split_sentences(" ".join([NOISE_SENTENCE] * (n_words // 18 + 1)))
    return split_sentences(" ".join(essay_words(n_words, essay_path)))


def _insert_at_depth(sentences: list[str], token_counts: list[int], depth: float, needle: str) -> str:
    """Join ``sentences`` with the needle after the last sentence ending at or before ``depth`` % of the tokens."""
    cum = list(itertools.accumulate(token_counts))
    total = cum[-1] if cum else 0
    cut = len(sentences) if depth >= 100 else bisect.bisect_right(cum, total * depth / 100)
    return " ".join(sentences[:cut]) + needle + " ".join(sentences[cut:])


def niah_grid(task: str, opts: Options, lengths: list[int] | None = None, depths: list[float] | None = None,
              haystack: str = "essay") -> list[Sample]:
    """One sample per (length, depth); ``opts.num_samples`` is not used (the grid sets the count)."""
    lengths = default_lengths(opts.context_length) if lengths is None else [int(x) for x in lengths]
    depths = list(DEFAULT_DEPTHS) if depths is None else [float(d) for d in depths]
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")
    bad = [x for x in lengths if x <= 0 or x > opts.context_length]
    if bad:
        raise ValueError(f"niah lengths must be in (0, context_length={opts.context_length}], got {bad}")
    if any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"niah depths must be percentages in [0, 100], got {depths}")
    path = (opts.data or {}).get("essay")
    # Enough sentences for the longest cell: about one word per token, with room to spare.
    sentences = _haystack_sentences(2 * max(lengths) + 64, haystack, path)
    counts = [count_tokens(opts.tokenizer, " " + s) for s in sentences]
    fitter = opts.fitter
    question = T.NIAH_GRID_QUESTION.format(retrieval_question=T.NIAH_GRID_QUESTION_TEXT)
    samples = []
    for length in lengths:
        for depth in depths:
            def build(n: int, depth=depth) -> tuple[str, str, str]:
                hay = _insert_at_depth(sentences[:n], counts[:n], depth, T.NIAH_GRID_NEEDLE)
                return T.NIAH_GRID_CONTEXT.format(context=hay), question, T.NIAH_GRID_ANSWER_PREFIX

            def total(n: int, build=build) -> int:
                return fitter.length(*build(n), GRID_MAX_NEW_TOKENS)

            n = fit_units(total, length, 0, what=f"{task} prompt", maximum=len(sentences))
            ctx, q, prefix = build(n)
            samples.append(Sample(
                id=f"{task}/L{length}-D{depth:g}", task=task, context=ctx, question=q, answer_prefix=prefix,
                answers=[T.NIAH_GRID_NEEDLE.strip()], max_new_tokens=GRID_MAX_NEW_TOKENS, chat_template=True,
                stop=["\n"], length=fitter.length(ctx, q, prefix, GRID_MAX_NEW_TOKENS), target_length=length,
                metadata={"grid_length": length, "grid_depth": depth, "haystack_units": n, "haystack_type": haystack,
                          "next_unit_length": None if n == len(sentences) else total(n + 1), "key_phrase": KEY_PHRASE},
            ))
    return samples


def passkey(task: str, opts: Options) -> list[Sample]:
    """A random 5-digit pass key at a random line of the noise haystack."""
    samples = []
    for i in range(opts.num_samples):
        rng = sample_rng(opts.seed, task, i)
        key = str(rng.randint(10000, 99999))
        frac = rng.random()
        needle = T.PASSKEY_NEEDLE.format(key=key)

        def build(n: int, needle=needle, frac=frac) -> tuple[str, str, str]:
            hay = "\n".join(insert_lines([NOISE_SENTENCE] * n, [needle], [frac]))
            return T.PASSKEY_CONTEXT.format(context=hay), T.PASSKEY_QUESTION, T.PASSKEY_ANSWER_PREFIX

        samples.append(fitted_sample(task, opts, i, build, [key], PASSKEY_MAX_NEW_TOKENS, haystack_type="noise",
                               depth=frac))
    return samples
