"""Moved to `kvjax.data.targets`; this name stays for existing imports."""

from kvjax.data.targets import *  # noqa: F401,F403
