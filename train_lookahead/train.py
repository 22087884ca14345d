"""The sharded train step and the resumable loop (jax_conventions.md §6, policies.md §11.4).

Only the trainable pytree (the lookahead embeddings and LoRA factors) is differentiated and held
in the optimizer; the frozen model params are a sharded argument that is never updated. The
state ({"trainable", "opt_state", "step"}) is replicated, the batch is split over the "data" mesh
axis, the frozen weights follow kvjax.sharding's logical rules over "model".

Every `checkpoint_every` steps the state and the grain iterator's position are saved together
(orbax); a run killed at any moment and re-run restores both and goes on with the next batch, so
its steps and data are exactly those of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from kvjax.checkpoint import StateAndJsonCheckpointer

from train_lookahead.config import OptimSection

LossFn = Callable[[Any, Any, dict[str, jax.Array]], jax.Array]
LOG = "log.jsonl"


def make_optimizer(optim: OptimSection, steps: int) -> optax.GradientTransformation:
    """Global-norm clip, then AdamW on a linear-warmup cosine schedule over `steps`."""
    schedule = _learning_rate(optim, steps)
    return optax.chain(optax.clip_by_global_norm(optim.clip_norm),
                       optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay))


BATCH_KEYS = ("tokens", "positions", "target", "response", "response_positions")


def batch_shardings(mesh: Mesh, keys: tuple[str, ...] = ("tokens", "positions", "target")) -> dict[str, NamedSharding]:
    """Rows over the "data" axis: tokens / positions [B, T], response / response_positions [B, Y],
    target [L, B, Hq, T]."""
    unknown = set(keys) - set(BATCH_KEYS)
    if unknown:
        raise ValueError(f"unknown batch key(s) {sorted(unknown)}; accepted: {BATCH_KEYS}")
    return {k: NamedSharding(mesh, P(None, "data", None, None) if k == "target" else P("data", None)) for k in keys}


_STEPS: dict[tuple, Callable] = {}  # jitted steps by (loss, optim, steps, mesh, keys, frozen shardings)


def cached_step(loss: LossFn, optim: OptimSection, steps: int, mesh: Mesh, frozen_shardings: Any,
                keys: tuple[str, ...]) -> Callable:
    """`build_step` for these settings, built once per process: a resumed or repeated run in the same
    process (tests, notebooks) reuses the compiled step."""
    leaves, treedef = jax.tree.flatten(frozen_shardings)
    key = (loss, optim, steps, mesh, keys, treedef, tuple(leaves))
    if key not in _STEPS:
        _STEPS[key] = build_step(loss, make_optimizer(optim, steps), mesh, frozen_shardings, keys)
    return _STEPS[key]


def build_step(loss: LossFn, tx: optax.GradientTransformation, mesh: Mesh, frozen_shardings: Any,
               keys: tuple[str, ...] = ("tokens", "positions", "target")) -> Callable:
    """The jitted step (state, frozen, batch) -> (state, {"loss", "grad_norm"}); the state is donated."""

    def step(state, frozen, batch):
        value, grads = jax.value_and_grad(loss)(state["trainable"], frozen, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["trainable"])
        new = {"trainable": optax.apply_updates(state["trainable"], updates), "opt_state": opt_state,
               "step": state["step"] + 1}
        return new, {"loss": value, "grad_norm": optax.tree.norm(grads)}

    replicated = NamedSharding(mesh, P())
    return jax.jit(step, in_shardings=(replicated, frozen_shardings, batch_shardings(mesh, keys)),
                   out_shardings=(replicated, replicated), donate_argnums=0)


def init_state(trainable: Any, tx: optax.GradientTransformation) -> dict[str, Any]:
    trainable = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), trainable)
    return {"trainable": trainable, "opt_state": tx.init(trainable), "step": jnp.int32(0)}


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over "data" (one process: the batch as is)."""
    shardings = batch_shardings(mesh, tuple(batch))
    rows = batch["tokens"].shape[0] * jax.process_count()
    if rows % mesh.shape["data"]:
        raise ValueError(f"train.batch_size={rows} must be divisible by the mesh's data axis ({mesh.shape['data']}); "
                         "set mesh.data or train.batch_size")
    return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v)) for k, v in batch.items()}


def train(loss: LossFn, trainable: Any, frozen: Any, frozen_shardings: Any, data: grain.IterDataset, *,
          steps: int, optim: OptimSection, mesh: Mesh, workdir: str | os.PathLike, checkpoint_every: int = 50,
          log_every: int = 10, on_step: Callable[[int, dict[str, float]], None] | None = None,
          progress: bool = True) -> tuple[Any, int]:
    """Trains `trainable` for `steps` steps over `data` batches, resuming from `workdir/checkpoints`.

    loss(trainable, frozen, batch) -> scalar float32. Logs {step, loss, grad_norm, lr, seconds} to
    `workdir/log.jsonl` every `log_every` steps (rows past the restored step are dropped first).
    on_step(step, metrics) is called after each step. Returns the trained params and the step reached.
    """
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tx = make_optimizer(optim, steps)
    replicated = NamedSharding(mesh, P())
    state = jax.device_put(init_state(trainable, tx), replicated)
    iterator = iter(data)
    ckpt = StateAndJsonCheckpointer(workdir / "checkpoints", every=checkpoint_every)
    if ckpt.latest_step() is not None:
        state, saved = ckpt.restore(state)
        iterator.set_state(saved["data"])
    start = int(state["step"])
    _drop_log_rows_after(workdir / LOG, start)
    step_fn = None
    frozen = jax.device_put(frozen, frozen_shardings)
    schedule = _learning_rate(optim, steps)
    t0 = time.time()
    try:
        with open(workdir / LOG, "a") as log, tqdm(total=steps, initial=start, desc="train",
                                                   disable=not progress) as bar:
            for step in range(start, steps):
                batch = put_batch(next(iterator), mesh)
                if step_fn is None:
                    step_fn = cached_step(loss, optim, steps, mesh, frozen_shardings, tuple(batch))
                state, metrics = step_fn(state, frozen, batch)
                done = step + 1
                ckpt.save(done, state, {"data": iterator.get_state()}, force=done == steps)
                row = None
                if on_step is not None or done % log_every == 0 or done == steps:
                    row = {"step": done, **{k: float(v) for k, v in metrics.items()},
                           "lr": float(schedule(step)), "seconds": round(time.time() - t0, 2)}
                if (done % log_every == 0 or done == steps) and jax.process_index() == 0:
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{row['loss']:.4f}")
                bar.update(1)
                if on_step is not None:
                    on_step(done, row)
    finally:
        ckpt.close()
    return jax.device_get(state["trainable"]), int(state["step"])


def _learning_rate(optim: OptimSection, steps: int) -> optax.Schedule:
    """Linear warmup over `warmup_fraction` of the steps (none for a 1-step run), then cosine decay."""
    warmup = min(int(round(steps * optim.warmup_fraction)), steps - 1)
    return optax.warmup_cosine_decay_schedule(0.0 if warmup else optim.learning_rate, optim.learning_rate, warmup,
                                              max(steps, 1), end_value=optim.learning_rate * optim.final_fraction)


def read_log(workdir: str | os.PathLike) -> list[dict[str, float]]:
    path = pathlib.Path(workdir) / LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _drop_log_rows_after(path: pathlib.Path, step: int) -> None:
    """Forgets rows an interrupted run logged past its last checkpoint (the resumed run logs them again)."""
    if jax.process_index() != 0 or not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        path.write_text("".join(kept))
