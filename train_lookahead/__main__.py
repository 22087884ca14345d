"""python -m train_lookahead --config configs/lookahead_bundled.yaml --workdir runs/lkv  (resumes when re-run)"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

import jax

from train_lookahead.config import RunConfig
from train_lookahead import dryrun
from train_lookahead.pipeline import build_mesh, maybe_initialize_distributed, run


def use_fake_cpu_devices(count: int) -> None:
    """A dry run checks a pod's mesh on this machine: on CPU, `count` fake devices (before jax starts)."""
    platforms = jax.config.jax_platforms
    if platforms in (None, "", "cpu"):
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", max(count, 1))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m train_lookahead",
                                description="Train LookaheadKV modules (learned lookahead tokens + LoRA) for a "
                                            "frozen model: targets, training, export. Re-run to resume.")
    p.add_argument("--config", required=True, help="a YAML run config (see configs/lookahead_*.yaml)")
    p.add_argument("--workdir", required=True, help="targets, checkpoints, log and export/ go here")
    p.add_argument("--eval-scores", help="a JSON file of {name: score} to put in the exported card")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--dry-run", action="store_true",
                   help="only lower one train step for the config's mesh with abstract weights (needs "
                        "model.architecture); checks shapes and shardings without loading the model")
    args = p.parse_args(argv)
    cfg = RunConfig.from_yaml(args.config)
    if args.dry_run:
        use_fake_cpu_devices(cfg.mesh.model * (cfg.mesh.data or 1))
    else:
        maybe_initialize_distributed()
    if args.eval_scores:
        cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, eval_scores=args.eval_scores))
    if args.dry_run:
        mesh = build_mesh(cfg.mesh)
        lowered = dryrun.lower_train_step(cfg, dryrun.model_config(cfg), mesh)  # no weights, no workdir
        print(f"lowered one train step for mesh {dict(mesh.shape)}: "
              f"{len(lowered.as_text())} characters of StableHLO")
        return 0
    command = "python -m train_lookahead " + " ".join(shlex.quote(a) for a in argv)
    out = run(cfg, args.workdir, command=command, progress=not args.no_progress)
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
