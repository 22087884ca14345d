"""``python -m kvjax.eval``: see `kvjax.eval.cli` (``--help`` documents every option)."""

from kvjax.eval.cli import main

raise SystemExit(main())
