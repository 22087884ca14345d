"""Moved to `kvjax.data.templates`; this name stays for existing imports."""

from kvjax.data.templates import *  # noqa: F401,F403
