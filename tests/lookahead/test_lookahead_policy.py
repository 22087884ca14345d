"""The `lookahead_kv` policy: scores against the NumPy reference (§11.3), and end to end in kvjax.generate."""

import dataclasses

import jax
import jax.numpy as jnp
import lkv_reference as ref
import numpy as np
import pytest
from conftest import prompts, with_random_b

import kvjax
import kvjax.lookahead as lk
from kvjax.engine import STEP_BUCKETS, TRACE_COUNTS, Setting, bucket_length, steps
from kvjax.policies import Ada, LookaheadKV, Pyramid
from kvjax.policies.allocators import pyramid_paper
from kvjax.sampling import Sampler

LENGTHS = (21, 13, 17)
WIDTH = 32  # the engine's first bucket


def _engine_scores(model, policy, toks, pos, budget):
    """The engine's prefill + lookahead pass, then the policy's scores [L,B,Hkv,C] and its plan."""
    spec = steps.prefill_spec([policy])
    _, cache, obs, _ = steps.prefill(model.params, toks, pos, jax.random.PRNGKey(0), cfg=model.config,
                                     capacity=WIDTH, observe=spec, rope_mode="original", sampler=Sampler(), mesh=None)
    (lookahead,) = policy.requirements().observe.producers  # the lookahead tokens' pass
    obs = obs.replace(**steps.produce(model.params, cache, toks, pos, policy.observation_inputs(), cfg=model.config,
                                      observation=lookahead, rope_mode="original"))
    plan = policy.plan(LENGTHS, model.config.num_layers, model.config.num_kv_heads, budget=budget)
    return np.asarray(policy.score(plan, cache, obs).scores), cache, obs, plan


def _want(P, A, cfg, row, config, t):
    """The reference scores of one row: the lookahead tokens' s̃ (and the window's attention) through §11.3."""
    win = ref.window(P, cfg, row, config.window) if config.window else None
    return ref.scores(ref.predicted(P, cfg, row, A, config), cfg, config, t, win)


@pytest.mark.parametrize("changes", [{}, {"gqa_reduce": "max", "pooling": None}, {"protect_last": 3, "kernel": 5},
                                     {"kernel": 7, "pool_offset": 3}, {"protect_last": 2, "kernel": 5, "pool_offset": 1},
                                     {"bridge": 4}, {"bridge": 3, "pooling": None, "protect_last": 2},
                                     {"tail": 6, "tail_weight": 0.5}, {"tail": 3, "tail_weight": 1.0, "protect_last": 2,
                                                                      "kernel": 3},
                                     {"window": 4, "window_weight": 0.7, "tail": 3},
                                     {"window": 3, "protect_last": 5, "gqa_reduce": "max", "kernel": 5},
                                     {"window": 6, "window_weight": 2.0, "pooling": None, "bridge": 2}])
def test_scores_match_numpy_reference(tiny, adapter, changes):
    ad = adapter.replace(config=dataclasses.replace(adapter.config, **changes))
    policy = LookaheadKV(adapter=ad)
    rows, toks, pos = prompts(tiny.config.vocab_size, LENGTHS, WIDTH, seed=11)
    got, cache, _, plan = _engine_scores(tiny, policy, jnp.asarray(toks), jnp.asarray(pos), budget=8)
    P, A = ref.to_numpy(tiny.params), ref.to_numpy(ad.params)
    for b, t in enumerate(LENGTHS):
        want = _want(P, A, tiny.config, rows[b], ad.config, t)
        region = t - ad.config.protected
        np.testing.assert_allclose(got[:, b, :, :region], want[:, :, :region], atol=2e-6, rtol=1e-4)
        assert (got[:, b, :, region:] == 0).all()
    # the kept sets: protected tail first, then the reference's top scores (ties at the boundary aside)
    keep, _ = policy.prefill_keep(plan, cache, _engine_scores(tiny, policy, jnp.asarray(toks), jnp.asarray(pos), 8)[2])
    keep = np.asarray(keep)
    w = ad.config.protected
    for b, t in enumerate(LENGTHS):
        want = _want(P, A, tiny.config, rows[b], ad.config, t)
        for l in range(tiny.config.num_layers):
            for h in range(tiny.config.num_kv_heads):
                kept = set(np.flatnonzero(keep[l, b, h]))
                assert len(kept) == 8
                order = np.argsort(-want[l, h, : t - w], kind="stable")
                top = set(order[: 8 - w].tolist()) | set(range(t - w, t))
                s = np.sort(want[l, h, : t - w])[::-1]
                if s[8 - w - 1] - s[8 - w] > 1e-6:
                    assert kept == top, (l, b, h)


