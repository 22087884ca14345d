"""Moved to `kvjax.data.words` (the synthetic tasks use it); this name stays for existing imports."""

from kvjax.data.words import *  # noqa: F401,F403
