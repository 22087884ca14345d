"""KVzip: query-agnostic scores from the model reconstructing its own context (arXiv 2505.23416;
authors' code snu-mllab/KVzip, kvpress KVzipPress).

The score of a prompt key is its max attention from the queries of a repeat-the-context pass
(the `Reconstruction` observation, a pass the engine runs after the prefill, chunk by chunk; see
kvjax/passes/reconstruction.py). The first n_sink tokens are protected (kvpress gives them score 1).
Budgets are shared by all layers and KV heads (layerwise=False, the default: kvpress prunes
int(L Hkv T r) entries over the whole cache) or by the heads of each layer (layerwise=True).

Cost: the reconstruction passes re-read the whole prompt against the full cache, so a KVzip prefill
costs about 2-3 plain prefills (kvpress's warning); in exchange the kept set does not depend on the
question (kvpress leaderboard, RULER-4K Llama-3.1-8B: about 95 up to r = 0.75, near the full cache).

Instruction tokens: `first_ids` / `next_ids` / `suffix_ids` are token ids (a policy never sees a
tokenizer); `KVzip.for_tokenizer(tokenizer)` encodes the authors' prompts "\\n\\nRepeat the previous
context exactly." and "\\n\\nRepeat the part of the previous context exactly, starting with". The
paper preset `kvzip` has none (repeat="fixed"): each repeat pass is the chunk alone (plus the previous
chunk's last tokens), over the whole prompt.

`kvzip_kvpress` (repeat="kvpress") builds the passes as kvpress 0.5.5's KVzipPress does when the engine
knows the prompts are chat-templated (`for_prompts`: the model's tokenizer has a chat template and every
prompt of the batch, text or token ids, starts with its prefix). The context is everything after the
template's prefix (system turn, user header; `prefix` = its length, kvpress's `prefix_length`): the
context alone when the eval feeds the question and the assistant header after compression (kvpress's
protocol), context + end of turn + assistant header for `generate(..., chat_template=True)`. Chunk 0's
pass is "\\n\\nRepeat the previous context exactly." + the template's suffix (end of turn, assistant
header) + the chunk; chunk i's is "\\n\\nRepeat the part of the previous context exactly, starting with"
+ the last 8 tokens of chunk i-1 + the suffix + the chunk; the sinks of chunk i are the first
min(n_sink, start) positions. For raw prompts (not starting with the template's prefix, or a model
without a tokenizer or without a chat template) it falls back to the fixed passes (the paper preset's:
no instruction, the whole prompt), where kvpress, given a tokenizer without a chat template, would still
add its instructions and "\\n" as the suffix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.observations import Observations, ObservationSpec
from kvjax.passes.reconstruction import Reconstruction
from kvjax.policies.allocators import Allocator, Global
from kvjax.policies.base import Plan, PromptFormat, Requirements, check_bool, check_choice, check_int
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
REPEATS = ("fixed", "kvpress")


def _check_ids(name: str, ids: Any) -> None:
    if not isinstance(ids, tuple):
        raise TypeError(f"{name} must be a tuple of token ids, got {ids!r}")
    for i, t in enumerate(ids):
        check_int(f"{name}[{i}]", t, 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVzip(PrefillPolicy):
    """KVzip with kvpress's defaults: chunk_size=2048, n_sink=4, postfix=8, layerwise=False.

    repeat: "fixed" (the passes hold the instruction ids given here, none by default, from position
    `prefix` on) or "kvpress" (on a chat-templated batch, `for_prompts` replaces first_ids / next_ids /
    suffix_ids and prefix with kvpress's, from the chat template; see the module docstring).
    prefix: the positions before the context (a chat template's header): never reconstructed nor scored
    (only their first n_sink are kept, as sinks).
    A budget C keeps L*Hkv*C entries in all (Hkv*C per layer when layerwise); a ratio r prunes
    int(L*Hkv*T*r) (rule="kvpress", the code's rounding) or keeps int(T(1-r)) per head on average
    (rule="paper"). `allocator` is unused (the allocation is `Global`).
    """

    name = "kvzip"
    chunked_prefill_reason = "its scores come from a pass that repeats the whole context after the prefill"

    chunk_size: int = 2048
    n_sink: int = 4
    postfix: int = 8
    layerwise: bool = False
    first_ids: tuple[int, ...] = ()
    next_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()
    prefix: int = 0
    repeat: str = "fixed"

    def __post_init__(self) -> None:
        check_int("chunk_size", self.chunk_size, 1)
        check_int("n_sink", self.n_sink, 0)
        check_int("postfix", self.postfix, 0)
        check_bool("layerwise", self.layerwise)
        check_int("prefix", self.prefix, 0)
        check_choice("repeat", self.repeat, REPEATS)
        for name in ("first_ids", "next_ids", "suffix_ids"):
            _check_ids(name, getattr(self, name))
        super().__post_init__()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, **overrides: Any) -> KVzip:
        """KVzip with the authors' instruction prompts encoded by `tokenizer` (no special tokens)."""
        enc = lambda text: tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return cls(first_ids=enc(FIRST_PROMPT), next_ids=enc(NEXT_PROMPT), **overrides)

    def for_prompts(self, fmt: PromptFormat | None) -> KVzip:
        """repeat="kvpress" on a batch of chat-templated prompts: kvpress's instructions, the template's
        suffix and its prefix length; otherwise the policy itself. A batch that mixes chat-templated and
        raw prompts is refused (the passes are built once for the whole batch)."""
        if self.repeat != "kvpress" or fmt is None or not any(fmt.templated):
            return self
        if not all(fmt.templated):
            raw = [b for b, t in enumerate(fmt.templated) if not t]
            raise ValueError(f"KVzip(repeat='kvpress') builds its repeat passes from the chat template for the whole "
                             f"batch, but rows {raw} do not start with the template's prefix (raw prompts) while "
                             "others do: run chat-templated and raw prompts in separate calls")
        enc = lambda text: tuple(int(t) for t in fmt.encode(text))  # noqa: E731
        return dataclasses.replace(self, first_ids=enc(FIRST_PROMPT), next_ids=enc(NEXT_PROMPT),
                                   suffix_ids=tuple(int(t) for t in fmt.suffix_ids), prefix=len(fmt.prefix_ids))

    def budget_allocator(self) -> Allocator:
        return Global(across_layers=not self.layerwise, rounding="pruned" if self.rule == "kvpress" else "kept")

    def protected_count(self) -> int:
        return self.n_sink

    def reconstruction(self) -> Reconstruction:
        return Reconstruction(chunk_size=self.chunk_size, n_sink=self.n_sink, postfix=self.postfix,
                              first_ids=self.first_ids, next_ids=self.next_ids, suffix_ids=self.suffix_ids,
                              prefix=self.prefix)

    def scorer_requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(reconstruction=self.reconstruction()))

    def check_lengths(self, lengths: tuple[int, ...]) -> None:
        if min(lengths) <= self.n_sink:
            raise ValueError(f"KVzip needs every prompt longer than n_sink={self.n_sink}; "
                             f"the shortest has {min(lengths)} tokens")
        if min(lengths) <= self.prefix:
            raise ValueError(f"KVzip reconstructs the context after the prefix of {self.prefix} tokens (a chat "
                             f"template's header); the shortest prompt has {min(lengths)} tokens, none after it")

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        if obs.reconstruction is None:
            raise ValueError("KVzip needs the reconstruction observation (ObservationSpec(reconstruction=...)), "
                             "which the engine's prefill records")
        sink = cache.valid & (cache.pos < self.n_sink)
        s = jnp.where(cache.valid & ~sink, obs.reconstruction.astype(jnp.float32), 0.0)
        return Scored(s, sink)
