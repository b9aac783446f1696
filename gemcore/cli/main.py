"""``gem``: one sub-command per module; each module has ``add_arguments(parser)`` and ``run(args) -> int``.

User errors (bad config, unknown implementation, bad input) print one line and exit with code 2;
no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from gemcore.config import ConfigError
from gemcore.plugin_manager import PluginError

#: sub-command -> (module, one-line help)
COMMANDS = {
    "train": ("gemcore.cli.train", "train the model (the main job)"),
    "info": ("gemcore.cli.info", "versions, GPUs, usable plugins and backends"),
    "plugins": ("gemcore.cli.plugins", "hook points, implementations and their plugins"),
    "plan": ("gemcore.cli.plan", "plan 5D parallelism for a model on a cluster"),
    "bench": ("gemcore.cli.bench", "benchmarks (attention, mx, comms, bbs, train)"),
}

USER_ERRORS = (ConfigError, PluginError, ValueError, FileNotFoundError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gem", description="gemcore: GEM-style recsys training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a command whose module is not part of this install
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> str:
    return f"gem: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning
    parser = build_parser()
    args = parser.parse_args(argv)
    from gemcore.trainer import TrainError

    try:
        return int(args._run(args) or 0)
    except (*USER_ERRORS, TrainError) as exc:
        print(f"gem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
