"""Math reasoning: GSM8K, MATH-500, AIME 2024/2025 (§4), from local JSONL files or the Hub.

Files are given as ``--data gsm8k=PATH`` (and ``math500``, ``aime24``, ``aime25``). Without one,
the Hub is tried through `datasets` when installed and online; otherwise the task is skipped.
Prompt: LazyEviction's (system "You are a helpful assistant.", the instruction then the problem,
the assistant turn opening with ``<think>\\n``); greedy; caps 4096 / 8192 / 16384 new tokens,
lowered to what ``context_length`` leaves after the prompt.
"""

from __future__ import annotations

import json
import pathlib

from kvjax.data.base import LengthFitter, Options, Sample, TaskSkipped

SYSTEM = "You are a helpful assistant."
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{{}}.\n{question}"
ANSWER_PREFIX = "<think>\n"

# task -> (max_new_tokens, Hub (path, config, split))
TASKS: dict[str, tuple[int, tuple[str, str | None, str]]] = {
    "gsm8k": (4096, ("openai/gsm8k", "main", "test")),
    "math500": (8192, ("HuggingFaceH4/MATH-500", None, "test")),
    "aime24": (16384, ("HuggingFaceH4/aime_2024", None, "train")),
    "aime25": (16384, ("yentinglin/aime_2025", None, "train")),
}
_QUESTION_FIELDS = ("question", "problem", "Problem", "Question")
_ANSWER_FIELDS = ("answer", "Answer", "solution")


def gsm8k_gold(solution: str) -> str:
    """GSM8K's gold answer: the text after ``####``, commas removed."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '####' answer: {solution[-80:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def _field(row: dict, names: tuple[str, ...], task: str) -> str:
    for n in names:
        if n in row and row[n] is not None:
            return str(row[n])
    raise ValueError(f"{task}: a row has none of the fields {names}: keys {sorted(row)}")


def load_rows(task: str, data: dict[str, str] | None) -> list[dict]:
    path = (data or {}).get(task)
    if path:
        p = pathlib.Path(path)
        if not p.is_file():
            raise TaskSkipped(f"{task}: the file {path!r} does not exist")
        with p.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    hub, config, split = TASKS[task][1]
    try:
        import datasets
    except ImportError:
        raise TaskSkipped(f"{task} needs --data {task}=PATH (JSONL) or the `datasets` package and a network "
                          "connection for the Hub") from None
    try:
        return list(datasets.load_dataset(hub, config, split=split))
    except Exception as err:
        raise TaskSkipped(f"{task}: no local file (--data {task}=PATH) and the Hub failed: "
                          f"{type(err).__name__}: {err}") from None


def math_task(task: str, opts: Options) -> list[Sample]:
    """The first ``num_samples`` problems; ``answers`` holds the gold answer string."""
    cap = TASKS[task][0]
    fitter = LengthFitter(opts.tokenizer, opts.overhead)
    samples = []
    for j, row in enumerate(load_rows(task, opts.data)[: opts.num_samples]):
        problem = _field(row, _QUESTION_FIELDS, task)
        gold = _field(row, _ANSWER_FIELDS, task)
        if task == "gsm8k":
            gold = gsm8k_gold(gold)
        context = INSTRUCTION.format(question=problem)
        # The system turn is not in the overhead (one user turn): count its text plus a few marker tokens.
        prompt_len = fitter.length(SYSTEM + context, "", ANSWER_PREFIX, 0) + 8
        max_new = min(cap, opts.context_length - prompt_len)
        if max_new <= 0:
            raise ValueError(f"context_length {opts.context_length} leaves no room to answer {task} problem {j} "
                             f"({prompt_len} prompt tokens)")
        samples.append(Sample(
            id=f"{task}/{row.get('unique_id', row.get('id', j))}", task=task, context=context, question="",
            answer_prefix=ANSWER_PREFIX, answers=[gold], max_new_tokens=max_new, chat_template=True, system=SYSTEM,
            length=prompt_len + max_new, target_length=opts.context_length, metadata={"metric": "math"},
        ))
    return samples
