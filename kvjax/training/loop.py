"""The one training loop of kvjax: optax, a sharded jitted step, Orbax checkpoints, exact resume.

`loss(trainable, frozen, batch)` returns a float32 scalar, or (scalar, {name: scalar metric}).
Only `trainable` is differentiated and held in the optimizer; `frozen` (a base model under
LookaheadKV, or None) is a sharded argument that is never updated. The state
({"trainable", "opt_state", "step"}) is replicated over the mesh, each batch is split over the
"data" mesh axis, and the frozen pytree takes the shardings it is given (replicated by default).

Entry points: `kvjax.training.bundled` (the bundled model, on one device) and `train_lookahead`
(LookaheadKV on a ("data", "model") mesh, grain input). Both resume a killed run from its last
checkpoint with the data it would have seen: batches are either a pure function of the step, or
come from an iterator whose position (`get_state()`) is saved with every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from kvjax.checkpoint import Checkpointer, StateAndJsonCheckpointer
from kvjax.sharding import make_mesh

# loss(trainable, frozen, batch) -> scalar, or (scalar, {name: scalar metric})
LossFn = Callable[[Any, Any, dict[str, jax.Array]], Any]
Batch = dict[str, np.ndarray]
LOG = "log.jsonl"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW on a linear-warmup cosine schedule, after global-norm clipping (`make_optimizer`).

    These defaults are the bundled model's; `train_lookahead.config.OptimSection` is this class with
    LookaheadKV's (policies.md §11.4). The number of steps is the run's, not the optimizer's.
    """

    learning_rate: float = 3e-4
    warmup_fraction: float = 0.03  # of the steps: linear warmup from 0 (none when it rounds to 0 steps)
    final_fraction: float = 0.1  # end of the cosine, as a fraction of learning_rate
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    clip_norm: float = 1.0

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"optim.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"optim.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if not 0 <= self.final_fraction <= 1:
            raise ValueError(f"optim.final_fraction must be in [0, 1], got {self.final_fraction}")
        if not self.clip_norm > 0:
            raise ValueError(f"optim.clip_norm must be > 0, got {self.clip_norm}")


def warmup_steps(optim: OptimConfig, steps: int) -> int:
    """`warmup_fraction` of `steps`, rounded, and below `steps` (a 1-step run has no warmup)."""
    return min(int(round(steps * optim.warmup_fraction)), steps - 1)


def learning_rate(optim: OptimConfig, steps: int) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `final_fraction` x the rate at `steps`."""
    warmup = warmup_steps(optim, steps)
    return optax.warmup_cosine_decay_schedule(0.0 if warmup else optim.learning_rate, optim.learning_rate, warmup,
                                              max(steps, 1), end_value=optim.learning_rate * optim.final_fraction)


def make_optimizer(optim: OptimConfig, steps: int) -> optax.GradientTransformation:
    """Global-norm clip, then AdamW on `learning_rate(optim, steps)`."""
    return optax.chain(optax.clip_by_global_norm(optim.clip_norm),
                       optax.adamw(learning_rate(optim, steps), b1=optim.b1, b2=optim.b2,
                                   weight_decay=optim.weight_decay))


def single_device_mesh() -> Mesh:
    """The trivial ("data", "model") mesh of the first device: the loop on one device."""
    return make_mesh(1, 1, devices=jax.devices()[:1])


def batch_shardings(mesh: Mesh, keys: tuple[str, ...], row_axes: Mapping[str, int] | None = None
                    ) -> dict[str, NamedSharding]:
    """Each batch array's rows over the "data" mesh axis: axis `row_axes[key]` (default 0), the rest replicated."""
    axes = dict(row_axes or {})
    return {k: NamedSharding(mesh, P(*([None] * axes.get(k, 0)), "data")) for k in keys}


