"""Moved to `kvjax.data.prose` (the synthetic tasks use it); this name stays for existing imports."""

from kvjax.data.prose import *  # noqa: F401,F403
