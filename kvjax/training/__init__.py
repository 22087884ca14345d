"""Training: a generic optax loop with Orbax resume (used for the bundled model and LookaheadKV)."""

from kvjax.training.loop import OptimConfig, make_optimizer, train

__all__ = ["OptimConfig", "make_optimizer", "train"]
