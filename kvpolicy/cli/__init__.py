"""The ``kvpolicy`` command line: one module per subcommand (``run``, ``eval``, ``fidelity``,
``drift``, ``bench``, ``calibrate``, ``presets``), each with ``add_parser(sub)`` and ``main(args)``.

    kvpolicy run --preset louiskv --compare full      # the built-in ~4K-token needle demo
    kvpolicy run --preset quest --budget 1024 --prompt-file doc.txt --max-new-tokens 128
    kvpolicy presets                                  # presets and registered components
    kvpolicy drift --new-tokens 4096                  # recall over a long generation, per window

Bad input ends with a one-line error and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import KVPolicyError
from . import bench, calibrate, drift, fidelity, presets, run
from . import eval as eval_

EXIT_USAGE = 2
# in the order `kvpolicy --help` lists them
COMMANDS = {"run": run, "eval": eval_, "fidelity": fidelity, "drift": drift, "bench": bench,
            "calibrate": calibrate, "presets": presets}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpolicy", description="KV-cache retrieval policies for long-context decoding")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE to register its components (repeatable)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from ..registry import load_plugin_module

        for module in args.plugin + args.sub_plugin:
            load_plugin_module(module)
        return COMMANDS[args.command].main(args)
    except KVPolicyError as exc:
        print(f"kvpolicy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
