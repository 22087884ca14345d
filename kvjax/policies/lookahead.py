"""LookaheadKV (policies.md §11.3): prompt keys scored by the attention of learned lookahead tokens.

The engine runs the adapter's n tokens after the prompt (LoRA on their rows, never stored in the
cache: the `LookaheadTokens` observation, with the adapter params as this policy's
`observation_inputs`) and hands over their attention mass per query head, `Observations.query_mass`
[L,B,Hq,C];
this policy turns it into scores: s̃ = mass / n, reduced over the query group (mean or max), then
max-pooled along positions (or not), exactly as configured in the adapter's `LookaheadConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.lookahead import Adapter, LookaheadConfig, load
from kvjax.observations import Observations, ObservationSpec
from kvjax.passes.lookahead import LookaheadTokens
from kvjax.policies.base import Plan, Requirements, as_i32, window_protected
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored, group_reduce_fn, pool1d


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Adapter:
    return load(path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LookaheadKV(PrefillPolicy):
    """LookaheadKV with a trained adapter; uniform budget by default (any allocator composes).

    adapter: an `Adapter` (kvjax.lookahead.load / init_adapter), a folder to load one from, or None
      for the bundled model's adapter (kvjax/assets/lookahead). Loaded when first needed; a missing
      bundled adapter raises FileNotFoundError saying how to pass one.
    Query-aware by default (the paper); `query_aware=False` scores the context alone in the eval's
    context-then-question mode. Scoring options (gqa_reduce, pooling, kernel, protect_last) are
    the adapter's `LookaheadConfig`.
    """

    name = "lookahead_kv"
    chunked_prefill_reason = ("its learned tokens are trained to follow the whole prompt and run once, "
                              "after it")

    adapter: Any = dataclasses.field(default=None, compare=False)
    # what the compiled scoring depends on: the adapter's config (or its path, until loaded)
    _identity: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        a = self.adapter
        if a is None:
            ident: Any = ("bundled",)
        elif isinstance(a, (str, os.PathLike)):
            ident = ("path", os.fspath(a))
        elif isinstance(a, Adapter):
            ident = ("adapter", a.config, a.model_info)
        else:
            raise TypeError("adapter must be a kvjax.lookahead.Adapter, a folder path, or None (the bundled "
                            f"model's adapter), got {type(a).__name__}")
        object.__setattr__(self, "_identity", ident)

    def lookahead_adapter(self) -> Adapter:
        """The adapter (loaded from its folder, or the bundled one, on first use)."""
        a = self.adapter
        if isinstance(a, Adapter):
            return a
        return _load("bundled" if a is None else os.fspath(a))

    @property
    def config(self) -> LookaheadConfig:
        return self.lookahead_adapter().config

    def protected_count(self) -> int:
        return self.config.protect_last

    def scorer_requirements(self) -> Requirements:
        a = self.lookahead_adapter()
        return Requirements(observe=ObservationSpec(LookaheadTokens(a.config, a.model_info)))

    def observation_inputs(self) -> dict[str, Any]:
        """The adapter params the lookahead pass runs with."""
        return self.lookahead_adapter().params

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        conf = self.config
        if obs.query_mass is None:
            raise ValueError("LookaheadKV needs the lookahead pass's query_mass observation (the engine's "
                             "LookaheadTokens pass, which its requirements ask for)")
        L, B, Hq, C = obs.query_mass.shape
        Hkv = cache.k.shape[2]
        s = (obs.query_mass / conf.n_tokens).reshape(L, B, Hkv, Hq // Hkv, C)
        s = group_reduce_fn(s, conf.gqa_reduce, axis=3)
        lengths = as_i32(plan.lengths)
        w = conf.protect_last
        cand = cache.valid & (cache.pos < (lengths - w)[None, :, None, None])
        s = pool1d(s, cand, conf.kernel, "none" if conf.pooling is None else conf.pooling)
        s = jnp.where(cand, s, 0.0)
        protected = window_protected(cache.pos, cache.valid, lengths, w) if w else jnp.zeros_like(cache.valid)
        return Scored(s, protected)
