"""Prompt assembly (docs/benchmarks.md §0): chat template, then the compressed / fed-after split.

The chat template is rendered for one user turn holding ``context + question`` (after an
optional system turn), and ``answer_prefix`` follows the assistant header. The rendered text is
cut in two:

* query-agnostic (default, as kvpress): ``compressed`` = template prefix + context;
  ``question`` = question + end of turn + assistant header + answer prefix;
* query-aware: ``compressed`` = template prefix + context + question;
  ``question`` = end of turn + assistant header + answer prefix.

Without a chat template (the tokenizer has none, or the sample says ``chat_template: False``)
the text is BOS + context + question + answer prefix, cut at the same places. Both parts are
encoded without adding special tokens: BOS and the template's markers are already in the text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.data.base import encode

_SPLIT = "\u2063KVJAX-SPLIT\u2063"  # invisible separators: no chat template rewrites them


@dataclasses.dataclass(frozen=True)
class PromptParts:
    compressed: str
    question: str

    @property
    def text(self) -> str:
        return self.compressed + self.question


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def _render(tokenizer: Any, user: str, system: str | None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_overhead(tokenizer: Any) -> int:
    """Tokens a single user turn adds around its content: the chat template's, or BOS's without one."""
    if tokenizer is None:
        return 0
    if has_chat_template(tokenizer):
        return len(encode(tokenizer, _render(tokenizer, "", None)))
    return 1 if getattr(tokenizer, "bos_token", None) else 0


def build_prompt(sample: dict[str, Any], tokenizer: Any, query_aware: bool = False) -> PromptParts:
    """The compressed part and the part fed after compression, as text (see the module docstring)."""
    context, question, prefix = sample["context"], sample["question"], sample["answer_prefix"]
    if sample.get("chat_template", True) and has_chat_template(tokenizer):
        rendered = _render(tokenizer, context + _SPLIT + question, sample.get("system"))
        if rendered.count(_SPLIT) != 1:
            raise ValueError("the chat template altered the prompt's split marker; cannot cut context from question")
        head, tail = rendered.split(_SPLIT)
        if not tail.startswith(question):
            raise ValueError("the chat template altered the question text; cannot cut context from question")
        end = tail[len(question):]
    else:
        head, end = (getattr(tokenizer, "bos_token", None) or "") + context, ""
    if query_aware:
        return PromptParts(head + question, end + prefix)
    return PromptParts(head, question + end + prefix)


def encode_prompt(parts: PromptParts, tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids of the compressed part and of the fed-after part (no special tokens added)."""
    return encode(tokenizer, parts.compressed), encode(tokenizer, parts.question)
