"""train_lookahead: the LookaheadKV training pipeline (targets -> sharded training -> export) over kvjax.

    python -m train_lookahead --config configs/lookahead_bundled.yaml --workdir runs/lkv
"""

from train_lookahead.config import RunConfig
from train_lookahead.pipeline import run

__all__ = ["RunConfig", "run"]
