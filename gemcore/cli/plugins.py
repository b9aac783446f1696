"""``gem plugins``: every hook point, its implementations, who supplies each, and the selection."""
from __future__ import annotations

import argparse
import json

from gemcore.cli.common import add_config_arguments, load_from_args
from gemcore.plugin_manager import HOOK_POINTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def describe(config, manager) -> dict:
    """{"plugins": [...], "hook_points": {point: {"config_key", "selected", "implementations"}}}."""
    cfg = config.to_dict()
    points = {}
    for point, (hook_name, key) in HOOK_POINTS.items():
        section, field = key.split(".")
        impls = manager.implementations(point)
        points[point] = {
            "hook": hook_name,
            "config_key": key,
            "selected": cfg[section][field],
            "implementations": [{"name": i.name, "plugin": i.plugin, "distribution": i.distribution}
                                for i in impls.values()],
        }
    plugins = [{"name": p.name, "distribution": p.distribution, "module": p.module, "status": "loaded"}
               for p in manager.plugins.values()]
    plugins += [{"name": f.name, "distribution": f.distribution, "status": "failed", "error": f.error}
                for f in manager.failed.values()]
    plugins += [{"name": n, "status": "disabled"} for n in sorted(manager.disabled)]
    return {"plugins": plugins, "hook_points": points}


def run(args: argparse.Namespace) -> int:
    config, manager = load_from_args(args)
    info = describe(config, manager)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gemcore hook points")
    for col in ("hook point", "config key", "implementation", "plugin", "distribution", "selected"):
        table.add_column(col)
    for point, entry in info["hook_points"].items():
        if not entry["implementations"]:
            table.add_row(point, entry["config_key"], "-", "-", "-", entry["selected"])
        for impl in entry["implementations"]:
            chosen = "*" if impl["name"] == entry["selected"] else ""
            table.add_row(point, entry["config_key"], impl["name"], impl["plugin"],
                          impl["distribution"] or "?", chosen)
    console = Console()
    console.print(table)
    for p in info["plugins"]:
        if p["status"] != "loaded":
            console.print(f"plugin {p['name']}: {p['status']}" + (f" ({p['error']})" if "error" in p else ""))
    return 0
