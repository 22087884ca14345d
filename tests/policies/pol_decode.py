"""A miniature engine for decode-time tests: the engine's `compress_prefill`, then a scan of (write, probs, update, evict).

Step probabilities come from a hash of (step, layer, row, query head, position), so they are
reproducible and independent of slot order; softmax over the valid slots per query head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.policies.base import compress_prefill


def _mix(x):
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def step_logits(t, pos, num_q_per_kv, seed, sharpness):
    """[L,B,Hkv,G,C] float32 logits for the tokens at `pos` [L,B,Hkv,C] at step t."""
    L, B, H, C = pos.shape
    u = lambda x: jnp.asarray(x).astype(jnp.uint32)  # noqa: E731
    layer = jnp.arange(L)[:, None, None, None, None]
    row = jnp.arange(B)[None, :, None, None, None]
    qh = (jnp.arange(H)[:, None] * num_q_per_kv + jnp.arange(num_q_per_kv)[None, :])[None, None, :, :, None]
    p = jnp.maximum(pos, 0)[:, :, :, None, :]
    h = _mix(u(seed) ^ _mix(u(t) ^ _mix(u(layer) ^ _mix(u(row) ^ _mix(u(qh) ^ _mix(u(p)))))))
    x = (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
    return sharpness * x * x * x  # heavy right tail: a few tokens get most of the mass


def step_probs(t, cache, num_q_per_kv, seed, sharpness):
    logits = step_logits(t, cache.pos, num_q_per_kv, seed, sharpness)
    v = cache.valid[:, :, :, None, :]
    logits = jnp.where(v, logits, -jnp.inf)
    p = jnp.exp(logits - logits.max(-1, keepdims=True))
    p = jnp.where(v, p, 0.0)
    return p / p.sum(-1, keepdims=True)


@functools.partial(
    jax.jit, static_argnames=("policy", "plan", "steps", "record", "group", "seed", "sharpness", "question")
)
def run_decode(policy, plan, cache, obs, *, steps, group, record=False, seed=0, sharpness=12.0, question=0):
    """Returns (n_valid [steps,L,B,Hkv] after each update, recorded arrays or None, final cache, written).

    `question` tokens are appended first without `decode_update` (context-then-question mode).
    recorded: pos and valid after the write [steps,L,B,Hkv,C], probs [steps,L,B,Hkv,G,C],
    written [steps,L,B,Hkv], keep [steps,L,B,Hkv,C]. written [steps,L,B,Hkv]: entries right after
    each write (a write into a full cache would overwrite a slot and not add one).
    """
    cache, state = compress_prefill(policy, plan, cache, obs, capacity=plan.capacity)
    lengths = jnp.asarray(plan.lengths, jnp.int32)
    L, B, H, C, D = cache.k.shape
    new = jnp.full((L, B, H, 1, D), 0.5, cache.k.dtype)
    for i in range(question):
        cache = cache.append(new, new, (lengths + i)[:, None])
    start = lengths + question

    def body(carry, t):
        cache, state = carry
        slots = cache.write_slots(1)
        cache = cache.scatter(slots, new, new, (start + t - 1)[:, None])
        n_written = cache.valid.sum(-1).astype(jnp.int32)
        probs = step_probs(t, cache, group, seed, sharpness)
        state, keep = policy.decode_update(plan, state, cache, probs, slots[..., 0], t)
        rec = (cache.pos, cache.valid, probs, slots[..., 0], keep) if record else None
        cache = cache.evict(keep)
        return (cache, state), (cache.valid.sum(-1).astype(jnp.int32), rec, n_written)

    (cache, _), (n_valid, rec, n_written) = jax.lax.scan(
        body, (cache, state), jnp.arange(1, steps + 1, dtype=jnp.int32)
    )
    return n_valid, rec, cache, n_written
