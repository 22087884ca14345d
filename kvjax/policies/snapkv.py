"""SnapKV and its allocating variants PyramidKV, Ada-SnapKV, Ada-PyramidKV (policies.md §5-7)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies.allocators import Ada, Allocator, Pyramid
from kvjax.policies.base import (
    Plan,
    Requirements,
    as_i32,
    check_bool,
    check_choice,
    check_int,
    check_pool_kernel,
    window_protected,
)
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import (
    GQA_REDUCES,
    POOLINGS,
    Scored,
    attention_scale,
    group_reduce_fn,
    last_window,
    pool1d,
    window_moments,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKV(PrefillPolicy):
    """Observation-window scoring: attention of the last `window` prompt queries on earlier keys.

    s[h, j] = sum (or mean) over window queries of A°[h, i, j] (softmax over all keys, window
    included, non-window columns kept), pooled along keys, reduced over the query group before
    or after pooling; the window itself is protected. Paper defaults (w=32, kernel 7, max-pool,
    sum, group mean before pooling, no compression if T < C); `snapkv_kvpress` is
    SnapKV(window=64, kernel=5, pooling="avg", window_reduce="mean", gqa_order="after",
    rule="kvpress", use_model_scale=False, query_aware=False).
    """

    name = "snapkv"
    chunked_prefill_reason = None

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    window_reduce: str = "sum"
    gqa_reduce: str = "mean"
    gqa_order: str = "before"
    use_model_scale: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("window", self.window, 1)
        check_pool_kernel("kernel", self.kernel)
        check_choice("pooling", self.pooling, POOLINGS)
        check_choice("window_reduce", self.window_reduce, ("sum", "mean"))
        check_choice("gqa_reduce", self.gqa_reduce, GQA_REDUCES)
        check_choice("gqa_order", self.gqa_order, ("before", "after"))
        check_bool("use_model_scale", self.use_model_scale)

    def protected_count(self) -> int:
        return self.window

    def scorer_requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(window=self.window))

    def check_lengths(self, lengths: tuple[int, ...]) -> None:
        if self.rule == "kvpress" and min(lengths) <= self.window:
            raise ValueError(
                f"{type(self).__name__}(rule='kvpress') needs every prompt longer than window={self.window} "
                f"(kvpress asserts T > w); the shortest has {min(lengths)} tokens"
            )

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        w = self.window
        lengths = as_i32(plan.lengths)
        q, qpos = last_window(obs, w)
        before = self.gqa_order == "before"
        scale = attention_scale(obs, cache.k.shape[-1], self.use_model_scale)
        reduce = self.gqa_reduce if before else None
        m = window_moments(q, qpos, cache, scale=scale, group_reduce=reduce, moments=("sum",))
        a = m["sum"] / w if self.window_reduce == "mean" else m["sum"]
        cand = cache.valid & (cache.pos < (lengths - w)[None, :, None, None])
        if before:
            s = pool1d(a, cand, self.kernel, self.pooling)
        else:
            s = group_reduce_fn(pool1d(a, cand[:, :, :, None], self.kernel, self.pooling), self.gqa_reduce, axis=3)
        s = jnp.where(cand, s, 0.0)
        return Scored(s, window_protected(cache.pos, cache.valid, lengths, w))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PyramidKV(SnapKV):
    """SnapKV scoring with PyramidKV's per-layer schedule (authors' LongBench runner: w=8, kernel 7,
    max-pool, beta=20). kvpress: scoring of snapkv_kvpress and Pyramid(rule="kvpress")."""

    name = "pyramidkv"

    window: int = 8
    allocator: Allocator = Pyramid(beta=20)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaSnapKV(SnapKV):
    """SnapKV scoring (mean over the window) with Ada-KV's head-wise allocation, alpha = 0.2."""

    name = "ada_snapkv"

    window_reduce: str = "mean"
    allocator: Allocator = Ada(alpha=0.2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaPyramidKV(SnapKV):
    """Ada-KV head-wise allocation on top of the PyramidKV layer schedule (Ada-KV's pyram mode)."""

    name = "ada_pyramidkv"

    window_reduce: str = "mean"
    allocator: Allocator = Ada(alpha=0.2, pyramid_beta=20)
