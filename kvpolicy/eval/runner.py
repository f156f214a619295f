"""The accuracy grid: tasks x lengths x seeds x presets x budgets, resumable.

Each finished cell is appended to ``results.jsonl`` in the output folder as soon as it is
done, so an interrupted run resumes where it stopped (a finished cell is never recomputed).
A cell is keyed by everything that decides it: the model, the task, the length, the seed, the
column's label and the policy's full spec (``Policy.to_dict()``: components and their options,
budget, zones, placement, backend), so a column re-run with other options, or another model,
runs again rather than reusing a result it did not produce. Every row records its model and
spec. A folder holds one model's results unless ``add_model`` (``--add-model``) allows more.
Prefill runs once per prompt and is shared by every preset and budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import ConfigError
from ..presets import PRESETS, preset
from . import decode as decoding
from .defaults import GRID_BUDGETS, GRID_LENGTHS, GRID_PRESETS, GRID_SEEDS
from .tasks import TASKS, build_chat, get_task, make_sample, score

RESULTS = "results.jsonl"
EMBEDDED = "smollm2"


@dataclass
class CellResult:
    task: str
    length: int
    seed: int
    preset: str
    budget: int | None
    score: float
    prediction: str
    reselect_share: float | None
    recall: float | None
    recall_per_layer: dict[str, float]
    seconds: float
    # absent from rows written before they were recorded: such rows are never reused
    model: str | None = None
    policy: dict | None = None  # Policy.to_dict() without its name
    # RunStats.miss_fraction and its warm form (absent from rows written before they were recorded)
    miss_fraction: float | None = None
    miss_fraction_warm: float | None = None
    # the decode steps ``reselect_share`` counts (absent from rows written before it was recorded)
    decode_steps: int | None = None

    @property
    def key(self) -> str:
        return cell_key(self.model, self.task, self.length, self.seed, self.preset, self.budget, self.policy)


def policy_spec(policy) -> dict:
    """What decides a policy's results: ``Policy.to_dict()`` less its display name."""
    spec = policy.to_dict()
    spec.pop("name", None)
    return spec


def _canonical(spec: Any) -> str:
    return json.dumps(spec, sort_keys=True, default=str)


def cell_key(model: str | None, task: str, length: int, seed: int, preset_name: str, budget: int | None,
             spec: dict | None) -> str:
    digest = hashlib.sha1(_canonical(spec).encode()).hexdigest()[:12]
    return f"{model}|{task}|{length}|{seed}|{preset_name}|{'all' if budget is None else budget}|{digest}"


def model_identity(model: Any) -> str:
    """A name for the model a result came from: ``"smollm2"`` for the embedded model, else the
    resolved path it was loaded from (a spec string such as ``--model`` takes, or a model's
    ``config._name_or_path``). A model built in memory has no path: it is named by its class,
    so pass ``run_grid(model_name=...)`` to tell two such models apart."""
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
    else:
        text = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        if not text:
            return type(model).__name__
    if text.strip().lower() == EMBEDDED:
        return EMBEDDED
    path = Path(text).expanduser()
    if not path.exists():
        return text
    resolved = path.resolve()
    from ..models import cache_dir

    if resolved == (cache_dir() / "models" / "smollm2-135m-instruct").resolve():
        return EMBEDDED  # where load_model("smollm2") keeps the embedded model
    return str(resolved)


def _note(message: str) -> None:
    print(f"kvpolicy: note: {message}", file=sys.stderr, flush=True)


def load_results(path: Path, note: Callable[[str], None] | None = _note) -> dict[str, CellResult]:
    """The rows of ``results.jsonl`` by key. A last line that does not parse (a write cut short
    by an interrupted run) is skipped with a ``note``; any other line that does not parse is a
    ``ConfigError`` naming it."""
    path = Path(path)
    results: dict[str, CellResult] = {}
    if not path.exists():
        return results
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            cell = CellResult(**fields)
        except (ValueError, TypeError) as exc:
            if number == last:
                if note:
                    note(f"{path}: skipped its last line, cut short by an interrupted write; that cell runs again")
                continue
            raise ConfigError(f"{path} line {number + 1} is not an eval result ({exc}); "
                              "fix or delete that line, or use another output folder") from None
        results[cell.key] = cell
    return results


