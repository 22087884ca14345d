"""`TaskBatches`: the bundled model's training batches, a pure function of the step.

Each step draws one row length (cycling through `data.lengths`, after the curriculum) and
`batch_size` rows: task samples of the suite rendered exactly as the evaluation renders them
(kvjax.data.prompts) and answered, followed by needle drills; or copy / recall rows (`rows`).
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvjax.data import generate, suite_tasks
from kvjax.data import templates as T
from kvjax.data.prompts import chat_overhead
from kvjax.data.ruler import MAX_NEW_TOKENS
from kvjax.data.words import NOISE_SENTENCE
from kvjax.training.bundled.config import DataConfig
from kvjax.training.bundled.drills import needle_drills, query_keys, render
from kvjax.training.bundled.rows import MAX_TARGETS, copy_row, recall_row, turn_format

ANSWER_ROOM = 40  # tokens a row keeps for its answer (the longest, four needle values, is 37 with the end token)


class TaskBatches:
    """batches(step) -> tokens, positions [B, length]; target_index, targets, weights [B, MAX_TARGETS].

    A pure function of `step`. target_index[b, j] is the position whose logits predict targets[b, j].
    Each row is one task sample rendered exactly as the evaluation renders it, answered, then (for
    samples whose context holds other needles) followed by further user turns of `needle_drills`
    until the row is full; a random fraction up to `drill_fraction` of the row is set aside for them.
    A `copy_fraction` of rows instead ask to repeat a list of random values (`_copy_row`). With
    `vt_chains`, vt rows hold that many more chains, each asked about after the answer (`_vt_row`).
    `curriculum` ([[until_step, lengths, batch_size?], ...]) trains on shorter rows (in bigger batches)
    first; `task_weights` repeats tasks in the mix (the needle-haystack tasks carry the most drills).
    """

    def __init__(self, data: DataConfig | Mapping[str, Any], tokenizer: Any):
        """data: a `DataConfig`, or the `data` mapping of a YAML config; tokenizer: the bundled one."""
        if not isinstance(data, DataConfig):
            data = DataConfig.from_dict(data)
        self.config = data
        self.lengths = list(data.lengths)
        self.curriculum = [(c.until, list(c.lengths), c.batch_size) for c in data.curriculum]
        self.batch_size = data.batch_size
        self.seed = data.seed
        self.tokenizer = tokenizer
        self.overhead = chat_overhead(tokenizer)
        self.turn = turn_format(tokenizer)
        all_lengths = sorted({n for _, ls, _ in self.curriculum for n in ls} | set(self.lengths))
        self.min_length = {t: self._min_length(t, max(all_lengths)) for t in suite_tasks(data.suite)}
        weights = data.task_weights
        if unknown := set(weights) - set(self.min_length):
            raise ValueError(f"task_weights names {sorted(unknown)}, not in suite {data.suite!r}: "
                             f"{sorted(self.min_length)}")
        # each task appears task_weights[task] times (default 1) in the cycle rows are drawn from
        self.tasks = {n: [t for t, m in self.min_length.items() if m <= n for _ in range(weights.get(t, 1))]
                      for n in all_lengths}
        if not all(self.tasks.values()):
            raise ValueError(f"no task of suite {data.suite!r} fits lengths {all_lengths}")

    def _generate(self, task: str, length: int, index: int) -> dict[str, Any]:
        return generate(task, self.tokenizer, length, 1, seed=self.seed + index, overhead=self.overhead)[0]

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
        data = self.config
        if rng.random() < data.copy_fraction:
            if step >= data.recall.from_step and rng.random() < data.recall.share:
                return self._recall_row(length, index)
            return self._copy_row(length, index)
        if step >= data.more_recall.from_step and rng.random() < data.more_recall.fraction:
            return self._recall_row(length, index)
        if task == "vt" and data.vt_chains:
            return self._vt_row(length, index)
        reserve = int(length * rng.uniform(0.0, data.drill_fraction))
        # the generators keep the task's whole generation cap free; a training row needs only ANSWER_ROOM of it
        slack = max(0, MAX_NEW_TOKENS["vt" if task == "vt" else "niah"] - ANSWER_ROOM)
        sample = self._generate(task, max(self.min_length[task], length + slack - reserve), index)
        queried = set(query_keys(sample))
        drills = [d for d in needle_drills(sample, rng, data.drill_order) if not queried & set(d[3])]
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
        rng = random.Random(self.seed * 9_000_011 + index)
        probe = self.turn.format(question=T.VT_QUESTION.format(query="12345"),
                                 prefix=T.VT_ANSWER_PREFIX.format(num_v=5, query="12345"))
        per_turn = len(self.tokenizer.encode(probe + " ".join(["ABCDE"] * 5), add_special_tokens=False)) + 1
        sample = self._generate("vt", max(self.min_length["vt"], length - self.config.vt_chains * per_turn), index)
        ctx = sample["context"]
        start = ctx.rfind(T.VT_CONTEXT.split("\n")[0])  # after the one-shot example
        lines = ctx[start:].split("\n")
        noise = [j for j, line in enumerate(lines) if line == NOISE_SENTENCE.strip()]
        taken, values = set(sample["answers"]) | {"VAR"}, {sample["question"].split("value ")[1].split()[0]}
        chains = []
        for _ in range(min(self.config.vt_chains, len(noise) // 5)):
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

    def _copy_row(self, length: int, index: int) -> tuple[list[int], list[int]]:
        """A copy row (`rows.copy_row`)."""
        return copy_row(self.tokenizer, length, self.seed, index)

    def _recall_row(self, length: int, index: int) -> tuple[list[int], list[int]]:
        """A recall row (`rows.recall_row`) with this config's `recall.uuids` and `recall.multi_value`."""
        return recall_row(self.tokenizer, length, self.seed, index, uuids=self.config.recall.uuids,
                          multi_value=self.config.recall.multi_value)

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

