"""Independent NumPy (float64) oracles for the scoring kernels, written from the spec.

Loops over (batch, query head) with explicit masks; no code shared with kvjax.kernels.
Also the input builders shared by the kernel tests (ragged positions, NaN poisoning).
"""

from __future__ import annotations

import numpy as np

EPS = 1e-10


def _softmax_rows(logits: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Row-wise softmax over the visible entries; rows with none visible are all zero."""
    out = np.zeros_like(logits)
    for i in range(logits.shape[0]):
        cols = np.flatnonzero(visible[i])
        if cols.size:
            z = logits[i, cols] - logits[i, cols].max()
            e = np.exp(z)
            out[i, cols] = e / e.sum()
    return out


def _visible(qpos: np.ndarray, kpos: np.ndarray) -> np.ndarray:
    """[T] query positions, [S] key positions -> [T,S]: 0 <= kpos[j] <= qpos[i]."""
    return (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])


def _logits(q: np.ndarray, k: np.ndarray, scale: float, visible: np.ndarray) -> np.ndarray:
    # Only visible entries are computed: NaN in padding must not even enter the oracle.
    out = np.zeros(visible.shape)
    rows, cols = np.nonzero(visible)
    out[rows, cols] = np.einsum("id,id->i", q[rows].astype(np.float64), k[cols].astype(np.float64)) * scale
    return out


def window_scores(q, k, qpos, kpos, scale, group_reduce, moments):
    """q [B,Hq,w,D], k [B,Hkv,S,D], qpos [B,w], kpos [B,Hkv,S] -> {moment: array}."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, hq, _, _ = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    per_head = {m: np.zeros((b, hkv, g, s)) for m in moments}
    for bi in range(b):
        for h in range(hq):
            kv = h // g
            vis = _visible(np.asarray(qpos)[bi], np.asarray(kpos)[bi, kv])
            p = _softmax_rows(_logits(q[bi, h], k[bi, kv], scale, vis), vis)
            for m in moments:
                c = {"sum": p, "sumsq": p ** 2, "entropy": -p * np.log(p + EPS)}[m]
                per_head[m][bi, kv, h % g] = c.sum(axis=0)
    reduce = {None: lambda x: x, "mean": lambda x: x.mean(2), "sum": lambda x: x.sum(2), "max": lambda x: x.max(2)}
    return {m: reduce[group_reduce](v) for m, v in per_head.items()}


def column_mass(q, k, qpos, kpos, scale):
    """q [B,Hq,T,D] (qpos -1 = padding) -> [B,Hkv,S]: sum over queries and group of the softmax."""
    return window_scores(q, k, qpos, kpos, scale, "sum", ("sum",))["sum"]


def log_sum_exp(q, k, qpos, kpos, scale):
    """[B,Hq,T] log-sum-exp of each query's visible logits (0 when it sees none)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, hq, t, _ = q.shape
    g = hq // k.shape[1]
    out = np.zeros((b, hq, t))
    for bi in range(b):
        for h in range(hq):
            vis = _visible(np.asarray(qpos)[bi], np.asarray(kpos)[bi, h // g])
            lg = _logits(q[bi, h], k[bi, h // g], scale, vis)
            for i in range(t):
                if vis[i].any():
                    x = lg[i, vis[i]]
                    out[bi, h, i] = x.max() + np.log(np.exp(x - x.max()).sum())
    return out


def decode_attention(query, k, v, valid, scale):
    """query [B,Hq,D], k/v [B,Hkv,S,D], valid [B,Hkv,S] -> (out [B,Hq,D], probs [B,Hkv,G,S])."""
    query, k, v = (np.asarray(x, np.float64) for x in (query, k, v))
    valid = np.asarray(valid)
    b, hq, d = query.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b, hq, d))
    probs = np.zeros((b, hkv, g, s))
    for bi in range(b):
        for h in range(hq):
            kv = h // g
            vis = valid[bi, kv][None, :]
            p = _softmax_rows(_logits(query[bi, h][None], k[bi, kv], scale, vis), vis)[0]
            probs[bi, kv, h % g] = p
            cols = np.flatnonzero(p)
            out[bi, h] = p[cols] @ v[bi, kv, cols]
    return out, probs


# ----------------------------------------------------------------------------- input builders

def right_padded_positions(lengths, hkv: int, s: int) -> np.ndarray:
    """[B,Hkv,S] int32: slot j holds position j for j < len_b, else -1 (right padding)."""
    lengths = np.asarray(lengths)
    pos = np.arange(s)[None, None, :].repeat(len(lengths), 0).repeat(hkv, 1)
    return np.where(pos < lengths[:, None, None], pos, -1).astype(np.int32)


def window_positions(lengths, w: int) -> np.ndarray:
    """[B,w] positions of the last w real tokens of each row."""
    lengths = np.asarray(lengths)
    return (lengths[:, None] - w + np.arange(w)[None, :]).astype(np.int32)


def poison_keys(x: np.ndarray, kpos: np.ndarray) -> np.ndarray:
    """NaN in every slot that holds no token (kpos == -1), per (batch, KV head)."""
    x = np.array(x, copy=True)
    x[np.asarray(kpos) < 0] = np.nan
    return x


def poison_queries(x: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """NaN in every padding query (qpos == -1): x [B,Hq,T,D], qpos [B,T]."""
    x = np.array(x, copy=True)
    mask = np.asarray(qpos) < 0
    x[np.nonzero(mask)[0], :, np.nonzero(mask)[1]] = np.nan
    return x
