"""Registry, presets (policies.md §13), plans, and the errors the issue asks for."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from kvjax import policies
from kvjax.policies import (
    CAKE,
    H2O,
    TOVA,
    Ada,
    AdaSnapKV,
    Cake,
    KNorm,
    LazyEviction,
    Pyramid,
    PyramidKV,
    Random,
    SnapKV,
    StreamingLLM,
    available,
    get,
    resolve,
)

PRESETS = {
    "ada_pyramidkv", "ada_snapkv", "adakv_snapkv_kvpress", "cake", "h2o", "h2o_prefill", "knorm", "knorm_kvpress",
    "lazy_eviction", "lookahead_kv", "observed_attention_kvpress", "pyramidkv", "pyramidkv_kvpress", "random", "snapkv",
    "snapkv_kvpress", "streaming_llm", "streaming_llm_kvpress", "tova", "tova_kvpress",
    # issue 15: the strongest scorers of 2025-26
    "ada_expected_attention", "ada_expected_attention_kvpress", "cake_cascade", "critical_ada_snapkv",
    "critical_adakv_snapkv_kvpress", "critical_snapkv", "critical_snapkv_kvpress", "defensivekv", "expected_attention",
    "expected_attention_kvpress", "kvzip", "kvzip_kvpress", "layer_defensivekv",
    # issue 27: LookaheadKV's scores under other budgets and CriticalKV's weighting
    "ada_lookahead_kv", "cake_lookahead_kv", "critical_lookahead_kv", "critical_ada_lookahead_kv", "layer_lookahead_kv",
    "critical_lookahead_kv_l2", "critical_ada_lookahead_kv_l2", "critical_lookahead_kv_rms",
}


def test_available_names_every_preset():
    assert set(available()) == PRESETS
    assert available() == sorted(available())
    for name in available():
        p = get(name)
        hash(p)  # a jit static argument
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.query_aware = not p.query_aware  # type: ignore[misc]
        assert p.query_aware is not name.endswith("_kvpress")


def test_preset_defaults_follow_the_spec():
    s = get("snapkv")
    assert (s.window, s.kernel, s.pooling, s.window_reduce, s.gqa_order) == (32, 7, "max", "sum", "before")
    assert s.rule == "paper"
    k = get("snapkv_kvpress")
    assert (k.window, k.kernel, k.pooling, k.window_reduce, k.gqa_order, k.rule, k.use_model_scale) == (
        64, 5, "avg", "mean", "after", "kvpress", False)
    p = get("pyramidkv")
    assert (p.window, p.kernel, p.pooling, p.allocator) == (8, 7, "max", Pyramid(beta=20, rule="paper"))
    assert get("pyramidkv_kvpress").allocator == Pyramid(beta=20, rule="kvpress")
    a = get("ada_snapkv")
    assert (a.window, a.kernel, a.pooling, a.window_reduce, a.allocator) == (32, 7, "max", "mean", Ada(alpha=0.2))
    assert get("ada_pyramidkv").allocator == Ada(alpha=0.2, pyramid_beta=20)
    assert get("adakv_snapkv_kvpress").allocator == Ada(alpha=0.2, rule="kvpress")
    c = get("cake")
    assert (c.window, c.gamma, c.tau1, c.tau2, c.decode, c.budget_allocator()) == (
        32, 200.0, 1.0, 1.0, True, Cake(tau1=1.0, tau2=1.0, window=32))
    assert CAKE.for_model("llama3.1-8b-128k", 1024).tau1 == 1.6
    assert CAKE.for_model("qwen2.5-7b-instruct", 128).budget_allocator().tau2 == 0.6
    assert get("knorm").skip_layers == (0, 1) and get("knorm_kvpress").skip_layers == ()
    assert (get("lazy_eviction").window, get("lazy_eviction").alpha) == (175, 1e-4)
    st = get("streaming_llm")
    assert (st.n_sink, st.decode, st.rope_mode) == (4, True, "cache_relative")
    assert get("streaming_llm_kvpress").decode is False
    assert get("tova_kvpress").protect_last and not get("tova").protect_last
    assert get("h2o_prefill").window == 8 and get("observed_attention_kvpress").normalize
    assert isinstance(get("random"), Random)


def test_get_applies_overrides_and_resolve():
    assert get("snapkv", window=16).window == 16
    assert resolve("h2o") == H2O()
    p = SnapKV(window=8)
    assert resolve(p) is p
    assert policies.get("ada_snapkv", allocator=Ada(alpha=0.5)).allocator.alpha == 0.5


def test_policies_are_static_jit_arguments():
    f = jax.jit(lambda x, policy: x + policy.window, static_argnames="policy")
    assert int(f(1, policy=SnapKV(window=3))) == 4


def test_plans_capacity_and_compaction():
    L, H = 4, 2
    p = SnapKV(window=8).plan((100, 40), L, H, budget=32, max_new_tokens=16, bucket=128)
    assert p.counts == ((32, 32),) * L and p.capacity == 48 and p.compact
    hash(p)
    short = SnapKV(window=8).plan((20, 30), L, H, budget=32, max_new_tokens=16)
    assert short.counts == ((20, 30),) * L and not short.compact and short.capacity == 46
    assert H2O().plan((100,), L, H, budget=20, max_new_tokens=64).capacity == 21
    assert TOVA().plan((100,), L, H, budget=20, max_new_tokens=64).capacity == 21
    assert StreamingLLM().plan((100,), L, H, budget=20, max_new_tokens=64).capacity == 20
    lazy = LazyEviction(window=10).plan((100,), L, H, budget=60, max_new_tokens=64, bucket=128)
    assert lazy.capacity == 110 and lazy.counts == ((100,),) * L and lazy.compact  # 110 < 128 + 64
    assert H2O().plan((10,), L, H, budget=500, max_new_tokens=5).capacity == 15  # never above T + new tokens
    # tokens fed without decode_update (a question) need room beyond the decode-time budget
    assert H2O().plan((100,), L, H, budget=20, max_new_tokens=64, question_tokens=9).capacity == 30
    assert SnapKV().plan((100,), L, H, budget=40, max_new_tokens=64, question_tokens=9).capacity == 104
    kv = get("snapkv_kvpress").plan((1000,), L, H, compression_ratio=0.5)
    assert kv.counts == ((500,),) * L


def test_unknown_policy_lists_available():
    with pytest.raises(ValueError) as e:
        get("snapkvv")
    for name in available():
        assert name in str(e.value)
    with pytest.raises(TypeError, match="accepted"):
        get("snapkv", windw=3)
    with pytest.raises(TypeError, match="policy must be"):
        resolve(3)


@pytest.mark.parametrize("kw", [dict(), dict(budget=10, compression_ratio=0.5)], ids=["neither", "both"])
def test_budget_xor_ratio(kw):
    with pytest.raises(ValueError, match="exactly one of budget"):
        SnapKV(window=4).plan((50,), 2, 2, **kw)


@pytest.mark.parametrize(
    "kw,exc",
    [(dict(budget=0), ValueError), (dict(budget=True), TypeError), (dict(budget=2.5), TypeError),
     (dict(compression_ratio=1.0), ValueError), (dict(compression_ratio=-0.1), ValueError),
     (dict(compression_ratio=float("nan")), TypeError)],
)
def test_bad_budget_values(kw, exc):
    with pytest.raises(exc, match="budget|compression_ratio"):
        SnapKV(window=4).plan((50,), 2, 2, **kw)


def test_bad_plan_arguments():
    with pytest.raises(ValueError, match="lengths"):
        SnapKV().plan((), 2, 2, budget=40)
    with pytest.raises(ValueError, match="lengths\\[1\\]"):
        SnapKV().plan((50, 0), 2, 2, budget=40)
    with pytest.raises(ValueError, match="bucket"):
        SnapKV().plan((50,), 2, 2, budget=40, bucket=10)
    with pytest.raises(ValueError, match="question_tokens"):
        H2O().plan((50,), 2, 2, budget=40, max_new_tokens=4, question_tokens=5)


@pytest.mark.parametrize(
    "policy,budget",
    [(SnapKV(window=32), 32), (PyramidKV(), 8), (AdaSnapKV(), 20), (CAKE(), 32), (get("h2o_prefill"), 5),
     (StreamingLLM(), 4), (LazyEviction(window=50), 49), (H2O(recent=10), 10), (TOVA(protect_last=True), 1)],
    ids=lambda x: type(x).__name__ if not isinstance(x, int) else str(x),
)
def test_budget_below_protected_tokens(policy, budget):
    with pytest.raises(ValueError, match="budget"):
        policy.plan((200,), 2, 2, budget=budget)


def test_ratio_below_protected_tokens_on_paper_presets():
    with pytest.raises(ValueError, match="protected"):
        SnapKV(window=32).plan((40, 1000), 2, 2, compression_ratio=0.5)  # row 0 keeps 20 <= w
    plan = get("snapkv_kvpress", window=32).plan((40, 1000), 2, 2, compression_ratio=0.5)  # kvpress: allowed
    assert plan.counts[0] == (20, 500)


def test_a_prompt_too_short_for_the_protected_tokens_gets_a_usable_error():
    """README's policy example on the Quick start's 7-token prompt: SnapKV's paper preset cannot compress it, and
    the *_kvpress preset the error used to suggest refuses it too (its window is 64). The error gives the shortest
    prompt that works at that ratio and a policy that does compress it."""
    import re

    with pytest.raises(ValueError) as err:
        SnapKV().plan((7,), 2, 2, compression_ratio=0.5)
    msg = str(err.value)
    assert "row 0 has 7 tokens" in msg and "32 protected tokens" in msg and "*_kvpress preset" not in msg, msg
    with pytest.raises(ValueError, match="longer than window=64"):
        get("snapkv_kvpress").plan((7,), 2, 2, compression_ratio=0.5)
    assert get("knorm_kvpress").plan((7,), 4, 2, compression_ratio=0.5).counts == ((3,),) * 4  # suggested: works
    for lengths, ratio in (((7,), 0.5), ((58,), 0.5), ((100,), 0.8), ((40, 1000), 0.875)):
        with pytest.raises(ValueError) as err:
            SnapKV().plan(lengths, 2, 2, compression_ratio=ratio)
        msg = str(err.value)
        need = int(re.search(rf"at compression_ratio={ratio} a prompt needs at least (\d+) tokens", msg).group(1))
        # the length given is the shortest the preset compresses at that ratio
        assert SnapKV().plan((need,), 2, 2, compression_ratio=ratio).counts[0][0] > 32
        with pytest.raises(ValueError, match="protected"):
            SnapKV().plan((need - 1,), 2, 2, compression_ratio=ratio)
        if min(lengths) > 32:  # longer than the window: the kvpress rule keeps the most recent protected tokens
            assert "*_kvpress preset" in msg and f"compression_ratio={ratio} leaves" in msg


def test_kvpress_prompt_length_limits():
    with pytest.raises(ValueError, match="longer than window"):
        get("snapkv_kvpress").plan((64, 100), 2, 2, compression_ratio=0.5)
    with pytest.raises(ValueError, match="n_sink"):
        get("streaming_llm_kvpress").plan((4,), 2, 2, compression_ratio=0.5)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: SnapKV(window=0), ValueError, "window"),
        (lambda: SnapKV(kernel=4), ValueError, "odd"),
        (lambda: SnapKV(pooling="mean"), ValueError, "pooling"),
        (lambda: SnapKV(gqa_reduce="median"), ValueError, "gqa_reduce"),
        (lambda: SnapKV(gqa_order="never"), ValueError, "gqa_order"),
        (lambda: SnapKV(window_reduce="max"), ValueError, "window_reduce"),
        (lambda: SnapKV(rule="kvjax"), ValueError, "rule"),
        (lambda: SnapKV(allocator="ada"), TypeError, "allocator"),
        (lambda: SnapKV(kvpress_compat="0.6"), ValueError, "kvpress_compat"),
        (lambda: SnapKV(query_aware="yes"), TypeError, "query_aware"),
        (lambda: Ada(alpha=1.5), ValueError, "alpha"),
        (lambda: Ada(rule="kvpress", normalize=True), ValueError, "normalize"),
        (lambda: Pyramid(beta=0), ValueError, "beta"),
        (lambda: Cake(tau1=0.0), ValueError, "tau1"),
        (lambda: CAKE(window=1), ValueError, "window"),
        (lambda: CAKE(gamma=-1.0), ValueError, "gamma"),
        (lambda: KNorm(skip_layers=[0, 1]), TypeError, "skip_layers"),
        (lambda: Random(seed=-1), ValueError, "seed"),
        (lambda: H2O(recent=-2), ValueError, "recent"),
        (lambda: TOVA(decode="yes"), TypeError, "decode"),
        (lambda: StreamingLLM(rope_mode="rerotate"), ValueError, "rope_mode"),
        (lambda: StreamingLLM(n_sink=-1), ValueError, "n_sink"),
        (lambda: LazyEviction(alpha=0.0), ValueError, "alpha"),
        (lambda: LazyEviction(window=0), ValueError, "window"),
        (lambda: get("cake", tau2=-1.0), ValueError, "tau2"),
    ],
)
def test_invalid_hyperparameters(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
