"""Preset names in kvpress's and the papers' spellings, the names results record, kvpress 0.5.5
arithmetic on the *_kvpress presets, the one budget check, and the model-scale switch."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import policies
from kvjax.engine import Setting
from kvjax.policies import TOVA, SnapKV, get, resolve
from kvjax.policies.base import Policy, kvpress_n_kept
from kvjax.policies.registry import canonical_name, name_of
from pol_helpers import D, make_inputs
from pol_reference import window_attention

SPELLINGS = {
    "streamingllm": "streaming_llm", "StreamingLLM": "streaming_llm", "streaming_llm": "streaming_llm",
    "streaming-llm": "streaming_llm", "StreamingLLMPress": "streaming_llm_kvpress",
    "snap_kv": "snapkv", "SnapKV": "snapkv", "SnapKVPress": "snapkv_kvpress", "snapkv_kvpress": "snapkv_kvpress",
    "pyramid_kv": "pyramidkv", "PyramidKV": "pyramidkv", "PyramidKVPress": "pyramidkv_kvpress",
    "AdaKV": "ada_snapkv", "Ada-KV": "ada_snapkv", "AdaKVPress": "adakv_snapkv_kvpress",
    "H2O": "h2o", "TOVA": "tova", "TOVAPress": "tova_kvpress", "KNorm": "knorm", "KnormPress": "knorm_kvpress",
    "ObservedAttentionPress": "observed_attention_kvpress", "LazyEviction": "lazy_eviction", "CAKE": "cake",
    "RandomPress": "random",
}


@pytest.mark.parametrize("spelling,canonical", sorted(SPELLINGS.items()))
def test_spellings_resolve_to_one_preset(spelling, canonical):
    assert canonical_name(spelling) == canonical
    assert get(spelling) == get(canonical) and resolve(spelling) == get(canonical)
    assert Setting(spelling, compression_ratio=0.5).policy_name == canonical


def test_unknown_name_lists_presets_and_the_closest():
    with pytest.raises(ValueError) as err:
        get("SnapKW")
    msg = str(err.value)
    assert "'SnapKW'" in msg and "did you mean 'snapkv'?" in msg
    assert all(name in msg for name in policies.available())
    with pytest.raises(ValueError) as err:
        canonical_name("zzzz")
    assert "did you mean" not in str(err.value) and "; available: " in str(err.value)


def test_policy_name_is_the_preset_of_the_class_defaults_and_labels_objects():
    classes = {type(get(n)) for n in policies.available()}
    for cls in classes:
        if cls.name != Policy.name:
            assert get(cls.name) == cls(), cls
    assert name_of(get("snapkv_kvpress")) == "snapkv_kvpress"
    assert name_of(SnapKV(window=16)) == "snapkv(window=16)"
    assert name_of(get("tova_kvpress", decode=True)) == "tova_kvpress(decode=True)"
    assert Setting(SnapKV(window=16), budget=64).policy_name == "snapkv(window=16)"
    # an adapter (or what the policy derives from it) is no hyperparameter: not part of the name
    adapter = policies.get("lookahead_kv").lookahead_adapter()
    assert name_of(dataclasses.replace(get("lookahead_kv"), adapter=adapter)) == "lookahead_kv"


KVPRESS = [n for n in policies.available() if n.endswith("_kvpress")]


@pytest.mark.parametrize("name", KVPRESS)
def test_kvpress_presets_follow_0_5_5_at_tiny_lengths(name):
    """kvpress 0.5.5 keeps max(1, int(T*(1-r))) entries: at T*(1-r) < 1 a head keeps one entry
    where 0.5.4 keeps none (PyramidKV's kvpress rule has its own float arithmetic, §6)."""
    p = get(name)
    assert p.kvpress_compat == "0.5.5"
    small = {f.name: 2 for f in dataclasses.fields(p) if f.name == "window"}
    if hasattr(p, "scorer"):  # a wrapper (CriticalKV): shrink its scorer's window
        small = {"scorer": dataclasses.replace(p.scorer, window=2)}
    new = get(name, **small)
    old = dataclasses.replace(new, kvpress_compat="0.5.4")
    T, r = 5, 0.9  # int(5 * 0.1) = 0
    assert kvpress_n_kept(T, r, "0.5.5") == 1 and kvpress_n_kept(T, r, "0.5.4") == 0
    a, b = (x.plan((T, 40), 2, 2, compression_ratio=r) for x in (new, old))
    if name == "pyramidkv_kvpress":
        assert a.counts == b.counts
        return
    if name == "adakv_snapkv_kvpress":  # n_kept = 1: the safeguard n_safe = int(1 * 0.2) = 0 is clamped to 1
        assert [row[0] for row in a.alloc.floor] == [1, 1] and [row[0] for row in b.alloc.floor] == [0, 0]
    assert [row[0] for row in a.counts] == [1, 1] and [row[0] for row in b.counts] == [0, 0]
    assert [row[1] for row in a.counts] == [row[1] for row in b.counts] == [3, 3]  # int(40 * (1 - 0.9)) = 3


def test_ada_safeguard_clamped_to_one_under_0_5_5():
    """n_kept = int(10 * 0.3) = 3 entries, n_safe = int(3 * 0.2) = 0 -> 1 on 0.5.5 (§1.1)."""
    p = get("adakv_snapkv_kvpress", window=2)
    for compat, n_safe in (("0.5.5", 1), ("0.5.4", 0)):
        plan = dataclasses.replace(p, kvpress_compat=compat).plan((10,), 1, 4, compression_ratio=0.7)
        assert plan.counts == ((3,),) and plan.alloc.floor == ((n_safe,),)


@pytest.mark.parametrize("budget,ratio", [(0, None), (None, 1.0), (None, -0.5), (3, 0.5), (None, None)])
def test_one_budget_check_for_settings_plans_and_the_cli(budget, ratio, capsys):
    from kvjax.eval.cli import main

    errors = []
    for make in (lambda: Setting("snapkv", compression_ratio=ratio, budget=budget),
                 lambda: SnapKV().plan((50,), 2, 2, budget=budget, compression_ratio=ratio)):
        with pytest.raises(ValueError) as err:
            make()
        errors.append(str(err.value).split("needs ")[-1].split("pass ")[-1])
    assert errors[0] == errors[1]
    if (budget is None) != (ratio is None):  # the CLI takes lists, so only a bad value can reach it
        flag = ["--budgets", str(budget)] if budget is not None else ["--compression-ratios", str(ratio)]
        with pytest.raises(SystemExit):
            main(flag + ["--policies", "snapkv"], generate_fn=lambda *a, **k: [], policies=["snapkv"])
        assert errors[0] in capsys.readouterr().err


def test_use_model_scale_follows_the_model_softmax_scale():
    """TOVA's prefill score is the last query's attention: with the model's scale when the model
    reports one that differs from 1/sqrt(d), with 1/sqrt(d) when use_model_scale=False (kvpress)."""
    inp = make_inputs(lengths=(12,), num_layers=1)
    obs = inp.obs.replace(attn_scale=0.9)  # a model whose scale is not 1/sqrt(d)
    plan = TOVA().plan((12,), 1, 2, budget=6)
    T = 12
    for use, scale in ((True, 0.9), (False, 1 / math.sqrt(D))):
        got = np.asarray(TOVA(use_model_scale=use).prefill_scores(plan, inp.cache, obs))[0, 0, 0, :T]
        want = window_attention(inp.q[0, 0].astype(np.float64), inp.k[0, 0].astype(np.float64), T, 1,
                                scale=scale)[:, 0, :T].mean(0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # without a model scale (or with 1/sqrt(d), what every Llama-family model here reports) the
    # switch changes nothing
    same = [np.asarray(TOVA(use_model_scale=u).prefill_scores(plan, inp.cache, inp.obs)) for u in (True, False)]
    np.testing.assert_array_equal(*same)


def test_llama_reports_its_softmax_scale(stories_path):
    import jax

    import kvjax
    from kvjax.engine import steps
    from kvjax.observations import ObservationSpec
    from kvjax.sampling import Sampler

    model = kvjax.load_model(stories_path)
    tokens = jnp.asarray([[1, 5, 9, 12]], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    _, _, obs, _ = steps.prefill(model.params, tokens, positions, jax.random.PRNGKey(0), cfg=model.config,
                                 capacity=4, observe=ObservationSpec(window=1), rope_mode="original",
                                 sampler=Sampler(), mesh=None)
    assert obs.attn_scale == model.config.head_dim ** -0.5


def test_kvpress_preset_keeps_one_entry_per_head_of_a_tiny_prompt(stories_path):
    import kvjax
    from kvjax.engine import compress

    model = kvjax.load_model(stories_path)
    cache = compress(model, [[1, 7, 9, 11, 13]], policy="knorm_kvpress", compression_ratio=0.9)
    assert (np.asarray(cache.valid).sum(-1) == 1).all()  # max(1, int(5 * 0.1)) on every layer and head
