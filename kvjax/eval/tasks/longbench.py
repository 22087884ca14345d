"""LongBench v1, the 16 English and code tasks (§3), from local JSONL files or the Hub.

Files: ``data["longbench"]`` is a folder holding ``{task}.jsonl`` as in the official release
(fields ``input``, ``context``, ``answers``, ``all_classes``, ``_id``, ``length``). Without it, the
Hub is tried through `datasets` when installed and online; otherwise the task is skipped with a
message. Prompts are the official templates (``dataset2prompt.json``) verbatim, cut into
context / question / answer prefix as kvpress does: the instructions around the context stay
in the context, the line holding ``{input}`` is the question, and the final cue ("Answer:",
"Summary:", ...) is the answer prefix. When the prompt does not fit, the middle of the context
is dropped (LongBench's middle truncation, applied to the context field).
"""

from __future__ import annotations

import json
import pathlib

from kvjax.data.base import LengthFitter, Options, Sample, TaskSkipped, decode, encode

_QA = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
# task -> (template, question marker or None, answer prefix). Templates verbatim from dataset2prompt.json.
PROMPTS: dict[str, tuple[str, str | None, str]] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}"
        "\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. "
        "Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:", "Question: {input}", "Answer:"),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        "article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
        "\"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the "
        "above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot "
        "be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no "
        "question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}"
        "\n\nAnswer:", "Question: {input}", "Answer:"),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the "
        "above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
        "Question: {input}", "Answer:"),
    "hotpotqa": (_QA + "\n\nThe following are given passages.\n{context}\n\n" + _QA + "\n\nQuestion: {input}\nAnswer:",
                 "Question: {input}", "Answer:"),
    "2wikimqa": (_QA + "\n\nThe following are given passages.\n{context}\n\n" + _QA + "\n\nQuestion: {input}\nAnswer:",
                 "Question: {input}", "Answer:"),
    "musique": (_QA + "\n\nThe following are given passages.\n{context}\n\n" + _QA + "\n\nQuestion: {input}\nAnswer:",
                "Question: {input}", "Answer:"),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}"
        "\n\nNow, write a one-page summary of the report.\n\nSummary:", None, "Summary:"),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one "
        "or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript "
        "in one or more sentences.\n\nQuery: {input}\nAnswer:", "Query: {input}", "Answer:"),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, "
        "write a one-page summary of all the news.\n\nSummary:", None, "Summary:"),
    "trec": ("Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
             "{input}", "{input}", ""),
    "triviaqa": ("Answer the question based on the given passage. Only give me the answer and do not output any "
                 "other words. The following are some examples.\n\n{context}\n\n{input}", "{input}", ""),
    "samsum": ("Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
               "{input}", "{input}", ""),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: ", None, "The final answer is: "),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract "
        "is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the "
        "paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc."
        "\n\nThe answer is: ", "The following is an abstract.", "The answer is: "),
    "lcc": ("Please complete the code given below. \n{context}Next line of code:\n", None, "Next line of code:\n"),
    "repobench-p": ("Please complete the code given below. \n{context}{input}Next line of code:\n", "{input}",
                    "Next line of code:\n"),
}

# task -> (metric, max_new_tokens) from §3.2 (dataset2maxlen.json).
TASKS: dict[str, tuple[str, int]] = {
    "narrativeqa": ("qa_f1", 128), "qasper": ("qa_f1", 128), "multifieldqa_en": ("qa_f1", 64),
    "hotpotqa": ("qa_f1", 32), "2wikimqa": ("qa_f1", 32), "musique": ("qa_f1", 32),
    "gov_report": ("rouge", 512), "qmsum": ("rouge", 512), "multi_news": ("rouge", 512),
    "trec": ("classification", 64), "triviaqa": ("qa_f1", 32), "samsum": ("rouge", 128),
    "passage_count": ("count", 32), "passage_retrieval_en": ("retrieval", 32),
    "lcc": ("code_sim", 64), "repobench-p": ("code_sim", 64),
}
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lcc", "repobench-p"})
FIRST_LINE_ONLY = frozenset({"trec", "triviaqa", "samsum"})


