"""Typed plan data (`Plan.alloc`): its fields are pytree leaves, so a traced plan keeps what the static
plan keeps, and which rows an allocator compresses is data, not structure (one compile per bucket)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kvjax.lookahead import Adapter, LookaheadConfig, ModelInfo
from kvjax.policies import CAKE, H2O, AdaSnapKV, DefensiveKV, KVzip, get
from kvjax.policies.allocators import AdaData, CakeData, GlobalData
from pol_helpers import HKV, LOOKAHEAD_N, make_inputs

L, BUDGET = 2, 12
# with window 4 and budget 12, the 10-token row is left whole by every allocator below, the others compressed
LENGTHS = (32, 10, 20)

CASES = {
    "ada_snapkv": (AdaSnapKV(window=4), AdaData),
    "adakv_snapkv_kvpress": (get("adakv_snapkv_kvpress", window=4), AdaData),
    "cake": (CAKE(window=4), CakeData),
    "defensivekv": (DefensiveKV(window=4), GlobalData),
    "layer_defensivekv": (DefensiveKV(window=4, layer_wise=True), GlobalData),
    "kvzip": (KVzip(), GlobalData),
    "h2o": (H2O(), type(None)),
}
_LKV = dict(adapter=Adapter(params={}, config=LookaheadConfig(n_tokens=LOOKAHEAD_N),
                            model_info=ModelInfo(16, L, 8, HKV, 8, 101, 32)))  # the config is what scores read
CASES.update({"ada_lookahead_kv": (get("ada_lookahead_kv", **_LKV), AdaData),
              "layer_lookahead_kv": (get("layer_lookahead_kv", **_LKV), GlobalData),
              "cake_lookahead_kv": (get("cake_lookahead_kv", **_LKV), CakeData)})
TRACES = {"n": 0}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _keep_static(policy, plan, cache, obs):
    return policy.prefill_keep(plan, cache, obs)[0]


@functools.partial(jax.jit, static_argnums=0)
def _keep_traced(policy, plan, cache, obs):
    TRACES["n"] += 1
    return policy.prefill_keep(plan, cache, obs)[0]


def _plan(policy, lengths):
    # capacity and compact are static metadata: equal across the batch of a bucket in the engine
    return policy.plan(lengths, L, HKV, budget=BUDGET).replace(capacity=0, compact=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_plan_keeps_the_static_plans_set_in_one_compile(name):
    policy, data_type = CASES[name]
    inp = make_inputs(3, lengths=LENGTHS, window=8, num_layers=L)
    plan = _plan(policy, LENGTHS)
    assert isinstance(plan.alloc, data_type)
    if plan.alloc is not None:
        assert [row[1] for row in plan.alloc.compressed] == [False] * L
        assert [row[0] for row in plan.alloc.compressed] == [True] * L
    static = np.asarray(_keep_static(policy, plan, inp.cache, inp.obs))
    assert (static[:, 1].sum(-1) == LENGTHS[1]).all()  # the whole row is kept
    assert (static[:, 0].sum(-1) < LENGTHS[0]).all()

    before = TRACES["n"]
    np.testing.assert_array_equal(np.asarray(_keep_traced(policy, plan, inp.cache, inp.obs)), static)
    # the same rows in another order: other compressed rows, same tree, no new compile, same kept sets
    order = [1, 2, 0]
    swapped = _plan(policy, tuple(LENGTHS[b] for b in order))
    assert jax.tree.structure(swapped) == jax.tree.structure(plan)
    inp2 = make_inputs(3, lengths=LENGTHS, window=8, num_layers=L, rows=order)
    got = np.asarray(_keep_traced(policy, swapped, inp2.cache, inp2.obs))
    assert TRACES["n"] - before == 1
    np.testing.assert_array_equal(got, static[:, order])
