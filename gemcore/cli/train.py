"""``gem train``: the main job."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from gemcore.cli.common import add_config_arguments, load_from_args

#: flag -> config key it sets
FLAG_KEYS = (("parallel", "parallelism.impl"), ("name", "run.name"), ("max_steps", "run.max_steps"), ("device", "run.device"),
             ("seed", "run.seed"), ("checkpoint_every", "train.checkpoint_every"),
             ("max_time", "train.max_time_s"), ("eval_every", "train.eval_every"))


def _non_negative(kind, least=0):
    def parse(text: str):
        value = kind(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a value >= {least}, got {text!r}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--name", help="run name: output goes to runs/NAME/")
    p.add_argument("--max-steps", type=_non_negative(int, least=1), metavar="N",
                   help="optimizer steps of the whole run (the LR schedule spans them)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where to train")
    p.add_argument("--parallel", metavar="IMPL", help="parallelism.impl (single, fsdp, planned, auto, ...)")
    p.add_argument("--seed", type=_non_negative(int), metavar="S", help="seed of model, data and sampler")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its checkpoint; with a larger --max-steps the LR "
                        "decay is re-based from the resume step to the new end (no jump)")
    p.add_argument("--checkpoint-every", type=_non_negative(int), metavar="N",
                   help="save a checkpoint every N steps (always at the end)")
    p.add_argument("--max-time", type=_non_negative(float), metavar="SECONDS",
                   help="stop (and save) after this much training time")
    p.add_argument("--stop-after", type=_non_negative(int), metavar="N",
                   help="stop (and save) after N steps of this invocation; continue with --resume")
    p.add_argument("--eval-every", type=_non_negative(int), metavar="K", help="held-out AUC every K steps")
    p.add_argument("--peak-tflops", type=_non_negative(float), metavar="T",
                   help="device peak (dense bf16 TFLOP/s) for MFU when the built-in table lacks it")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _declared(key: str) -> bool:
    """Whether the config dataclasses declare ``section.name``."""
    from gemcore.config import Config

    section, name = key.split(".")
    return name in {f.name for f in dataclasses.fields(type(getattr(Config(), section)))}


def _apply_extra_fields(config, pending: dict[str, object]) -> None:
    """Set keys the config dataclasses do not declare yet (read by the trainer with getattr)."""
    for key, value in pending.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gemcore.cli.report import print_summary, progress_bar
    from gemcore.comms.launch import detect
    from gemcore.config import load_config
    from gemcore.trainer import RunComplete, TrainError, run_training

    extra, undeclared = [], {}
    for flag, key in FLAG_KEYS:
        value = getattr(args, flag)
        if value is None:
            continue
        if not _declared(key):
            undeclared[key] = value
        else:
            extra.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    config, manager = load_from_args(args, extra)
    if args.resume:  # the run's own config, with explicit overrides on top (e.g. more steps)
        saved = Path(args.resume) / "config.toml"
        if not saved.is_file():
            raise TrainError(f"--resume {args.resume}: no config.toml in that folder")
        config = load_config(saved, [*args.overrides, *extra])
    _apply_extra_fields(config, undeclared)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    launch = detect()
    # under a launcher (mpirun, torchrun) a rank's output is relayed: plain text, no ANSI codes,
    # whatever the rank's own stream looks like; alone, rich decides from the stream
    terminal = None if launch.launcher == "none" else False
    console = Console(stderr=True, force_terminal=terminal)
    try:
        with progress_bar(console, config.run.max_steps, disabled=args.quiet or launch.rank != 0) as update:
            summary, run_dir = run_training(config, manager, resume=args.resume, progress=update,
                                            stop_after=args.stop_after, peak_flops_per_s=peak)
    except RunComplete as done:
        if launch.rank == 0:
            print(f"gem train: {done}", file=sys.stderr)
        return 0
    if launch.rank == 0:  # global rank 0: the rank that wrote the run folder
        print_summary(Console(force_terminal=terminal), summary, run_dir)
    return 0
