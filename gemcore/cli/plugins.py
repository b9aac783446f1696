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


def _table(info: dict):
    """The hook points as one table (its natural width may exceed a narrow terminal)."""
    from rich.table import Table

    table = Table(title="gemcore hook points")
    for col in ("hook point", "config key", "implementation", "plugin", "distribution", "selected"):
        table.add_column(col, no_wrap=True)
    for point, entry in info["hook_points"].items():
        if not entry["implementations"]:
            table.add_row(point, entry["config_key"], "-", "-", "-", entry["selected"])
        for impl in entry["implementations"]:
            chosen = "*" if impl["name"] == entry["selected"] else ""
            table.add_row(point, entry["config_key"], impl["name"], impl["plugin"],
                          impl["distribution"] or "?", chosen)
    return table


def _list_lines(info: dict) -> list[str]:
    """The same content as :func:`_table`, a hook point per heading and one short line per
    implementation (``*``: the selected one)."""
    lines = ["gemcore hook points (* selected)"]
    for point, entry in info["hook_points"].items():
        lines.append(f"{point} ({entry['config_key']} = {entry['selected']})")
        for impl in entry["implementations"]:
            mark = "*" if impl["name"] == entry["selected"] else " "
            lines.append(f" {mark} {impl['name']}: plugin {impl['plugin']} ({impl['distribution'] or '?'})")
        if not entry["implementations"]:
            lines.append("   (no implementation)")
    return lines


def run(args: argparse.Namespace) -> int:
    config, manager = load_from_args(args)
    info = describe(config, manager)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    table = _table(info)
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    if natural <= console.width:
        console.print(table)
    else:  # a narrow terminal: one line per implementation, nothing cut
        for line in _list_lines(info):
            console.print(line, markup=False, highlight=False, overflow="fold")
    for p in info["plugins"]:
        if p["status"] != "loaded":
            console.print(f"plugin {p['name']}: {p['status']}" + (f" ({p['error']})" if "error" in p else ""))
    return 0
