"""ExpectedAttention: the attention future queries are expected to pay, from query statistics
(arXiv 2510.00636; the authors' code is kvpress's ExpectedAttentionPress).

With mu_h, Sigma_h the mean and (biased) covariance of the pre-RoPE queries of head h over the
prompt positions >= n_sink, and Rbar the RoPE rotation averaged over the next n_future_positions
positions T .. T+n-1 (Rbar = diag(mean cos) + diag(mean sin) P, P the rotate-half matrix):
  z_h(j) = (Rbar mu_h) . k_j / sqrt(d) + 1/2 k_j^T (Rbar Sigma_h Rbar^T) k_j / d     (covariance term optional)
  a_h(j) = softmax over the non-sink keys j of z_h;  s(j) = mean over the query group of a_h(j);
  s(j) <- (s(j) + epsilon) * ||v_j||_2 when use_vnorm.
The n_sink first tokens are protected. Keys are the cached post-RoPE keys. The query statistics
come from the prefill (`query_stats` observation), with the model's RoPE inverse frequencies.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.kernels import masked_softmax
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies.base import Plan, Requirements, as_i32, check_bool, check_float, check_int
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored


def average_rope(lengths: jax.Array, inv_freq: jax.Array, n_future: int) -> jax.Array:
    """Rbar [B,D,D] float32: the HF rotate-half RoPE matrix averaged over positions T_b .. T_b+n-1."""
    half = inv_freq.shape[0]
    p = (lengths[:, None] + jnp.arange(n_future)[None]).astype(jnp.float32)  # [B,n]
    ang = p[..., None] * inv_freq[None, None]  # [B,n,D/2]
    c = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1).mean(1)  # [B,D]
    s = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1).mean(1)
    eye = jnp.eye(half, dtype=jnp.float32)
    zero = jnp.zeros_like(eye)
    rot = jnp.block([[zero, -eye], [eye, zero]])  # rotate_half(x) = rot @ x
    return c[:, :, None] * jnp.eye(2 * half)[None] + s[:, :, None] * rot[None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpectedAttention(PrefillPolicy):
    """ExpectedAttention with the authors' (kvpress) defaults: n_future_positions=512, n_sink=4,
    use_covariance=True, use_vnorm=True, epsilon=0. kvpress's leaderboard entry is Ada-KV over it
    with epsilon=1e-2 (`ada_expected_attention_kvpress`)."""

    name = "expected_attention"
    chunked_prefill_reason = ("its query statistics cover every prompt query, recorded by the one-shot "
                              "prefill only")

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_future_positions", self.n_future_positions, 1)
        check_int("n_sink", self.n_sink, 0)
        check_bool("use_covariance", self.use_covariance)
        check_bool("use_vnorm", self.use_vnorm)
        check_float("epsilon", self.epsilon, 0.0, float("inf"), hi_open=True)

    def protected_count(self) -> int:
        return self.n_sink

    def scorer_requirements(self) -> Requirements:
        return Requirements(observe=ObservationSpec(query_stats=self.n_sink))

    def check_lengths(self, lengths: tuple[int, ...]) -> None:
        if min(lengths) <= self.n_sink:
            raise ValueError(f"ExpectedAttention needs every prompt longer than n_sink={self.n_sink} "
                             f"(kvpress asserts it); the shortest has {min(lengths)} tokens")

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        if obs.query_mean is None or obs.rope_inv_freq is None:
            raise ValueError("ExpectedAttention needs the query statistics observation "
                             f"(ObservationSpec(query_stats={self.n_sink}))")
        lengths = as_i32(plan.lengths)
        d = cache.k.shape[-1]
        rbar = average_rope(lengths, jnp.asarray(obs.rope_inv_freq, jnp.float32), self.n_future_positions)
        mu = jnp.einsum("bde,lbhe->lbhd", rbar, obs.query_mean.astype(jnp.float32))
        cov = None
        if self.use_covariance:
            cov = jnp.einsum("bde,lbhef,bgf->lbhdg", rbar, obs.query_cov.astype(jnp.float32), rbar)
        sink = cache.pos < self.n_sink
        cand = cache.valid & ~sink

        def one(xs):  # one layer: [B,Hq,D], [B,Hq,D,D] | None, [B,Hkv,C,D], [B,Hkv,C]
            m, c, k, ok = xs
            B, Hkv = k.shape[:2]
            G = m.shape[1] // Hkv
            kf = k.astype(jnp.float32)
            z = jnp.einsum("bhgd,bhcd->bhgc", m.reshape(B, Hkv, G, d), kf) / jnp.sqrt(jnp.float32(d))
            if c is not None:
                kc = jnp.einsum("bhcd,bhgde->bhgce", kf, c.reshape(B, Hkv, G, d, d))
                z = z + jnp.einsum("bhgce,bhce->bhgc", kc, kf) / (2 * d)
            return masked_softmax(z, ok[:, :, None, :]).mean(2)

        s = jax.lax.map(one, (mu, cov, cache.k, cand)) if cov is not None else \
            jax.lax.map(lambda xs: one((xs[0], None, xs[1], xs[2])), (mu, cache.k, cand))
        if self.use_vnorm:
            vn = jnp.sqrt(jnp.sum(jnp.square(cache.v.astype(jnp.float32)), -1))
            s = (s + jnp.float32(self.epsilon)) * vn
        return Scored(jnp.where(cand, s, 0.0), cache.valid & sink)
