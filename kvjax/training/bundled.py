"""Train the bundled default model on the synthetic tasks of the eval suite, then export it.

    python -m kvjax.training.bundled --config configs/bundled_model.yaml --workdir runs/bundled
    python -m kvjax.training.bundled --config configs/bundled_model.yaml --workdir runs/bundled --export kvjax/assets/model

Each step draws one sequence length (cycling through `data.lengths`) and `batch_size` samples of
the suite's tasks, rendered exactly as the evaluation renders them (kvjax.eval.prompts); the loss
is next-token cross-entropy on the answer tokens (and the end-of-turn token). Re-running the same
command resumes from the last checkpoint in the workdir.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from kvjax.models.config import ModelConfig
from kvjax.models.export import init_params, save_hf
from kvjax.models.llama import extend
from kvjax.training.loop import OptimConfig, train

TOKENIZER_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "tokenizer"


def load_tokenizer(folder: pathlib.Path = TOKENIZER_DIR):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def model_config(spec: dict[str, Any], tokenizer) -> ModelConfig:
    return ModelConfig(
        family="llama", vocab_size=len(tokenizer), dtype="float32", rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
        num_layers=spec["num_layers"], num_heads=spec["num_heads"], num_kv_heads=spec["num_kv_heads"],
        head_dim=spec["head_dim"], max_position_embeddings=spec["max_position_embeddings"],
        rope_theta=float(spec["rope_theta"]), tie_embeddings=bool(spec["tie_embeddings"]),
    )


def render(sample: dict[str, Any], tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids as the evaluation feeds them, target ids = the task's canonical completion + end-of-turn)."""
    from kvjax.eval.prompts import build_prompt, encode_prompt
    from kvjax.eval.tasks.targets import completion

    context, question = encode_prompt(build_prompt(sample, tokenizer), tokenizer)
    answer = tokenizer.encode(completion(sample), add_special_tokens=False)
    return context + question, answer + [tokenizer.eos_token_id]


MAX_TARGETS = 64  # answer tokens scored per row (logits are computed only there)


class TaskBatches:
    """batches(step) -> tokens, positions [B, length]; target_index, targets, weights [B, MAX_TARGETS].

    A pure function of `step`. target_index[b, j] is the position whose logits predict targets[b, j].
    """

    def __init__(self, data: dict[str, Any], tokenizer):
        from kvjax.eval.prompts import chat_overhead
        from kvjax.eval.tasks import task_names

        self.lengths = list(data["lengths"])
        self.batch_size = int(data["batch_size"])
        self.seed = int(data["seed"])
        self.tokenizer = tokenizer
        self.overhead = chat_overhead(tokenizer)
        # tasks whose prompt fits each length (variable tracking needs ~768 tokens for its one-shot example)
        self.tasks = {n: [t for t in task_names(data["suite"]) if self._fits(t, n)] for n in self.lengths}
        if not all(self.tasks.values()):
            raise ValueError(f"no task of suite {data['suite']!r} fits lengths {self.lengths}")

    def _fits(self, task: str, length: int) -> bool:
        from kvjax.eval.tasks import generate_task

        try:
            generate_task(task, self.tokenizer, length, 1, seed=self.seed, overhead=self.overhead)
            return True
        except ValueError:
            return False

    def sample(self, step: int, i: int) -> tuple[list[int], list[int]]:
        from kvjax.eval.tasks import generate_task

        index = step * self.batch_size + i
        length = self.lengths[step % len(self.lengths)]
        tasks = self.tasks[length]
        task = tasks[index % len(tasks)]
        s = generate_task(task, self.tokenizer, length, 1, seed=self.seed + index, overhead=self.overhead)[0]
        return render(s, self.tokenizer)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        length = self.lengths[step % len(self.lengths)]
        B = self.batch_size
        tokens = np.full((B, length), self.tokenizer.pad_token_id, np.int32)
        positions = np.full((B, length), -1, np.int32)
        target_index = np.zeros((B, MAX_TARGETS), np.int32)
        targets = np.zeros((B, MAX_TARGETS), np.int32)
        weights = np.zeros((B, MAX_TARGETS), np.float32)
        for i in range(B):
            prompt, answer = self.sample(step, i)
            seq = prompt + answer
            if len(seq) > length or len(answer) > MAX_TARGETS:
                raise ValueError(f"sample of {len(seq)} tokens ({len(answer)} answer tokens) exceeds "
                                 f"length={length} / MAX_TARGETS={MAX_TARGETS}")
            n, a = len(seq), len(answer)
            tokens[i, :n] = seq
            positions[i, :n] = np.arange(n)
            target_index[i, :a] = np.arange(len(prompt) - 1, n - 1)  # each answer token from the one before
            targets[i, :a] = answer
            weights[i, :a] = 1.0
        return {"tokens": tokens, "positions": positions, "target_index": target_index, "targets": targets,
                "weights": weights}


def lm_loss(params, frozen, batch, *, cfg: ModelConfig):
    """Weighted next-token cross-entropy; metrics: answer-token accuracy."""
    logits, _, _ = extend(params, cfg, None, batch["tokens"], batch["positions"], fresh=True,
                          logit_index=batch["target_index"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    w = batch["weights"]
    denom = jnp.maximum(w.sum(), 1.0)
    acc = ((jnp.argmax(logits, -1) == batch["targets"]) * w).sum() / denom
    return (nll * w).sum() / denom, {"answer_token_accuracy": acc}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/bundled_model.yaml", help="training YAML (model, data, optim, train)")
    ap.add_argument("--workdir", default="runs/bundled", help="checkpoints and log.jsonl; rerun to resume")
    ap.add_argument("--steps", type=int, help="override optim.steps")
    ap.add_argument("--max-minutes", type=float, help="stop (with a checkpoint) after this long; rerun to resume")
    ap.add_argument("--export", help="write the trained model (HF format + tokenizer) to this folder and exit")
    args = ap.parse_args(argv)
    conf = yaml.safe_load(pathlib.Path(args.config).read_text())
    if args.steps:
        conf["optim"]["steps"] = args.steps
    tokenizer = load_tokenizer()
    cfg = model_config(conf["model"], tokenizer)
    params = init_params(cfg, jax.random.PRNGKey(conf["train"].get("init_seed", 0)))
    optim = OptimConfig(**conf["optim"])
    if args.export:
        from kvjax.checkpoint import Checkpointer
        from kvjax.training.loop import make_optimizer

        ckpt = Checkpointer(pathlib.Path(args.workdir) / "checkpoints")
        like = {"trainable": params, "opt_state": make_optimizer(optim).init(params), "step": jnp.int32(0)}
        state = ckpt.restore(like)
        out = save_hf(args.export, jax.device_get(state["trainable"]), cfg)
        tokenizer.save_pretrained(out)
        print(f"exported step {int(state['step'])} to {out}")
        return
    batches = TaskBatches(conf["data"], tokenizer)
    loss = functools.partial(lm_loss, cfg=cfg)
    pathlib.Path(args.workdir).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.workdir) / "config.json").write_text(json.dumps(conf, indent=2))
    _, steps = train(loss, params, None, batches, optim, args.workdir,
                     checkpoint_every=conf["train"]["checkpoint_every"], log_every=conf["train"]["log_every"],
                     max_seconds=None if args.max_minutes is None else args.max_minutes * 60)
    print(f"trained to step {steps} in {args.workdir}")


if __name__ == "__main__":
    main()
