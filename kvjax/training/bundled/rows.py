"""Rows that are not task samples: copy rows (repeat a list) and recall rows (restate needle lines).

Each returns (token ids, target indices into them); every token of the reply, with its end-of-turn
token, is a target. Both are pure functions of (seed, index, length) for one tokenizer.
"""

from __future__ import annotations

import random
from typing import Any

from kvjax.data import templates as T
from kvjax.data.haystacks import key_words, random_value

COPY_INSTRUCTION = "Repeat the following text exactly.\n"
RECALL_INSTRUCTION = "Memorize these special magic numbers, then state each one again.\n"
MAX_TARGETS = 256  # target tokens scored per row (logits are computed only there)


def turn_format(tokenizer: Any) -> str:
    """The text between an answer's end-of-turn token and the next answer: '{question}', '{prefix}'."""
    msgs = [{"role": "user", "content": "\x00"}, {"role": "assistant", "content": "\x01"},
            {"role": "user", "content": "\x02"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    tail = text.split("\x01", 1)[1]
    if not tail.startswith(tokenizer.eos_token):
        raise ValueError("the chat template does not end an assistant turn with the eos token")
    return tail[len(tokenizer.eos_token):].replace("\x02", "{question}") + "{prefix}"


def user_turn(tokenizer: Any, instruction: str) -> tuple[list[int], list[int]]:
    """Token ids of a chat user turn opening with `instruction`, before and after its content,
    through the assistant header."""
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": instruction + "\x00"}], tokenize=False, add_generation_prompt=True)
    before, after = head.split("\x00")
    return (tokenizer.encode(before, add_special_tokens=False),
            tokenizer.encode(after, add_special_tokens=False))


def copy_row(tokenizer: Any, length: int, seed: int, index: int) -> tuple[list[int], list[int]]:
    """A user turn asking to repeat a list of random items, answered with that list.

    The items are the tasks' random values (7-digit numbers, UUIDs, adjective-noun keys,
    variable names), so no token of the reply can be guessed: it must be copied. Copying a text
    seen once is what induction heads do, the second half of retrieval (find the key, then copy
    what follows it); every token of the reply is a target.
    """
    rng = random.Random(seed * 7_000_003 + index)
    words = key_words()
    kinds = ("numbers", "uuids", "words", "names")
    before, after = user_turn(tokenizer, COPY_INSTRUCTION)
    span = min((length - len(before) - len(after) - 1) // 2, MAX_TARGETS - 1)
    items: list[str] = []
    while len(tokenizer.encode(" ".join(items), add_special_tokens=False)) < span:
        kind = rng.choice(kinds)
        items.append("".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) if kind == "names"
                     else random_value(kind, rng, words))
    chunk = tokenizer.encode(" ".join(items), add_special_tokens=False)[:span]
    row = before + chunk + after
    return row + chunk + [tokenizer.eos_token_id], list(range(len(row), len(row) + len(chunk) + 1))


def recall_row(tokenizer: Any, length: int, seed: int, index: int, *, uuids: float = 0.0,
               multi_value: float = 0.0) -> tuple[list[int], list[int]]:
    """Needle lines, then a reply that states every key's value again in shuffled order.

    The reply is either the needle lines themselves ("... for KEY is: VALUE.") or the answer
    sentences of the evaluation (" The special magic number for KEY mentioned in the provided
    text is VALUE."), so each value is a retrieval by its key, at a short or at the evaluation's
    distance from it; every token of the reply is a target. A `uuids` share of rows use UUID
    values, with word or UUID keys (as niah_single_3 and niah_multikey_3 do). A `multi_value`
    share of keys have 2-4 values on lines scattered among the others, stated together in order
    of appearance (as niah_multivalue asks).
    """
    rng = random.Random(seed * 5_000_011 + index)
    words = key_words()
    answer_style = rng.random() < 0.5
    before, after = user_turn(tokenizer, RECALL_INSTRUCTION)
    order = random.Random(index)
    # a separate stream, so rows of configs without `uuids` / `multi_value` stay as they were
    kinds = random.Random(seed * 3_000_017 + index)
    key_kind, value_kind = "words", "numbers"
    if kinds.random() < uuids:  # as niah_single_3 (word keys) or niah_multikey_3 (UUID keys)
        key_kind, value_kind = kinds.choice(("words", "uuids")), "uuids"

    def render(facts: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
        lines = "\n".join(T.NIAH_NEEDLE.format(type_needle_v=value_kind, key=k, value=v) for k, v in facts)
        values: dict[str, list[str]] = {}
        for k, v in facts:
            values.setdefault(k, []).append(v)
        shuffled = random.Random(order.random()).sample(list(values), len(values))
        if answer_style:
            plural, singular = T.NIAH_ANSWER_PREFIX, T.singular(T.NIAH_ANSWER_PREFIX)
            reply = "\n".join(
                (singular.format(type_needle_v=value_kind[:-1], query=k) if len(values[k]) == 1
                 else plural.format(type_needle_v=value_kind, query=k)) + f" {', '.join(values[k])}."
                for k in shuffled)
        else:
            reply = "\n".join(T.NIAH_NEEDLE.format(type_needle_v=value_kind, key=k, value=v)
                              for k in shuffled for v in values[k])
        return (tokenizer.encode(lines, add_special_tokens=False),
                tokenizer.encode(reply, add_special_tokens=False))

    facts: list[tuple[str, str]] = []
    while True:
        key = random_value(key_kind, rng, words)
        if any(key == k for k, _ in facts):
            continue
        many = multi_value and kinds.random() < multi_value
        candidate = list(facts)
        for _ in range(kinds.randint(2, 4) if many else 1):
            fact = (key, random_value(value_kind, rng, words))
            candidate.insert(kinds.randint(0, len(candidate)) if many else len(candidate), fact)
        ctx, reply = render(candidate)
        if len(before) + len(ctx) + len(after) + len(reply) + 1 > length or len(reply) + 1 > MAX_TARGETS:
            break
        facts = candidate
    ctx, reply = render(facts)
    row = before + ctx + after
    return row + reply + [tokenizer.eos_token_id], list(range(len(row), len(row) + len(reply) + 1))
