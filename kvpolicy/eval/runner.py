"""The accuracy grid: tasks x lengths x seeds x presets x budgets, resumable.

Each finished cell is appended to ``results.jsonl`` in the output folder as soon as it is
done, so an interrupted run resumes where it stopped (a finished cell is never recomputed).
Prefill runs once per prompt and is shared by every preset and budget.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from ..errors import ConfigError
from ..presets import PRESETS, preset
from . import decode as decoding
from .tasks import TASKS, build_chat, get_task, make_sample, score


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

    @property
    def key(self) -> str:
        return cell_key(self.task, self.length, self.seed, self.preset, self.budget)


def cell_key(task: str, length: int, seed: int, preset_name: str, budget: int | None) -> str:
    return f"{task}|{length}|{seed}|{preset_name}|{budget if preset_name != 'full' else 'all'}"


def load_results(path: Path) -> dict[str, CellResult]:
    results: dict[str, CellResult] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                cell = CellResult(**json.loads(line))
                results[cell.key] = cell
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
    lengths: Iterable[int] = (2048, 4096, 8192),
    budgets: Iterable[int] = (256, 512, 1024),
    presets: Iterable[str] = ("full", "streaming", "quest", "arkvale", "clusterkv", "louiskv", "pariskv", "oracle"),
    seeds: Iterable[int] = (0, 1, 2),
    variants: dict[str, tuple[str, dict]] | None = None,
    progress: bool = True,
    dry_run: bool = False,
) -> list[CellResult]:
    """Run (or resume) the grid; returns every cell's result, finished earlier or now.

    ``variants`` names extra columns: ``{label: (preset_name, options)}``, e.g.
    ``{"louiskv-anchor": ("louiskv", {"trigger": {"name": "query_cosine", "against": "anchor"}})}``;
    a label may then be used in ``presets`` like a preset name.
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    results = load_results(path)

    plan = []
    for length in lengths:
        for task in tasks:
            for seed in seeds:
                cells = []
                for name in presets:
                    for budget in ([None] if name == "full" else budgets):
                        key = cell_key(task, length, seed, name, budget)
                        if key not in results and key not in {c[2] for c in cells}:
                            cells.append((name, budget, key))
                plan.append((length, task, seed, cells))
    total = len(results) + sum(len(cells) for *_, cells in plan)
    bar = _Progress(total, len(results), progress)
    stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    device = next(model.parameters()).device

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
                    task=task, length=length, seed=seed, preset=name, budget=None if name == "full" else budget,
                    score=score(task, text, sample.answers), prediction=text,
                    reselect_share=decoded.reselect_share,
                    recall=1.0 if policy.is_dense else decoded.recall,
                    recall_per_layer={str(k): v for k, v in decoded.recall_per_layer.items()},
                    seconds=time.perf_counter() - started,
                )
                sink.write(json.dumps(asdict(cell)) + "\n")
                sink.flush()
                results[key] = cell
                bar.step(f"{task} {length} seed {seed} {name} {budget or ''}")
    bar.close()
    return list(results.values())
