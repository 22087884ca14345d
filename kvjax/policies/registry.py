"""Preset names (policies.md §13 and the *_kvpress presets) -> configured policy instances.

Names are also accepted in kvpress's and the papers' spellings (`SnapKV`, `snap_kv`,
`StreamingLLM`, `SnapKVPress`, `KnormPress`, ...): `canonical_name` maps them to one preset, and
results are recorded under that name. A kvpress class name (`...Press`) means the `*_kvpress` preset.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
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
from kvjax.policies.lookahead import (
    AdaLookaheadKV,
    CakeLookaheadKV,
    CriticalLookaheadKV,
    LayerLookaheadKV,
    LookaheadKV,
    lookahead_scorer,
)
from kvjax.policies.snapkv import AdaPyramidKV, AdaSnapKV, PyramidKV, SnapKV
from kvjax.policies.streaming import StreamingLLM
from kvjax.policies.tova import TOVA

# kvpress semantics for the *_kvpress presets: its budget rule, no question in the compressed
# prompt, and 0.5.5's arithmetic (at least one entry kept, Ada-KV's safeguard at least 1).
_KVPRESS = dict(rule="kvpress", query_aware=False, kvpress_compat="0.5.5")
# kvpress's SnapKV scoring (w=64, kernel 5, avg-pool, mean over the window, group mean after
# pooling, 1/sqrt(d)), shared by its PyramidKV and AdaKV presses.
_KVPRESS_SNAP = dict(window=64, kernel=5, pooling="avg", window_reduce="mean", gqa_order="after",
                     use_model_scale=False, **_KVPRESS)

_PRESETS: dict[str, Policy] = {
    "streaming_llm": StreamingLLM(),
    "streaming_llm_kvpress": StreamingLLM(decode=False, rope_mode="original", **_KVPRESS),
    "h2o": H2O(),
    "h2o_prefill": H2OPrefill(),
    "observed_attention_kvpress": H2OPrefill(window=0, normalize=True, **_KVPRESS),
    "tova": TOVA(),
    "tova_kvpress": TOVA(decode=False, protect_last=True, use_model_scale=False, **_KVPRESS),
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
    "expected_attention_kvpress": ExpectedAttention(**_KVPRESS),
    "ada_expected_attention": ExpectedAttention(epsilon=1e-2, allocator=Ada(alpha=0.2)),
    # kvpress's leaderboard entry `expected_attention`: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))
    "ada_expected_attention_kvpress": ExpectedAttention(epsilon=1e-2, allocator=Ada(alpha=0.2, rule="kvpress"),
                                                        **_KVPRESS),
    "critical_snapkv": CriticalKV(scorer=SnapKV()),
    "critical_ada_snapkv": CriticalKV(scorer=AdaSnapKV()),
    "critical_snapkv_kvpress": CriticalKV(scorer=SnapKV(**_KVPRESS_SNAP), **_KVPRESS),
    "critical_adakv_snapkv_kvpress": CriticalKV(scorer=SnapKV(allocator=Ada(alpha=0.2, rule="kvpress"),
                                                              **_KVPRESS_SNAP), **_KVPRESS),
    "defensivekv": DefensiveKV(),
    "layer_defensivekv": DefensiveKV(layer_wise=True),
    "kvzip": KVzip(),
    # kvpress's KVzipPress: its repeat instructions and chat-template suffix, the context after the prefix
    "kvzip_kvpress": KVzip(repeat="kvpress", **_KVPRESS),
    "knorm": KNorm(),
    "knorm_kvpress": KNorm(skip_layers=(), **_KVPRESS),
    "lazy_eviction": LazyEviction(),
    "lookahead_kv": LookaheadKV(),
    # issue 27: LookaheadKV's scores under other budgets and CriticalKV's value weighting (their docstrings
    # say what each combines); like lookahead_kv they run a LookaheadKV adapter (`adapter=`)
    "ada_lookahead_kv": AdaLookaheadKV(),
    "layer_lookahead_kv": LayerLookaheadKV(),
    "cake_lookahead_kv": CakeLookaheadKV(),
    "critical_lookahead_kv": CriticalLookaheadKV(),
    "critical_ada_lookahead_kv": CriticalLookaheadKV(scorer=AdaLookaheadKV()),
    # the value norm in L2 from W_o's Gram matrices: CriticalKV's reweighting at a ninth of the L1 norm's cost
    "critical_lookahead_kv_l2": CriticalLookaheadKV(value_norm=2),
    "critical_ada_lookahead_kv_l2": CriticalLookaheadKV(scorer=AdaLookaheadKV(), value_norm=2),
    # the group's root mean square of those L2 norms: one Gram matrix per KV head, a third of _l2's cost on SmolLM2
    "critical_lookahead_kv_rms": CriticalLookaheadKV(value_norm=2, group_norm="rms"),
    "random": Random(),
}


def available() -> list[str]:
    """Every registered preset name, sorted."""
    return sorted(_PRESETS)


# Spellings that case and punctuation folding does not reach (kvpress's AdaKVPress wraps SnapKV).
_ALIASES = {"adakv": "ada_snapkv", "adakvpress": "adakv_snapkv_kvpress", "randompress": "random",
            "observedattention": "observed_attention_kvpress", "cakekv": "cake"}


def _fold(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def close_match(name: str, names: Iterable[str]) -> str | None:
    """The name in `names` closest to `name` (difflib), or None."""
    by_fold = {_fold(n): n for n in names}
    hit = difflib.get_close_matches(_fold(name), list(by_fold), n=1, cutoff=0.6)
    return by_fold[hit[0]] if hit else None


def canonical_name(name: str, names: Iterable[str] | None = None) -> str:
    """The preset (one of `names`, default `available()`) that `name` spells, in any case and with
    or without underscores or hyphens: "StreamingLLM" and "streaming-llm" -> "streaming_llm";
    kvpress class names mean the kvpress preset: "SnapKVPress" -> "snapkv_kvpress".
    Raises ValueError listing the presets (and the closest one) for an unknown name."""
    names = available() if names is None else sorted(names)
    if not isinstance(name, str):
        raise TypeError(f"a policy name must be a string, got {name!r}")
    if name in names:
        return name
    by_fold: dict[str, str] = {}
    for n in names:
        by_fold.setdefault(_fold(n), n)
    key = _fold(name)
    tries = [key, _fold(_ALIASES.get(key, ""))]
    if key.endswith("press"):  # a kvpress class: "SnapKVPress" = SnapKV + Press -> snapkv_kvpress
        tries.append(key[: -len("press")] + "kvpress")
    for k in tries:
        if k and k in by_fold:
            return by_fold[k]
    near = close_match(name, names)
    hint = f" (did you mean {near!r}?)" if near else ""
    raise ValueError(f"unknown policy {name!r}{hint}; available: {', '.join(names)}")


def name_of(policy: Policy) -> str:
    """The name results record for a policy object: its preset's name when it equals a preset,
    else the nearest preset of its class with the hyperparameters that differ, e.g.
    "snapkv(window=16)"; a class with no preset is named by `Policy.name` (or the class name)."""

    def differs(a: Any, b: Any) -> bool:  # a wrapped policy (CriticalKV's scorer) differs by its own name
        if isinstance(a, Policy) and isinstance(b, Policy):  # (so that its adapter is not a hyperparameter)
            return type(a) is not type(b) or name_of(a) != name_of(b)
        return a != b

    def diff(preset: Policy) -> list[str]:
        return [f"{f.name}={getattr(policy, f.name)!r}" for f in dataclasses.fields(policy)
                if f.compare and f.init  # hyperparameters only
                and differs(getattr(policy, f.name), getattr(preset, f.name))]

    same = {n: diff(p) for n, p in _PRESETS.items() if type(p) is type(policy)}
    if not same:
        return policy.name if policy.name != Policy.name else type(policy).__name__
    name = min(same, key=lambda n: (len(same[n]), n != policy.name))
    return f"{name}({', '.join(same[name])})" if same[name] else name


def get(name: str, **overrides: Any) -> Policy:
    """The preset `name` (any spelling `canonical_name` accepts), with hyperparameters replaced by
    `overrides` (e.g. get("snapkv", window=16))."""
    name = canonical_name(name)
    preset = _PRESETS[name]
    fields = {f.name for f in dataclasses.fields(preset)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"{name}: unknown hyperparameter(s) {unknown}; accepted: {sorted(fields)}")
    return dataclasses.replace(preset, **overrides)


def resolve(policy: str | Policy) -> Policy:
    """A preset name (any spelling `canonical_name` accepts) or a policy instance -> a policy instance."""
    if isinstance(policy, str):
        return get(policy)
    if isinstance(policy, Policy):
        return policy
    raise TypeError(f"policy must be a preset name (one of {available()}) or a Policy instance, got {policy!r}")


def lookahead_presets() -> list[str]:
    """The presets that run a LookaheadKV adapter's tokens (lookahead_kv and its compositions), sorted:
    each takes `adapter=` (`get(name, adapter=...)`), and the eval includes them only when it has one."""
    return [n for n in available() if lookahead_scorer(_PRESETS[n]) is not None]


def chunked_presets() -> list[str]:
    """The presets that support chunked prefill (`Policy.supports_chunked_prefill`), sorted."""
    return [n for n in available() if _PRESETS[n].supports_chunked_prefill]


def check_chunked_prefill(policy: Policy, chunk: Any) -> None:
    """Refuses a chunked prefill the policy cannot run: `chunk` (prefill tokens per chunk) must be an
    int >= 1 and at least `policy.chunk_minimum()` (its observation window and protected tokens),
    and the policy must support it. ValueError naming the policy and the supported presets."""
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(f"prefill_chunk must be an int (prompt tokens per chunk) or None, got {chunk!r}")
    if chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive number of prompt tokens, got {chunk}")
    reason = policy.chunked_prefill_unsupported()
    if reason is not None:
        raise ValueError(f"policy {name_of(policy)!r} does not support chunked prefill (prefill_chunk={chunk}): "
                         f"{reason}; presets that support it: {', '.join(chunked_presets())}")
    least = policy.chunk_minimum()
    if chunk < least:
        raise ValueError(f"policy {name_of(policy)!r}: prefill_chunk={chunk} is smaller than the {least} tokens "
                         "its observation window / protected tokens need in one chunk; use prefill_chunk >= "
                         f"{least}")
