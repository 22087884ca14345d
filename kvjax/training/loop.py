"""A generic training loop: `loss_fn(trainable, frozen, batch)`, optax, Orbax checkpoints, resume.

Only `trainable` is differentiated and held in the optimizer; `frozen` (e.g. a base model under
LookaheadKV) is passed through untouched. Batches are a pure function of the step index, so a
resumed run sees exactly the data an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from tqdm.auto import tqdm

from kvjax.checkpoint import Checkpointer

LossFn = Callable[[Any, Any, Any], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay, global-norm clipping."""

    steps: int
    learning_rate: float = 3e-4
    warmup_fraction: float = 0.03
    final_fraction: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    clip_norm: float = 1.0

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction={self.warmup_fraction} must be in [0, 1)")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    warmup = max(1, int(cfg.steps * cfg.warmup_fraction))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, warmup, cfg.steps,
                                                  end_value=cfg.learning_rate * cfg.final_fraction)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def train(
    loss_fn: LossFn,
    trainable: Any,
    frozen: Any,
    batches: Callable[[int], Any],
    optim: OptimConfig,
    workdir: str | os.PathLike,
    *,
    checkpoint_every: int = 100,
    log_every: int = 10,
    on_log: Callable[[int, dict[str, float]], None] | None = None,
    max_seconds: float | None = None,
) -> tuple[Any, int]:
    """Trains until `optim.steps` (or `max_seconds`), resuming from `workdir/checkpoints` if present.

    batches(step) -> a pytree of arrays for that step. Appends metrics to `workdir/log.jsonl`.
    Returns the trainable params and the number of steps done.
    """
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tx = make_optimizer(optim)
    state = {"trainable": trainable, "opt_state": tx.init(trainable), "step": jnp.int32(0)}
    ckpt = Checkpointer(workdir / "checkpoints", every=checkpoint_every)
    if ckpt.latest_step() is not None:
        state = ckpt.restore(state)
    start = int(state["step"])
    _drop_log_rows_after(workdir / "log.jsonl", start)

    @jax.jit
    def step_fn(state, frozen, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"], frozen, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["trainable"])
        new = {"trainable": optax.apply_updates(state["trainable"], updates), "opt_state": opt_state,
               "step": state["step"] + 1}
        return new, {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}

    t0 = time.time()
    step = start
    with open(workdir / "log.jsonl", "a") as log, tqdm(total=optim.steps, initial=start, desc="train") as bar:
        for step in range(start, optim.steps):
            state, metrics = step_fn(state, frozen, batches(step))
            done = step + 1
            if done % log_every == 0 or done == optim.steps:
                row = {k: float(v) for k, v in metrics.items()}
                row.update(step=done, seconds=round(time.time() - t0, 1))
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{row['loss']:.4f}")
                if on_log:
                    on_log(done, row)
            ckpt.save(done, state)
            bar.update(1)
            if max_seconds is not None and time.time() - t0 > max_seconds:
                break
    ckpt.wait()
    if ckpt.latest_step() != int(state["step"]):
        ckpt.save(int(state["step"]), state, force=True)
    ckpt.close()
    return state["trainable"], int(state["step"])


def _drop_log_rows_after(path: pathlib.Path, step: int) -> None:
    """Forgets the metrics an interrupted run logged past its last checkpoint: the resumed run
    logs those steps again, and the loss curve must hold each step once."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        path.write_text("".join(kept))
