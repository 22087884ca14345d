"""Moved to `kvjax.data.haystacks`; this name stays for existing imports."""

from kvjax.data.haystacks import *  # noqa: F401,F403
