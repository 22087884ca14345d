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
import random
import re
import string
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from kvjax.eval.tasks.ruler import MAX_NEW_TOKENS
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


NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: ([^\s.]+)\.")
COPY_INSTRUCTION = "Repeat the following text exactly.\n"
RECALL_INSTRUCTION = "Memorize these special magic numbers, then state each one again.\n"
ANSWER_ROOM = 40  # tokens a row keeps for its answer (the longest, four needle values, is 37 with the end token)
MAX_TARGETS = 256  # target tokens scored per row (logits are computed only there)


def render(sample: dict[str, Any], tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids as the evaluation feeds them, target ids = the task's canonical completion + end-of-turn).

    Needle answers are listed in their order of appearance in the context (the metric ignores order).
    """
    from kvjax.eval.prompts import build_prompt, encode_prompt
    from kvjax.eval.tasks.targets import completion

    if sample["task"].startswith("niah") and len(sample["answers"]) > 1:
        ctx = sample["context"]
        sample = {**sample, "answers": sorted(sample["answers"], key=lambda a: ctx.find(a))}
    context, question = encode_prompt(build_prompt(sample, tokenizer), tokenizer)
    answer = tokenizer.encode(completion(sample), add_special_tokens=False)
    return context + question, answer + [tokenizer.eos_token_id]


def needle_drills(sample: dict[str, Any], rng: random.Random,
                  order: str = "query") -> list[tuple[str, str, str, tuple[str, ...]]]:
    """Extra questions on the needles of a sample's context, in random order: (question, prefix, answer, keys).

    Every needle line of the haystack (distractors included) is a key-value fact the context states,
    so asking about each one gives many retrieval targets per long sequence instead of one. Keys with
    several values are asked in the plural form; a quarter of the drills ask 2-4 keys at once (as
    niah_multiquery does). Questions use RULER's own templates. The values of a drill asking several
    keys are listed key by key (`order="query"`) or in their order of appearance (`"context"`, as
    `render` lists a sample's own answers).
    """
    from kvjax.eval.tasks import templates as T

    facts: dict[str, tuple[str, list[str]]] = {}
    for kind, key, value in NEEDLE.findall(sample["context"]):
        facts.setdefault(key, (kind, []))[1].append(value)
    keys = list(facts)
    rng.shuffle(keys)
    drills = []
    while keys:
        take = rng.randint(2, 4) if len(keys) >= 2 and rng.random() < 0.25 else 1
        group, keys = keys[:take], keys[take:]
        if len({facts[k][0] for k in group}) > 1:
            group = group[:1]
        kind = facts[group[0]][0]
        values = [v for k in group for v in facts[k][1]]
        if order == "context":
            values.sort(key=sample["context"].find)
        query = ", ".join(group[:-1]) + ", and " + group[-1] if len(group) > 1 else group[0]
        tmpl = (T.NIAH_QUESTION, T.NIAH_ANSWER_PREFIX)
        if len(values) == 1:  # RULER's singular form: "A special magic number ... is"
            tmpl, kind = tuple(T.singular(t) for t in tmpl), kind[:-1]
        q, prefix = (t.format(type_needle_v=kind, query=query) for t in tmpl)
        drills.append((q, prefix, " " + ", ".join(values) + ".", tuple(group)))
    return drills


class TaskBatches:
    """batches(step) -> tokens, positions [B, length]; target_index, targets, weights [B, MAX_TARGETS].

    A pure function of `step`. target_index[b, j] is the position whose logits predict targets[b, j].
    Each row is one task sample rendered exactly as the evaluation renders it, answered, then (for
    samples whose context holds other needles) followed by further user turns of `needle_drills`
    until the row is full; a random fraction up to `drill_fraction` of the row is set aside for them.
    A `copy_fraction` of rows instead ask to repeat a list of random values (`_copy_row`). With
    `vt_chains`, vt rows hold that many more chains, each asked about after the answer (`_vt_row`).
    `curriculum` ([[until_step, lengths, batch_size?], ...]) trains on shorter rows (in bigger batches) first; `task_weights` repeats
    tasks in the mix (the needle-haystack tasks carry the most drills).
    """

    def __init__(self, data: dict[str, Any], tokenizer):
        from kvjax.eval.prompts import chat_overhead
        from kvjax.eval.tasks import task_names

        self.lengths = list(data["lengths"])
        # [until_step, lengths] or [until_step, lengths, batch_size]
        self.curriculum = [(int(c[0]), list(c[1]), int(c[2]) if len(c) > 2 else int(data["batch_size"]))
                           for c in data.get("curriculum", [])]
        self.drill_fraction = float(data.get("drill_fraction", 0.0))
        self.drill_order = data.get("drill_order", "query")  # needle_drills' order of several keys' values
        if self.drill_order not in ("query", "context"):
            raise ValueError(f"drill_order must be 'query' or 'context', got {self.drill_order!r}")
        self.copy_fraction = float(data.get("copy_fraction", 0.0))
        recall = data.get("recall", {})  # {from_step, share, uuids}: copy rows that become `_recall_row`s
        self.recall_from, self.recall_share = int(recall.get("from_step", 0)), float(recall.get("share", 0.0))
        self.recall_uuids = float(recall.get("uuids", 0.0))  # share of recall rows with UUID values (and keys)
        self.recall_multi_value = float(recall.get("multi_value", 0.0))  # share of their keys with 2-4 values
        # {from_step, fraction}: of the remaining (task) rows, this fraction become recall rows too
        more = data.get("more_recall", {})
        self.recall_more_from, self.recall_more = int(more.get("from_step", 0)), float(more.get("fraction", 0.0))
        # vt rows carry this many more chains of variables, each asked about in a turn after the answer
        self.vt_chains = int(data.get("vt_chains", 0))
        self.batch_size = int(data["batch_size"])
        self.seed = int(data["seed"])
        self.tokenizer = tokenizer
        self.overhead = chat_overhead(tokenizer)
        self.turn = self._turn_format()
        all_lengths = sorted({n for _, ls, _ in self.curriculum for n in ls} | set(self.lengths))
        self.min_length = {t: self._min_length(t, max(all_lengths)) for t in task_names(data["suite"])}
        weights = {t: int(w) for t, w in data.get("task_weights", {}).items()}
        if unknown := set(weights) - set(self.min_length):
            raise ValueError(f"task_weights names {sorted(unknown)}, not in suite {data['suite']!r}: "
                             f"{sorted(self.min_length)}")
        # each task appears task_weights[task] times (default 1) in the cycle rows are drawn from
        self.tasks = {n: [t for t, m in self.min_length.items() if m <= n for _ in range(weights.get(t, 1))]
                      for n in all_lengths}
        if not all(self.tasks.values()):
            raise ValueError(f"no task of suite {data['suite']!r} fits lengths {all_lengths}")

    def _turn_format(self) -> str:
        """The text between an answer's end-of-turn token and the next answer: '{question}', '{prefix}'."""
        msgs = [{"role": "user", "content": "\x00"}, {"role": "assistant", "content": "\x01"},
                {"role": "user", "content": "\x02"}]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        tail = text.split("\x01", 1)[1]
        if not tail.startswith(self.tokenizer.eos_token):
            raise ValueError("the chat template does not end an assistant turn with the eos token")
        return tail[len(self.tokenizer.eos_token):].replace("\x02", "{question}") + "{prefix}"

    def _generate(self, task: str, length: int, index: int) -> dict[str, Any]:
        from kvjax.eval.tasks import generate_task

        return generate_task(task, self.tokenizer, length, 1, seed=self.seed + index, overhead=self.overhead)[0]

    def _min_length(self, task: str, top: int) -> int:
        lo, hi = 64, top  # smallest multiple of 32 the task fits in
        if not self._fits(task, hi):
            return top + 1
        while hi - lo > 32:
            mid = (lo + hi) // 64 * 32
            lo, hi = (lo, mid) if self._fits(task, mid) else (mid, hi)
        return hi

    def _fits(self, task: str, length: int) -> bool:
        try:
            self._generate(task, length, 0)
            return True
        except ValueError:
            return False

    def stage(self, step: int) -> tuple[list[int], int]:
        """(row lengths, batch size) in force at `step`."""
        for until, lengths, batch_size in self.curriculum:
            if step < until:
                return lengths, batch_size
        return self.lengths, self.batch_size

    def length_at(self, step: int) -> int:
        lengths, _ = self.stage(step)
        return lengths[step % len(lengths)]

    def sample(self, step: int, i: int) -> tuple[list[int], list[int]]:
        """(token ids, indices into them that are targets) of row i at `step`."""
        index = step * 1000 + i  # unique while batches stay below 1000 rows
        length = self.length_at(step)
        tasks = self.tasks[length]
        task = tasks[index % len(tasks)]
        rng = random.Random(self.seed * 1_000_003 + index)
        if rng.random() < self.copy_fraction:
            if step >= self.recall_from and rng.random() < self.recall_share:
                return self._recall_row(length, index)
            return self._copy_row(length, index)
        if step >= self.recall_more_from and rng.random() < self.recall_more:
            return self._recall_row(length, index)
        if task == "vt" and self.vt_chains:
            return self._vt_row(length, index)
        reserve = int(length * rng.uniform(0.0, self.drill_fraction))
        # the generators keep the task's whole generation cap free; a training row needs only ANSWER_ROOM of it
        slack = max(0, MAX_NEW_TOKENS["vt" if task == "vt" else "niah"] - ANSWER_ROOM)
        sample = self._generate(task, max(self.min_length[task], length + slack - reserve), index)
        queried = set(query_keys(sample))
        drills = [d for d in needle_drills(sample, rng, self.drill_order) if not queried & set(d[3])]
        if not drills and reserve:
            sample = self._generate(task, length + slack, index)
        return self._answered(sample, [(q, prefix, value) for q, prefix, value, _ in drills], length)

    def _answered(self, sample: dict[str, Any], turns: list[tuple[str, str, str]],
                  length: int) -> tuple[list[int], list[int]]:
        """`sample` rendered and answered, then further (question, prefix, reply) turns while the row
        has room; (token ids, target indices: every answer and reply token, each with its end token)."""
        prompt, answer = render(sample, self.tokenizer)
        ids, targets = prompt + answer, list(range(len(prompt), len(prompt) + len(answer)))
        for question, prefix, value in turns:
            turn = self.tokenizer.encode(self.turn.format(question=question, prefix=prefix), add_special_tokens=False)
            reply = self.tokenizer.encode(value, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            if len(ids) + len(turn) + len(reply) > length or len(targets) + len(reply) > MAX_TARGETS:
                break
            ids += turn
            targets += range(len(ids), len(ids) + len(reply))
            ids += reply
        return ids, targets

    def _vt_row(self, length: int, index: int) -> tuple[list[int], list[int]]:
        """A vt sample whose context holds `vt_chains` more chains, each asked about after the answer.

        The extra chains replace noise lines (in order, at random places), so the row stays the
        evaluation's vt prompt with more to track; every turn asks RULER's own question and ends in
        its answer prefix, whose trailing space leaves the first name to be written without its
        leading space, as the evaluation asks. Each turn is one more example of that.
        """
        from kvjax.eval.tasks import templates as T
        from kvjax.tokenizer.words import NOISE_SENTENCE

        rng = random.Random(self.seed * 9_000_011 + index)
        probe = self.turn.format(question=T.VT_QUESTION.format(query="12345"),
                                 prefix=T.VT_ANSWER_PREFIX.format(num_v=5, query="12345"))
        per_turn = len(self.tokenizer.encode(probe + " ".join(["ABCDE"] * 5), add_special_tokens=False)) + 1
        sample = self._generate("vt", max(self.min_length["vt"], length - self.vt_chains * per_turn), index)
        ctx = sample["context"]
        start = ctx.rfind(T.VT_CONTEXT.split("\n")[0])  # after the one-shot example
        lines = ctx[start:].split("\n")
        noise = [j for j, line in enumerate(lines) if line == NOISE_SENTENCE.strip()]
        taken, values = set(sample["answers"]) | {"VAR"}, {sample["question"].split("value ")[1].split()[0]}
        chains = []
        for _ in range(min(self.vt_chains, len(noise) // 5)):
            names = []
            while len(names) < 5:
                name = "".join(rng.choices(string.ascii_uppercase, k=5))
                if name not in taken:
                    taken.add(name)
                    names.append(name)
            value = str(rng.randrange(10000, 99999))
            while value in values:
                value = str(rng.randrange(10000, 99999))
            values.add(value)
            at = sorted(rng.sample(noise, 5))
            noise = [j for j in noise if j not in at]
            for j, (pos, line) in enumerate(zip(at, [f"VAR {names[0]} = {value}"] +
                                                [f"VAR {names[k + 1]} = VAR {names[k]} " for k in range(4)])):
                lines[pos] = line
            chains.append((value, names))
        turns = [(T.VT_QUESTION.format(query=value), T.VT_ANSWER_PREFIX.format(num_v=5, query=value), " ".join(names))
                 for value, names in chains]
        return self._answered({**sample, "context": ctx[:start] + "\n".join(lines)}, turns, length)

    def _user_turn(self, instruction: str) -> tuple[list[int], list[int]]:
        """Token ids of a chat user turn opening with `instruction`, before and after its content,
        through the assistant header."""
        head = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": instruction + "\x00"}], tokenize=False, add_generation_prompt=True)
        before, after = head.split("\x00")
        return (self.tokenizer.encode(before, add_special_tokens=False),
                self.tokenizer.encode(after, add_special_tokens=False))

    def _copy_row(self, length: int, index: int) -> tuple[list[int], list[int]]:
        """A user turn asking to repeat a list of random items, answered with that list.

        The items are the tasks' random values (7-digit numbers, UUIDs, adjective-noun keys,
        variable names), so no token of the reply can be guessed: it must be copied. Copying a text
        seen once is what induction heads do, the second half of retrieval (find the key, then copy
        what follows it); every token of the reply is a target.
        """
        from kvjax.eval.tasks.haystacks import key_words, random_value

        rng = random.Random(self.seed * 7_000_003 + index)
        words = key_words()
        kinds = ("numbers", "uuids", "words", "names")
        before, after = self._user_turn(COPY_INSTRUCTION)
        span = min((length - len(before) - len(after) - 1) // 2, MAX_TARGETS - 1)
        items: list[str] = []
        while len(self.tokenizer.encode(" ".join(items), add_special_tokens=False)) < span:
            kind = rng.choice(kinds)
            items.append("".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) if kind == "names"
                         else random_value(kind, rng, words))
        chunk = self.tokenizer.encode(" ".join(items), add_special_tokens=False)[:span]
        row = before + chunk + after
        return row + chunk + [self.tokenizer.eos_token_id], list(range(len(row), len(row) + len(chunk) + 1))

    def _recall_row(self, length: int, index: int) -> tuple[list[int], list[int]]:
        """Needle lines, then a reply that states every key's value again in shuffled order.

        The reply is either the needle lines themselves ("... for KEY is: VALUE.") or the answer
        sentences of the evaluation (" The special magic number for KEY mentioned in the provided
        text is VALUE."), so each value is a retrieval by its key, at a short or at the evaluation's
        distance from it; every token of the reply is a target. A `recall.uuids` share of rows use
        UUID values, with word or UUID keys (as niah_single_3 and niah_multikey_3 do). A
        `recall.multi_value` share of keys have 2-4 values on lines scattered among the others, stated
        together in order of appearance (as niah_multivalue asks).
        """
        from kvjax.eval.tasks import templates as T
        from kvjax.eval.tasks.haystacks import key_words, random_value

        rng = random.Random(self.seed * 5_000_011 + index)
        words = key_words()
        answer_style = rng.random() < 0.5
        before, after = self._user_turn(RECALL_INSTRUCTION)
        order = random.Random(index)
        # a separate stream, so rows of configs without `recall.uuids` / `multi_value` stay as they were
        kinds = random.Random(self.seed * 3_000_017 + index)
        key_kind, value_kind = "words", "numbers"
        if kinds.random() < self.recall_uuids:  # as niah_single_3 (word keys) or niah_multikey_3 (UUID keys)
            key_kind, value_kind = kinds.choice(("words", "uuids")), "uuids"

        def render(facts: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
            lines = "\n".join(T.NIAH_NEEDLE.format(type_needle_v=value_kind, key=k, value=v) for k, v in facts)
            values: dict[str, list[str]] = {}
            for k, v in facts:
                values.setdefault(k, []).append(v)
            shuffled = random.Random(order.random()).sample(list(values), len(values))
            if answer_style:
                plural, singular = T.NIAH_ANSWER_PREFIX, T.singular(T.NIAH_ANSWER_PREFIX)
                reply = "\n".join(
                    (singular.format(type_needle_v=value_kind[:-1], query=k) if len(values[k]) == 1
                     else plural.format(type_needle_v=value_kind, query=k)) + f" {', '.join(values[k])}."
                    for k in shuffled)
            else:
                reply = "\n".join(T.NIAH_NEEDLE.format(type_needle_v=value_kind, key=k, value=v)
                                  for k in shuffled for v in values[k])
            return (self.tokenizer.encode(lines, add_special_tokens=False),
                    self.tokenizer.encode(reply, add_special_tokens=False))

        facts: list[tuple[str, str]] = []
        while True:
            key = random_value(key_kind, rng, words)
            if any(key == k for k, _ in facts):
                continue
            many = self.recall_multi_value and kinds.random() < self.recall_multi_value
            candidate = list(facts)
            for _ in range(kinds.randint(2, 4) if many else 1):
                fact = (key, random_value(value_kind, rng, words))
                candidate.insert(kinds.randint(0, len(candidate)) if many else len(candidate), fact)
            ctx, reply = render(candidate)
            if len(before) + len(ctx) + len(after) + len(reply) + 1 > length or len(reply) + 1 > MAX_TARGETS:
                break
            facts = candidate
        ctx, reply = render(facts)
        row = before + ctx + after
        return row + reply + [self.tokenizer.eos_token_id], list(range(len(row), len(row) + len(reply) + 1))

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        length = self.length_at(step)
        B = self.stage(step)[1]
        tokens = np.full((B, length), self.tokenizer.pad_token_id, np.int32)
        positions = np.full((B, length), -1, np.int32)
        target_index = np.zeros((B, MAX_TARGETS), np.int32)
        targets = np.zeros((B, MAX_TARGETS), np.int32)
        weights = np.zeros((B, MAX_TARGETS), np.float32)
        context_weights = np.zeros((B, length), np.float32)  # at p: token p+1 is real and not a target
        for i in range(B):
            ids, where = self.sample(step, i)
            if len(ids) > length or len(where) > MAX_TARGETS:
                raise ValueError(f"row of {len(ids)} tokens ({len(where)} targets) exceeds "
                                 f"length={length} / MAX_TARGETS={MAX_TARGETS}")
            n, a = len(ids), len(where)
            tokens[i, :n] = ids
            positions[i, :n] = np.arange(n)
            target_index[i, :a] = np.asarray(where) - 1  # each target from the token before it
            targets[i, :a] = np.asarray(ids)[where]
            weights[i, :a] = 1.0
            context_weights[i, : n - 1] = 1.0
            context_weights[i, target_index[i, :a]] = 0.0
        return {"tokens": tokens, "positions": positions, "target_index": target_index, "targets": targets,
                "weights": weights, "context_weights": context_weights}


def query_keys(sample: dict[str, Any]) -> list[str]:
    """The keys a needle sample's own question asks about (parsed from its answer prefix)."""
    m = re.search(r" for (.+) mentioned in the provided text", sample.get("answer_prefix", ""))
    if not m:
        return []
    return [k.strip() for k in re.split(r", and |, ", m.group(1))]


def lm_loss(params, frozen, batch, *, cfg: ModelConfig, context_weight: float = 0.0):
    """Mean next-token cross-entropy on the answer tokens, plus `context_weight` x the mean over
    every other real token (plain language modelling of the prompts: the haystacks, needle lines and
    questions repeat keys and values, which is what grows copying heads early). Metrics: the two
    losses and answer-token accuracy."""
    logits, _, _ = extend(params, cfg, None, batch["tokens"], batch["positions"], fresh=True,
                          logit_index=None if context_weight else batch["target_index"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    if context_weight:
        ans_logp = jnp.take_along_axis(logp, batch["target_index"][..., None], axis=1)
        tokens = batch["tokens"]
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
        nll_all = -jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
        cw = batch["context_weights"]
        context_nll = (nll_all * cw).sum() / jnp.maximum(cw.sum(), 1.0)
    else:
        ans_logp, context_nll = logp, jnp.float32(0.0)
    nll = -jnp.take_along_axis(ans_logp, batch["targets"][..., None], axis=-1)[..., 0]
    w = batch["weights"]
    denom = jnp.maximum(w.sum(), 1.0)
    acc = ((jnp.argmax(ans_logp, -1) == batch["targets"]) * w).sum() / denom
    answer_nll = (nll * w).sum() / denom
    return answer_nll + context_weight * context_nll, {"answer_token_accuracy": acc, "answer_loss": answer_nll,
                                                        "context_loss": context_nll}


def plot_loss(logs: list[tuple[pathlib.Path, int]], out_png: pathlib.Path) -> list[dict[str, float]]:
    """Plots loss and answer-token accuracy against step from `log.jsonl` files, each with the step
    its run started from (phases of one training, in order); returns the rows, steps offset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{**row, "step": row["step"] + offset} for path, offset in logs
            for row in map(json.loads, filter(str.strip, path.read_text().splitlines()))]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r.get("answer_loss", r["loss"]) for r in rows], label="answer loss")
    if any("context_loss" in r for r in rows):
        ax.plot(steps, [r.get("context_loss", float("nan")) for r in rows], label="prompt-token loss", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["answer_token_accuracy"] for r in rows], color="tab:green", label="answer-token accuracy",
             alpha=0.8)
    ax2.set_ylabel("accuracy")
    for _, offset in logs[1:]:  # where a phase starts
        ax.axvline(offset, color="gray", linestyle="--", linewidth=0.8)
    fig.legend(loc="upper center", ncol=3, fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return rows


def write_model_card(out: pathlib.Path, conf: dict[str, Any], cfg: ModelConfig, rows: list[dict[str, float]],
                     config_path: str, scores: dict[str, Any] | None = None,
                     earlier: dict[str, Any] | None = None) -> None:
    """MODEL_CARD.md beside the exported weights: architecture, command, data, steps, loss curve."""
    optim = OptimConfig(**conf["optim"])
    curriculum = "; ".join(f"{c[1]} (batch {c[2] if len(c) > 2 else conf['data']['batch_size']}) until step {c[0]}"
                           for c in conf["data"].get("curriculum", []))
    n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))
    last = rows[-1] if rows else {}
    text = f"""# kvjax bundled model

A small Llama-architecture model (GQA) trained from scratch by kvjax's own code on the synthetic
long-context tasks of the evaluation's default suite, so that `python -m kvjax.eval` runs offline.
It is a test instrument for KV-cache eviction, not a language model.

- architecture: {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads
  (head_dim {cfg.head_dim}), MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size} (byte-level BPE in this
  folder), tied embeddings, RoPE theta {cfg.rope_theta}, {cfg.max_position_embeddings} positions; {n_params:,} parameters
- data: generated on the fly by `kvjax.eval.tasks` (suite `{conf['data']['suite']}`: RULER needle tasks and
  variable tracking), rendered with the chat template exactly as the evaluation renders them, at row lengths
  {conf['data']['lengths']} tokens{f" (first {curriculum})" if curriculum else ""}, batch {conf['data']['batch_size']}, seeds from
  {conf['data']['seed']} (disjoint from the evaluation's), task weights {conf['data'].get('task_weights', {})}
  (the last phase's data; each phase's config says what it changed).
  After its answer, each row holds further user turns asking about the other needles of its context
  (up to {conf['data'].get('drill_fraction', 0):.0%} of the row; values of several keys listed in {conf['data'].get('drill_order', 'query')} order),
  so one long context yields many retrieval targets.
  {conf['data'].get('copy_fraction', 0):.0%} of rows instead ask to repeat a list of random values (numbers, UUIDs,
  keys, variable names), which grows copying (induction) heads; from step
  {conf['data'].get('recall', {}).get('from_step', 0)}, a share of {conf['data'].get('recall', {}).get('share', 0):.0%}
  of those list needle lines and ask for every value again, as needle lines or as the evaluation's answer sentences
  ({conf['data'].get('recall', {}).get('uuids', 0):.0%} of them with UUID values; {conf['data'].get('recall', {}).get('multi_value', 0):.0%} of their keys with 2-4 values);
  from step {conf['data'].get('more_recall', {}).get('from_step', 0)}, a further
  {conf['data'].get('more_recall', {}).get('fraction', 0):.0%} of the task rows are such recall rows{
  f"; vt rows hold {conf['data']['vt_chains']} more chains, each asked about after the answer"
  if conf['data'].get('vt_chains') else ""}
- loss: mean cross-entropy on the answer tokens + {conf['train'].get('context_weight', 0)} x mean cross-entropy on
  every other prompt token (language modelling of the prompts)
- optimisation: AdamW, peak LR {optim.learning_rate}, warmup {optim.warmup_fraction:.0%}, cosine decay to
  {optim.final_fraction:.0%}, weight decay {optim.weight_decay}, clip {optim.clip_norm}; {last.get('step', 0)} steps in all
{_phases_table(config_path, conf, earlier)}
- final answer loss {last.get('answer_loss', last.get('loss', float('nan'))):.4f}, answer-token accuracy {last.get('answer_token_accuracy', float('nan')):.3f}
- reproduce: {_reproduce(config_path, earlier)}

![loss curve](loss_curve.png)

## Full-cache scores

{_scores_section(scores)}
"""
    (out / "MODEL_CARD.md").write_text(text)


def _phases_table(config_path: str, conf: dict[str, Any], earlier: dict[str, Any] | None) -> str:
    """A Markdown table of the training phases: config, steps, peak learning rate, data seed."""
    rows = ["| phase | config | steps | peak LR | data seed |", "|---:|---|---:|---:|---:|"]
    phases = [(p["config"], yaml.safe_load(pathlib.Path(p["config"]).read_text())) for p in _chain(earlier)]
    for j, (path, c) in enumerate(phases + [(config_path, conf)], start=1):
        rows.append(f"| {j} | `{path}` | {c['optim']['steps']} | {c['optim']['learning_rate']} | {c['data']['seed']} |")
    return "\n" + "\n".join(rows) + "\n"


def _chain(earlier: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The earlier phases a run started from (its `init_from.json`, nested), oldest first."""
    phases = []
    while earlier:
        phases.insert(0, earlier)
        earlier = earlier.get("earlier")
    return phases


def _reproduce(config_path: str, earlier: dict[str, Any] | None) -> str:
    cmd = "python -m kvjax.training.bundled"
    phases = _chain(earlier)
    if not phases:
        return (f"`{cmd} --config {config_path} --workdir runs/bundled` (resumes when re-run), then the same "
                "command with `--export kvjax/assets/model`")
    dirs = ["runs/bundled"] + [f"runs/bundled_{j + 2}" for j in range(len(phases))]
    steps = [f"`{cmd} --config {phases[0]['config']} --workdir {dirs[0]}` ({phases[0]['step']} steps)"]
    for j, phase in enumerate(phases[1:] + [{"config": config_path}], start=1):
        init = f" --init-from {dirs[j - 1]} --init-from-config {phases[j - 1]['config']}"
        steps.append(f"`{cmd} --config {phase['config']} --workdir {dirs[j]}{init}`"
                     + (f" ({phase['step']} steps)" if "step" in phase else ""))
    return (", then ".join(steps) + " (each resumes when re-run), then the last command with "
            "`--export kvjax/assets/model`; the loss curve shows every phase")


def full_cache_scores(eval_dir: str | pathlib.Path) -> dict[str, Any]:
    """Mean full-cache score per task (0-100) from an eval output folder's results.jsonl, plus its run config."""
    folder = pathlib.Path(eval_dir)
    per_task: dict[str, list[float]] = {}
    for line in (folder / "results.jsonl").read_text().splitlines():
        if line.strip() and (row := json.loads(line))["policy"] == "full":
            per_task.setdefault(row["task"], []).append(float(row["score"]))
    config = json.loads((folder / "run_config.json").read_text())
    return {"tasks": {t: 100 * float(np.mean(v)) for t, v in per_task.items()},
            "samples": {t: len(v) for t, v in per_task.items()}, "config": config}


def _scores_section(scores: dict[str, Any] | None) -> str:
    if not scores:
        return "Not measured yet: run `python -m kvjax.eval` and export again with `--scores OUT_DIR`."
    cfg = scores["config"]
    lines = [f"From `python -m kvjax.eval` (context length {cfg['context_length']}, seed {cfg['seed']}, "
             f"{'query-aware' if cfg['query_aware'] else 'query-agnostic'}), full cache:", "",
             "| task | samples | score |", "|---|---|---|"]
    lines += [f"| {t} | {scores['samples'][t]} | {v:.1f} |" for t, v in scores["tasks"].items()]
    mean = float(np.mean(list(scores["tasks"].values())))
    lines += [f"| **mean** | | **{mean:.1f}** |"]
    return "\n".join(lines)


def _restore(workdir: pathlib.Path, params, optim: OptimConfig) -> dict[str, Any]:
    """The latest training state in `workdir/checkpoints` (params shaped like `params`)."""
    from kvjax.checkpoint import Checkpointer
    from kvjax.training.loop import make_optimizer

    ckpt = Checkpointer(workdir / "checkpoints")
    like = {"trainable": params, "opt_state": make_optimizer(optim).init(params), "step": jnp.int32(0)}
    return ckpt.restore(like)


def _shapes(cfg: ModelConfig):
    from kvjax.models.loading import param_shapes

    return param_shapes(cfg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/bundled_model.yaml", help="training YAML (model, data, optim, train)")
    ap.add_argument("--workdir", default="runs/bundled", help="checkpoints and log.jsonl; rerun to resume")
    ap.add_argument("--steps", type=int, help="override optim.steps")
    ap.add_argument("--max-minutes", type=float, help="stop (with a checkpoint) after this long; rerun to resume")
    ap.add_argument("--export", help="write the trained model (HF format + tokenizer) to this folder and exit")
    ap.add_argument("--scores", help="with --export: an eval output folder whose full-cache scores go in the model card")
    ap.add_argument("--init-from", help="start from the final weights of this earlier run's workdir (a next phase)")
    ap.add_argument("--init-from-config", default="configs/bundled_model.yaml", help="the config of --init-from's run")
    args = ap.parse_args(argv)
    conf = yaml.safe_load(pathlib.Path(args.config).read_text())
    if args.steps:
        conf["optim"]["steps"] = args.steps
    tokenizer = load_tokenizer()
    cfg = model_config(conf["model"], tokenizer)
    params = init_params(cfg, jax.random.PRNGKey(conf["train"].get("init_seed", 0)))
    optim = OptimConfig(**conf["optim"])
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
        first = yaml.safe_load(pathlib.Path(args.init_from_config).read_text())
        state = _restore(pathlib.Path(args.init_from), params, OptimConfig(**first["optim"]))
        if int(state["step"]) != int(first["optim"]["steps"]):
            raise ValueError(f"--init-from {args.init_from} stopped at step {int(state['step'])}, not at the "
                             f"{first['optim']['steps']} steps of {args.init_from_config}: finish that run first")
        params = state["trainable"]
        workdir.mkdir(parents=True, exist_ok=True)
        phase = {"workdir": str(args.init_from), "config": args.init_from_config, "step": int(state["step"])}
        if (before := pathlib.Path(args.init_from) / "init_from.json").exists():  # a third phase or later
            phase["earlier"] = json.loads(before.read_text())
        (workdir / "init_from.json").write_text(json.dumps(phase))
    batches = TaskBatches(conf["data"], tokenizer)
    loss = functools.partial(lm_loss, cfg=cfg, context_weight=float(conf["train"].get("context_weight", 0.0)))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(conf, indent=2))
    _, steps = train(loss, params, None, batches, optim, args.workdir,
                     checkpoint_every=conf["train"]["checkpoint_every"], log_every=conf["train"]["log_every"],
                     max_seconds=None if args.max_minutes is None else args.max_minutes * 60)
    print(f"trained to step {steps} in {args.workdir}")


if __name__ == "__main__":
    main()
