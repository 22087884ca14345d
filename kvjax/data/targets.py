"""Canonical completions: what a perfect model writes after ``answer_prefix`` (for training data).

Each one scores 1.0 under its task's metric; the format follows the task's own one-shot example
where it has one (vt, cwe), and a plain sentence otherwise (the needle grid: the whole needle,
which its ROUGE-1 score compares against).
"""

from __future__ import annotations

from typing import Any


def completion(sample: dict[str, Any]) -> str:
    """The reference continuation of ``sample`` (without the end-of-turn token)."""
    task, answers = sample["task"], sample["answers"]
    if task == "vt":
        return " ".join(answers)
    if task == "cwe":
        return " " + " ".join(f"{j + 1}. {w}" for j, w in enumerate(answers))
    if task == "fwe":
        return " " + " ".join(answers)
    if task == "niah_grid":
        return " " + answers[0]
    if task.startswith("niah") or task == "passkey":
        return " " + ", ".join(answers) + "."
    if not answers:
        raise ValueError(f"task {task!r} has no reference answer to complete")
    return " " + answers[0]
