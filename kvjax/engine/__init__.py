"""The generation engine: bucketed batched prefill -> (compress) -> `lax.while_loop` decode.

- `inputs`: host side: prompt encoding and validation, length buckets, padding (`Batch`).
- `steps`: the jitted programs: model prefill, policy compression, chunk feed, decode loop.
- `api`: `generate`, `generate_settings`, `compress`, `continuation_logits`.

Prompts are right-padded to a length bucket; row b's prompt sits in cache slots 0..len_b-1 at
positions 0..len_b-1, and padding is masked by position -1. Each (bucket, batch size, policy,
budget, max_new_tokens bucket) compiles one prefill and one decode loop, reused by later calls.
A batch whose prompts fall in several buckets runs as sub-batches, each padded only to its own
bucket (`inputs.split_rows`; `split=None` keeps one batch padded to the longest prompt's bucket).
"""

from kvjax.engine.api import (
    GenerateOutput,
    Setting,
    compress,
    continuation_logits,
    generate,
    generate_settings,
    make_plan,
)
from kvjax.engine.inputs import BUCKETS, MIN_QUESTION_BUCKET, STEP_BUCKETS, bucket_length, encode_prompts
from kvjax.engine.steps import TRACE_COUNTS, prefill_spec

__all__ = [
    "BUCKETS",
    "MIN_QUESTION_BUCKET",
    "STEP_BUCKETS",
    "TRACE_COUNTS",
    "GenerateOutput",
    "Setting",
    "bucket_length",
    "compress",
    "continuation_logits",
    "encode_prompts",
    "generate",
    "generate_settings",
    "make_plan",
    "prefill_spec",
]
