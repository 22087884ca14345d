"""Independent NumPy references written from docs/policies.md (float64, loops, one row at a time).

Nothing here imports kvjax.policies. Positions equal slots at prefill (right padding), so a
reference works on the prompt of one (layer, row): q [Hq, T, D], k [Hkv, T, D].
"""

from __future__ import annotations

import math

import numpy as np

D = 8


# ----------------------------------------------------------------------------- budgets (§1.1, §6-8)


def n_kept(T: int, r: float, compat: str = "0.5.4") -> int:
    n = int(T * (1 - r))
    return max(1, n) if compat != "0.5.4" else n


def pyramid_paper(T, C, w, L, beta):
    if T < C:
        return [T] * L
    b0 = C - w
    if T < 2 * b0:
        return [b0 + w] * L
    mn = b0 // beta
    mx = 2 * b0 - mn
    if mx >= T - w:
        mx = T - w
        mn = 2 * b0 - mx
    step = (mx - mn) // (L - 1)
    return [mx - l * step + w for l in range(L)]


def pyramid_kvpress(T, r, w, L, beta):
    K = T * (1 - r)
    mn = K / beta
    mx = 2 * K - mn
    if mx >= T - w:
        mx = T - w
        mn = 2 * K - mx
    if not (T >= mx >= mn >= w):
        return [round(K)] * L
    return [round(mx - l * (mx - mn) / (L - 1)) for l in range(L)]


