"""Held-out training loss of LookaheadKV adapters: can a recipe's seeds be told apart without the eval? (issue 27)

The recipe's seeds differ by 17 points on RULER (TABLE.md, "Run-to-run spread"). This computes each adapter's
training objective, KL(target || predicted) of the frozen model's own response attention, on prompts of the
training families that no adapter saw (the run config's data sources with another seed): a score that needs
no RULER sample and no correct answer (the 135M model quotes few lines exactly, so the families' own task
scores are near 0 even with the full cache).

    python eval/lookahead_ablations/validation_loss.py --config eval/lookahead_ablations/configs/tokens_8_codes.yaml \\
        --seed 1000 --num-samples 16 --workdir runs/validation_codes \\
        --adapters runs/lookahead_ablations/tokens_8_codes/export runs/lookahead_ablations/tokens_8_codes_seed_1/export

The targets are written under --workdir (resumable, as the pipeline's); each adapter's loss is the mean over
every held-out prompt (batches of the run's train.batch_size, one epoch).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import jax
import numpy as np

import kvjax.lookahead as lk
from train_lookahead.config import RunConfig
from train_lookahead.data import train_dataset
from train_lookahead.loss import lookahead_loss
from train_lookahead.pipeline import build_mesh, load_frozen
from train_lookahead.targets import TargetRecords, generate_targets


def held_out(cfg: RunConfig, seed: int, num_samples: int) -> RunConfig:
    """`cfg` with every data source drawn at `seed` (`num_samples` in all, split as evenly as the sources
    allow), its prompts other than the training run's, and targets without the stored prompt cache."""
    if any(s.seed == seed for s in cfg.data.sources):
        raise ValueError(f"--seed {seed} is a training source's seed; pick one the adapters did not train on")
    n = len(cfg.data.sources)
    sources = tuple(dataclasses.replace(s, seed=seed, num_samples=num_samples // n + (i < num_samples % n))
                    for i, s in enumerate(cfg.data.sources))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=sources),
                               targets=dataclasses.replace(cfg.targets, prompt_cache=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the adapters' training config (model, data, targets)")
    ap.add_argument("--seed", type=int, default=1000, help="data seed of the held-out prompts")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--workdir", required=True, help="where the held-out targets are written (resumes)")
    ap.add_argument("--adapters", nargs="+", required=True, help="adapter folders (exports) to score")
    args = ap.parse_args()
    cfg = held_out(RunConfig.from_yaml(args.config), args.seed, args.num_samples)
    model = load_frozen(cfg.model, build_mesh(cfg.mesh))
    records = TargetRecords(generate_targets(model, cfg.data, cfg.targets, pathlib.Path(args.workdir),
                                             progress=False))
    b = cfg.train.batch_size
    data = iter(train_dataset(records, batch_size=b, seed=0, max_prompt_tokens=cfg.data.max_prompt_tokens,
                              max_response_tokens=cfg.targets.max_response_tokens, query_aware=cfg.train.query_aware))
    batches = [next(data) for _ in range(len(records) // b)]  # one epoch: every prompt once (less a remainder)
    print(f"held-out prompts: {len(batches) * b} ({args.config}, data seed {args.seed}); loss: {cfg.train.loss}\n")
    print("| adapter | held-out loss (mean ± s.e. over batches) |\n|---|---:|")
    for path in args.adapters:
        adapter = lk.load(path, model=model)
        loss = jax.jit(lookahead_loss(model.config, adapter.config, False, cfg.train.loss, cfg.train.topk_fraction))
        values = np.array([float(loss(adapter.params, model.params, batch)) for batch in batches])
        se = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
        print(f"| {path} | {values.mean():.4f} ± {se:.4f} |", flush=True)


if __name__ == "__main__":
    main()
