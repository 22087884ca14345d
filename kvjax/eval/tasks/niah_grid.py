"""Moved to `kvjax.data.niah_grid`; this name stays for existing imports."""

from kvjax.data.niah_grid import *  # noqa: F401,F403
