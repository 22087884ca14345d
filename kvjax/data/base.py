"""Sample schema, token counting and the length search shared by every task generator.

A sample is a plain JSON-able dict (the kvpress row schema plus bookkeeping):

    id             unique within the task, e.g. "niah_single_1/7"
    task           task name
    context        the part compressed in query-agnostic mode
    question       the part appended after compression
    answer_prefix  text placed after the assistant header; the model continues from it
    answers        list of reference strings
    max_new_tokens generation cap
    chat_template  whether the model's chat template wraps context + question (default True)
    length         prompt tokens (with chat-template overhead) + max_new_tokens
    target_length  the requested context length, or None when the sample was not fitted

Length contract of fitted generators: ``length <= target_length``, and one more haystack unit
(sentence, word, line, list item, document) would overflow it, i.e. the fit is tight to one unit.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypedDict


class Sample(TypedDict, total=False):
    id: str
    task: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
    chat_template: bool
    length: int
    target_length: int | None
    system: str
    stop: list[str]
    metadata: dict[str, Any]


class TokenizerLike(Protocol):
    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any: ...

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str: ...


class TaskSkipped(Exception):
    """Raised by a generator that cannot run here; the message says why (shown to the user)."""


def encode(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, for HF tokenizers, `tokenizers.Tokenizer` or plain encoders."""
    try:
        out = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        out = tokenizer.encode(text)
    if hasattr(out, "ids"):  # tokenizers.Encoding
        out = out.ids
    return list(out)


def reference_answer(sample: Sample) -> str:
    """The text a correct answer continues the prompt with, after its answer prefix: the generator's own
    (``metadata["reference"]``) when it wrote one, else the expected answers one per line after a space."""
    return sample["metadata"].get("reference") or " " + "\n".join(sample["answers"])


def count_tokens(tokenizer: TokenizerLike, text: str) -> int:
    """Number of tokens of ``text`` without special tokens."""
    return len(encode(tokenizer, text))


def decode(tokenizer: TokenizerLike, ids: Sequence[int]) -> str:
    """Text of ``ids``; special tokens are kept (callers pass plain-text ids)."""
    return tokenizer.decode(list(ids))


def sample_rng(seed: int, task: str, index: int) -> random.Random:
    """The per-sample generator: independent of the other samples and of the length search."""
    return random.Random(seed * 1_000_003 + zlib.crc32(task.encode()) * 7919 + index)


def fit_units(total_tokens: Callable[[int], int], limit: int, minimum: int = 0, what: str = "prompt",
              maximum: int | None = None) -> int:
    """Largest ``n`` in ``[minimum, maximum]`` with ``total_tokens(n) <= limit``: doubling, then bisection.

    Keeps the invariant "lo fits, hi overflows", so the answer always satisfies
    ``total_tokens(n) <= limit < total_tokens(n + 1)`` (unless ``n == maximum``: the source ran
    out) even if ``total_tokens`` is not monotonic. Raises ValueError naming the shortest
    possible prompt when even ``minimum`` units overflow.
    """
    smallest = total_tokens(minimum)
    if smallest > limit:
        raise ValueError(
            f"context_length {limit} is too small for this {what}: the shortest prompt needs {smallest} tokens"
        )
    if maximum is not None and total_tokens(maximum) <= limit:
        return maximum
    lo, step = minimum, 1
    hi = minimum + step
    while (maximum is None or hi < maximum) and total_tokens(hi) <= limit:
        lo = hi
        step *= 2
        hi = lo + step
        if step > 1 << 26:
            raise ValueError(f"the {what} does not grow with its haystack size; cannot fit it to {limit} tokens")
    if maximum is not None:
        hi = min(hi, maximum)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if total_tokens(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


class LengthFitter:
    """Counts full-prompt tokens of (context, question, answer_prefix) for one tokenizer.

    ``overhead`` is the number of tokens the chat template (or BOS) adds around a single user
    turn; generators add it and ``max_new_tokens`` so that ``length`` is what the model sees.
    """

    def __init__(self, tokenizer: TokenizerLike, overhead: int = 0) -> None:
        if overhead < 0:
            raise ValueError(f"overhead must be >= 0, got {overhead}")
        self.tokenizer = tokenizer
        self.overhead = overhead

    def length(self, context: str, question: str, answer_prefix: str, max_new_tokens: int) -> int:
        return count_tokens(self.tokenizer, context + question + answer_prefix) + self.overhead + max_new_tokens


def check_length(context_length: int) -> None:
    if not isinstance(context_length, int) or isinstance(context_length, bool) or context_length <= 0:
        raise ValueError(f"context_length must be a positive int, got {context_length!r}")


def check_num_samples(num_samples: int) -> None:
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 0:
        raise ValueError(f"num_samples must be an int >= 0, got {num_samples!r}")


@dataclasses.dataclass
class Options:
    """What every generator takes besides the task name."""

    tokenizer: TokenizerLike
    context_length: int
    num_samples: int
    seed: int = 42
    overhead: int = 0
    data: dict[str, str] | None = None
    words: str = "builtin"

    @property
    def fitter(self) -> LengthFitter:
        return LengthFitter(self.tokenizer, self.overhead)


def fitted_sample(task: str, opts: Options, index: int, build: Callable[[int], tuple[str, str, str]],
                  answers: list[str], max_new: int, minimum: int = 0, maximum: int | None = None,
                  **meta: object) -> Sample:
    """The sample whose haystack size is the largest that fits ``opts.context_length`` (see `fit_units`).

    ``build(n)`` returns (context, question, answer_prefix) with ``n`` haystack units.
    """
    fitter = opts.fitter

    def total(n: int) -> int:
        return fitter.length(*build(n), max_new)

    n = fit_units(total, opts.context_length, minimum, what=f"{task} prompt", maximum=maximum)
    context, question, prefix = build(n)
    return Sample(
        id=f"{task}/{index}", task=task, context=context, question=question, answer_prefix=prefix,
        answers=answers, max_new_tokens=max_new, chat_template=True,
        length=fitter.length(context, question, prefix, max_new), target_length=opts.context_length,
        metadata={"haystack_units": n, "next_unit_length": None if n == maximum else total(n + 1), **meta},
    )
