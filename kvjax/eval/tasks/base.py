"""Moved to `kvjax.data.base`; this name stays for existing imports."""

from kvjax.data.base import *  # noqa: F401,F403
