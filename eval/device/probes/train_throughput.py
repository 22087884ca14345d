"""Probe: LookaheadKV training throughput (issue 27's recipe) on an accelerator, without carrying the GGUF.

The recipe (`configs/lookahead_smollm2_ood.yaml`) trains on SmolLM2-135M-Instruct, a 98 MB GGUF that does not
travel to a lent device machine (64 MiB carried in all). Throughput depends on the model's shapes, not its
weights, so this carries the model's config and tokenizer only (a few MB) and draws random weights there:

    python eval/device/probes/train_throughput.py prepare DIR     # here: config.json + tokenizer from the GGUF
    python eval/device/probes/train_throughput.py run DIR --out eval/device/train_throughput_<device>.md
        # there: random weights of that shape into DIR, then `python -m train_lookahead.throughput` on the
        # recipe with model.path = DIR (same data, targets and training settings)

One difference from the real model: random weights rarely emit EOS, so every target answer runs to the
recipe's max_response_tokens (128); the real model stops earlier on some prompts, so targets here are an upper
bound on its cost.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import yaml

RECIPE = pathlib.Path("configs/lookahead_smollm2_ood.yaml")
GGUF = pathlib.Path("../shared/fixtures/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")


def prepare(folder: pathlib.Path) -> None:
    from kvjax.models.export import hf_config
    from kvjax.models.gguf import load_gguf

    cfg, _, tok = load_gguf(GGUF, tokenizer=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    tok.save_pretrained(str(folder))
    print(f"wrote {sorted(p.name for p in folder.iterdir())} to {folder}")


def run(folder: pathlib.Path, out: str, chunks: int, steps: int) -> int:
    from kvjax.models.config import ModelConfig
    from kvjax.models.export import init_params, save_hf
    from train_lookahead import throughput

    hf = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf, "float32")
    if not (folder / "model.safetensors").exists():
        save_hf(folder, init_params(cfg, jax.random.key(0)), cfg)
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["model"]["path"] = str(folder.resolve())
    config = folder / "recipe.yaml"
    config.write_text(yaml.safe_dump(recipe, sort_keys=False))
    note = (f"{RECIPE}'s settings on random weights of SmolLM2-135M's shape (eval/device/probes/"
            f"train_throughput.py; every answer runs to max_response_tokens)")
    return throughput.main(["--config", str(config), "--chunks", str(chunks), "--steps", str(steps),
                            "--note", note, "--out", out])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("prepare", "run"))
    p.add_argument("folder", type=pathlib.Path)
    p.add_argument("--out", default="eval/device/train_throughput.md")
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    if args.mode == "prepare":
        prepare(args.folder)
        return 0
    return run(args.folder, args.out, args.chunks, args.steps)


if __name__ == "__main__":
    sys.exit(main())
