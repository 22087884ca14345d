"""Output norms (CriticalKV, DefensiveKV): per key of a prefill, ||v_j W_o^h||_1, the L1 norm of its
value projected by its query head's rows of the output projection, averaged over the query group.

`ObservationSpec(output_norms_l2=True)` records the L2 norm, from the D x D Gram matrix of W_o^h:
||v W_o^h||_2 = sqrt(v (W_o^h W_o^h^T) v^T), D^2 multiply-adds per key and query head against the L1 norm's
D x E (E the model width; for SmolLM2-135M 64 x 64 against 64 x 576, a ninth).
`ObservationSpec(output_norms_rms=True)` records the root mean square of the group's L2 norms,
sqrt(mean_h ||v W_o^h||_2^2) = sqrt(v (mean_h W_o^h W_o^h^T) v^T): one summed Gram matrix per KV head, D^2
multiply-adds per key and KV head (a G-th of the L2 group mean's cost, G query heads per KV head).

Fields: output_norms, output_norms_l2, output_norms_rms [L,B,Hkv,C] float32 (0 on padding and past the prompt);
prefills only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.observations.base import LayerView, Observation
from kvjax.observations.column_mass import pad_slots

BLOCK = 128  # keys per block ([B,Hq,block,E] at once)


ORDS = (1, 2, "rms")


def output_norms(v: jax.Array, wo: jax.Array, real: jax.Array, ord: int = 1) -> jax.Array:
    """The group mean of ||v_j W_o^h||_ord per key, float32 [B,Hkv,n] (ord "rms": the group's root mean
    square of ||v_j W_o^h||_2). v [B,Hkv,n,D]; wo [Hq*D,E] (rows of query head h at h*D:(h+1)*D); real [B,n]
    bool (padding keys get 0). ord 1: keys go through in blocks, so [B,Hq,block,E] is the largest
    intermediate; ord 2: through the Gram matrices [Hkv,G,D,D]; "rms": their group mean [Hkv,D,D]."""
    B, Hkv, n, D = v.shape
    E = wo.shape[-1]
    G = wo.shape[0] // (Hkv * D)
    w = wo.reshape(Hkv, G, D, E)
    if ord == "rms":
        w32 = w.astype(jnp.float32)
        gram = jnp.einsum("hgde,hgfe->hdf", w32, w32) / G
        v32 = v.astype(jnp.float32)
        sq = jnp.sum(jnp.einsum("bhnd,hdf->bhnf", v32, gram) * v32, axis=-1)
        return jnp.where(real[:, None, :], jnp.sqrt(jnp.maximum(sq, 0.0)), 0.0)
    if ord == 2:
        w32 = w.astype(jnp.float32)
        gram = jnp.einsum("hgde,hgfe->hgdf", w32, w32)
        v32 = v.astype(jnp.float32)
        vg = jnp.einsum("bhnd,hgdf->bhgnf", v32, gram)  # two steps: a 3-operand einsum may not pair them so
        sq = jnp.sum(vg * v32[:, :, None], axis=-1)
        return jnp.where(real[:, None, :], jnp.sqrt(jnp.maximum(sq, 0.0)).mean(2), 0.0)
    if ord != 1:
        raise ValueError(f"output_norms: ord must be one of {ORDS}, got {ord!r}")
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
    ord = 1

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        if not view.call.fresh:
            return {}
        norms = output_norms(view.v, view.wo, view.call.positions >= 0, self.ord)
        return {self.fields[0]: pad_slots(norms, view.call)}


@dataclasses.dataclass(frozen=True)
class OutputNormsL2(OutputNorms):
    """The L2 norms (CriticalKV(value_norm=2)), through the Gram matrices: a ninth of the L1 norms' cost on
    SmolLM2's shape."""

    keyword = "output_norms_l2"
    fields = ("output_norms_l2",)
    ord = 2


@dataclasses.dataclass(frozen=True)
class OutputNormsRMS(OutputNorms):
    """The group's root mean square of the L2 norms (CriticalKV(value_norm=2, group_norm="rms")): one summed
    Gram matrix per KV head, a G-th of the L2 group mean's cost."""

    keyword = "output_norms_rms"
    fields = ("output_norms_rms",)
    ord = "rms"
