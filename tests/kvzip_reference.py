"""KVzip's reconstruction scores of one prompt from Hugging Face transformers (PyTorch): the reference that
kvjax.passes.reconstruction and the LookaheadKV teacher "kvzip" are tested against."""

import math

import numpy as np
import torch


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def hf_kvzip_scores(hf, ids, spec):
    """[L, Hkv, T] reference for one prompt: for each chunk, HF runs prompt + repeat pass in one causal
    forward (= prefill then pass); the pass's post-RoPE queries and the cached keys give the subsampled
    softmax, maxed over the group and the pass's queries."""
    cfg = hf.config
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    G, T, L = Hq // Hkv, len(ids), cfg.num_hidden_layers
    out = np.zeros((L, Hkv, T))
    chunks = [ids[s:s + spec.chunk_size] for s in range(0, T, spec.chunk_size)]
    for i, chunk in enumerate(chunks):
        start = i * spec.chunk_size
        instr = list(spec.first_ids) if i == 0 else list(spec.next_ids) + chunks[i - 1][-spec.postfix:]
        rep = instr + list(spec.suffix_ids) + chunk
        n = len(rep)
        seen = {}
        hooks = [layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, l=l, seen=seen: seen.__setitem__(l, (kw["hidden_states"], kw["position_embeddings"])),
            with_kwargs=True) for l, layer in enumerate(hf.model.layers)]
        with torch.no_grad():
            res = hf(torch.tensor([ids + rep]), use_cache=True)
        for h in hooks:
            h.remove()
        for l, layer in enumerate(hf.model.layers):
            attn = layer.self_attn
            hs, (cos, sin) = seen[l]
            with torch.no_grad():
                q = attn.q_proj(hs).view(1, -1, Hq, D).transpose(1, 2)
                if hasattr(attn, "q_norm"):
                    q = attn.q_norm(q)
                q = (q * cos[:, None] + _rotate_half(q) * sin[:, None])[0, :, T:].double().numpy()  # [Hq,n,D]
            pkv = res.past_key_values
            k = (pkv.layers[l].keys if hasattr(pkv, "layers") else pkv[l][0])[0].double().numpy()  # [Hkv,T+n,D]
            sink = min(spec.n_sink, start)
            cols = list(range(sink)) + list(range(start, start + len(chunk))) + list(range(T, T + n))
            for h in range(Hq):
                logits = q[h] @ k[h // G, cols].T / math.sqrt(D)  # [n, cols]
                causal = np.ones_like(logits, bool)
                causal[:, -n:] = np.tril(np.ones((n, n), bool))
                logits = np.where(causal, logits, -np.inf)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                best = p[:, sink:sink + len(chunk)].max(0)
                out[l, h // G, start:start + len(chunk)] = np.maximum(out[l, h // G, start:start + len(chunk)], best)
    return out
