"""Task families outside RULER, for training LookaheadKV adapters out of distribution (issue 27).

An adapter scored on RULER must not have trained on RULER's families (needles, variable tracking, common /
frequent words, QA). These prompts ask for something else over built-in prose (`kvjax.data.prose`):

- ``line_recall`` (family "lines", as LongChat's LongEval line retrieval): the context is numbered lines
  of prose, "line 17: ..."; the question asks to quote one line by its number. The answer is the line.
- ``record_recall`` (family "lines"): the same numbered-line retrieval, but every line is a short record
  that ends in a code (a 7-digit number, a UUID, a phone number, an amount, a date or an upper-case
  reference), so the answer is a string of digits and hex that must be quoted whole. It exists because the
  prose-only adapter kept only the first tokens of such values (eval/lookahead_smollm2_ood).
- ``records_recall`` (family "lines"): the numbered records of ``record_recall``, but the question asks for
  two to four of them at once (lines far apart, asked in a random order), so the answer draws on several
  spans of the context, as RULER's multi-value and multi-query needles do. It exists because adapters trained
  on one-span answers differ most by training seed on the multi-needle tasks (eval/lookahead_ablations).
- ``repeat_first`` / ``repeat_last`` (family "copy"): a paragraph of prose; the question asks to repeat its
  first (or last) sentence word for word. The answer is that sentence.

Every line and sentence is a fresh seeded prose sentence; nothing is keyed by a "magic number", a
variable name or a word list. All three are scoreable (string_match_all: the answer appears in the
prediction), so the same generators also measure an adapter on them.
"""

from __future__ import annotations

import random

from kvjax.data.base import Options, Sample, fitted_sample, sample_rng
from kvjax.data.prose import prose_sentences

MAX_NEW_TOKENS = {"line_recall": 48, "record_recall": 64, "records_recall": 192, "repeat_first": 48,
                  "repeat_last": 48}
MAX_ASKED = 4  # records_recall asks for 2..MAX_ASKED lines
_MAX_UNITS = 2000  # lines or sentences per prompt (far above what 16K tokens hold)


CODE_KINDS = ("number", "uuid", "phone", "amount", "date", "reference")


def code(kind: str, rng: random.Random) -> str:
    """A random value of one of `CODE_KINDS`: 4821937, 9f1c0a2e-77b4-4c1d-8e0f-3b5a6c7d8e9f, 415-682-0193,
    48,213.07, 2031-04-17, QX-58K2T9."""
    if kind == "number":
        return str(rng.randrange(10**6, 10**7))
    if kind == "uuid":
        return "-".join("".join(rng.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12))
    if kind == "phone":
        return f"{rng.randrange(200, 1000)}-{rng.randrange(200, 1000)}-{rng.randrange(10**4):04d}"
    if kind == "amount":
        return f"{rng.randrange(1000, 100000):,}.{rng.randrange(100):02d}"
    if kind == "date":
        return f"{rng.randrange(1990, 2040)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"
    if kind == "reference":
        alnum = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
        return "".join(rng.choice(alnum) for _ in range(2)) + "-" + "".join(rng.choice(alnum) for _ in range(6))
    raise ValueError(f"kind must be one of {CODE_KINDS}, got {kind!r}")


def records(n: int, seed: int) -> list[str]:
    """`n` records: the first words of a prose sentence, then a code of a random kind (prefix-stable in n)."""
    rng = random.Random(seed)
    out = []
    for sentence in prose_sentences(n, seed=seed):
        words = sentence.rstrip(".").split()[:rng.randrange(4, 9)]
        kind = rng.choice(CODE_KINDS)
        out.append(f"{' '.join(words)}, {kind} {code(kind, rng)}.")
    return out


def line_recall(task: str, opts: Options) -> list[Sample]:
    """Numbered lines (prose for ``line_recall``, code-bearing records for ``record_recall`` and
    ``records_recall``); "What is the content of line k?" with k uniform over the lines, or for
    ``records_recall`` "What are the contents of lines k1, k2 and k3?" with 2..MAX_ASKED lines, one from each
    of as many equal parts of the record (in a random order)."""
    samples = []
    for i in range(opts.num_samples):
        rng = sample_rng(opts.seed, task, i)
        seed = rng.randrange(2**31)
        lines = prose_sentences(_MAX_UNITS, seed=seed) if task == "line_recall" else records(_MAX_UNITS, seed)
        asked = rng.randrange(2, MAX_ASKED + 1) if task == "records_recall" else 1
        depths = [(part + rng.random()) / asked for part in range(asked)]
        rng.shuffle(depths)

        def build(n: int, lines=lines, depths=depths) -> tuple[str, str, str]:
            ks = _asked_lines(depths, n)
            context = "Below is a record of numbered lines.\n" + "".join(
                f"line {j + 1}: {lines[j]}\n" for j in range(n))
            if len(ks) == 1:
                question = f"\nWhat is the content of line {ks[0]}? Quote it exactly."
            else:
                listed = ", ".join(map(str, ks[:-1])) + f" and {ks[-1]}"
                question = f"\nWhat are the contents of lines {listed}? Quote each exactly, one per line."
            return context, question, f"line {ks[0]}:"

        sample = fitted_sample(task, opts, i, build, [], MAX_NEW_TOKENS[task], minimum=asked, maximum=_MAX_UNITS)
        ks = _asked_lines(depths, sample["metadata"]["haystack_units"])
        sample["answers"] = [lines[k - 1] for k in ks]
        sample["metadata"]["line" if asked == 1 else "lines"] = ks[0] if asked == 1 else ks
        sample["metadata"]["reference"] = " " + "\n".join(
            (f"line {k}: " if j else "") + lines[k - 1] for j, k in enumerate(ks))
        samples.append(sample)
    return samples


def _asked_lines(depths: list[float], n: int) -> list[int]:
    """The 1-based line at each relative depth in [0, 1) of `n` lines."""
    return [1 + min(int(d * max(n, 1)), max(n, 1) - 1) for d in depths]


def repeat_sentence(task: str, opts: Options) -> list[Sample]:
    """A prose paragraph; repeat its first (``repeat_first``) or last (``repeat_last``) sentence."""
    which = "first" if task == "repeat_first" else "last"
    samples = []
    for i in range(opts.num_samples):
        rng = sample_rng(opts.seed, task, i)
        sentences = prose_sentences(_MAX_UNITS, seed=rng.randrange(2**31))

        def build(n: int, sentences=sentences) -> tuple[str, str, str]:
            return (" ".join(sentences[:n]),
                    f"\n\nRepeat the {which} sentence of the text above, word for word.", "")

        sample = fitted_sample(task, opts, i, build, [], MAX_NEW_TOKENS[task], minimum=2, maximum=_MAX_UNITS)
        n = sample["metadata"]["haystack_units"]
        sample["answers"] = [sentences[0] if which == "first" else sentences[n - 1]]
        samples.append(sample)
    return samples
