"""Task data: the synthetic long-context task generators shared by eval, training and the tokenizer builder.

RULER's 13 tasks (``ruler``; qa_1 / qa_2 read local SQuAD / HotpotQA files), the needle grid and
passkey (``niah_grid``), their haystacks, word lists and built-in prose, the prompt templates,
the canonical completions (``targets``) and the prompt rendering every consumer shares
(``prompts``). A sample is a plain dict (``base.Sample``); `generate` fits it to a tokenizer and a
context length. This package imports nothing from kvjax.eval, kvjax.training or kvjax.engine.

Suites: ``default`` (the 8 RULER needle tasks and vt: the bundled model's), ``ruler`` (all 13),
``synthetic`` (every RULER-style task generated from code alone), ``ood_train`` (families outside RULER,
``kvjax.data.lines``: line retrieval and sentence copying, for out-of-distribution LookaheadKV adapters;
``ood_train_codes`` adds numbered records that end in codes; ``ood_train_multi`` asks for several records at
once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from kvjax.data.base import Options, Sample, TaskSkipped, TokenizerLike, check_length, check_num_samples
from kvjax.data.lines import line_recall, repeat_sentence
from kvjax.data.niah_grid import niah_grid, passkey
from kvjax.data.qa import qa
from kvjax.data.ruler import NIAH_TASKS, cwe, fwe, niah, vt


@dataclasses.dataclass(frozen=True)
class Generator:
    """A task generator: ``builder(name, Options, **task_options) -> list[Sample]``."""

    name: str
    family: str  # ruler | niah_grid | passkey | lines | copy
    builder: Callable[..., list[Sample]]
    description: str


def _generators() -> dict[str, Generator]:
    reg: dict[str, Generator] = {}
    for name, spec in NIAH_TASKS.items():
        what = f"{spec.k} key(s) x {spec.v} value(s), {spec.q} query, {spec.haystack} haystack"
        reg[name] = Generator(name, "ruler", niah, f"RULER needle: {what}")
    reg["vt"] = Generator("vt", "ruler", vt, "RULER variable tracking (1 chain, 4 hops)")
    reg["cwe"] = Generator("cwe", "ruler", cwe, "RULER common words extraction")
    reg["fwe"] = Generator("fwe", "ruler", fwe, "RULER frequent words extraction")
    reg["qa_1"] = Generator("qa_1", "ruler", qa, "RULER QA on SQuAD v2 (needs --data squad=PATH)")
    reg["qa_2"] = Generator("qa_2", "ruler", qa, "RULER QA on HotpotQA (needs --data hotpotqa=PATH)")
    reg["niah_grid"] = Generator("niah_grid", "niah_grid", niah_grid,
                                 "needle-in-a-haystack over lengths x depths (heatmap)")
    reg["passkey"] = Generator("passkey", "passkey", passkey, "5-digit pass key in noise")
    reg["line_recall"] = Generator("line_recall", "lines", line_recall,
                                   "quote a numbered line of prose by its number (LongEval-style; not RULER)")
    reg["record_recall"] = Generator("record_recall", "lines", line_recall,
                                     "quote a numbered record that ends in a code (digits, UUID, phone, amount, "
                                     "date, reference) by its number (not RULER)")
    reg["records_recall"] = Generator("records_recall", "lines", line_recall,
                                      "quote 2-4 numbered records that end in codes, far apart, by their numbers "
                                      "(not RULER)")
    for which in ("first", "last"):
        reg[f"repeat_{which}"] = Generator(f"repeat_{which}", "copy", repeat_sentence,
                                           f"repeat the {which} sentence of a prose paragraph (not RULER)")
    return reg


GENERATORS: dict[str, Generator] = _generators()
RULER_TASKS = [*NIAH_TASKS, "vt", "cwe", "fwe", "qa_1", "qa_2"]
SUITES: dict[str, list[str]] = {
    "default": [*NIAH_TASKS, "vt"],
    "ruler": RULER_TASKS,
    "synthetic": [*NIAH_TASKS, "vt", "cwe", "fwe", "niah_grid", "passkey"],
    "ood_train": ["line_recall", "repeat_first", "repeat_last"],
    "ood_train_codes": ["line_recall", "record_recall", "repeat_first", "repeat_last"],
    "ood_train_multi": ["records_recall"],
}


def suite_tasks(suite: str) -> list[str]:
    """The task names of ``suite``; ValueError listing the suites otherwise."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; valid suites: {', '.join(SUITES)}")
    return list(SUITES[suite])


def resolve_tasks(names: Sequence[str], tasks: Collection[str] | None = None,
                  suites: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """Expands suite names, keeps order, drops repeats; ValueError listing the valid names otherwise.

    tasks / suites: the task names and suites accepted (default: this package's ``GENERATORS`` and
    ``SUITES``; kvjax.eval passes its larger registry).
    """
    tasks = GENERATORS if tasks is None else tasks
    suites = SUITES if suites is None else suites
    out: list[str] = []
    unknown = []
    for n in names:
        for t in suites.get(n, [n]):
            if t not in tasks:
                unknown.append(t)
            elif t not in out:
                out.append(t)
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(map(repr, unknown))}. Valid tasks: {', '.join(tasks)}; "
                         f"suites: {', '.join(suites)}")
    return out


def run_builder(builder: Callable[..., list[Sample]], name: str, tokenizer: TokenizerLike | None,
                context_length: int, num_samples: int, *, needs_tokenizer: bool = True, seed: int = 42,
                overhead: int = 0, data: dict[str, str] | None = None, words: str = "builtin",
                **task_options: Any) -> list[Sample]:
    """Checks the shared arguments and calls ``builder(name, Options(...), **task_options)``."""
    check_length(context_length)
    check_num_samples(num_samples)
    if tokenizer is None and needs_tokenizer:
        raise TaskSkipped(f"{name} needs a tokenizer, and this model has none (only 'fidelity' runs on token ids)")
    opts = Options(tokenizer, context_length, num_samples, seed=seed, overhead=overhead, data=data, words=words)
    return builder(name, opts, **task_options)


def generate(name: str, tokenizer: TokenizerLike, context_length: int, num_samples: int, *,
             seed: int = 42, overhead: int = 0, data: dict[str, str] | None = None, words: str = "builtin",
             **task_options: Any) -> list[Sample]:
    """Samples of synthetic task ``name`` fitted to ``tokenizer`` and ``context_length``.

    overhead: tokens the chat template adds around one user turn (`prompts.chat_overhead`).
    data: local files by name (essay, squad, hotpotqa). words: "builtin" or "wonderwords" key and
    common-word lists. task_options: niah_grid takes lengths, depths, haystack.
    Raises TaskSkipped (with the reason) when the task cannot run here.
    """
    if name not in GENERATORS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(GENERATORS)}")
    return run_builder(GENERATORS[name].builder, name, tokenizer, context_length, num_samples, seed=seed,
                       overhead=overhead, data=data, words=words, **task_options)


__all__ = ["GENERATORS", "RULER_TASKS", "SUITES", "Generator", "Options", "Sample", "TaskSkipped",
           "TokenizerLike", "generate", "resolve_tasks", "run_builder", "suite_tasks"]
