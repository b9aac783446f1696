"""``gem train``: the main job."""
from __future__ import annotations

import argparse

from gemcore.cli.common import add_config_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--name", help="run name: output goes to runs/NAME/")
    p.add_argument("--max-steps", type=int, metavar="N", help="optimizer steps")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where to train")
    p.add_argument("--seed", type=int, metavar="S", help="seed of model, data and sampler")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gemcore.cli.report import print_summary, progress_bar
    from gemcore.trainer import run_training

    extra = []
    for flag, key in (("name", "run.name"), ("max_steps", "run.max_steps"), ("device", "run.device"),
                      ("seed", "run.seed")):
        value = getattr(args, flag)
        if value is not None:
            extra.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    config, manager = load_from_args(args, extra)
    if args.resume:  # the run's own config, with explicit overrides on top (e.g. more steps)
        from gemcore.config import load_config
        from pathlib import Path

        config = load_config(Path(args.resume) / "config.toml", [*args.overrides, *extra])
    console = Console(stderr=True)
    with progress_bar(console, config.run.max_steps, disabled=args.quiet) as update:
        summary, run_dir = run_training(config, manager, resume=args.resume, progress=update)
    print_summary(Console(), summary, run_dir)
    return 0
