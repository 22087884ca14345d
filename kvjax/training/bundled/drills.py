"""Rows' answers and extra questions: the rendered prompt and target of a sample, needle drills.

`render` feeds a sample exactly as the evaluation does (kvjax.data.prompts) and answers it with
the task's canonical completion; `needle_drills` turns every needle line of a context into
further questions, so one long context gives many retrieval targets.
"""

from __future__ import annotations

import random
import re
from typing import Any

from kvjax.data import templates as T
from kvjax.data.prompts import build_prompt, encode_prompt
from kvjax.data.targets import completion

NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: ([^\s.]+)\.")


def render(sample: dict[str, Any], tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids as the evaluation feeds them, target ids = the task's canonical completion + end-of-turn).

    Needle answers are listed in their order of appearance in the context (the metric ignores order).
    """
    if sample["task"].startswith("niah") and len(sample["answers"]) > 1:
        ctx = sample["context"]
        sample = {**sample, "answers": sorted(sample["answers"], key=lambda a: ctx.find(a))}
    context, question = encode_prompt(build_prompt(sample, tokenizer), tokenizer)
    answer = tokenizer.encode(completion(sample), add_special_tokens=False)
    return context + question, answer + [tokenizer.eos_token_id]


def needle_drills(sample: dict[str, Any], rng: random.Random,
                  order: str = "query") -> list[tuple[str, str, str, tuple[str, ...]]]:
    """Extra questions on the needles of a sample's context, in random order: (question, prefix, answer, keys).

    Every needle line of the haystack (distractors included) is a key-value fact the context states,
    so asking about each one gives many retrieval targets per long sequence instead of one. Keys with
    several values are asked in the plural form; a quarter of the drills ask 2-4 keys at once (as
    niah_multiquery does). Questions use RULER's own templates. The values of a drill asking several
    keys are listed key by key (`order="query"`) or in their order of appearance (`"context"`, as
    `render` lists a sample's own answers).
    """
    facts: dict[str, tuple[str, list[str]]] = {}
    for kind, key, value in NEEDLE.findall(sample["context"]):
        facts.setdefault(key, (kind, []))[1].append(value)
    keys = list(facts)
    rng.shuffle(keys)
    drills = []
    while keys:
        take = rng.randint(2, 4) if len(keys) >= 2 and rng.random() < 0.25 else 1
        group, keys = keys[:take], keys[take:]
        if len({facts[k][0] for k in group}) > 1:
            group = group[:1]
        kind = facts[group[0]][0]
        values = [v for k in group for v in facts[k][1]]
        if order == "context":
            values.sort(key=sample["context"].find)
        query = ", ".join(group[:-1]) + ", and " + group[-1] if len(group) > 1 else group[0]
        tmpl = (T.NIAH_QUESTION, T.NIAH_ANSWER_PREFIX)
        if len(values) == 1:  # RULER's singular form: "A special magic number ... is"
            tmpl, kind = tuple(T.singular(t) for t in tmpl), kind[:-1]
        q, prefix = (t.format(type_needle_v=kind, query=query) for t in tmpl)
        drills.append((q, prefix, " " + ", ".join(values) + ".", tuple(group)))
    return drills


def query_keys(sample: dict[str, Any]) -> list[str]:
    """The keys a needle sample's own question asks about (parsed from its answer prefix)."""
    m = re.search(r" for (.+) mentioned in the provided text", sample.get("answer_prefix", ""))
    if not m:
        return []
    return [k.strip() for k in re.split(r", and |, ", m.group(1))]

