"""``kvpolicy presets``: the presets with their defaults, and every registered component."""

from __future__ import annotations

from .common import add_plugin_flag


def add_parser(sub) -> None:
    presets = sub.add_parser("presets", help="list presets and registered components")
    add_plugin_flag(presets)


def main(args) -> int:
    from ..presets import PRESETS, preset, preset_doc
    from ..registry import KINDS, lookup, names

    print("presets:")
    for name in PRESETS:
        print(f"  {name:10s} {preset_doc(name)}")
        print(f"  {'':10s} defaults: {preset(name).describe().split(': ', 1)[1]}")
    print()
    for kind in KINDS:
        print(f"{kind} components:")
        for name in names(kind):
            cls = lookup(kind, name)
            summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            print(f"  {name:16s} {summary}  [{cls.__module__}]")
    return 0