def put_batch(batch: Batch, mesh: Mesh, row_axes: Mapping[str, int] | None = None) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over "data" (one process: the batch as is)."""
    shardings = batch_shardings(mesh, tuple(batch), row_axes)
    axes = dict(row_axes or {})
    for k, v in batch.items():
        rows = np.shape(v)[axes.get(k, 0)] * jax.process_count()
        if rows % mesh.shape["data"]:
            raise ValueError(f"batch[{k!r}] has {rows} rows in all, not divisible by the mesh's data axis "
                             f"({mesh.shape['data']}): change the batch size or the mesh")
    return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v)) for k, v in batch.items()}


def init_state(trainable: Any, tx: optax.GradientTransformation) -> dict[str, Any]:
    """{"trainable" (float32), "opt_state", "step": 0}: the state the loop checkpoints. The trainable
    arrays are copies: the step donates the state, and the caller's arrays must outlive it."""
    trainable = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), trainable)
    return {"trainable": trainable, "opt_state": tx.init(trainable), "step": jnp.int32(0)}


def build_step(loss: LossFn, tx: optax.GradientTransformation, mesh: Mesh, frozen_shardings: Any,
               keys: tuple[str, ...], row_axes: Mapping[str, int] | None = None) -> Callable:
    """The jitted step (state, frozen, batch) -> (state, {"loss", "grad_norm", and the loss's metrics});
    the state is donated."""

    def with_metrics(trainable, frozen, batch):
        out = loss(trainable, frozen, batch)
        return out if isinstance(out, tuple) else (out, {})

    def step(state, frozen, batch):
        (value, metrics), grads = jax.value_and_grad(with_metrics, has_aux=True)(state["trainable"], frozen, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["trainable"])
        new = {"trainable": optax.apply_updates(state["trainable"], updates), "opt_state": opt_state,
               "step": state["step"] + 1}
        return new, {"loss": value, "grad_norm": optax.tree.norm(grads), **metrics}

    replicated = NamedSharding(mesh, P())
    return jax.jit(step, in_shardings=(replicated, frozen_shardings, batch_shardings(mesh, keys, row_axes)),
                   out_shardings=(replicated, replicated), donate_argnums=0)


_STEPS: dict[tuple, Callable] = {}  # jitted steps by (loss, optim, steps, mesh, keys, row axes, frozen shardings)


def cached_step(loss: LossFn, optim: OptimConfig, steps: int, mesh: Mesh, frozen_shardings: Any,
                keys: tuple[str, ...], row_axes: Mapping[str, int] | None = None) -> Callable:
    """`build_step` for these settings, built once per process: a resumed or repeated run in the same
    process (tests, notebooks) reuses the compiled step."""
    leaves, treedef = jax.tree.flatten(frozen_shardings)
    key = (loss, optim, steps, mesh, keys, tuple(sorted((row_axes or {}).items())), treedef, tuple(leaves))
    if key not in _STEPS:
        _STEPS[key] = build_step(loss, make_optimizer(optim, steps), mesh, frozen_shardings, keys, row_axes)
    return _STEPS[key]


