"""Train the bundled default model on the synthetic tasks of the eval suite, then export it.

    python -m kvjax.training.bundled --config configs/bundled_model.yaml --workdir runs/bundled
    python -m kvjax.training.bundled --config configs/bundled_model.yaml --workdir runs/bundled --export kvjax/assets/model

Each step draws one sequence length (cycling through `data.lengths`) and `batch_size` samples of
the suite's tasks, rendered exactly as the evaluation renders them (kvjax.data.prompts); the loss
is next-token cross-entropy on the answer tokens (and the end-of-turn token). Re-running the same
command resumes from the last checkpoint in the workdir. The config's sections and keys are those of
`kvjax.training.bundled.config.BundledConfig`.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
from typing import Any

import jax

from kvjax.checkpoint import Checkpointer
from kvjax.models.export import init_params, save_hf
from kvjax.tokenizer import load_tokenizer
from kvjax.training.bundled.config import BundledConfig, BundledOptim, load_config, model_config
from kvjax.training.bundled.data import TaskBatches
from kvjax.training.bundled.loss import lm_loss
from kvjax.training.bundled.report import _chain, full_cache_scores, plot_loss, write_model_card
from kvjax.training.loop import init_state, make_optimizer, train


def _restore(workdir: pathlib.Path, params: Any, optim: BundledOptim) -> dict[str, Any]:
    """The latest training state in `workdir/checkpoints` (params shaped like `params`)."""
    ckpt = Checkpointer(workdir / "checkpoints")
    return ckpt.restore(init_state(params, make_optimizer(optim, optim.steps)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvjax.training.bundled", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/bundled_model.yaml", help="training YAML (model, data, optim, train)")
    ap.add_argument("--workdir", default="runs/bundled", help="checkpoints and log.jsonl; rerun to resume")
    ap.add_argument("--steps", type=int, help="override optim.steps")
    ap.add_argument("--max-minutes", type=float, help="stop (with a checkpoint) after this long; rerun to resume")
    ap.add_argument("--export", help="write the trained model (HF format + tokenizer) to this folder and exit")
    ap.add_argument("--scores", help="with --export: an eval output folder whose full-cache scores go in the model card")
    ap.add_argument("--init-from", help="start from the final weights of this earlier run's workdir (a next phase)")
    ap.add_argument("--init-from-config", default="configs/bundled_model.yaml", help="the config of --init-from's run")
    args = ap.parse_args(argv)
    conf: BundledConfig = load_config(args.config)
    if args.steps:
        conf = conf.with_steps(args.steps)
    tokenizer = load_tokenizer()
    cfg = model_config(conf.model, tokenizer)
    params = init_params(cfg, jax.random.PRNGKey(conf.train.init_seed))
    optim = conf.optim
    workdir = pathlib.Path(args.workdir)
    earlier = json.loads((workdir / "init_from.json").read_text()) if (workdir / "init_from.json").exists() else None
    if args.export:
        state = _restore(workdir, params, optim)
        out = save_hf(args.export, jax.device_get(state["trainable"]), cfg)
        tokenizer.save_pretrained(out)
        logs, offset = [], 0
        for phase in _chain(earlier):
            logs.append((pathlib.Path(phase["workdir"]) / "log.jsonl", offset))
            offset += int(phase["step"])
        logs.append((workdir / "log.jsonl", offset))
        rows = plot_loss(logs, out / "loss_curve.png")
        write_model_card(out, conf, cfg, rows, args.config, full_cache_scores(args.scores) if args.scores else None,
                         earlier=earlier)
        print(f"exported step {int(state['step'])} to {out}")
        return
    if args.init_from and not (workdir / "checkpoints").exists():
        # a second phase: the final weights of an earlier run, a fresh optimizer and schedule
        first = load_config(args.init_from_config)
        state = _restore(pathlib.Path(args.init_from), params, first.optim)
        if int(state["step"]) != first.optim.steps:
            raise ValueError(f"--init-from {args.init_from} stopped at step {int(state['step'])}, not at the "
                             f"{first.optim.steps} steps of {args.init_from_config}: finish that run first")
        params = state["trainable"]
        workdir.mkdir(parents=True, exist_ok=True)
        phase = {"workdir": str(args.init_from), "config": args.init_from_config, "step": int(state["step"])}
        if (before := pathlib.Path(args.init_from) / "init_from.json").exists():  # a third phase or later
            phase["earlier"] = json.loads(before.read_text())
        (workdir / "init_from.json").write_text(json.dumps(phase))
    batches = TaskBatches(conf.data, tokenizer)
    loss = functools.partial(lm_loss, cfg=cfg, context_weight=conf.train.context_weight)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(conf.raw, indent=2))
    _, steps = train(loss, params, None, batches, steps=optim.steps, optim=optim, workdir=args.workdir,
                     checkpoint_every=conf.train.checkpoint_every, log_every=conf.train.log_every,
                     max_seconds=None if args.max_minutes is None else args.max_minutes * 60)
    print(f"trained to step {steps} in {args.workdir}")


if __name__ == "__main__":
    main()
