"""Training: the one optax loop of kvjax (`loop`: a sharded jitted step, Orbax checkpoints, exact resume).

Its entry points are the bundled model's trainer (`kvjax.training.bundled`, on one device) and
LookaheadKV's pipeline (`train_lookahead`, on a ("data", "model") mesh with grain input), which
imports this package; nothing here imports `train_lookahead`.
"""

from kvjax.training.loop import (
    OptimConfig,
    batch_shardings,
    build_step,
    init_state,
    learning_rate,
    make_optimizer,
    read_log,
    train,
    warmup_steps,
)

__all__ = ["OptimConfig", "batch_shardings", "build_step", "init_state", "learning_rate", "make_optimizer",
           "read_log", "train", "warmup_steps"]
