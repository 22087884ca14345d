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
preset has none: the repeat pass is then the chunk alone (plus the previous chunk's last tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.observations import Observations, ObservationSpec
from kvjax.passes.reconstruction import Reconstruction
from kvjax.policies.allocators import Allocator, Global
from kvjax.policies.base import Plan, Requirements, check_bool, check_int
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


def _check_ids(name: str, ids: Any) -> None:
    if not isinstance(ids, tuple):
        raise TypeError(f"{name} must be a tuple of token ids, got {ids!r}")
    for i, t in enumerate(ids):
        check_int(f"{name}[{i}]", t, 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVzip(PrefillPolicy):
    """KVzip with kvpress's defaults: chunk_size=2048, n_sink=4, postfix=8, layerwise=False.

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

    def __post_init__(self) -> None:
        check_int("chunk_size", self.chunk_size, 1)
        check_int("n_sink", self.n_sink, 0)
        check_int("postfix", self.postfix, 0)
        check_bool("layerwise", self.layerwise)
        for name in ("first_ids", "next_ids", "suffix_ids"):
            _check_ids(name, getattr(self, name))
        super().__post_init__()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, **overrides: Any) -> KVzip:
        """KVzip with the authors' instruction prompts encoded by `tokenizer` (no special tokens)."""
        enc = lambda text: tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return cls(first_ids=enc(FIRST_PROMPT), next_ids=enc(NEXT_PROMPT), **overrides)

    def budget_allocator(self) -> Allocator:
        return Global(across_layers=not self.layerwise, rounding="pruned" if self.rule == "kvpress" else "kept")

    def protected_count(self) -> int:
        return self.n_sink

    def reconstruction(self) -> Reconstruction:
        return Reconstruction(chunk_size=self.chunk_size, n_sink=self.n_sink, postfix=self.postfix,
                              first_ids=self.first_ids, next_ids=self.next_ids, suffix_ids=self.suffix_ids)

    def scorer_requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(reconstruction=self.reconstruction()))

    def check_lengths(self, lengths: tuple[int, ...]) -> None:
        if min(lengths) <= self.n_sink:
            raise ValueError(f"KVzip needs every prompt longer than n_sink={self.n_sink}; "
                             f"the shortest has {min(lengths)} tokens")

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        if obs.reconstruction is None:
            raise ValueError("KVzip needs the reconstruction observation (ObservationSpec(reconstruction=...)), "
                             "which the engine's prefill records")
        sink = cache.valid & (cache.pos < self.n_sink)
        s = jnp.where(cache.valid & ~sink, obs.reconstruction.astype(jnp.float32), 0.0)
        return Scored(s, sink)
