"""Fidelity of a compressed cache: next-token KL(full || compressed) and top-1 agreement.

Both take logits ``[T, V]`` (or ``[..., V]``) at the same positions: the full cache's and the
compressed cache's predictions of each continuation token. Computed in float64 with a stable
log-softmax; ``-inf`` logits (masked vocabulary entries) are allowed. Ties in the arg-max break
toward the lower token id on both sides.
"""

from __future__ import annotations

import numpy as np


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    if not np.all(np.isfinite(m)):
        raise ValueError("every row of logits needs at least one finite entry")
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def _check(full: np.ndarray, compressed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    full, compressed = np.asarray(full, np.float64), np.asarray(compressed, np.float64)
    if full.shape != compressed.shape or full.ndim < 1 or full.shape[-1] == 0:
        raise ValueError(f"full and compressed logits must have one shape [..., V], "
                         f"got {full.shape} and {compressed.shape}")
    if np.isnan(full).any() or np.isnan(compressed).any():
        raise ValueError("logits contain NaN")
    return full, compressed


def kl_per_position(full_logits: np.ndarray, compressed_logits: np.ndarray) -> np.ndarray:
    """KL(p_full || p_compressed) in nats at each position: ``[...]``; inf where p_full > 0 = p_compressed."""
    full, comp = _check(full_logits, compressed_logits)
    lp, lq = _log_softmax(full), _log_softmax(comp)
    p = np.exp(lp)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (lp - lq), 0.0)
    return np.sum(terms, axis=-1)


def kl_divergence(full_logits: np.ndarray, compressed_logits: np.ndarray) -> float:
    """Mean over positions of KL(p_full || p_compressed), in nats."""
    return float(np.mean(kl_per_position(full_logits, compressed_logits)))


def top1_agreement(full_logits: np.ndarray, compressed_logits: np.ndarray) -> float:
    """Fraction of positions where both caches predict the same most likely token."""
    full, comp = _check(full_logits, compressed_logits)
    return float(np.mean(np.argmax(full, axis=-1) == np.argmax(comp, axis=-1)))
