"""Sampler: greedy, top-k, top-p against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.sampling import Sampler


def _draws(sampler, logits, n=400):
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    return np.asarray(jax.vmap(lambda k: sampler(logits, k))(keys))  # [n, B]


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(1), (4, 30))
    np.testing.assert_array_equal(Sampler()(logits, None), np.argmax(np.asarray(logits), -1))


def test_top_k_only_draws_the_k_best():
    logits = jax.random.normal(jax.random.PRNGKey(2), (3, 50)) * 3
    draws = _draws(Sampler(temperature=1.0, top_k=4), logits)
    top = np.argsort(-np.asarray(logits), -1)[:, :4]
    for b in range(3):
        assert set(draws[:, b]) <= set(top[b])
        assert len(set(draws[:, b])) > 1


def test_top_p_draws_the_nucleus_only():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = _draws(Sampler(temperature=1.0, top_p=0.7), logits)
    # the nucleus is the smallest prefix of sorted probs whose mass reaches 0.7: {0, 1}
    assert set(draws[:, 0]) == {0, 1}
    freq0 = (draws[:, 0] == 0).mean()
    assert abs(freq0 - 0.5 / 0.8) < 0.08


def test_temperature_matches_softmax_frequencies():
    p = np.array([0.6, 0.3, 0.1])
    draws = _draws(Sampler(temperature=2.0), jnp.log(jnp.asarray(p))[None], n=2000)[:, 0]
    want = p ** 0.5 / (p ** 0.5).sum()
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 2000, want, atol=0.04)


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_sampler_arguments(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        Sampler(**kw)