def split_template(task: str) -> tuple[str, str, str]:
    """(context template, question template, answer prefix); their concatenation is the official template."""
    template, marker, prefix = PROMPTS[task]
    if not template.endswith(prefix):
        raise AssertionError(f"{task}: template does not end with its answer prefix")
    body = template[: len(template) - len(prefix)]
    cut = len(body) if marker is None else body.rindex(marker)
    return body[:cut], body[cut:], prefix


def load_rows(task: str, data: dict[str, str] | None) -> list[dict]:
    """Rows of ``{task}.jsonl`` in ``data["longbench"]``, else from the Hub, else TaskSkipped."""
    folder = (data or {}).get("longbench")
    if folder:
        path = pathlib.Path(folder) / f"{task}.jsonl"
        if not path.is_file():
            raise TaskSkipped(f"longbench/{task}: no file {path} (expected {{task}}.jsonl from the official release)")
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    try:
        import datasets
    except ImportError:
        raise TaskSkipped(f"longbench/{task} needs --data longbench=DIR with {task}.jsonl "
                          "(or the `datasets` package and a network connection for the Hub)") from None
    try:
        return list(datasets.load_dataset("THUDM/LongBench", task, split="test"))
    except Exception as err:  # offline, or the Hub refused: say so and go on
        raise TaskSkipped(f"longbench/{task}: no local file (--data longbench=DIR) and the Hub failed: "
                          f"{type(err).__name__}: {err}") from None


def _middle_truncate(tokenizer, text: str, keep: int) -> str:
    ids = encode(tokenizer, text)
    if len(ids) <= keep:
        return text
    half = keep // 2
    return decode(tokenizer, ids[:half]) + decode(tokenizer, ids[len(ids) - (keep - half):])


def longbench(task: str, opts: Options) -> list[Sample]:
    """The first ``num_samples`` rows of ``longbench/{name}``, fitted to ``context_length``."""
    name = task.split("/", 1)[1]
    metric, max_new = TASKS[name]
    rows = load_rows(name, opts.data)[: opts.num_samples]
    ctx_t, q_t, prefix = split_template(name)
    chat = name not in NO_CHAT_TEMPLATE
    fitter = LengthFitter(opts.tokenizer, opts.overhead if chat else 0)
    samples = []
    for j, row in enumerate(rows):
        question = q_t.replace("{input}", row.get("input", "") or "")
        raw = row["context"]
        context = ctx_t.replace("{context}", raw)
        room = opts.context_length - fitter.length(ctx_t.replace("{context}", ""), question, prefix, max_new)
        if room <= 0:
            raise ValueError(f"context_length {opts.context_length} leaves no room for the {task} context")
        if fitter.length(context, question, prefix, max_new) > opts.context_length:
            # Shrink until the whole prompt fits (token counts are not additive across the cut).
            keep = room
            while keep > 0:
                context = ctx_t.replace("{context}", _middle_truncate(opts.tokenizer, raw, keep))
                if fitter.length(context, question, prefix, max_new) <= opts.context_length:
                    break
                keep -= max(1, (fitter.length(context, question, prefix, max_new) - opts.context_length))
        samples.append(Sample(
            id=f"{task}/{row.get('_id', j)}", task=task, context=context, question=question, answer_prefix=prefix,
            answers=list(row["answers"]), max_new_tokens=max_new, chat_template=chat,
            length=fitter.length(context, question, prefix, max_new), target_length=opts.context_length,
            metadata={"all_classes": row.get("all_classes"), "metric": metric, "source_length": row.get("length"),
                      "truncated": context != ctx_t.replace("{context}", raw)},
        ))
    return samples
