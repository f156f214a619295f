#!/usr/bin/env python3
"""The standing mutation check: each named bug in ``scripts/mutations.py`` must fail its tests.

    .venv/bin/python scripts/mutation_check.py            # every mutation (about 6 minutes on 2 cores)
    .venv/bin/python scripts/mutation_check.py --list
    .venv/bin/python scripts/mutation_check.py --only layer-ignores-the-trigger --only host-read-of-next-slot
    .venv/bin/python scripts/mutation_check.py --rev HEAD  # a commit, not the working tree

For each mutation: copy the working tree (tracked and untracked, not ignored files; or with
``--rev`` the tree of a commit, which leaves out anyone's uncommitted edits) to a temporary
directory, replace the mutation's ``original`` text in its file, run its tests there with this
Python (``pytest -x``), and report KILLED (the tests failed) or SURVIVED (they passed). The
working tree itself is never modified. Exits 1 if any mutation survived or is STALE (its
``original`` text is no longer found exactly once: the code moved, so the entry in
``scripts/mutations.py`` must be rewritten against the new code), 0 when every one was killed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from mutations import MUTATIONS, Mutation  # noqa: E402


class Source:
    """Where the copy comes from: the working tree (``rev`` None) or a commit."""

    def __init__(self, rev: str | None):
        self.rev = rev
        if rev is not None:
            # resolved once: a branch that moves during the run must not mix two trees
            self.rev = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout.strip()

    def files(self) -> list[str]:
        if self.rev is None:
            command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        else:
            command = ["git", "ls-tree", "-r", "-z", "--name-only", self.rev]
        out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True).stdout
        names = [name for name in out.decode().split("\0") if name]
        return [n for n in names if (ROOT / n).is_file()] if self.rev is None else names

    def read(self, name: str) -> str | None:
        if self.rev is None:
            path = ROOT / name
            return path.read_text() if path.is_file() else None
        shown = subprocess.run(["git", "show", f"{self.rev}:{name}"], cwd=ROOT, capture_output=True)
        return shown.stdout.decode() if shown.returncode == 0 else None

    def copy_to(self, target: Path) -> None:
        if self.rev is None:
            for name in self.files():
                dest = target / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dest)
            return
        archive = subprocess.run(["git", "archive", "--format=tar", self.rev], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)


def _stale_reason(mutation: Mutation, source: Source) -> str | None:
    text = source.read(mutation.file)
    if text is None:
        return f"{mutation.file} does not exist"
    found = text.count(mutation.original)
    if found != 1:
        where = "is no longer" if found == 0 else f"occurs {found} times"
        return f"its original text {where} in {mutation.file}"
    return None


def _env(tree: Path) -> dict:
    env = dict(os.environ)
    # the copy's kvpolicy, not the editable install's
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _check_import(tree: Path) -> None:
    where = subprocess.run(
        [sys.executable, "-c", "import kvpolicy; print(kvpolicy.__file__)"],
        cwd=tree, env=_env(tree), check=True, capture_output=True, text=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"mutation_check: the copy imports kvpolicy from {where}, not from {tree}")


def run_one(mutation: Mutation, source: Source, timeout: float) -> tuple[str, str, float]:
    """(verdict, detail, seconds); verdict is KILLED, SURVIVED, STALE or ERROR."""
    stale = _stale_reason(mutation, source)
    if stale is not None:
        return "STALE", stale + ": the code moved; rewrite this entry in scripts/mutations.py", 0.0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvpolicy-mutant-") as tmp:
        tree = Path(tmp)
        source.copy_to(tree)
        _check_import(tree)
        path = tree / mutation.file
        path.write_text(path.read_text().replace(mutation.original, mutation.replacement, 1))
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *mutation.tests]
        try:
            result = subprocess.run(command, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "ERROR", f"tests ran past {timeout:.0f} s", time.monotonic() - start
    seconds = time.monotonic() - start
    output = result.stdout + result.stderr
    if result.returncode == 0:
        return "SURVIVED", _last_line(output), seconds
    if result.returncode == 1:
        failed = re.findall(r"^FAILED (\S+)", output, flags=re.M)
        return "KILLED", f"by {failed[0]}" if failed else _last_line(output), seconds
    # 2: interrupted (e.g. a collection error, which an import-breaking mutant causes); 5: no tests
    return ("KILLED" if result.returncode == 2 else "ERROR"), f"pytest exit {result.returncode}: {_last_line(output)}", seconds


def _last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation's tests (default 900)")
    parser.add_argument("--rev", metavar="REV", help="check this commit's tree instead of the working tree")
    args = parser.parse_args(argv)
    source = Source(args.rev)

    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            stale = _stale_reason(m, source)
            print(f"{m.name:42s} {m.file}: {m.why}{'  [STALE: ' + stale + ']' if stale else ''}")
            print(f"{'':42s} tests: {' '.join(m.tests)}")
        return 0
    unknown = [name for name in args.only or [] if name not in by_name]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    chosen = [by_name[name] for name in args.only] if args.only else list(MUTATIONS)

    verdicts = {}
    for m in chosen:
        verdict, detail, seconds = run_one(m, source, args.timeout)
        verdicts[m.name] = verdict
        print(f"{verdict:8s} {m.name} ({seconds:.0f} s): {detail}", flush=True)
    killed = sum(v == "KILLED" for v in verdicts.values())
    print(f"\nkilled {killed} of {len(chosen)}", end="")
    bad = {v: [n for n, x in verdicts.items() if x == v] for v in ("SURVIVED", "STALE", "ERROR")}
    for verdict, names in bad.items():
        if names:
            print(f"; {verdict.lower()}: {', '.join(names)}", end="")
    print()
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