def cake_adjust(budgets, total, seq_len):
    """The integer fix-up of §8 step 2, transcribed as numpy."""
    b = np.array(budgets, dtype=int)
    excess = np.maximum(b - seq_len, 0)
    b = np.minimum(b, seq_len)
    tot = excess.sum()
    if tot > 0:
        ok = b < seq_len
        n = ok.sum()
        if n > 0:
            b[ok] += tot // n
            b[np.where(ok)[0][: tot % n]] += 1
    diff = total - b.sum()
    if diff != 0:
        ok = b < seq_len if diff > 0 else b > 1
        n = ok.sum()
        if n > 0:
            b[ok] += np.sign(diff) * (abs(diff) // n)
            b[np.where(ok)[0][: abs(diff) % n]] += np.sign(diff)
    return b.tolist()


# ----------------------------------------------------------------------------- attention (§1.7-1.9)


def window_attention(q, k, T, w, scale=None):
    """A° for one (layer, row): [Hq, w, T] softmax of the last w queries over keys <= their position
    (all T columns; the caller drops the window columns)."""
    scale = scale or 1 / math.sqrt(D)
    Hq, Hkv = q.shape[0], k.shape[0]
    G = Hq // Hkv
    out = np.zeros((Hq, w, T))
    for h in range(Hq):
        for i in range(w):
            p = T - w + i
            if p < 0:
                continue
            logits = np.array([q[h, p] @ k[h // G, j] * scale for j in range(p + 1)], dtype=np.float64)
            e = np.exp(logits - logits.max())
            out[h, i, : p + 1] = e / e.sum()
    return out


def pool(x, kernel, kind):
    """1-D 'same' pooling over the last axis: avg divides by kernel with zero padding, max pads -inf."""
    if kind == "none" or kernel == 1:
        return x.copy()
    n, r = x.shape[-1], kernel // 2
    out = np.zeros_like(x)
    for j in range(n):
        lo, hi = j - r, j + r + 1
        win = x[..., max(lo, 0) : min(hi, n)]
        out[..., j] = win.sum(-1) / kernel if kind == "avg" else win.max(-1)
    return out


def gqa(x, how, axis):
    return {"mean": np.mean, "max": np.max, "sum": np.sum}[how](x, axis=axis)


def snapkv_scores(q, k, T, w, kernel, pooling, window_reduce, gqa_reduce, gqa_order, Hkv):
    """[Hkv, T-w] SnapKV scores of the non-window keys (§5)."""
    A = window_attention(q, k, T, w)[:, :, : T - w]
    s = A.sum(1) if window_reduce == "sum" else A.mean(1)  # [Hq, T-w]
    s = s.reshape(Hkv, -1, T - w)
    if gqa_order == "before":
        return pool(gqa(s, gqa_reduce, 1), kernel, pooling)
    return gqa(pool(s, kernel, pooling), gqa_reduce, 1)


# ----------------------------------------------------------------------------- selection (§1.5-1.6)


def topk(scores: dict[int, float], n: int) -> set[int]:
    """The n best positions: higher score first, ties to the lower position."""
    order = sorted(scores, key=lambda p: (-scores[p], p))
    return set(order[: max(n, 0)])


def keep_with_protected(scores: dict[int, float], protected: list[int], count: int) -> set[int]:
    """Protected first (most recent first when the count is short), then the top by score."""
    prot = sorted(protected, reverse=True)
    if count <= len(prot):
        return set(prot[:count])
    return set(prot) | topk({p: s for p, s in scores.items() if p not in protected}, count - len(prot))


# ----------------------------------------------------------------------------- Ada-KV (§7)


def ada_pyram_base(T, C, w, L, beta):
    """Ada-KV pyram mode: B' of layer l = cap_l of §6 with B0 = C - w (the formula, no branches)."""
    b0 = C - w
    mn = b0 // beta
    mx = 2 * b0 - mn
    if mx >= T - w:
        mx = T - w
        mn = 2 * b0 - mx
    step = (mx - mn) // (L - 1)
    return [mx - l * step for l in range(L)]


def ada_paper(scores, T, w, bp, alpha, skip_layer=False):
    """scores [Hkv, T-w] of non-window keys -> per-head non-window caps (original rule)."""
    H = scores.shape[0]
    F = int(bp * alpha)
    if skip_layer:
        return [bp] * H
    flat = sorted(((-scores[h, j], j, h) for h in range(H) for j in range(T - w)))
    counts = [0] * H
    for _, _, h in flat[: H * bp]:
        counts[h] += 1
    return [int(round(c * (1 - alpha) + F)) for c in counts]


def ada_kvpress(full_scores, protected, n, alpha, compat="0.5.4"):
    """full_scores [Hkv, T] (protected positions ranked first), n = n_kept -> per-head counts."""
    H, T = full_scores.shape
    n_safe = int(n * alpha)
    if compat != "0.5.4" and n > 0:
        n_safe = max(1, n_safe)

    def key(h, j):
        return (0, -j, 0) if j in protected else (1, -full_scores[h, j], j)

    per_head = [sorted(range(T), key=lambda j: key(h, j)) for h in range(H)]
    safe = {(h, j) for h in range(H) for j in per_head[h][:n_safe]}
    rest = sorted(((key(h, j), h, j) for h in range(H) for j in range(T) if (h, j) not in safe))
    counts = [n_safe] * H
    for _, h, _ in rest[: H * (n - n_safe)]:
        counts[h] += 1
    return counts


# ----------------------------------------------------------------------------- CAKE (§8)


def cake_layer_stats(q, k, T, w, gamma, Hkv):
    """(entropy H, variance V, indicator [Hkv, T-w]) for one (layer, row)."""
    A = window_attention(q, k, T, w)[:, :, : T - w]  # [Hq, w, T-w]
    H = float(-(A * np.log(A + 1e-10)).sum())
    var = A.var(axis=1, ddof=1)
    V = float(var.sum())
    ind = A.mean(1) + gamma * var  # [Hq, T-w]
    ind = pool(ind, 5, "avg").reshape(Hkv, -1, T - w).mean(1)
    return H, V, ind


# ----------------------------------------------------------------------------- Random baseline


@np.errstate(over="ignore")
def lowbias32(x):
    x = np.asarray(x, dtype=np.uint32)
    x = x ^ (x >> np.uint32(16))
    x = (x * np.uint32(0x7FEB352D)).astype(np.uint32)
    x = x ^ (x >> np.uint32(15))
    x = (x * np.uint32(0x846CA68B)).astype(np.uint32)
    return x ^ (x >> np.uint32(16))


def random_score(seed, layer, head, pos):
    h = lowbias32(np.uint32(seed) ^ lowbias32(np.uint32(layer) ^ lowbias32(np.uint32(head) ^ lowbias32(pos))))
    return (h >> np.uint32(8)).astype(np.float64) * 2.0**-24


# ----------------------------------------------------------------------------- LazyEviction (§10)


def lazy_priority(t, ts, mri):
    sig = lambda x: 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))  # noqa: E731
    h1 = 2 * sig(-(1 + (t - ts) / (mri + 1e-5)))
    h2 = 0.0 if mri == 0 else 2 * sig(-(mri - 1))
    return h1 + h2
