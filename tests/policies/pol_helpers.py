"""Random prefill inputs for policy tests: GQA 8 query heads over 2 KV heads, right-padded batch."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache
from kvjax.observations import Observations

HQ, HKV, D = 8, 2, 8
G = HQ // HKV
LENGTHS = (29, 17, 23)
E = 16  # model width of the stand-in output projection
QUERY_STATS_FROM = 4  # ExpectedAttention's default n_sink
INV_FREQ = tuple(float(x) for x in 1.0 / 10000.0 ** (np.arange(0, D, 2) / D))


@dataclasses.dataclass
class Inputs:
    """NumPy copies (for references) and the JAX cache / observations (for policies).

    q [L,B,Hq,S,D]: every prompt query (post-RoPE stand-in); k [L,B,Hkv,S,D]; lengths [B].
    mass [L,B,Hkv,S]: column mass of all causal prompt queries, summed over the group.
    """

    q: np.ndarray
    k: np.ndarray
    lengths: tuple[int, ...]
    window: int
    mass: np.ndarray
    cache: KVCache
    obs: Observations
    v: np.ndarray | None = None  # [L,B,Hkv,S,D]
    wo: np.ndarray | None = None  # [L,Hq*D,E] stand-in output projection

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]


def causal_column_mass(q: np.ndarray, k: np.ndarray, lengths) -> np.ndarray:
    """Engine observation (float64 NumPy): sum over query i <= T-1 of softmax_j<=i, group summed."""
    L, B, Hq, S, _ = q.shape
    out = np.zeros((L, B, HKV, S))
    for l in range(L):
        for b, t in enumerate(lengths):
            for h in range(Hq):
                logits = q[l, b, h, :t] @ k[l, b, h // G, :t].T / np.sqrt(D)
                logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                out[l, b, h // G, :t] += p.sum(0)
    return out


def output_norms_np(v: np.ndarray, wo: np.ndarray, lengths) -> np.ndarray:
    """Engine observation (float64 NumPy): group mean over query heads g of ||v_j W_o^g||_1, [L,B,Hkv,S]."""
    L, B, _, S, _ = v.shape
    out = np.zeros((L, B, HKV, S))
    for l in range(L):
        for b, t in enumerate(lengths):
            for h in range(HQ):
                proj = v[l, b, h // G, :t].astype(np.float64) @ wo[l, h * D:(h + 1) * D].astype(np.float64)
                out[l, b, h // G, :t] += np.abs(proj).sum(-1) / G
    return out


def query_stats_np(q: np.ndarray, lengths, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Engine observation: mean [L,B,Hq,D] and biased covariance [L,B,Hq,D,D] of q at positions start..T-1."""
    L, B, Hq, _, _ = q.shape
    mean, cov = np.zeros((L, B, Hq, D)), np.zeros((L, B, Hq, D, D))
    for l in range(L):
        for b, t in enumerate(lengths):
            x = q[l, b, :, start:t].astype(np.float64)  # [Hq, n, D]
            if x.shape[1] == 0:
                continue
            mean[l, b] = x.mean(1)
            c = x - mean[l, b][:, None]
            cov[l, b] = np.einsum("hnd,hne->hde", c, c) / x.shape[1]
    return mean, cov


LOOKAHEAD_N = 4  # stand-in lookahead tokens: the last 4 prompt queries of each row