def _drop_torn_tail(path: Path) -> None:
    """Make the file end with a whole line before appending to it: a torn last line is cut off."""
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    try:
        CellResult(**json.loads(data[start:]))
    except (ValueError, TypeError):
        with path.open("r+b") as handle:
            handle.truncate(start)
        return
    with path.open("ab") as handle:  # whole, only its newline is missing
        handle.write(b"\n")


def check_out_dir(out_dir: str | Path, model_name: str, *, add_model: bool = False,
                  note: Callable[[str], None] | None = None) -> dict[str, CellResult]:
    """Create ``out_dir`` if needed and return its results; raise ``ConfigError`` if it is not a
    folder that can be written, or holds another model's results and ``add_model`` is false."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output folder {str(out)!r} is a file; name a folder (created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".{RESULTS}.probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write in output folder {str(out)!r} ({exc.strerror}); "
                          "name a writable folder") from None
    results = load_results(out / RESULTS, note=note)
    others = sorted({c.model or "(not recorded: written by an older kvpolicy)" for c in results.values()}
                    - {model_name})
    if others and not add_model:
        raise ConfigError(
            f"{out / RESULTS} holds results of another model ({', '.join(others)}), not of {model_name!r}; "
            "use another output folder, or --add-model (add_model=True) to add this model's results beside them"
        )
    return results


def check_names(names: Iterable[str], known: Iterable[str], what: str) -> list[str]:
    names, known = list(names), list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown {what} {', '.join(map(repr, unknown))}; known {what}s: {', '.join(known)}")
    return names


class _Progress:
    """One line, rewritten: done/total, elapsed, ETA from the mean time of cells run so far."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.total, self.done, self.enabled = total, done, enabled
        self.ran, self.started = 0, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        self.ran += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.ran * (self.total - self.done)
        print(f"\r[{self.done}/{self.total}] {elapsed:6.0f}s elapsed, ETA {eta:6.0f}s  {label:60.60s}",
              end="", flush=True)

    def close(self) -> None:
        if self.enabled and self.ran:
            print(flush=True)


