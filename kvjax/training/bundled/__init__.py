"""Training of the bundled default model: `python -m kvjax.training.bundled` (see `cli`).

config (typed YAML config), data (`TaskBatches`), drills and rows (what a row holds), loss
(`lm_loss`), report (loss curve, model card), cli (`main`). The names below are those of the
former single module, kept for existing imports.
"""

from kvjax.tokenizer import TOKENIZER_DIR, load_tokenizer
from kvjax.training.bundled.cli import _restore, main
from kvjax.training.bundled.config import BundledConfig, DataConfig, ModelSpec, TrainConfig, load_config, model_config
from kvjax.training.bundled.data import ANSWER_ROOM, TaskBatches
from kvjax.training.bundled.drills import NEEDLE, needle_drills, query_keys, render
from kvjax.training.bundled.loss import lm_loss
from kvjax.training.bundled.report import (
    _chain,
    _phases_table,
    _reproduce,
    _scores_section,
    _shapes,
    full_cache_scores,
    plot_loss,
    write_model_card,
)
from kvjax.training.bundled.rows import COPY_INSTRUCTION, MAX_TARGETS, RECALL_INSTRUCTION

__all__ = ["ANSWER_ROOM", "COPY_INSTRUCTION", "MAX_TARGETS", "NEEDLE", "RECALL_INSTRUCTION", "TOKENIZER_DIR",
           "BundledConfig", "DataConfig", "ModelSpec", "TaskBatches", "TrainConfig", "full_cache_scores",
           "lm_loss", "load_config", "load_tokenizer", "main", "model_config", "needle_drills", "plot_loss",
           "query_keys", "render", "write_model_card"]
