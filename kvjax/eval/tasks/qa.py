"""Moved to `kvjax.data.qa`; this name stays for existing imports."""

from kvjax.data.qa import *  # noqa: F401,F403