def test_ensemble_scores_are_the_members_mean(tiny, adapter):
    """A stacked adapter (two members, each its own lookahead pass) scores with the mean of the members' s̃,
    then the one config's pooling and tail, as the NumPy reference of that mean."""
    conf = dataclasses.replace(adapter.config, kernel=3, tail=4)
    other = with_random_b(lk.init_adapter(tiny, adapter.config, jax.random.PRNGKey(7)), seed=8)
    both = lk.stack([adapter, other], config=conf)
    policy = LookaheadKV(adapter=both)
    rows, toks, pos = prompts(tiny.config.vocab_size, LENGTHS, WIDTH, seed=12)
    got, *_ = _engine_scores(tiny, policy, jnp.asarray(toks), jnp.asarray(pos), budget=8)
    P = ref.to_numpy(tiny.params)
    members = [ref.to_numpy(a.params) for a in (adapter, other)]
    for b, t in enumerate(LENGTHS):
        mean = np.mean([ref.predicted(P, tiny.config, rows[b], A, conf) for A in members], axis=0)
        want = ref.scores(mean, tiny.config, conf, t)
        np.testing.assert_allclose(got[:, b, :, :t], want, atol=2e-6, rtol=1e-4)
        one = ref.scores(ref.predicted(P, tiny.config, rows[b], members[0], conf), tiny.config, conf, t)
        assert np.abs(one - want).max() > 1e-4  # the second member moves the scores


def _ids(model, lengths, seed):
    rng = np.random.RandomState(seed)
    return [[1] + rng.randint(3, model.config.vocab_size, n - 1).tolist() for n in lengths]


def test_generate_exact_counts_and_no_lookahead_kv_in_the_decode_cache(tiny, adapter):
    lengths = (40, 25, 33)
    ids = _ids(tiny, lengths, 0)
    policy = LookaheadKV(adapter=adapter)
    settings = [Setting(None), Setting(policy, budget=10), Setting(policy, budget=64)]
    full, out, same = kvjax.engine.generate_settings(tiny, ids, settings, max_new_tokens=6, stop_tokens=[])
    np.testing.assert_allclose(out.kept, 10)
    cfg = tiny.config  # the decode cache holds the budget plus the decode room, nothing for the lookahead tokens
    room = bucket_length(6, STEP_BUCKETS)
    assert out.cache_bytes == kvjax.KVCache.init(cfg.num_layers, 3, cfg.num_kv_heads, 10 + room, cfg.head_dim,
                                                 cfg.jnp_dtype).nbytes()
    assert (out.tokens[:, 0] == full.tokens[:, 0]).all()  # the first token comes from the frozen prefill
    np.testing.assert_array_equal(same.tokens, full.tokens)  # nothing evicted: the lookahead pass left no trace
    np.testing.assert_allclose(same.kept, lengths)
    cache = kvjax.engine.compress(tiny, ids, policy=policy, budget=10)
    pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
    for b, t in enumerate(lengths):
        assert (valid[:, b].sum(-1) == 10).all()
        assert (pos[:, b][valid[:, b]] < t).all()  # only prompt positions; no lookahead entry
        assert (pos[:, b][valid[:, b]] >= 0).all()


@pytest.mark.parametrize("allocator", [Pyramid(beta=20), Ada(alpha=0.2)], ids=["pyramid", "ada"])
def test_allocators_compose(tiny, adapter, allocator):
    lengths = (40, 25, 33)
    ids = _ids(tiny, lengths, 1)
    budget = 12
    policy = LookaheadKV(adapter=adapter, allocator=allocator)
    cache = kvjax.engine.compress(tiny, ids, policy=policy, budget=budget)
    kept = np.asarray(cache.valid).sum(-1)  # [L,B,Hkv]
    L, Hkv = tiny.config.num_layers, tiny.config.num_kv_heads
    for b, t in enumerate(lengths):
        if isinstance(allocator, Pyramid):
            want = pyramid_paper(t, budget, 0, L, 20)
            for l in range(L):
                assert (kept[l, b] == want[l]).all(), (l, b)
        else:  # Ada: per-head budgets differ, the layer total is Hkv * budget up to the rounding of cap_h
            assert (np.abs(kept[:, b].sum(-1) - Hkv * budget) <= Hkv).all()
    if isinstance(allocator, Ada):
        assert (kept[:, :, 0] != kept[:, :, 1]).any()  # really head-adaptive
    out = kvjax.generate(tiny, ids, policy=policy, budget=budget, max_new_tokens=4, stop_tokens=[])
    np.testing.assert_allclose(out.kept, kept.mean(axis=(0, 2)), rtol=1e-6)


