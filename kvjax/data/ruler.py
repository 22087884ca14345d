"""RULER's 13 tasks (docs/benchmarks.md §1), generated from code and fitted to a tokenizer.

Every generator binary-searches its haystack size per sample so that prompt tokens (with the
chat-template overhead) plus ``max_new_tokens`` are at most ``context_length`` and one more
haystack unit would overflow it (see ``base.fit_units``). Random draws that do not depend on the
haystack size (keys, values, depths) are made before the search, so each sample is a pure
function of (seed, task, index, tokenizer, context_length).
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections.abc import Callable

from kvjax.data import templates as T
from kvjax.data.base import Options, Sample, fit_units, fitted_sample, sample_rng
from kvjax.data.haystacks import (
    DEPTHS,
    common_words,
    essay_words,
    insert_lines,
    key_words,
    pseudo_word,
    random_value,
    split_sentences,
)
from kvjax.data.words import NOISE_SENTENCE

MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


@dataclasses.dataclass(frozen=True)
class NiahSpec:
    haystack: str  # noise | essay | needle
    type_k: str
    type_v: str
    k: int = 1
    v: int = 1
    q: int = 1


NIAH_TASKS: dict[str, NiahSpec] = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", k=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", v=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", k=4, q=4),
}


def _distinct(draw: Callable[[], str], n: int, exclude: set[str] | None = None) -> list[str]:
    seen, out = set(exclude or ()), []
    while len(out) < n:
        x = draw()
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def niah(task: str, opts: Options) -> list[Sample]:
    """The 8 needle tasks (§1.4): needles in a noise, essay or needle haystack."""
    spec = NIAH_TASKS[task]
    words = key_words(opts.words)
    k = max(spec.k, spec.q)
    single = spec.q * spec.v == 1
    tv = spec.type_v[:-1] if single else spec.type_v
    tmpl = [T.singular(t) if single else t for t in (T.NIAH_CONTEXT, T.NIAH_QUESTION, T.NIAH_ANSWER_PREFIX)]
    samples = []
    for i in range(opts.num_samples):
        rng = sample_rng(opts.seed, task, i)
        keys = _distinct(lambda: random_value(spec.type_k, rng, words), k)
        values = [_distinct(lambda: random_value(spec.type_v, rng, words), spec.v) for _ in keys]
        needles = [T.NIAH_NEEDLE.format(type_needle_v=spec.type_v, key=key, value=val)
                   for key, vals in zip(keys, values) for val in vals]
        random.Random(opts.seed).shuffle(needles)
        picked = rng.sample(range(k), spec.q)
        queries = [keys[j] for j in picked]
        answers = [a for j in picked for a in values[j]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        haystack = _niah_haystack(spec, rng, needles, set(keys), words, opts)

        def build(n: int, haystack=haystack, query=query) -> tuple[str, str, str]:
            return (tmpl[0].format(type_needle_v=tv, context=haystack(n)),
                    tmpl[1].format(type_needle_v=tv, query=query),
                    tmpl[2].format(type_needle_v=tv, query=query))

        samples.append(fitted_sample(task, opts, i, build, answers, MAX_NEW_TOKENS["niah"],
                                     haystack_type=spec.haystack))
    return samples


def _niah_haystack(spec: NiahSpec, rng: random.Random, needles: list[str], keys: set[str],
                   words: tuple[str, ...], opts: Options) -> Callable[[int], str]:
    if spec.haystack == "essay":
        depths = sorted(rng.sample(DEPTHS, len(needles)))
        path = (opts.data or {}).get("essay")

        def essay(n: int) -> str:
            sents = split_sentences(" ".join(essay_words(n, path)))
            cuts = [0] + [int(len(sents) * d / 100) for d in depths] + [len(sents)]
            parts = []
            for j in range(1, len(cuts)):
                parts.append(" ".join(sents[cuts[j - 1]:cuts[j]]))
                if j - 1 < len(needles):
                    parts.append(needles[j - 1])
            return " ".join(p for p in parts if p)

        return essay
    fractions = [rng.random() for _ in needles]
    if spec.haystack == "noise":
        return lambda n: "\n".join(insert_lines([NOISE_SENTENCE] * n, needles, fractions))
    if spec.haystack == "needle":
        hay_rng = random.Random(rng.getrandbits(64))
        stream: list[str] = []

        def distractor() -> str:
            key = _distinct(lambda: random_value(spec.type_k, hay_rng, words), 1, keys)[0]
            value = random_value(spec.type_v, hay_rng, words)
            return T.NIAH_NEEDLE.format(type_needle_v=spec.type_v, key=key, value=value)

        def needle_hay(n: int) -> str:
            while len(stream) < n:
                stream.append(distractor())
            return "\n".join(insert_lines(stream[:n], needles, fractions))

        return needle_hay
    raise ValueError(f"haystack must be 'noise', 'essay' or 'needle', got {spec.haystack!r}")


def _vt_names(rng: random.Random, length: int, n: int = 5) -> list[str]:
    return _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=length)), n, {"VAR"})


def _vt_context(names: list[str], value: str, fractions: list[float], n: int) -> str:
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(len(names) - 1)]
    return "\n".join(insert_lines([NOISE_SENTENCE] * n, chain, fractions)).replace(". \n", ".\n")


def _vt_parts(context: str, value: str) -> tuple[str, str, str]:
    return (T.VT_CONTEXT.format(context=context), T.VT_QUESTION.format(query=value),
            T.VT_ANSWER_PREFIX.format(num_v=5, query=value))


def vt(task: str, opts: Options) -> list[Sample]:
    """Variable tracking (§1.5): one chain of 5 variables in noise, after a one-shot example.

    The one-shot example is fitted once to ``min(500, context_length // 4)`` tokens (RULER uses
    500 at 4K and above; the cap keeps it from eating short contexts; below about 900 tokens of
    context even the bare example does not fit and is left out) and re-randomised per sample.
    """
    icl_rng = random.Random(opts.seed)
    icl_fracs = [icl_rng.random() for _ in range(5)]
    placeholder = [f"<{j}>" for j in range(5)]
    icl_length = min(500, opts.context_length // 4)

    def icl_text(n: int, names: list[str], value: str) -> str:
        ctx, q, prefix = _vt_parts(_vt_context(names, value, icl_fracs, n), value)
        return ctx + q + prefix + " ".join(names) + "\n\n"

    probe_names = _vt_names(random.Random(opts.seed), 3)
    fitter = opts.fitter
    try:
        n_icl = fit_units(lambda n: fitter.length("", "", icl_text(n, probe_names, "12345"), MAX_NEW_TOKENS["vt"]),
                          icl_length, 0, what="vt one-shot example")
    except ValueError:  # even the bare example does not fit in a quarter of a short context: go without it
        n_icl = None
    samples = []
    for i in range(opts.num_samples):
        rng = sample_rng(opts.seed, task, i)
        names = _vt_names(rng, 5)
        value = str(rng.randrange(10000, 99999))
        fractions = [rng.random() for _ in names]
        icl = "" if n_icl is None else icl_text(n_icl, _vt_names(rng, 3), str(rng.randrange(10000, 99999)))

        def build(n: int, names=names, value=value, fractions=fractions, icl=icl) -> tuple[str, str, str]:
            ctx, q, prefix = _vt_parts(_vt_context(names, value, fractions, n), value)
            return icl + ctx, q, prefix

        samples.append(fitted_sample(task, opts, i, build, names, MAX_NEW_TOKENS["vt"], haystack_type="noise"))
    return samples


def _numbered(words: list[str]) -> str:
    return " ".join(f"{j + 1}. {w}" for j, w in enumerate(words))


def _extend(words: list[str], n: int) -> list[str]:
    """The first ``n`` of ``words`` followed by pseudo-words that are not in ``words``."""
    if n <= len(words):
        return words[:n]
    known, out, j = set(words), list(words), 0
    while len(out) < n:
        w = pseudo_word(j)
        j += 1
        if w not in known:
            out.append(w)
    return out


def cwe(task: str, opts: Options) -> list[Sample]:
    """Common words extraction (§1.6): 10 words repeated often among words repeated rarely.

    When the word list runs out (long contexts), pronounceable pseudo-words extend it.
    """
    base = list(common_words(opts.words))
    random.Random(opts.seed).shuffle(base)
    short = opts.context_length < 4096
    freq_cw, freq_ucw = (6, 1) if short else (30, 3)
    icl_words, icl_cw, icl_ucw = (20, 3, 1) if short else (40, 10, 3)

    def example(words: list[str], cw: int, ucw: int) -> tuple[str, list[str]]:
        items = words[:10] * cw + words[10:] * ucw
        random.Random(opts.seed).shuffle(items)
        return _numbered(items), words[:10]

    samples = []
    for i in range(opts.num_samples):
        rng = sample_rng(opts.seed, task, i)
        icl_ctx, icl_ans = example(rng.sample(base, icl_words), icl_cw, icl_ucw)
        icl = (T.CWE_CONTEXT.format(context=icl_ctx) + T.CWE_QUESTION + T.CWE_ANSWER_PREFIX
               + " " + _numbered(icl_ans) + "\n")
        order = rng.sample(base, len(base))

        def build(n: int, order=order, icl=icl) -> tuple[str, str, str]:
            ctx, _ = example(_extend(order, 10 + n), freq_cw, freq_ucw)
            return icl + T.CWE_CONTEXT.format(context=ctx), T.CWE_QUESTION, T.CWE_ANSWER_PREFIX

        samples.append(fitted_sample(task, opts, i, build, order[:10], MAX_NEW_TOKENS["cwe"]))
    return samples


def fwe(task: str, opts: Options) -> list[Sample]:
    """Frequent words extraction (§1.7): Zipf(2) counts over coded 6-letter words; answer ranks 2-4."""
    zeta2 = 3.141592653589793 ** 2 / 6
    max_new = MAX_NEW_TOKENS["fwe"]
    vocab_size = max(5, (opts.context_length - max_new) // 50)
    samples = []
    for i in range(opts.num_samples):
        rng = sample_rng(opts.seed, task, i)
        vocab = sorted(set(_distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=6)), vocab_size)))
        random.Random(opts.seed).shuffle(vocab)
        vocab[0] = "..."

        def build(n: int, vocab=vocab) -> tuple[str, str, str]:
            items = [w for rank, w in enumerate(vocab, start=1) for _ in range(int(n * rank ** -2.0 / zeta2))]
            random.Random(opts.seed).shuffle(items)
            return T.FWE_CONTEXT.format(context=" ".join(items)), T.FWE_QUESTION, T.FWE_ANSWER_PREFIX

        # From n = 74 on, floor(n / (16 zeta2)) > floor(n / (25 zeta2)): rank 4 strictly beats rank 5,
        # so the three references are unambiguous.
        samples.append(fitted_sample(task, opts, i, build, vocab[1:4], max_new, minimum=74))
    return samples
