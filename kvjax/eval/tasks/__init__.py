"""Task registry: names, suites, metrics, and `generate_task`.

Suites (usable wherever task names are): ``default`` (the bundled model's suite: the 8 RULER
needle tasks and vt), ``ruler`` (all 13), ``synthetic`` (every task generated from code alone),
``longbench`` (16 tasks, local files), ``math`` (GSM8K, MATH-500, AIME 24/25, local files).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvjax.data import GENERATORS, RULER_TASKS, run_builder
from kvjax.data import resolve_tasks as _resolve_tasks
from kvjax.data import SUITES as SYNTHETIC_SUITES
from kvjax.data.base import Options, Sample, TaskSkipped, TokenizerLike, check_length, check_num_samples  # noqa: F401
from kvjax.data.niah_grid import niah_grid, passkey  # noqa: F401
from kvjax.data.qa import qa  # noqa: F401
from kvjax.data.ruler import NIAH_TASKS, cwe, fwe, niah, vt  # noqa: F401
from kvjax.eval.tasks.fidelity import fidelity
from kvjax.eval.tasks.longbench import TASKS as LONGBENCH_TASKS
from kvjax.eval.tasks.longbench import longbench
from kvjax.eval.tasks.math import TASKS as MATH_TASKS
from kvjax.eval.tasks.math import math_task

_METRICS = {"qa_1": "string_match_part", "qa_2": "string_match_part", "niah_grid": "rouge1"}


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    name: str
    family: str  # ruler | niah_grid | passkey | longbench | math | fidelity
    metric: str  # a key of kvjax.eval.metrics.METRICS
    builder: Callable[..., list[Sample]]
    description: str


def _registry() -> dict[str, TaskInfo]:
    reg: dict[str, TaskInfo] = {}
    for name, gen in GENERATORS.items():  # the synthetic generators of kvjax.data
        reg[name] = TaskInfo(name, gen.family, _METRICS.get(name, "string_match_all"), gen.builder, gen.description)
    for name, (metric, _) in LONGBENCH_TASKS.items():
        reg[f"longbench/{name}"] = TaskInfo(f"longbench/{name}", "longbench", metric, longbench,
                                            f"LongBench {name} (--data longbench=DIR)")
    for name in MATH_TASKS:
        reg[name] = TaskInfo(name, "math", "math", math_task, f"{name} math reasoning (--data {name}=PATH)")
    reg["fidelity"] = TaskInfo("fidelity", "fidelity", "fidelity", fidelity,
                               "next-token KL and top-1 agreement, compressed vs full cache")
    return reg


TASKS: dict[str, TaskInfo] = _registry()
SUITES: dict[str, list[str]] = {
    **SYNTHETIC_SUITES,
    "longbench": [f"longbench/{n}" for n in LONGBENCH_TASKS],
    "math": list(MATH_TASKS),
}


def task_names(suite: str | None = None) -> list[str]:
    """All task names, or those of ``suite``."""
    if suite is None:
        return list(TASKS)
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; valid suites: {', '.join(SUITES)}")
    return list(SUITES[suite])


def resolve_tasks(names: list[str]) -> list[str]:
    """Expands suite names, keeps order, drops repeats; ValueError listing the valid names otherwise."""
    return _resolve_tasks(names, TASKS, SUITES)


def generate_task(name: str, tokenizer: TokenizerLike | None, context_length: int, num_samples: int, *,
                  seed: int = 42, overhead: int = 0, data: dict[str, str] | None = None, words: str = "builtin",
                  **task_options: Any) -> list[Sample]:
    """Samples of task ``name`` fitted to ``tokenizer`` and ``context_length``.

    overhead: tokens the chat template adds around one user turn (`prompts.chat_overhead`).
    data: local files by name (essay, squad, hotpotqa, longbench, gsm8k, math500, aime24, aime25,
      fidelity, fidelity_ids). words: "builtin" or "wonderwords" key and common-word lists.
    task_options: niah_grid takes lengths, depths, haystack; fidelity takes continuation_tokens.
    Raises TaskSkipped (with the reason) when the task cannot run here.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    info = TASKS[name]
    return run_builder(info.builder, name, tokenizer, context_length, num_samples,
                       needs_tokenizer=info.family != "fidelity", seed=seed, overhead=overhead, data=data,
                       words=words, **task_options)


__all__ = ["RULER_TASKS", "SUITES", "TASKS", "Sample", "TaskInfo", "TaskSkipped", "generate_task", "resolve_tasks", "task_names"]