def run_grid(
    model,
    tokenizer,
    *,
    out_dir: str | Path,
    tasks: Iterable[str] = tuple(TASKS),
    lengths: Iterable[int] = GRID_LENGTHS,
    budgets: Iterable[int] = GRID_BUDGETS,
    presets: Iterable[str] = GRID_PRESETS,
    seeds: Iterable[int] = GRID_SEEDS,
    variants: dict[str, tuple[str, dict]] | None = None,
    progress: bool = True,
    dry_run: bool = False,
    model_name: str | None = None,
    add_model: bool = False,
) -> list[CellResult]:
    """Run (or resume) the grid; returns this model's results in ``out_dir``, finished earlier or
    now: for the columns of this run, those of their current spec; for other columns, the last one
    written per cell.

    ``variants`` names extra columns: ``{label: (preset_name, options)}``, e.g.
    ``{"louiskv-anchor": ("louiskv", {"trigger": {"name": "query_cosine", "against": "anchor"}})}``;
    a label may then be used in ``presets`` like a preset name.
    ``model_name`` names the model in ``results.jsonl`` (default: ``model_identity(model)``);
    ``out_dir`` holding another model's results is a ``ConfigError`` unless ``add_model``.
    ``dry_run`` only validates the arguments (every preset is built at every budget).
    """
    variants = dict(variants or {})
    for label, (base, _) in variants.items():
        if label in PRESETS:
            raise ConfigError(f"variant label {label!r} is already a preset name; pick another label")
        check_names([base], PRESETS, "preset")
    tasks = check_names(tasks, TASKS, "task")
    presets = check_names(presets, list(PRESETS) + list(variants), "preset")
    lengths, budgets, seeds = list(lengths), list(budgets), list(seeds)
    if not (tasks and presets and lengths and budgets and seeds):
        raise ConfigError("the grid is empty: give at least one task, preset, length, budget and seed")
    for length in lengths:
        if length <= 0:
            raise ConfigError(f"lengths must be positive integers, got {length}")

    def base_of(name: str) -> str:
        return variants.get(name, (name, {}))[0]

    def build(name: str, budget: int | None, model=None):
        base, options = variants.get(name, (name, {}))
        policy = preset(base, model=model, **({} if base == "full" else {"budget": budget}), **options)
        policy.name = name
        return policy

    for name in presets:
        for budget in budgets:
            build(name, budget)  # raises on a bad budget or option
    if dry_run:
        return []
    model_name = model_name or model_identity(model)
    out = Path(out_dir)
    results = check_out_dir(out, model_name, add_model=add_model, note=_note)
    path = out / RESULTS

    specs: dict[tuple[str, int | None], str | None] = {}

    def spec_of(name: str, budget: int | None) -> str | None:
        """This run's spec of column ``name`` at ``budget``, canonical (None: it cannot be built)."""
        if (name, budget) not in specs:
            try:
                specs[(name, budget)] = _canonical(policy_spec(build(name, budget, model)))
            except ConfigError:
                specs[(name, budget)] = None
        return specs[(name, budget)]

    plan, done = [], 0
    for length in lengths:
        for task in tasks:
            for seed in seeds:
                cells = []
                for name in presets:
                    for budget in ([None] if base_of(name) == "full" else budgets):
                        spec = json.loads(spec_of(name, budget))
                        key = cell_key(model_name, task, length, seed, name, budget, spec)
                        if key in {c[2] for c in cells}:
                            continue
                        if key in results:
                            done += 1
                        else:
                            cells.append((name, budget, key))
                plan.append((length, task, seed, cells))
    bar = _Progress(done + sum(len(cells) for *_, cells in plan), done, progress)
    stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    device = next(model.parameters()).device

    _drop_torn_tail(path)
    with path.open("a", encoding="utf-8") as sink:
        for length, task, seed, cells in plan:
            if not cells:
                continue
            sample = make_sample(task, tokenizer, length, seed)
            chat = build_chat(tokenizer, sample)
            shared = decoding.prefill(model, chat["input_ids"].to(device), chat["attention_mask"].to(device))
            for name, budget, key in cells:
                started = time.perf_counter()
                policy = build(name, budget, model)
                decoded = decoding.decode(model, shared, policy, get_task(task).max_new_tokens,
                                          measure_recall=True, stop_ids=stop_ids)
                text = tokenizer.decode(decoded.tokens, skip_special_tokens=True)
                cell = CellResult(
                    task=task, length=length, seed=seed, preset=name, budget=budget,
                    score=score(task, text, sample.answers), prediction=text,
                    reselect_share=decoded.reselect_share,
                    recall=1.0 if policy.is_dense else decoded.recall,
                    recall_per_layer={str(k): v for k, v in decoded.recall_per_layer.items()},
                    seconds=time.perf_counter() - started,
                    model=model_name, policy=json.loads(_canonical(policy_spec(policy))),
                    miss_fraction=decoded.miss_fraction, miss_fraction_warm=decoded.miss_fraction_warm,
                    decode_steps=decoded.decode_steps,
                )
                assert cell.key == key
                sink.write(json.dumps(asdict(cell)) + "\n")
                sink.flush()
                results[key] = cell
                bar.step(f"{task} {length} seed {seed} {name} {budget or ''}")
    bar.close()

    current = set(presets)
    latest: dict[tuple, CellResult] = {}
    for cell in results.values():  # in the order written: a later row of a cell wins
        if cell.model != model_name:
            continue
        if cell.preset in current and _canonical(cell.policy) != spec_of(cell.preset, cell.budget):
            continue  # an earlier definition of a column this run defines anew
        latest[(cell.task, cell.length, cell.seed, cell.preset, cell.budget)] = cell
    return list(latest.values())
