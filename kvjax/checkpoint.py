"""Training checkpoints with Orbax (the only module that imports orbax)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves and restores a training-state pytree every `every` steps, keeping the last `keep`."""

    def __init__(self, directory: str | os.PathLike, *, every: int = 100, keep: int = 2):
        self.directory = pathlib.Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        return self.manager.save(step, args=ocp.args.StandardSave(state), force=force)

    def restore(self, state_like: Any, step: int | None = None) -> Any:
        """Restores `step` (default latest) into the structure, shapes, dtypes and shardings of `state_like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
        try:
            return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as e:
            raise ValueError(f"checkpoint step {step} in {self.directory} could not be restored (corrupt or "
                             f"from another model): {e}") from None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class StateAndJsonCheckpointer(Checkpointer):
    """A `Checkpointer` whose steps also hold a JSON item (e.g. a grain iterator's `get_state()`),
    saved and restored atomically with the state pytree."""

    def save(self, step: int, state: Any, json_item: dict | None = None, *, force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), json=ocp.args.JsonSave(json_item or {}))
        return self.manager.save(step, args=args, force=force)

    def restore(self, state_like: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, json item) of `step` (default latest); the state takes the structure, shapes, dtypes
        and shardings of `state_like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                     json=ocp.args.JsonRestore()))
        except Exception as e:
            raise ValueError(f"checkpoint step {step} in {self.directory} could not be restored (corrupt or "
                             f"from another model or config): {e}") from None
        return out["state"], out["json"]
