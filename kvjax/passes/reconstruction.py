"""KVzip's reconstruction (arXiv 2505.23416): a pass the engine runs after the prefill, in which the model
repeats the context, and every context key scores the most attention it receives.

The context (the prompt from position `prefix` on: a chat template's system / user header stays out of it,
as in kvpress) is cut into chunks; for each chunk the model runs one `extend` of [instruction, chunk]
against a copy of the prefilled cache grown by the pass's length (the prompt cache itself is never
changed; the pass's keys go to the grown slots C, C+1, ...). Each key of the chunk scores the max, over
its group's query heads and the pass's queries, of the softmax over the subsampled keys (the sinks, the
chunk, the pass's own keys, causal): kvpress's `KVzipPress.score_kvzip`.

That max is computed in query blocks that read only those keys, as static slices of the grown cache
(`subsampled_column_max`): a block's logits on the sinks and the chunk are held once, and the pass's own
keys enter only through each query's log-sum-exp, accumulated online over the own-key blocks below the
causal diagonal; the [queries x cache] probabilities are never formed. Its cost is linear in the prompt
(about 1.5 chunk_size logits per pass query), where the probabilities over every cache slot cost
(prompt + pass) per query (`implementation="materialized"`, the reference it is tested against). The
passes' `extend` themselves re-read the whole prompt against the full cache (about one more prefill);
only their first position's logits are computed.

The prefilled cache must be a prefill's layout: slot t holds position t (`kvjax.engine.steps.prefill`).

Field: reconstruction [L,B,Hkv,C] float32 (0 for slots no pass scored: padding, and the prefix).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.cache import KVCache
from kvjax.kernels import masked_softmax
from kvjax.models.config import ModelConfig
from kvjax.models.forward import extend
from kvjax.observations.base import Observation
from kvjax.observations.spec import ObservationSpec

IMPLEMENTATIONS = ("blocked", "materialized")


@dataclasses.dataclass(frozen=True)
class Reconstruction(Observation):
    """The pass's configuration. The context, positions prefix, prefix+1, ... of each prompt, is cut into
    chunks of `chunk_size` tokens; chunk i is fed against the prefilled cache as [first_ids (i = 0) or
    next_ids + the last min(postfix, chunk_size) tokens of chunk i-1 (i > 0), suffix_ids, chunk i], at
    positions T, T+1, ... (T: the row's prompt length). Each key of chunk i scores the max, over the query
    heads of its group and over that pass's queries, of the softmax over the keys {sinks: positions <
    min(n_sink, chunk start)} + {chunk i} + {the pass's own keys, causal}; the pass's keys are then dropped
    (the prompt cache is unchanged). Positions below `prefix` are never scored (0)."""

    chunk_size: int = 2048
    n_sink: int = 4
    postfix: int = 8
    first_ids: tuple[int, ...] = ()
    next_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()
    prefix: int = 0

    keyword = "reconstruction"
    fields = ("reconstruction",)
    producer = True

    @classmethod
    def from_keyword(cls, value: Any) -> None:
        if value is not None:
            raise TypeError(f"reconstruction= takes a Reconstruction (or None), got {type(value).__name__}")
        return None

    @classmethod
    def absent(cls) -> None:
        return None

    def value(self) -> Reconstruction:
        return self

    def check(self, cfg: Any, longest: int, inputs: Any) -> None:
        if longest <= self.prefix:
            raise ValueError(f"the reconstruction starts at position prefix={self.prefix}, but no prompt is longer")

    def produce(self, params: Any, cfg: Any, cache: KVCache, tokens: jax.Array, positions: jax.Array, *,
                rope_mode: str, inputs: Any) -> dict[str, jax.Array]:
        return {"reconstruction": reconstruction_scores(params, cfg, cache, tokens, positions, self, rope_mode)}


def chunk_bounds(spec: Reconstruction, T: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a bucket of T positions: from `prefix`, `chunk_size` at a time."""
    return [(s, min(s + spec.chunk_size, T)) for s in range(spec.prefix, T, spec.chunk_size)]


def pass_inputs(spec: Reconstruction, tokens: jax.Array, lengths: jax.Array, i: int, start: int, end: int
                ) -> tuple[jax.Array, jax.Array]:
    """Chunk i's pass: ids [B,n] and positions [B,n] (after each row's prompt; -1 on padding: the end of a
    row's last, shorter chunk, and every token of a row whose prompt ends before the chunk starts)."""
    B = tokens.shape[0]
    post = min(spec.postfix, spec.chunk_size) if i else 0  # the previous chunk is a whole one
    instr = spec.first_ids if i == 0 else spec.next_ids
    head = jnp.broadcast_to(jnp.asarray(instr, jnp.int32)[None], (B, len(instr)))
    tail = jnp.broadcast_to(jnp.asarray(spec.suffix_ids, jnp.int32)[None], (B, len(spec.suffix_ids)))
    ids = jnp.concatenate([head, tokens[:, start - post:start], tail, tokens[:, start:end]], axis=1)
    n, p = ids.shape[1], ids.shape[1] - (end - start)
    index = jnp.arange(n)
    real = (index[None] < p) | (start + index[None] - p < lengths[:, None])
    real = real & (lengths > start)[:, None]  # a row whose prompt ends before the chunk sits out
    return ids, jnp.where(real, lengths[:, None] + index[None], -1).astype(jnp.int32)


# float32 elements of one query block's logits on the context keys ([B,Hq,block,S]; 16 MiB)
_TILE_ELEMENTS = 1 << 22
QUERY_BLOCK = 256  # the most queries per block
KEY_BLOCK = 256  # own keys per block of the log-sum-exp loop


# finite "minus infinity" for masked logits: exp(MASK - m) underflows to 0 without inf - inf = NaN
_MASK = -0.7 * float(np.finfo(np.float32).max)
_INT_BIG = int(np.iinfo(np.int32).max)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _block_ranges(qpos: jax.Array, kpos: jax.Array, bq: int, bk: int) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) [nQ] int32: the key blocks that may hold a key some query of each query block sees
    (0 <= kpos <= qpos), over the batch and heads together; lo = hi = 0 when none. Exact for any
    positions: a block outside holds no visible pair. qpos [B,Tp], kpos [B,Hkv,Sp] (-1 = none)."""
    b, tp = qpos.shape
    qmax = jnp.max(qpos.reshape(b, tp // bq, bq), axis=-1)[:, None, :, None]  # [B,1,nQ,1]
    kmin = jnp.min(jnp.where(kpos >= 0, kpos, _INT_BIG).reshape(b, kpos.shape[1], -1, bk), axis=-1)
    some = jnp.any(kmin[:, :, None, :] <= qmax, axis=(0, 1))  # [nQ,nK]
    idx = jnp.arange(some.shape[1], dtype=jnp.int32)
    hi = jnp.max(jnp.where(some, idx + 1, 0), axis=1).astype(jnp.int32)
    lo = jnp.min(jnp.where(some, idx, _INT_BIG), axis=1)
    return jnp.where(hi > 0, lo, 0).astype(jnp.int32), hi


def query_block(b: int, hq: int, n: int, s: int) -> int:
    """A power of two in [8, QUERY_BLOCK] query rows, smaller when a [B,Hq,block,S] tile would be large,
    and no larger than n needs."""
    c = QUERY_BLOCK
    while c > 8 and b * hq * c * max(s, 1) > _TILE_ELEMENTS:
        c //= 2
    return min(c, max(8, 1 << max(0, (n - 1).bit_length())))


def subsampled_column_max(queries: jax.Array, query_positions: jax.Array, ctx_keys: jax.Array,
                          ctx_positions: jax.Array, own_keys: jax.Array, own_positions: jax.Array, *,
                          scale: float, block: int | None = None, key_block: int | None = None) -> jax.Array:
    """float32 [B,Hkv,S]: per context key, the max over the query group and the queries of its probability
    under each query's softmax over the context keys and the own keys together.

    queries [B,Hq,n,D] (post-RoPE), query_positions [B,n] (-1 = padding: contributes nothing);
    ctx_keys [B,Hkv,S,D], ctx_positions [B,Hkv,S]; own_keys [B,Hkv,m,D], own_positions [B,Hkv,m]
    (-1 = empty). Query i sees key j iff 0 <= pos[j] <= query_positions[i].

    The queries run in blocks (a scan): a block's logits on the context keys [B,Hkv,G,block,S] are formed
    once; the own keys add only to each query's log-sum-exp (online max and sum over own-key blocks, the
    blocks holding no visible key skipped); then p = exp(s - lse) on the
    context columns and its max over the block. Never more than one block's [block x S] at a time.
    """
    b, hq, n, d = queries.shape
    hkv, s, m = ctx_keys.shape[1], ctx_keys.shape[2], own_keys.shape[2]
    g = hq // hkv
    qb = block or query_block(b, hq, n, s)
    bk = key_block or min(KEY_BLOCK, _round_up(max(m, 1), 8))
    npad, mpad = _round_up(n, qb), _round_up(max(m, 1), bk)
    nq, nk = npad // qb, mpad // bk
    qpos = _pad(query_positions.astype(jnp.int32), 1, npad, -1)
    q = _pad(queries, 2, npad).reshape(b, hkv, g, nq, qb, d)
    opos = _pad(own_positions.astype(jnp.int32), 2, mpad, -1)
    lo, hi = _block_ranges(qpos, opos, qb, bk)
    ko = _pad(own_keys, 2, mpad).reshape(b, hkv, nk, bk, d).transpose(2, 0, 1, 3, 4)
    opb = opos.reshape(b, hkv, nk, bk).transpose(2, 0, 1, 3)[:, :, :, None, None, :]  # [nK,B,Hkv,1,1,bk]
    cpos = ctx_positions.astype(jnp.int32)[:, :, None, None, :]  # [B,Hkv,1,1,S]
    mask = _MASK

    def logits(qc: jax.Array, k: jax.Array) -> jax.Array:
        return jnp.einsum("bhgcd,bhsd->bhgcs", qc, k, precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32) * scale

    def step(best, xs):
        qc, qpc, l0, l1 = xs  # [B,Hkv,G,qb,D], [B,qb], [], []
        qp = qpc[:, None, None, :, None]
        see = (cpos >= 0) & (cpos <= qp)
        lc = jnp.where(see, logits(qc, ctx_keys), mask)
        m_ctx = jnp.max(lc, axis=-1)  # [B,Hkv,G,qb]

        def own(j, carry):  # online log-sum-exp of the block's queries over own-key block j
            m_own, s_own = carry
            vis = (opb[j] >= 0) & (opb[j] <= qp)
            lo_ = jnp.where(vis, logits(qc, ko[j]), mask)
            m_new = jnp.maximum(m_own, jnp.max(lo_, axis=-1))
            part = jnp.sum(jnp.where(vis, jnp.exp(lo_ - m_new[..., None]), 0.0), axis=-1)
            return m_new, s_own * jnp.exp(m_own - m_new) + part

        m_own, s_own = lax.fori_loop(l0, l1, own, (jnp.full(m_ctx.shape, mask, jnp.float32),
                                                   jnp.zeros(m_ctx.shape, jnp.float32)))
        top = jnp.maximum(m_ctx, m_own)
        e = jnp.where(see, jnp.exp(lc - top[..., None]), 0.0)
        total = jnp.sum(e, axis=-1) + s_own * jnp.exp(m_own - top)
        p = e * (1.0 / jnp.where(total > 0, total, 1.0))[..., None]
        return jnp.maximum(best, jnp.max(p, axis=(2, 3))), None

    xs = (jnp.moveaxis(q, 3, 0), jnp.moveaxis(qpos.reshape(b, nq, qb), 1, 0), lo, hi)
    best, _ = lax.scan(step, jnp.zeros((b, hkv, s), jnp.float32), xs)
    return best


def subsampled_column_max_reference(queries: jax.Array, query_positions: jax.Array, ctx_keys: jax.Array,
                                    ctx_positions: jax.Array, own_keys: jax.Array, own_positions: jax.Array, *,
                                    scale: float) -> jax.Array:
    """`subsampled_column_max` with the [B,Hq,n,S+m] probabilities materialised (tests, small sizes)."""
    b, hq, n, d = queries.shape
    hkv = ctx_keys.shape[1]
    keys = jnp.concatenate([ctx_keys, own_keys.astype(ctx_keys.dtype)], axis=2)
    kpos = jnp.concatenate([ctx_positions, own_positions], axis=2).astype(jnp.int32)[:, :, None, None, :]
    lg = jnp.einsum("bhgtd,bhsd->bhgts", queries.reshape(b, hkv, hq // hkv, n, d), keys,
                    precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32) * scale
    see = (kpos >= 0) & (kpos <= query_positions.astype(jnp.int32)[:, None, None, :, None])
    return jnp.max(masked_softmax(lg, see)[..., : ctx_keys.shape[2]], axis=(2, 3))


def _chunk_max_materialized(q: jax.Array, qpos: jax.Array, cache: KVCache, lengths: jax.Array, start: int,
                            end: int, n_sink: int, scale: float) -> jax.Array:
    """[L,B,Hkv,C'] float32 over every slot of the grown cache: per key of the chunk [start, end), the max
    over group heads and queries of the subsampled softmax, the probabilities over all C' slots
    materialised per block of QUERY_BLOCK queries (masks pick the subsampled keys). The reference."""
    _, B, Hq, n, D = q.shape
    Hkv = cache.k.shape[2]
    G = Hq // Hkv
    nb = -(-n // QUERY_BLOCK)
    pad = nb * QUERY_BLOCK - n
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
    qpos = jnp.pad(qpos, ((0, 0), (0, pad)), constant_values=-1)
    sink = min(n_sink, start)

    def layer(xs):
        ql, kl, pl, vl = xs  # [B,Hq,n',D], [B,Hkv,C,D], [B,Hkv,C], [B,Hkv,C]
        chunk = vl & (pl >= start) & (pl < jnp.minimum(end, lengths)[:, None, None])  # prompt keys only
        own = vl & (pl >= lengths[:, None, None])  # the pass's keys (positions after the prompt)
        base = vl & (pl < sink) | chunk

        def block(best, i):
            qb = lax.dynamic_slice_in_dim(ql, i * QUERY_BLOCK, QUERY_BLOCK, axis=2)
            pb = lax.dynamic_slice_in_dim(qpos, i * QUERY_BLOCK, QUERY_BLOCK, axis=1)
            lg = jnp.einsum("bhgnd,bhcd->bhgnc", qb.reshape(B, Hkv, G, QUERY_BLOCK, D), kl,
                            precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32) * scale
            see = base[:, :, None, None, :] | (own[:, :, None, None, :] & (pl[:, :, None, None, :]
                                                                          <= pb[:, None, None, :, None]))
            see = see & (pb >= 0)[:, None, None, :, None]
            probs = jnp.where(chunk[:, :, None, None, :], masked_softmax(lg, see), 0.0)
            return jnp.maximum(best, probs.max((2, 3))), None

        best, _ = lax.scan(block, jnp.zeros(vl.shape, jnp.float32), jnp.arange(nb))
        return best

    return lax.map(layer, (q, cache.k, cache.pos, cache.valid))


def reconstruction_scores(params: Any, cfg: ModelConfig, cache: KVCache, tokens: jax.Array, positions: jax.Array,
                          spec: Reconstruction, rope_mode: str = "original", implementation: str = "blocked"
                          ) -> jax.Array:
    """KVzip's scores [L,B,Hkv,C] float32 for a prefilled `cache` of the right-padded prompts
    tokens / positions [B,T] (-1 = padding). Slots outside every row's context get 0.

    implementation: "blocked" (`subsampled_column_max` on static slices of the grown cache) or
    "materialized" (the probabilities over every slot of the grown cache, per block of queries: the
    reference the blocked path is tested against)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    B, T = tokens.shape
    C = cache.capacity
    L, _, Hkv = cache.k.shape[:3]
    lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
    out = jnp.zeros(cache.valid.shape, jnp.float32)
    scale = cfg.head_dim**-0.5
    kpos = jnp.where(cache.valid, cache.pos, -1)
    for i, (start, end) in enumerate(chunk_bounds(spec, T)):
        ids, pos = pass_inputs(spec, tokens, lengths, i, start, end)
        n = ids.shape[1]
        slots = jnp.broadcast_to(C + jnp.arange(n, dtype=jnp.int32), (L, B, Hkv, n))
        _, grown, obs = extend(params, cfg, cache.grow(C + n), ids, pos, fresh=False, slots=slots,
                               observe=ObservationSpec(window=n), rope_mode=rope_mode,
                               logit_index=jnp.zeros((B, 0), jnp.int32))  # no logits
        q, qpos = obs.window_queries, obs.window_positions  # every query of the pass (n = the window)
        sink = min(spec.n_sink, start)
        if implementation == "materialized":
            best = _chunk_max_materialized(q, qpos, grown, lengths, start, end, spec.n_sink, scale)[..., start:end]
        else:
            ctx = jnp.concatenate([cache.k[:, :, :, :sink], cache.k[:, :, :, start:end]], axis=3)
            ctx_pos = jnp.concatenate([kpos[..., :sink], kpos[..., start:end]], axis=-1)
            own_pos = jnp.where(grown.valid[..., C:], grown.pos[..., C:], -1)
            best = lax.map(lambda xs: subsampled_column_max(xs[0], qpos, *xs[1:], scale=scale)[..., sink:],
                           (q, ctx, ctx_pos, grown.k[:, :, :, C:], own_pos))
        out = out.at[..., start:end].set(best)
    return out
