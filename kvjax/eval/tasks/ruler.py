"""Moved to `kvjax.data.ruler`; this name stays for existing imports."""

from kvjax.data.ruler import *  # noqa: F401,F403
