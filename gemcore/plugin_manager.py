"""Discover plugins through the ``gemcore.plugins`` entry-point group and resolve implementations.

Built-in plugins are registered the same way as third-party ones (see pyproject.toml). A plugin
whose import fails is remembered with its error and a warning is issued; it only becomes fatal when
the configuration selects a name that no loaded plugin offers, and then the error names every
plugin that failed (an unimportable plugin cannot say which names it would have offered).
"""
from __future__ import annotations

import importlib.metadata as importlib_metadata
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from gemcore import hookspecs

ENTRY_POINT_GROUP = "gemcore.plugins"
DISABLE_ENV = "GEMCORE_DISABLE_PLUGINS"

#: hook point name -> (registry hook, config key that selects one implementation)
HOOK_POINTS: dict[str, tuple[str, str]] = {
    "attention": ("gemcore_attention_impls", "attention.impl"),
    "precision": ("gemcore_precision_policies", "precision.impl"),
    "parallelism": ("gemcore_parallelism_impls", "parallelism.impl"),
    "communication": ("gemcore_comms_backends", "comms.backend"),
    "data": ("gemcore_samplers", "data.sampler"),
}


class PluginError(Exception):
    """A plugin problem the user must fix (unknown implementation, broken plugin selected)."""


@dataclass
class Implementation:
    """One named implementation offered at a hook point."""

    name: str
    factory: Callable[..., Any]
    plugin: str
    distribution: str | None


@dataclass
class FailedPlugin:
    name: str
    distribution: str | None
    error: str


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    module: str


@dataclass
class GemPluginManager:
    """A pluggy manager with gemcore's registries on top. One per process or per test."""

    pm: pluggy.PluginManager = field(default_factory=lambda: _new_pluggy_manager())
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    failed: dict[str, FailedPlugin] = field(default_factory=dict)
    disabled: set[str] = field(default_factory=set)

    @property
    def hook(self):
        return self.pm.hook

    # ------------------------------------------------------------------ loading
    def load_entry_points(self, disable: Iterable[str] = ()) -> None:
        """Import and register every plugin of the entry-point group not disabled by name."""
        self.disabled |= set(disable) | _env_disabled()
        seen: set[str] = set()
        for ep in _entry_points():
            if ep.name in seen:  # the same distribution seen twice on sys.path
                continue
            seen.add(ep.name)
            dist = _dist_name(ep)
            if ep.name in self.disabled:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure is reported, not fatal
                message = f"{type(exc).__name__}: {exc}"
                self.failed[ep.name] = FailedPlugin(ep.name, dist, message)
                warnings.warn(f"gemcore plugin {ep.name!r} ({dist or 'unknown distribution'}) "
                              f"failed to load: {message}", RuntimeWarning, stacklevel=2)
                continue
            self.register(plugin, name=ep.name, distribution=dist)

    def register(self, plugin: Any, name: str, distribution: str | None = None) -> None:
        """Register a plugin object or module under ``name`` (validated against the specs)."""
        if name in self.disabled:
            return
        self.pm.register(plugin, name=name)
        self.pm.check_pending()  # a hookimpl with a misspelt name is an error here, not silence
        self.plugins[name] = PluginInfo(name, distribution, getattr(plugin, "__name__", repr(plugin)))

    # ------------------------------------------------------------------ registries
    def implementations(self, hook_point: str) -> dict[str, Implementation]:
        """All implementations at ``hook_point`` (see :data:`HOOK_POINTS`), by name."""
        hook_name, _ = HOOK_POINTS[hook_point]
        hook_caller = getattr(self.pm.hook, hook_name)
        found: dict[str, Implementation] = {}
        for impl in reversed(hook_caller.get_hookimpls()):  # registration order
            plugin_name = self.pm.get_name(impl.plugin) or "?"
            offered = impl.function() or {}
            for name, factory in offered.items():
                if name in found:
                    raise PluginError(f"{hook_point} implementation {name!r} is offered by both "
                                      f"plugin {found[name].plugin!r} and {plugin_name!r}")
                info = self.plugins.get(plugin_name)
                found[name] = Implementation(name, factory, plugin_name,
                                             info.distribution if info else None)
        return found

    def resolve(self, hook_point: str, name: str) -> Implementation:
        """The implementation ``name`` at ``hook_point``, or a :class:`PluginError` saying why not."""
        impls = self.implementations(hook_point)
        if name in impls:
            return impls[name]
        key = HOOK_POINTS[hook_point][1]
        message = (f"{key}: unknown implementation {name!r}; available: "
                   f"{', '.join(sorted(impls)) or 'none'}")
        if self.disabled:
            message += f" (disabled plugins: {', '.join(sorted(self.disabled))})"
        if self.failed:  # an unimportable plugin cannot say what it offers: name every suspect
            broken = "; ".join(f"{f.name!r} ({f.distribution or 'unknown distribution'}): {f.error}"
                               for f in self.failed.values())
            message += f". Plugins that failed to load and may provide it: {broken}"
        raise PluginError(message)


def _new_pluggy_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _entry_points():
    return importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)


def _dist_name(ep) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def _env_disabled() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def create_plugin_manager(disable: Iterable[str] = ()) -> GemPluginManager:
    """A fresh manager with every entry-point plugin loaded (minus ``disable`` and the env list)."""
    manager = GemPluginManager()
    manager.load_entry_points(disable)
    return manager
