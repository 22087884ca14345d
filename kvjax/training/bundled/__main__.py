"""`python -m kvjax.training.bundled`: see `kvjax.training.bundled.cli`."""

from kvjax.training.bundled.cli import main

main()
