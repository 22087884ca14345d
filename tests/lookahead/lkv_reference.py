"""A plain NumPy (float64) forward of a Llama-family model with LookaheadKV's row-masked LoRA,
written from policies.md §11 and the HF Llama equations (test reference; one row at a time)."""

from __future__ import annotations

import numpy as np

PROJ = ("q", "k", "v", "o", "gate", "up", "down")


def to_numpy(tree):
    import jax

    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def rope(x, pos, theta):
    """HF half-split rotation, default RoPE. x [H,S,D], pos [S]."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def forward(P, cfg, embeds, lora_rows=None, lora=None, scale=0.0, pos=None):
    """embeds [S,E] at positions `pos` [S] (increasing; None: 0..S-1), causal. lora: {proj: {"a": [L,in,r], "b": [L,r,out]}} applied
    (times `scale`) on the rows where lora_rows [S] is True. Returns logits [S,V], probs per layer
    [L,Hq,S,S], keys and values per layer [L,Hkv,S,D] (keys post-RoPE)."""
    S = embeds.shape[0]
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = Hq // Hkv
    lay = P["layers"]
    rows = np.zeros(S, bool) if lora_rows is None else np.asarray(lora_rows, bool)
    pos = np.arange(S, dtype=np.float64) if pos is None else np.asarray(pos, np.float64)
    h = np.asarray(embeds, np.float64)
    all_probs, all_k, all_v = [], [], []
    for l in range(cfg.num_layers):
        def lin(x, name, l=l):
            y = x @ lay[name][l]
            if lora is not None and name in lora:
                y = y + rows[:, None] * scale * ((x @ lora[name]["a"][l]) @ lora[name]["b"][l])
            return y

        x = rms(h, lay["input_norm"][l], cfg.rms_norm_eps)
        q = rope(lin(x, "q").reshape(S, Hq, D).transpose(1, 0, 2), pos, cfg.rope_theta)
        k = rope(lin(x, "k").reshape(S, Hkv, D).transpose(1, 0, 2), pos, cfg.rope_theta)
        v = lin(x, "v").reshape(S, Hkv, D).transpose(1, 0, 2)
        probs = np.zeros((Hq, S, S))
        out = np.zeros((Hq, S, D))
        for hd in range(Hq):
            logits = q[hd] @ k[hd // G].T / np.sqrt(D)
            logits = np.where(np.tril(np.ones((S, S), bool)), logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            probs[hd] = p
            out[hd] = p @ v[hd // G]
        attn = out.transpose(1, 0, 2).reshape(S, Hq * D)
        h = h + lin(attn, "o")
        x = rms(h, lay["post_norm"][l], cfg.rms_norm_eps)
        g = lin(x, "gate")
        act = g / (1 + np.exp(-g)) * lin(x, "up")
        h = h + lin(act, "down")
        all_probs.append(probs), all_k.append(k), all_v.append(v)
    head = P["embed"].T if cfg.tie_embeddings else P["lm_head"]
    logits = rms(h, P["final_norm"], cfg.rms_norm_eps) @ head
    return logits, np.stack(all_probs), np.stack(all_k), np.stack(all_v)


def predicted(P, cfg, prompt, A, config):
    """s̃ [L,Hq,T] of one row: [X; P] in one pass, LoRA on the P rows, the P rows' attention on X
    averaged over the n lookahead queries (the softmax includes the causal lookahead keys). P sits at
    T .. T+n-1, or with config.span = S at T + floor(i * S / n) for token i."""
    T, n = len(prompt), config.n_tokens
    embeds = np.concatenate([P["embed"][np.asarray(prompt)], A["embeddings"]], 0)
    rows = np.arange(T + n) >= T
    after = np.arange(n) if config.span is None else np.floor(np.arange(n) * config.span / n)
    pos = np.concatenate([np.arange(T), T + after])
    _, probs, _, _ = forward(P, cfg, embeds, rows, A["lora"], config.alpha / config.rank, pos=pos)
    return probs[:, :, T:, :T].mean(axis=2)


def response(P, cfg, prompt, resp):
    """s_GT [L,Hq,T] of one row: full causal attention over [X; Y], mean over Y rows of X columns."""
    T = len(prompt)
    embeds = P["embed"][np.asarray(list(prompt) + list(resp))]
    _, probs, _, _ = forward(P, cfg, embeds)
    return probs[:, :, T:, :T].mean(axis=2)


def window(P, cfg, prompt, w):
    """[L,Hq,T] of one row: the prompt's own last w queries' attention on it (causal, over the prompt alone),
    mean over the w queries (SnapKV's observation window)."""
    T = len(prompt)
    _, probs, _, _ = forward(P, cfg, P["embed"][np.asarray(prompt)])
    return probs[:, :, T - w:, :].mean(axis=2)


def pool_max(x, region_len, kernel, offset=0):
    """Max pooling along the last axis over positions < region_len (-inf padding), 0 elsewhere; position j
    takes the max over j - kernel//2 - offset .. j + kernel//2 - offset."""
    out = np.zeros_like(x)
    r = kernel // 2
    for j in range(region_len):
        lo, hi = max(0, j - r - offset), min(region_len, j + r - offset + 1)
        out[..., j] = x[..., lo:hi].max(-1)
    return out


def bridge(x, region_len, reach):
    """Valleys filled along the last axis over positions < region_len: x_j -> max(x_j, min(max of the reach+1
    positions ending at j, max of those starting at j)), each side clipped to the region."""
    out = x.copy()
    for j in range(region_len):
        left = x[..., max(0, j - reach):j + 1].max(-1)
        right = x[..., j:min(region_len, j + reach + 1)].max(-1)
        out[..., j] = np.maximum(x[..., j], np.minimum(left, right))
    return out


def scores(s_tilde, cfg, config, T, win=None):
    """The policy's per-(layer, KV head) scores [L,Hkv,T] from s̃ [L,Hq,T] (plus window_weight x `win` [L,Hq,T],
    the window's attention, when config.window): GQA reduce, bridging, pooling, tail."""
    L, Hq, _ = s_tilde.shape
    if config.window:
        s_tilde = s_tilde + config.window_weight * win
    g = s_tilde.reshape(L, cfg.num_kv_heads, Hq // cfg.num_kv_heads, T)
    red = g.mean(2) if config.gqa_reduce == "mean" else g.max(2)
    region = T - max(config.protect_last, config.window)
    raw = red
    if config.bridge:
        red = bridge(red, region, config.bridge)
    out = np.where(np.arange(T) < region, red, 0.0) if config.pooling is None else \
        pool_max(red, region, config.kernel, config.pool_offset)
    for j in range(1, region):  # the tail: tail_weight x the highest raw score of the `tail` slots before
        if config.tail:
            out[..., j] = np.maximum(out[..., j], config.tail_weight * raw[..., max(0, j - config.tail):j].max(-1))
    return out


def topk(target, pred, fraction):
    """-log of pred's mass (normalised over T) on target's top ceil(fraction*T) entries (ties with the k-th
    included), per [..., T]; mass clamped at 1e-10."""
    T = target.shape[-1]
    k = max(1, int(np.ceil(fraction * T)))
    kth = np.sort(target, -1)[..., T - k][..., None]
    p = pred / pred.sum(-1, keepdims=True)
    return -np.log(np.maximum(np.where(target >= kth, p, 0.0).sum(-1), 1e-10))


def kl(target, pred):
    """KL(t̂ || p̂) per [..., T] with p clamped at 1e-10 in the log; both normalised over T."""
    t = target / target.sum(-1, keepdims=True)
    p = pred / pred.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(t > 0, t * (np.log(np.where(t > 0, t, 1)) - np.log(np.maximum(p, 1e-10))), 0.0)
    return terms.sum(-1)
