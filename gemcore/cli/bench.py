"""``gem bench NAME``: dispatch to ``gemcore.bench.NAME`` (add_arguments / run)."""
from __future__ import annotations

import argparse
import importlib

#: benchmark name -> module; a benchmark whose module is absent is not offered.
BENCHMARKS = {
    "attention": "gemcore.bench.attention",
    "mx": "gemcore.bench.mx",
    "comms": "gemcore.bench.comms",
    "comms_overlap": "gemcore.bench.comms_overlap",
    "comms_step": "gemcore.bench.comms_step",
    "bbs": "gemcore.bench.bbs",
    "train": "gemcore.bench.train",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        bp = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else None)
        module.add_arguments(bp)
        bp.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return args._bench_run(args)
