"""Benchmarks: ``python -m kvjax.bench <subcommand>``.

Each public module of this package that defines ``add_arguments(parser)`` and ``run(args)``
(and optionally ``HELP``) is a subcommand named after the module: ``kernels`` lives in
``kernels.py``; adding ``overhead.py`` adds ``python -m kvjax.bench overhead``. Shared timing
and table helpers are in ``_timing.py``.
"""
