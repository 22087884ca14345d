"""RULER qa_1 (SQuAD v2 dev) and qa_2 (HotpotQA dev-distractor), from local files (§1.8).

Without the file the task is skipped with a message: kvjax ships no copy of either data set.
"""

from __future__ import annotations

import functools
import json
import pathlib
import random

from kvjax.data import templates as T
from kvjax.data.base import Options, Sample, TaskSkipped, fitted_sample, sample_rng
from kvjax.data.haystacks import require
from kvjax.data.ruler import MAX_NEW_TOKENS

QA_SOURCES = {"qa_1": ("squad", "the SQuAD v2 dev JSON (dev-v2.0.json)"),
              "qa_2": ("hotpotqa", "the HotpotQA dev-distractor JSON (hotpot_dev_distractor_v1.json)")}


@functools.lru_cache(maxsize=2)
def read_squad(path: str) -> tuple[list[dict], list[str]]:
    """Answerable questions and the sorted unique paragraphs of a SQuAD v2 JSON file."""
    data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["data"]
    docs = sorted({p["context"] for d in data for p in d["paragraphs"]})
    index = {c: j for j, c in enumerate(docs)}
    qas = []
    for d in data:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            gold = index[p["context"]]
            for qa in p["qas"]:
                if not qa.get("is_impossible", False):
                    qas.append({"query": qa["question"], "answers": [a["text"] for a in qa["answers"]],
                                "docs": [gold], "more": [j for j in article if j != gold]})
    return qas, docs


@functools.lru_cache(maxsize=2)
def read_hotpotqa(path: str) -> tuple[list[dict], list[str]]:
    """Questions and the sorted unique ``title\\nparagraph`` documents of a HotpotQA JSON file."""
    data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    render = lambda t, p: f"{t}\n{''.join(p)}"  # noqa: E731
    docs = sorted({render(t, p) for d in data for t, p in d["context"]})
    index = {c: j for j, c in enumerate(docs)}
    qas = [{"query": d["question"], "answers": [d["answer"]],
            "docs": [index[render(t, p)] for t, p in d["context"]], "more": []} for d in data]
    return qas, docs


def qa(task: str, opts: Options) -> list[Sample]:
    """Sample i asks question i; gold documents plus distractors (same article first), shuffled."""
    name, what = QA_SOURCES[task]
    path = require(opts.data, name, task, what)
    qas, docs = (read_squad if name == "squad" else read_hotpotqa)(path)
    if not qas:
        raise TaskSkipped(f"{task}: {path!r} holds no answerable question")
    samples = []
    for i in range(min(opts.num_samples, len(qas))):
        rng = sample_rng(opts.seed, task, i)
        item = qas[i]
        gold = item["docs"]
        more = rng.sample(item["more"], len(item["more"]))
        rest = [j for j in range(len(docs)) if j not in set(gold) | set(item["more"])]
        pool = more + rng.sample(rest, len(rest))

        def build(n: int, gold=gold, pool=pool, query=item["query"]) -> tuple[str, str, str]:
            chosen = [docs[j] for j in gold + pool[:n]]
            random.Random(opts.seed).shuffle(chosen)
            ctx = "\n\n".join(T.QA_DOCUMENT.format(i=j + 1, document=d) for j, d in enumerate(chosen))
            return T.QA_CONTEXT.format(context=ctx), T.QA_QUESTION.format(query=query), T.QA_ANSWER_PREFIX

        samples.append(fitted_sample(task, opts, i, build, item["answers"], MAX_NEW_TOKENS["qa"],
                               maximum=len(pool), haystack_type="documents"))
    return samples