def test_query_agnostic_context_then_question(tiny, adapter):
    contexts = _ids(tiny, (40, 25, 33), 2)
    questions = _ids(tiny, (5, 7, 4), 3)
    policy = LookaheadKV(adapter=adapter, query_aware=False)
    settings = [Setting(None), Setting(policy, budget=10), Setting(policy, budget=64)]
    full, out, same = kvjax.engine.generate_settings(tiny, contexts, settings, questions=questions,
                                                     max_new_tokens=4, stop_tokens=[])
    np.testing.assert_allclose(out.kept, 10)  # the context was compressed; the question came after
    np.testing.assert_array_equal(same.tokens, full.tokens)


def test_errors(tiny, adapter, tmp_path):
    ids = _ids(tiny, (20, 12), 4)
    from tiny_models import build_hf

    build_hf("llama2", tmp_path / "mha")
    other = kvjax.load_model(tmp_path / "mha")
    with pytest.raises(ValueError, match="trained for another model"):
        kvjax.generate(other, ids, policy=LookaheadKV(adapter=adapter), budget=8, max_new_tokens=2)
    short = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, max_position_embeddings=24))
    with pytest.raises(ValueError, match=r"n_tokens=4 lookahead tokens needs 25 positions.*max_position_embeddings=24"):
        kvjax.generate(short, [ids[0][:19] + [5, 6]], policy=LookaheadKV(adapter=adapter), budget=8,
                       max_new_tokens=2)
    with pytest.raises(TypeError, match="adapter must be a kvjax.lookahead.Adapter"):
        LookaheadKV(adapter=42)
    windowed = LookaheadKV(adapter=adapter.replace(config=dataclasses.replace(adapter.config, window=10)))
    with pytest.raises(ValueError, match="budget"):  # the observation window is kept whole: 10 > 8
        kvjax.generate(tiny, ids, policy=windowed, budget=8, max_new_tokens=2)


def test_bundled_or_folder_adapter(tiny, adapter, tmp_path, monkeypatch):
    ids = _ids(tiny, (20, 12), 4)
    monkeypatch.setattr(lk.adapter, "BUNDLED", tmp_path / "absent")
    kvjax.policies.lookahead._load.cache_clear()
    with pytest.raises(FileNotFoundError, match="no bundled LookaheadKV adapter"):
        kvjax.generate(tiny, ids, policy="lookahead_kv", compression_ratio=0.5, max_new_tokens=2)
    # a folder path is loaded when first needed
    lk.save(adapter, tmp_path / "ad")
    out = kvjax.generate(tiny, ids, policy=LookaheadKV(adapter=str(tmp_path / "ad")), budget=8, max_new_tokens=2,
                         stop_tokens=[])
    np.testing.assert_allclose(out.kept, 8)


def test_shared_prefill_with_another_policy_and_one_compile_per_bucket(tiny, adapter):
    ids = _ids(tiny, (40, 45, 38), 5)
    policy = LookaheadKV(adapter=adapter)
    alone = kvjax.generate(tiny, ids, policy=policy, budget=10, max_new_tokens=4, stop_tokens=[])
    both = kvjax.engine.generate_settings(tiny, ids, [Setting("snapkv", budget=36), Setting(policy, budget=10)],
                                          max_new_tokens=4, stop_tokens=[])
    np.testing.assert_array_equal(both[1].tokens, alone.tokens)
    np.testing.assert_allclose(both[0].kept, 36)
    before = TRACE_COUNTS["prefill"], TRACE_COUNTS["produce:lookahead"]
    kvjax.generate(tiny, _ids(tiny, (50, 33, 61), 6), policy=policy, budget=10, max_new_tokens=4, stop_tokens=[])
    # same bucket and batch: the prefill the lookahead tokens ride is not traced again (nor a pass after it)
    assert (TRACE_COUNTS["prefill"], TRACE_COUNTS["produce:lookahead"]) == before