def lookahead_np(q: np.ndarray, k: np.ndarray, lengths, n: int = LOOKAHEAD_N) -> dict[str, np.ndarray]:
    """Stand-ins for the lookahead pass's observations ([L,B,Hq,S] float64 each, 0 past the prompt): the
    last n prompt queries of each row, as if they came after it, attend to all its T keys; per query
    head and slot the sum over them of p, p^2 and -p log(p + 1e-10) (query_mass, _sumsq, _entropy)."""
    L, B, Hq, S, _ = q.shape
    out = {f: np.zeros((L, B, Hq, S)) for f in ("query_mass", "query_sumsq", "query_entropy")}
    for l in range(L):
        for b, t in enumerate(lengths):
            for h in range(Hq):
                qs, ks = q[l, b, h, max(t - n, 0):t].astype(np.float64), k[l, b, h // G, :t].astype(np.float64)
                logits = qs @ ks.T / np.sqrt(D)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                out["query_mass"][l, b, h, :t] = p.sum(0)
                out["query_sumsq"][l, b, h, :t] = (p * p).sum(0)
                out["query_entropy"][l, b, h, :t] = -(p * np.log(p + 1e-10)).sum(0)
    return out


def make_inputs(
    seed: int = 0,
    lengths: tuple[int, ...] = LENGTHS,
    slots: int | None = None,
    window: int = 8,
    num_layers: int = 2,
    q_scale: float = 2.5,
    rows: list[int] | None = None,
) -> Inputs:
    """Random keys/queries; row b fills slots 0..len_b-1 at positions 0..len_b-1, the rest invalid.

    `rows` picks rows of a larger random draw (so one sequence can be tested alone or in a batch
    with identical contents): the draw always has max(lengths) tokens per row.
    """
    rng = np.random.default_rng(seed)
    shape = (num_layers, len(lengths), HKV, max(lengths), D)
    q = rng.normal(size=shape[:2] + (HQ,) + shape[3:]).astype(np.float32) * q_scale
    k = rng.normal(size=shape).astype(np.float32)
    v = rng.normal(size=shape).astype(np.float32)
    if rows is not None:
        q, k, v = q[:, rows], k[:, rows], v[:, rows]
        lengths = tuple(lengths[r] for r in rows)
    return build(q, k, v, lengths, slots or max(lengths), window)


def build(q, k, v, lengths, slots, window) -> Inputs:
    """Pads the per-row prompt arrays into `slots` cache slots and derives the observations."""
    L, B, _, n, _ = q.shape
    pad = slots - n
    if pad > 0:
        z = lambda x: np.concatenate([x, np.zeros(x.shape[:3] + (pad, D), x.dtype)], axis=3)  # noqa: E731
        q, k, v = z(q), z(k), z(v)
    q, k, v = q[:, :, :, :slots], k[:, :, :, :slots], v[:, :, :, :slots]
    slot = np.arange(slots)
    lens = np.asarray(lengths)
    valid = slot[None, :] < lens[:, None]  # [B,S]
    for b, t in enumerate(lengths):  # garbage beyond each prompt must not matter
        k[:, b, :, t:] = 7.0
        q[:, b, :, t:] = -3.0
    pos = np.where(valid, slot[None, :], -1)
    valid4 = np.broadcast_to(valid[None, :, None, :], (L, B, HKV, slots))
    pos4 = np.broadcast_to(pos[None, :, None, :], (L, B, HKV, slots)).astype(np.int32)
    cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(v), pos=jnp.asarray(pos4), valid=jnp.asarray(valid4))
    wpos = lens[:, None] - window + np.arange(window)[None, :]
    idx = np.maximum(wpos, 0)
    wq = np.take_along_axis(q, idx[None, :, None, :, None], axis=3)
    mass = causal_column_mass(q, k, lengths)
    wo = np.random.default_rng(1234).normal(size=(L, HQ * D, E)).astype(np.float32) / 4
    qmean, qcov = query_stats_np(q, lengths, QUERY_STATS_FROM)  # q doubles as the pre-RoPE queries
    lookahead = {f: jnp.asarray(x.astype(np.float32)) for f, x in lookahead_np(q, k, lengths).items()}
    obs = Observations(
        window_queries=jnp.asarray(wq),
        window_positions=jnp.asarray(np.where(wpos >= 0, wpos, -1).astype(np.int32)),
        column_mass=jnp.asarray(mass.astype(np.float32)),
        lengths=jnp.asarray(lens.astype(np.int32)),
        output_norms=jnp.asarray(output_norms_np(v, wo, lengths).astype(np.float32)),
        query_mean=jnp.asarray(qmean.astype(np.float32)),
        query_cov=jnp.asarray(qcov.astype(np.float32)),
        rope_inv_freq=INV_FREQ,
        # a stand-in for KVzip's reconstruction scores: a per-slot function of the key (row-independent)
        reconstruction=jnp.asarray(np.where(valid4, 1 / (1 + np.exp(-k[..., 0] - k[..., 1])), 0).astype(np.float32)),
        **lookahead,
    )
    return Inputs(q=q, k=k, lengths=tuple(lengths), window=window, mass=mass, cache=cache, obs=obs, v=v, wo=wo)


def kept_positions(keep: np.ndarray, pos: np.ndarray) -> dict[tuple[int, int, int], set[int]]:
    """{(layer, row, head): set of kept positions} from a keep mask and the slot positions."""
    keep, pos = np.asarray(keep), np.asarray(pos)
    out = {}
    for idx in np.ndindex(keep.shape[:3]):
        out[idx] = {int(p) for p in pos[idx][keep[idx]]}
    return out


def assert_same_kept(got: set[int], want: set[int], scores: dict[int, float], protected: set[int], tol=1e-5, where=""):
    """Kept sets equal, except swaps of non-protected tokens whose reference scores tie (within
    `tol`) at the selection boundary (policies.md §1.5: boundary ties are don't-care)."""
    assert len(got) == len(want), f"{where}: kept {len(got)} entries, reference {len(want)}"
    diff = got ^ want
    if not diff:
        return
    assert not (diff & protected), f"{where}: protected tokens differ: {sorted(diff & protected)}"
    boundary = min(scores[p] for p in want - protected)
    for p in diff:
        assert abs(scores[p] - boundary) <= tol * (1 + abs(boundary)), (
            f"{where}: position {p} (score {scores[p]}) differs from the reference set (boundary {boundary}); "
            f"got-only {sorted(got - want)}, ref-only {sorted(want - got)}"
        )
