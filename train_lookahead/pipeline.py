"""One run: load the frozen model on the mesh, generate targets, train, export.

Re-running with the same workdir resumes: finished target chunks are kept, training restores its
last checkpoint (state and data position), and the export is rewritten at the end.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable

import jax
from jax.sharding import Mesh

import kvjax
from kvjax.lookahead import check_positions, init_adapter
from kvjax.models.loading import param_shardings
from kvjax.models.model import resolve_model
from kvjax.sharding import make_mesh
from kvjax.training import read_log, train

from train_lookahead.config import MeshSection, ModelSection, RunConfig
from train_lookahead.data import ROW_AXES, train_dataset
from train_lookahead.export import export
from train_lookahead.loss import lookahead_loss
from train_lookahead.targets import TargetRecords, generate_targets

# environment variables that mean "this process is one of several hosts" (Cloud TPU pods, explicit setups)
_MULTI_HOST_ENV = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def maybe_initialize_distributed(environ: dict[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize()` when the environment says multi-host (a TPU pod slice with
    several workers, or an explicit coordinator address); returns whether it did."""
    env = os.environ if environ is None else environ
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1 or any(env.get(k) for k in _MULTI_HOST_ENV):
        jax.distributed.initialize()
        return True
    return False


def build_mesh(section: MeshSection) -> Mesh:
    return make_mesh(section.data, section.model)


def load_frozen(section: ModelSection, mesh: Mesh) -> kvjax.Model:
    """The frozen model, its params sharded over `mesh` by kvjax.sharding's logical rules."""
    return kvjax.load_model(resolve_model(section.path), dtype=section.dtype, mesh=mesh)


def _check_workdir_config(workdir: pathlib.Path, cfg: RunConfig) -> None:
    """A workdir belongs to one config (export settings aside): resuming under another is an error.
    A field added to the config since the workdir was started counts as its default there."""
    path = workdir / "config.json"
    now = {k: v for k, v in cfg.to_dict().items() if k != "export"}
    if path.exists():
        old = json.loads(path.read_text())
        try:
            old = RunConfig.from_dict(old).to_dict()
        except (TypeError, ValueError):
            pass  # a config this version cannot read: compared as it is, so the difference is named
        old = {k: v for k, v in old.items() if k != "export"}
        diff = sorted(k for k in set(old) | set(now) if old.get(k) != json.loads(json.dumps(now)).get(k))
        if diff:
            raise ValueError(f"{workdir} was started with another config (sections {', '.join(diff)} differ); "
                             "use a new --workdir to train with this one")
    elif jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg.to_dict(), indent=1))


def run(cfg: RunConfig, workdir: str | os.PathLike, *, command: str = "", progress: bool = True,
        on_step: Callable | None = None) -> pathlib.Path:
    """Targets, training and export for `cfg` in `workdir`; returns the export folder."""
    workdir = pathlib.Path(workdir)
    _check_workdir_config(workdir, cfg)
    mesh = build_mesh(cfg.mesh)
    if cfg.train.batch_size % mesh.shape["data"]:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} must be divisible by the mesh's data axis "
                         f"({mesh.shape['data']}); set mesh.data or train.batch_size")
    model = load_frozen(cfg.model, mesh)
    # the padded prompt plus the lookahead tokens must fit the model's positions: fail before the targets
    check_positions(model.config, cfg.data.max_prompt_tokens, cfg.lookahead)
    folder = generate_targets(model, cfg.data, cfg.targets, workdir, progress=progress)
    records = TargetRecords(folder)
    steps = cfg.train.steps or len(records) // cfg.train.batch_size
    if steps < 1:
        raise ValueError(f"{len(records)} target records make no full batch of train.batch_size="
                         f"{cfg.train.batch_size}; lower it or add prompts")
    data = train_dataset(records, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                         max_prompt_tokens=cfg.data.max_prompt_tokens,
                         max_response_tokens=cfg.targets.max_response_tokens, process_index=jax.process_index(),
                         process_count=jax.process_count(), query_aware=cfg.train.query_aware)
    adapter = init_adapter(model, cfg.lookahead, jax.random.PRNGKey(cfg.train.adapter_seed),
                           token_ids=cfg.train.init_tokens)
    loss = lookahead_loss(model.config, cfg.lookahead, cfg.train.remat, cfg.train.loss, cfg.train.topk_fraction)
    trained, done = train(loss, adapter.params, model.params,
                          data, steps=steps, optim=cfg.optim, workdir=workdir, mesh=mesh,
                          frozen_shardings=param_shardings(model.config, mesh), row_axes=ROW_AXES,
                          checkpoint_every=cfg.train.checkpoint_every, log_every=cfg.train.log_every,
                          on_step=on_step, progress=progress)
    out = workdir / "export"
    if jax.process_index() == 0:
        export(out, adapter.replace(params=trained), cfg, rows=read_log(workdir), command=command,
               model_path=cfg.model.path, steps=done, records=len(records),
               skipped=records.manifest["skipped_long"])
    return out
