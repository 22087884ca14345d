"""Entry point: ``python -m kvjax.bench <subcommand> [options]``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from types import ModuleType

import kvjax.bench as _package


def subcommands() -> dict[str, ModuleType]:
    """Modules of kvjax.bench (not starting with "_") that define add_arguments and run."""
    found = {}
    for info in sorted(pkgutil.iter_modules(_package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{_package.__name__}.{info.name}")
        if callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None)):
            found[info.name] = module
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax.bench", description=_package.__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(subcommands()) + "}")
    for name, module in subcommands().items():
        text = getattr(module, "HELP", None)
        p = sub.add_parser(name, help=text and text.replace("%", "%%"), description=text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
