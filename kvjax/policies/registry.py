"""Preset names (policies.md §13 and the *_kvpress presets) -> configured policy instances."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.policies.allocators import Ada, Pyramid
from kvjax.policies.base import Policy
from kvjax.policies.baseline import Random
from kvjax.policies.cake import CAKE
from kvjax.policies.critical import CriticalKV
from kvjax.policies.defensive import DefensiveKV
from kvjax.policies.expected import ExpectedAttention
from kvjax.policies.h2o import H2O, H2OPrefill
from kvjax.policies.knorm import KNorm
from kvjax.policies.kvzip import KVzip
from kvjax.policies.lazy import LazyEviction
from kvjax.policies.snapkv import AdaPyramidKV, AdaSnapKV, PyramidKV, SnapKV
from kvjax.policies.streaming import StreamingLLM
from kvjax.policies.tova import TOVA

# kvpress's SnapKV scoring (w=64, kernel 5, avg-pool, mean over the window, group mean after
# pooling, 1/sqrt(d)), shared by its PyramidKV and AdaKV presses.
_KVPRESS_SNAP = dict(
    window=64,
    kernel=5,
    pooling="avg",
    window_reduce="mean",
    gqa_order="after",
    rule="kvpress",
    use_model_scale=False,
    query_aware=False,
)

_PRESETS: dict[str, Policy] = {
    "streaming_llm": StreamingLLM(),
    "streaming_llm_kvpress": StreamingLLM(decode=False, rope_mode="original", rule="kvpress", query_aware=False),
    "h2o": H2O(),
    "h2o_prefill": H2OPrefill(),
    "observed_attention_kvpress": H2OPrefill(window=0, normalize=True, rule="kvpress", query_aware=False),
    "tova": TOVA(),
    "tova_kvpress": TOVA(decode=False, protect_last=True, rule="kvpress", use_model_scale=False, query_aware=False),
    "snapkv": SnapKV(),
    "snapkv_kvpress": SnapKV(**_KVPRESS_SNAP),
    "pyramidkv": PyramidKV(),
    "pyramidkv_kvpress": PyramidKV(allocator=Pyramid(beta=20, rule="kvpress"), **_KVPRESS_SNAP),
    "ada_snapkv": AdaSnapKV(),
    "ada_pyramidkv": AdaPyramidKV(),
    "adakv_snapkv_kvpress": SnapKV(allocator=Ada(alpha=0.2, rule="kvpress"), **_KVPRESS_SNAP),
    "cake": CAKE(),
    "cake_cascade": CAKE(cascade=True),
    "expected_attention": ExpectedAttention(),
    "expected_attention_kvpress": ExpectedAttention(rule="kvpress", query_aware=False),
    "ada_expected_attention": ExpectedAttention(epsilon=1e-2, allocator=Ada(alpha=0.2)),
    # kvpress's leaderboard entry `expected_attention`: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))
    "ada_expected_attention_kvpress": ExpectedAttention(
        epsilon=1e-2, allocator=Ada(alpha=0.2, rule="kvpress"), rule="kvpress", query_aware=False
    ),
    "critical_snapkv": CriticalKV(scorer=SnapKV()),
    "critical_ada_snapkv": CriticalKV(scorer=AdaSnapKV()),
    "critical_snapkv_kvpress": CriticalKV(scorer=SnapKV(**_KVPRESS_SNAP), query_aware=False),
    "critical_adakv_snapkv_kvpress": CriticalKV(
        scorer=SnapKV(allocator=Ada(alpha=0.2, rule="kvpress"), **_KVPRESS_SNAP), query_aware=False
    ),
    "defensivekv": DefensiveKV(),
    "layer_defensivekv": DefensiveKV(layer_wise=True),
    "kvzip": KVzip(),
    "kvzip_kvpress": KVzip(rule="kvpress", query_aware=False),
    "knorm": KNorm(),
    "knorm_kvpress": KNorm(skip_layers=(), rule="kvpress", query_aware=False),
    "lazy_eviction": LazyEviction(),
    "random": Random(),
}


def available() -> list[str]:
    """Every registered preset name, sorted."""
    return sorted(_PRESETS)


def get(name: str, **overrides: Any) -> Policy:
    """The preset `name`, with hyperparameters replaced by `overrides` (e.g. get("snapkv", window=16))."""
    if not isinstance(name, str) or name not in _PRESETS:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available())}")
    preset = _PRESETS[name]
    fields = {f.name for f in dataclasses.fields(preset)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"{name}: unknown hyperparameter(s) {unknown}; accepted: {sorted(fields)}")
    return dataclasses.replace(preset, **overrides)


def resolve(policy: str | Policy) -> Policy:
    """A preset name or a policy instance -> a policy instance."""
    if isinstance(policy, str):
        return get(policy)
    if isinstance(policy, Policy):
        return policy
    raise TypeError(f"policy must be a preset name (one of {available()}) or a Policy instance, got {policy!r}")
