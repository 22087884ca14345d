"""Moved to `kvjax.data.prompts` (training renders prompts as the evaluation does); this name stays."""

from kvjax.data.prompts import *  # noqa: F401,F403
