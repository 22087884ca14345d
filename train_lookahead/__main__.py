"""python -m train_lookahead --config configs/lookahead_bundled.yaml --workdir runs/lkv  (resumes when re-run)"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from train_lookahead.config import RunConfig
from train_lookahead.pipeline import maybe_initialize_distributed, run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m train_lookahead",
                                description="Train LookaheadKV modules (learned lookahead tokens + LoRA) for a "
                                            "frozen model: targets, training, export. Re-run to resume.")
    p.add_argument("--config", required=True, help="a YAML run config (see configs/lookahead_*.yaml)")
    p.add_argument("--workdir", required=True, help="targets, checkpoints, log and export/ go here")
    p.add_argument("--eval-scores", help="a JSON file of {name: score} to put in the exported card")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = p.parse_args(argv)
    maybe_initialize_distributed()
    cfg = RunConfig.from_yaml(args.config)
    if args.eval_scores:
        cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, eval_scores=args.eval_scores))
    command = "python -m train_lookahead " + " ".join(shlex.quote(a) for a in argv)
    out = run(cfg, args.workdir, command=command, progress=not args.no_progress)
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
