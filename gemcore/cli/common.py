"""Options shared by sub-commands: --config / --set, and building the plugin manager from them."""
from __future__ import annotations

import argparse

from gemcore.config import Config, load_config
from gemcore.plugin_manager import GemPluginManager, create_plugin_manager


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="F", help="TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set attention.impl=jfa (repeatable)")


def load_from_args(args: argparse.Namespace, extra: list[str] = ()) -> tuple[Config, GemPluginManager]:
    """The validated config and a plugin manager honouring ``plugins.disable``."""
    config = load_config(args.config, [*args.overrides, *extra])
    return config, create_plugin_manager(config.plugins.disable)
