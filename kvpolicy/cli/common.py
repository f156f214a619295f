"""What the subcommands share: the hidden per-subcommand ``--plugin``, the device default, list
flags, and output files checked before a long run rather than after it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import KVPolicyError


def add_plugin_flag(parser: argparse.ArgumentParser) -> None:
    """``--plugin`` after the subcommand too (``kvpolicy run --plugin m ...``), as before it."""
    parser.add_argument("--plugin", action="append", default=[], dest="sub_plugin", metavar="MODULE",
                        help=argparse.SUPPRESS)


def device_name(args) -> str:
    """``--device``, or cuda where there is one, else cpu."""
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def csv(values) -> str:
    """A library default as a flag's comma-separated text."""
    return ",".join(str(v) for v in values)


def ints(text: str, what: str) -> list[int]:
    """A comma-separated ``--what`` as integers."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KVPolicyError(f"--{what} takes comma-separated integers, got {text!r}") from None


def floats(text: str, what: str) -> list[float]:
    """A comma-separated ``--what`` as numbers."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KVPolicyError(f"--{what} takes comma-separated numbers, got {text!r}") from None
    if not values:
        raise KVPolicyError(f"--{what} needs at least one number, got {text!r}")
    return values


def check_writable(path: str | None, flag: str) -> None:
    """Fail now, not after the run, if ``path`` cannot be written (a file that is missing stays missing)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise KVPolicyError(f"{flag} {path!r} is a folder; name a file to write")
    existed = target.exists()
    try:
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise KVPolicyError(f"{flag} {path!r} cannot be written ({exc.strerror}); name a file in a writable folder") from None
    if not existed:
        target.unlink(missing_ok=True)


def write_text(path: str, text: str, flag: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise KVPolicyError(f"{flag} {path!r} cannot be written ({exc.strerror})") from None


def warn_past_positions(model, tokens: int, what: str) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        print(f"kvpolicy: warning: {what} ({tokens} tokens) exceeds the model's max_position_embeddings ({limit}); "
              "past it the model runs at positions it was not trained for", file=sys.stderr, flush=True)
