"""Name -> class registry for policy components, and plugin discovery.

    @register("trigger", "every_other")
    class EveryOther(Trigger): ...

Third-party packages expose a module through the entry-point group ``kvpolicy.plugins``;
importing that module runs its ``@register`` decorators.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Callable, TypeVar

from .errors import ConfigError, UnknownNameError

KINDS = ("trigger", "units", "selector")
ENTRY_POINT_GROUP = "kvpolicy.plugins"

_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}
_loaded_plugins: set[str] = set()

T = TypeVar("T", bound=type)


def _check_kind(kind: str) -> None:
    if kind not in _REGISTRY:
        raise UnknownNameError(f"unknown component kind {kind!r}; known kinds: {', '.join(KINDS)}")


def register(kind: str, name: str) -> Callable[[T], T]:
    """Class decorator: make ``cls`` constructible by ``name`` in policies and presets."""
    _check_kind(kind)

    def decorate(cls: T) -> T:
        base = base_class(kind)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            what = f"class {cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
            raise ConfigError(f"cannot register {what} as {kind} {name!r}: a {kind} must subclass "
                              f"{base.__module__}.{base.__qualname__}")
        existing = _REGISTRY[kind].get(name)
        # the same definition run again (a re-run notebook cell, a reloaded module) replaces the old one
        same = existing is not None and (existing.__module__, existing.__qualname__) == (cls.__module__, cls.__qualname__)
        if existing is not None and existing is not cls and not same:
            raise ConfigError(
                f"{kind} {name!r} is already registered by {existing.__module__}.{existing.__qualname__}"
            )
        _REGISTRY[kind][name] = cls
        cls.registered_name = name
        return cls

    return decorate


def base_class(kind: str) -> type:
    """The class every component of ``kind`` subclasses (imported here: its module registers built-ins)."""
    if kind == "trigger":
        from .triggers.base import Trigger

        return Trigger
    if kind == "units":
        from .units.base import UnitBuilder

        return UnitBuilder
    from .selectors.base import Selector

    return Selector


def lookup(kind: str, name: str) -> type:
    """The class registered as ``name``; the error lists the known names."""
    _check_kind(kind)
    if name not in _REGISTRY[kind]:  # built-ins never wait on (or break with) third-party plugins
        load_plugins()
    try:
        return _REGISTRY[kind][name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY[kind])) or "(none)"
        raise UnknownNameError(f"unknown {kind} {name!r}; known {kind} components: {known}") from None


def names(kind: str) -> list[str]:
    _check_kind(kind)
    load_plugins()
    return sorted(_REGISTRY[kind])


def load_plugin_module(module: str) -> None:
    """Import a plugin module by dotted name (the CLI's ``--plugin``)."""
    if module in _loaded_plugins:
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"cannot import plugin module {module!r}: {exc}") from exc
    _loaded_plugins.add(module)


def load_plugins() -> None:
    """Import every module advertised in the ``kvpolicy.plugins`` entry-point group (once)."""
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value in _loaded_plugins:
            continue
        try:
            ep.load()
        except Exception as exc:  # a broken third-party plugin must name itself, every time
            raise ConfigError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        _loaded_plugins.add(ep.value)