def train(loss: LossFn, trainable: Any, frozen: Any, data: Callable[[int], Batch] | Iterable[Batch], *, steps: int,
          optim: OptimConfig, workdir: str | os.PathLike, mesh: Mesh | None = None, frozen_shardings: Any = None,
          row_axes: Mapping[str, int] | None = None, checkpoint_every: int = 50, log_every: int = 10,
          on_step: Callable[[int, dict[str, float] | None], None] | None = None, max_seconds: float | None = None,
          progress: bool = True) -> tuple[Any, int]:
    """Trains `trainable` to `steps` steps, resuming from `workdir/checkpoints`; returns (params, step reached).

    data: `batches(step) -> batch` (a pure function of the step: checkpoints hold the state alone), or
      an iterable whose iterator has `get_state` / `set_state`, such as a grain dataset (checkpoints
      hold its position too, as JSON). A batch is {name: array}, this process's rows on axis
      `row_axes.get(name, 0)`.
    mesh: a ("data", "model") mesh (default: the first device alone). frozen_shardings: the
      shardings of `frozen` (default: replicated).
    Every `checkpoint_every` steps, and at the end, the state is saved. Every `log_every` steps
    {step, loss, grad_norm, the loss's metrics, lr, seconds} is appended to `workdir/log.jsonl`
    (rows past the restored step are dropped first, so each step is logged once).
    on_step(step, row) runs after each step (row is None between log steps when on_step is None).
    max_seconds: stop (with a checkpoint) once a step ends after this long; re-run to go on.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = single_device_mesh() if mesh is None else mesh
    replicated = NamedSharding(mesh, P())
    if frozen_shardings is None:
        frozen_shardings = jax.tree.map(lambda _: replicated, frozen)
    tx = make_optimizer(optim, steps)
    state = jax.device_put(init_state(trainable, tx), replicated)
    iterator = None
    if callable(data) and not hasattr(data, "__iter__"):
        ckpt = Checkpointer(workdir / "checkpoints", every=checkpoint_every)
    else:
        iterator = iter(data)
        if not (hasattr(iterator, "get_state") and hasattr(iterator, "set_state")):
            raise TypeError(f"data must be a function of the step or an iterable whose iterator has get_state / "
                            f"set_state (a grain dataset); got {type(data).__name__}")
        ckpt = StateAndJsonCheckpointer(workdir / "checkpoints", every=checkpoint_every)

    def save(done: int, state: dict[str, Any], force: bool = False) -> None:
        if iterator is None:
            ckpt.save(done, state, force=force)
        else:
            ckpt.save(done, state, {"data": iterator.get_state()}, force=force)

    if ckpt.latest_step() is not None:
        if iterator is None:
            state = ckpt.restore(state)
        else:
            state, saved = ckpt.restore(state)
            iterator.set_state(saved["data"])
    start = int(state["step"])
    _drop_log_rows_after(workdir / LOG, start)
    frozen = jax.device_put(frozen, frozen_shardings)
    schedule = learning_rate(optim, steps)
    step_fn = None
    t0 = time.time()
    try:
        with open(workdir / LOG, "a") as log, tqdm(total=steps, initial=start, desc="train",
                                                   disable=not progress) as bar:
            for step in range(start, steps):
                batch = put_batch(data(step) if iterator is None else next(iterator), mesh, row_axes)
                if step_fn is None:
                    step_fn = cached_step(loss, optim, steps, mesh, frozen_shardings, tuple(batch), row_axes)
                state, metrics = step_fn(state, frozen, batch)
                done = step + 1
                save(done, state, force=done == steps)
                logged = done % log_every == 0 or done == steps
                row = None
                if on_step is not None or logged:
                    row = {"step": done, **{k: float(v) for k, v in metrics.items()},
                           "lr": float(schedule(step)), "seconds": round(time.time() - t0, 2)}
                if logged and jax.process_index() == 0:
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{row['loss']:.4f}")
                bar.update(1)
                if on_step is not None:
                    on_step(done, row)
                if max_seconds is not None and time.time() - t0 > max_seconds:
                    break
        ckpt.wait()
        if ckpt.latest_step() != int(state["step"]):  # stopped by max_seconds between checkpoints
            save(int(state["step"]), state, force=True)
    finally:
        ckpt.close()
    return jax.device_get(state["trainable"]), int(state["step"])


def read_log(workdir: str | os.PathLike) -> list[dict[str, float]]:
    """The rows of `workdir/log.jsonl` ([] before the first)."""
    path = pathlib.Path(workdir) / LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _drop_log_rows_after(path: pathlib.Path, step: int) -> None:
    """Forgets the rows an interrupted run logged past its last checkpoint: the resumed run logs those
    steps again, and the loss curve must hold each step once."""
    if jax.process_index() != 0 or not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        path.write_text("".join(kept))
