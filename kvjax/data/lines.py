"""Task families outside RULER, for training LookaheadKV adapters out of distribution (issue 27).

An adapter scored on RULER must not have trained on RULER's families (needles, variable tracking, common /
frequent words, QA). These prompts ask for something else over built-in prose (`kvjax.data.prose`):

- ``line_recall`` (family "lines", as LongChat's LongEval line retrieval): the context is numbered lines
  of prose, "line 17: ..."; the question asks to quote one line by its number. The answer is the line.
- ``repeat_first`` / ``repeat_last`` (family "copy"): a paragraph of prose; the question asks to repeat its
  first (or last) sentence word for word. The answer is that sentence.

Every line and sentence is a fresh seeded prose sentence; nothing is keyed by a "magic number", a
variable name or a word list. All three are scoreable (string_match_all: the answer appears in the
prediction), so the same generators also measure an adapter on them.
"""

from __future__ import annotations

from kvjax.data.base import Options, Sample, fitted_sample, sample_rng
from kvjax.data.prose import prose_sentences

MAX_NEW_TOKENS = {"line_recall": 48, "repeat_first": 48, "repeat_last": 48}
_MAX_UNITS = 2000  # lines or sentences per prompt (far above what 16K tokens hold)


def line_recall(task: str, opts: Options) -> list[Sample]:
    """Numbered prose lines; "What is the content of line k?" with k uniform over the lines."""
    samples = []
    for i in range(opts.num_samples):
        rng = sample_rng(opts.seed, task, i)
        lines = prose_sentences(_MAX_UNITS, seed=rng.randrange(2**31))
        depth = rng.random()

        def build(n: int, lines=lines, depth=depth) -> tuple[str, str, str]:
            k = 1 + min(int(depth * max(n, 1)), max(n, 1) - 1)
            context = "Below is a record of numbered lines.\n" + "".join(
                f"line {j + 1}: {lines[j]}\n" for j in range(n))
            return context, f"\nWhat is the content of line {k}? Quote it exactly.", f"line {k}:"

        sample = fitted_sample(task, opts, i, build, [], MAX_NEW_TOKENS[task], minimum=1, maximum=_MAX_UNITS)
        n = sample["metadata"]["haystack_units"]
        k = 1 + min(int(depth * n), n - 1)
        sample["answers"] = [lines[k - 1]]
        sample["metadata"]["line"] = k
        samples.append(sample)
    return samples


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
