"""The flash prefill path of `extend` against the materialised-probabilities path it replaces (the attention
op without its flash implementation: `$KVJAX_ATTENTION_IMPLEMENTATION`): logits, cache, observations, the kept
sets of SnapKV and H2O, and one compilation per bucket."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.engine import TRACE_COUNTS, bucket_length
from kvjax.kernels import attention
from kvjax.models import extend
from kvjax.models.local import init_cache
from kvjax.observations import ObservationSpec

RNG = np.random.RandomState(7)


@pytest.fixture(scope="module")
def stories(stories_path):
    """The stories260K fixture (a trained Llama, GQA 8/4) with room for 4096 positions (its RoPE is the
    default one, so the weights run unchanged past its 512 training positions)."""
    model = kvjax.load_model(stories_path)
    return dataclasses.replace(model, config=dataclasses.replace(model.config, max_position_embeddings=4096))


def _batch(lengths, T, vocab, left=False):
    tokens = np.zeros((len(lengths), T), np.int32)
    positions = np.full((len(lengths), T), -1, np.int32)
    for b, n in enumerate(lengths):
        cols = slice(T - n, T) if left else slice(0, n)
        tokens[b, cols] = RNG.randint(3, vocab, n)
        positions[b, cols] = np.arange(n)
    return jnp.asarray(tokens), jnp.asarray(positions)


def _use_flash(monkeypatch, flash):
    if flash:
        monkeypatch.delenv(attention.ENV_VAR, raising=False)
    else:  # the materialised path: every implementation but flash
        monkeypatch.setenv(attention.ENV_VAR, "xla_fused,decode,materialized,blocked")


def _prefill(model, tokens, positions, observe, flash, monkeypatch):
    _use_flash(monkeypatch, flash)
    cfg = model.config
    fn = jax.jit(extend, static_argnames=("cfg", "fresh", "observe"))  # traced anew: reads the variable
    return fn(model.params, cfg, init_cache(cfg, tokens.shape[0], tokens.shape[1]), tokens, positions,
              fresh=True, observe=observe)


@pytest.mark.parametrize("lengths, T, left", [((200, 77), 200, False), ((1100, 1030), 1100, False),
                                              ((1100, 900), 1100, True)])
def test_flash_prefill_equals_materialised_path(stories, monkeypatch, lengths, T, left):
    """Logits, keys/values and every probability-free observation (SnapKV's window, the column mass) of
    the flash prefill equal those of the materialised path, with right or left padding, up to T > 1024."""
    model = stories
    tokens, positions = _batch(lengths, T, model.config.vocab_size, left)
    spec = ObservationSpec(window=16, column_mass=True)
    new = _prefill(model, tokens, positions, spec, True, monkeypatch)
    old = _prefill(model, tokens, positions, spec, False, monkeypatch)
    real = np.asarray(positions >= 0)
    scale = np.abs(np.asarray(old[0])[real]).max()
    np.testing.assert_allclose(np.asarray(new[0])[real], np.asarray(old[0])[real], atol=2e-5 * scale)
    slots = real[None, :, None, :, None]  # [L,B,Hkv,C,D]: the real tokens' slots
    for a, b in ((new[1].k, old[1].k), (new[1].v, old[1].v)):
        np.testing.assert_allclose(np.where(slots, a, 0), np.where(slots, b, 0), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(new[1].pos), np.asarray(old[1].pos))
    np.testing.assert_allclose(np.asarray(new[2].window_queries), np.asarray(old[2].window_queries), atol=2e-5)
    np.testing.assert_allclose(np.asarray(new[2].column_mass), np.asarray(old[2].column_mass), rtol=1e-4, atol=1e-4)


def test_query_mass_still_materialises(stories, monkeypatch):
    """query_mass reads probabilities: a prefill asking for it takes the materialised path, flash or not."""
    model = stories
    tokens, positions = _batch((40, 25), 40, model.config.vocab_size)
    spec = ObservationSpec(query_mass=True)
    new = _prefill(model, tokens, positions, spec, True, monkeypatch)[2].query_mass
    old = _prefill(model, tokens, positions, spec, False, monkeypatch)[2].query_mass
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


@pytest.mark.parametrize("policy", ["snapkv", "h2o_prefill", "observed_attention_kvpress"])
@pytest.mark.parametrize("lengths", [(300, 170), (1300, 1100)])
def test_kept_sets_unchanged(stories, monkeypatch, policy, lengths):
    """SnapKV (window queries) and H2O (column mass) keep the same entries after a flash prefill as after
    the materialised one."""
    model = stories
    prompts = [[1] + RNG.randint(3, model.config.vocab_size, n - 1).tolist() for n in lengths]
    kept = []
    for flash in (True, False):
        _use_flash(monkeypatch, flash)
        jax.clear_caches()  # the engine's jitted prefill is traced again under the variable
        cache = kvjax.engine.compress(model, prompts, policy=policy, compression_ratio=0.5)
        kept.append(np.where(np.asarray(cache.valid), np.asarray(cache.pos), -1))
    np.testing.assert_array_equal(np.sort(kept[0], -1), np.sort(kept[1], -1))


def test_one_compilation_per_bucket(stories):
    """Prompts of other lengths in the same bucket reuse the flash prefill and the compression programs."""
    model = stories
    assert {bucket_length(n) for n in (1100, 1500, 1900, 2000)} == {2048}
    prompts = lambda lengths: [[1] + RNG.randint(3, 512, n - 1).tolist() for n in lengths]  # noqa: E731
    for policy in ("snapkv", "h2o_prefill"):
        kvjax.engine.compress(model, prompts((1100, 1900)), policy=policy, compression_ratio=0.5)
        before = dict(TRACE_COUNTS)
        kvjax.engine.compress(model, prompts((1500, 2000)), policy=policy, compression_ratio=0.5)
        assert TRACE_COUNTS == before
