"""Output norms (CriticalKV, DefensiveKV): per key of a prefill, ||v_j W_o^h||_1, the L1 norm of its
value projected by its query head's rows of the output projection, averaged over the query group.

Field: output_norms [L,B,Hkv,C] float32 (0 on padding and past the prompt); prefills only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.observations.base import LayerView, Observation
from kvjax.observations.column_mass import pad_slots

BLOCK = 128  # keys per block ([B,Hq,block,E] at once)


def output_norms(v: jax.Array, wo: jax.Array, real: jax.Array) -> jax.Array:
    """The group mean of ||v_j W_o^h||_1 per key, float32 [B,Hkv,n]. v [B,Hkv,n,D]; wo [Hq*D,E] (rows of
    query head h at h*D:(h+1)*D); real [B,n] bool (padding keys get 0). Keys go through in blocks, so
    [B,Hq,block,E] is the largest intermediate."""
    B, Hkv, n, D = v.shape
    E = wo.shape[-1]
    G = wo.shape[0] // (Hkv * D)
    w = wo.reshape(Hkv, G, D, E)
    block = min(n, BLOCK)
    nb = -(-n // block)
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, nb * block - n), (0, 0))).reshape(B, Hkv, nb, block, D)

    def one(vb):  # [B,Hkv,block,D] -> [B,Hkv,block]
        proj = jnp.einsum("bhcd,hgde->bhgce", vb, w.astype(vb.dtype), preferred_element_type=jnp.float32)
        return jnp.abs(proj).sum(-1).mean(2)

    out = jax.lax.map(one, vp.transpose(2, 0, 1, 3, 4))  # [nb,B,Hkv,block]
    out = out.transpose(1, 2, 0, 3).reshape(B, Hkv, nb * block)[:, :, :n]
    return jnp.where(real[:, None, :], out, 0.0)


@dataclasses.dataclass(frozen=True)
class OutputNorms(Observation):
    keyword = "output_norms"
    fields = ("output_norms",)

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        if not view.call.fresh:
            return {}
        return {"output_norms": pad_slots(output_norms(view.v, view.wo, view.call.positions >= 0), view.call)}
