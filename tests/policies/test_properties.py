"""Hypothesis properties of every preset over random lengths and budgets (GQA 8/2, padded batch of 3)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.policies import (
    CAKE,
    H2O,
    TOVA,
    Ada,
    AdaPyramidKV,
    AdaSnapKV,
    CriticalKV,
    DefensiveKV,
    ExpectedAttention,
    H2OPrefill,
    KVzip,
    KNorm,
    LazyEviction,
    PyramidKV,
    Random,
    SnapKV,
    StreamingLLM,
    get,
)
from kvjax.lookahead import Adapter, LookaheadConfig, ModelInfo
from kvjax.policies.prefill import PrefillPolicy
from pol_helpers import HKV, LOOKAHEAD_N, kept_positions, make_inputs

SLOTS, SLOTS_ALONE, L = 32, 40, 2
# the LookaheadKV presets read their scoring options from an adapter's config (make_inputs supplies
# stand-ins for the tokens' observations); its params and model are never used here
LKV = dict(adapter=Adapter(params={}, config=LookaheadConfig(n_tokens=LOOKAHEAD_N),
                           model_info=ModelInfo(16, L, 8, HKV, 8, 101, 32)))

POLICIES = {
    "snapkv": SnapKV(window=4),
    "snapkv_kvpress": get("snapkv_kvpress", window=4),
    "pyramidkv": PyramidKV(window=4),
    "pyramidkv_kvpress": get("pyramidkv_kvpress", window=4),
    "ada_snapkv": AdaSnapKV(window=4),
    "ada_pyramidkv": AdaPyramidKV(window=4, allocator=Ada(alpha=0.2, pyramid_beta=4)),
    "adakv_snapkv_kvpress": get("adakv_snapkv_kvpress", window=4),
    "cake": CAKE(window=4),
    "knorm": KNorm(),
    "knorm_kvpress": get("knorm_kvpress"),
    "random": Random(seed=5),
    "h2o_prefill": H2OPrefill(window=4),
    "observed_attention_kvpress": get("observed_attention_kvpress"),
    "h2o": H2O(),
    "tova": TOVA(),
    "tova_kvpress": get("tova_kvpress"),
    "streaming_llm": StreamingLLM(),
    "streaming_llm_kvpress": get("streaming_llm_kvpress"),
    "lazy_eviction": LazyEviction(window=4),
    "cake_cascade": CAKE(window=4, cascade=True),
    "expected_attention": ExpectedAttention(n_future_positions=8),
    "expected_attention_kvpress": get("expected_attention_kvpress", n_future_positions=8),
    "ada_expected_attention": get("ada_expected_attention", n_future_positions=8),
    "ada_expected_attention_kvpress": get("ada_expected_attention_kvpress", n_future_positions=8),
    "critical_snapkv": CriticalKV(scorer=SnapKV(window=4)),
    "critical_ada_snapkv": CriticalKV(scorer=AdaSnapKV(window=4)),
    "critical_snapkv_kvpress": get("critical_snapkv_kvpress", scorer=get("snapkv_kvpress", window=4)),
    "critical_adakv_snapkv_kvpress": get("critical_adakv_snapkv_kvpress", scorer=get("adakv_snapkv_kvpress", window=4)),
    "defensivekv": DefensiveKV(window=4),
    "layer_defensivekv": DefensiveKV(window=4, layer_wise=True),
    "kvzip": KVzip(),
    "kvzip_kvpress": get("kvzip_kvpress"),
    "lookahead_kv": get("lookahead_kv", **LKV),
    "ada_lookahead_kv": get("ada_lookahead_kv", **LKV),
    "layer_lookahead_kv": get("layer_lookahead_kv", **LKV),
    "cake_lookahead_kv": get("cake_lookahead_kv", **LKV),
    "critical_lookahead_kv": get("critical_lookahead_kv", **LKV),
}


def protected_of(policy, T, C):
    """Positions a policy must keep at prefill (given the count C it keeps), or an empty set."""
    if isinstance(policy, CriticalKV):
        return protected_of(policy.scorer, T, C)
    if isinstance(policy, (ExpectedAttention, KVzip)):  # sinks; a count below them keeps the most recent ones
        n = min(policy.n_sink, T)
        return set(range(n - min(n, C), n))
    if isinstance(policy, (SnapKV, CAKE, H2OPrefill, DefensiveKV)):
        w = policy.window
        return set(range(T - min(w, C), T)) if w else set()
    if isinstance(policy, StreamingLLM):  # a count below the sinks keeps the most recent ones (§1.6)
        n = min(policy.n_sink, T)
        return set(range(n - min(n, C), n))
    if isinstance(policy, H2O):
        return set(range(T - min(C // 2, T), T))
    if isinstance(policy, TOVA) and policy.protect_last:
        return {T - 1} if C else set()
    return set()


@functools.partial(jax.jit, static_argnums=0)
def _keep(policy, plan, cache, obs):
    return policy.prefill_keep(plan, cache, obs)[0]


@functools.partial(jax.jit, static_argnums=0)
def _head_counts(policy, plan, cache, obs):
    return policy.head_counts(plan, policy.score(plan, cache, obs), cache, obs)


def traced(plan):
    """The plan as a traced argument: only its integer leaves vary between examples."""
    return dataclasses.replace(plan, capacity=0, compact=True, max_new_tokens=0)


def budget_args(policy, data):
    if getattr(policy, "rule", "paper") == "kvpress":
        return None, data.draw(st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.75, 0.8, 0.9]), label="ratio")
    low = {SnapKV: 5, CAKE: 5, H2OPrefill: 5, StreamingLLM: 5, LazyEviction: 4, H2O: 2, ExpectedAttention: 5,
           DefensiveKV: 5, CriticalKV: 5, KVzip: 5}
    lo = next((v for k, v in low.items() if isinstance(policy, k)), 1)
    return data.draw(st.integers(lo, 34), label="budget"), None


def run(policy, seed, lengths, budget, ratio, slots=SLOTS, rows=None):
    inp = make_inputs(seed, lengths=lengths, slots=slots, window=8, num_layers=L, rows=rows)
    plan = policy.plan(inp.lengths, L, HKV, budget=budget, compression_ratio=ratio, max_new_tokens=3)
    keep = np.asarray(_keep(policy, traced(plan), inp.cache, inp.obs))
    return inp, plan, keep


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_prefill_properties(name, data):
    policy = POLICIES[name]
    lengths = tuple(data.draw(st.lists(st.integers(10, SLOTS), min_size=3, max_size=3), label="lengths"))
    seed = data.draw(st.integers(0, 2**16), label="seed")
    budget, ratio = budget_args(policy, data)
    inp, plan, keep = run(policy, seed, lengths, budget, ratio)
    counts = keep.sum(-1)
    got = kept_positions(keep, inp.cache.pos)

    # exactly the allocated number per (layer, row, head); static allocations equal the plan
    if isinstance(policy, PrefillPolicy):
        np.testing.assert_array_equal(counts, np.asarray(_head_counts(policy, traced(plan), inp.cache, inp.obs)))
    alloc = getattr(policy, "budget_allocator", lambda: None)()
    if alloc is None or type(alloc).__name__ in ("Uniform", "Pyramid"):
        np.testing.assert_array_equal(counts, np.asarray(plan.counts)[:, :, None].repeat(HKV, -1))
    if isinstance(alloc, Ada):  # head budgets vary; the layer total is fixed up to the spec's rounding
        total, nominal, floor = counts.sum(-1), np.asarray(plan.counts), np.asarray(plan.alloc.floor)
        if alloc.rule == "kvpress":  # exactly Hkv * n_kept survive per layer
            np.testing.assert_array_equal(total, HKV * nominal)
        else:  # sum_h round(count_h (1-a) + F) with sum_h count_h = Hkv B', B' = C - w
            w = policy.protected_count()
            bp = nominal - w
            want = HKV * (bp * (1 - alloc.alpha) + floor + w)
            compressed = np.asarray(plan.alloc.compressed)
            assert (np.abs(np.where(compressed, total - want, 0)) <= HKV / 2 + 1e-9).all()
    assert counts.max() <= plan.capacity

    # protected tokens are always kept
    for (l, b, h), kept in got.items():
        T = inp.lengths[b]
        assert protected_of(policy, T, counts[l, b, h]) <= kept

    # deterministic
    np.testing.assert_array_equal(keep, np.asarray(_keep(policy, traced(plan), inp.cache, inp.obs)))

    # the same sequence alone, padded differently, keeps the same entries
    for b in range(3):
        alone, _, keep1 = run(policy, seed, lengths, budget, ratio, slots=SLOTS_ALONE, rows=[b])
        got1 = kept_positions(keep1, alone.cache.pos)
        for l in range(L):
            for h in range(HKV):
                assert got1[(l, 0, h)] == got[(l, b, h)], f"row {b} alone differs at layer {l} head {h}"


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_budget_at_or_above_prompt_changes_nothing(name, data):
    policy = POLICIES[name]
    lengths = tuple(data.draw(st.lists(st.integers(10, SLOTS), min_size=3, max_size=3), label="lengths"))
    seed = data.draw(st.integers(0, 2**16), label="seed")
    # Two documented exceptions need one more token: Ada-KV compresses when C - w == T - w
    # (its rule is B' > T - w), and decode-time StreamingLLM frees a slot for the next write.
    ada = isinstance(getattr(policy, "budget_allocator", lambda: None)(), Ada)
    extra = 1 if (ada or isinstance(policy, StreamingLLM)) and policy.rule == "paper" else 0
    budget = max(lengths) + extra + data.draw(st.integers(0, 3), label="over")
    inp, plan, keep = run(policy, seed, lengths, budget, None)
    np.testing.assert_array_equal(keep, np.asarray(inp.cache.valid))
    assert not plan.compact or plan.capacity < max(lengths) + plan.max_new_tokens
