"""Run a benchmark with module constants set first: a setting a GPU call measures before it is a default.

    python3 benchmarks/with_settings.py MODULE.NAME=VALUE [...] -- SCRIPT.py|-m MODULE [ARGS...]

Each ``MODULE.NAME`` must already exist (a misspelt constant is an error, not a new attribute);
``VALUE`` is read as a Python literal (``True``, ``4096``, ``'gather'``), else taken as a string. Then
the script (or ``-m`` module) runs as ``__main__`` with ``ARGS``. For example, pariskv end to end with
the radix level passes on larger chunks at every size:

    python3 benchmarks/with_settings.py kvpolicy.kernels.triton.rerank_select._RADIX_LEVEL_LARGE_CALL=0 \\
        -- -m kvpolicy bench e2e --contexts 32768 --batches 1 --presets pariskv@gpu
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys
from collections.abc import Sequence


def apply(setting: str) -> tuple[str, object]:
    """Set one ``MODULE.NAME=VALUE``; returns (``MODULE.NAME``, the value set)."""
    target, sep, text = setting.partition("=")
    module_name, dot, name = target.rpartition(".")
    if not sep or not dot or not name:
        raise SystemExit(f"with_settings: expected MODULE.NAME=VALUE, got {setting!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"with_settings: {module_name} has no {name!r} to set")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    setattr(module, name, value)
    return target, value


def main(argv: Sequence[str]) -> None:
    argv = list(argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit(__doc__)
    split = argv.index("--")
    for setting in argv[:split]:
        target, value = apply(setting)
        print(f"with_settings: {target} = {value!r}", flush=True)
    command = argv[split + 1:]
    if command[0] == "-m":
        if len(command) < 2:
            raise SystemExit("with_settings: -m needs a module")
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
