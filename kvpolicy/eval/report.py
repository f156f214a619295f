"""Tables, JSON summary and PNG plots of an evaluation grid."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Iterable

from .runner import CellResult

NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")


def summarize(cells: Iterable[CellResult]) -> list[dict]:
    """One row per (model, preset, budget, length): mean score over all tasks and over needle tasks,
    re-selection share and attention recall. Cells of two models are never averaged together.

    ``reselect_share`` is the mean of the cells' shares; ``reselect_share_pairs`` counts every (layer, step)
    pair of the group once, so a short answer weighs by its steps (None where a cell's steps were not
    recorded). Where the first decode step is forced to select (``first_selection="first_step"``), a short
    answer's share is at least one over its steps."""
    groups: dict[tuple, list[CellResult]] = defaultdict(list)
    for cell in cells:
        groups[(cell.model or "", cell.preset, cell.budget, cell.length)].append(cell)
    rows = []
    for (model, name, budget, length), group in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][3], kv[0][2] or 0, kv[0][1])):
        needles = [c.score for c in group if c.task in NEEDLE_TASKS]
        counted = [c for c in group if c.reselect_share is not None]
        shares = [c.reselect_share for c in counted]
        pairs = None
        if counted and all(c.decode_steps for c in counted):
            pairs = sum(c.reselect_share * c.decode_steps for c in counted) / sum(c.decode_steps for c in counted)
        recalls = [c.recall for c in group if c.recall is not None]
        per_task: dict[str, list[float]] = defaultdict(list)
        for c in group:
            per_task[c.task].append(c.score)
        rows.append({
            "model": model or None,
            "preset": name,
            "budget": budget,
            "length": length,
            "cells": len(group),
            "score": mean(c.score for c in group),
            "needle_score": mean(needles) if needles else None,
            "reselect_share": mean(shares) if shares else None,
            "reselect_share_pairs": pairs,
            "recall": mean(recalls) if recalls else None,
            "per_task": {task: mean(scores) for task, scores in sorted(per_task.items())},
        })
    return rows


def _fmt(value, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value:.1f}"


def table(rows: list[dict]) -> str:
    """A markdown table (it reads as plain text in a terminal too); a model column when rows hold two or more."""
    several = len({r.get("model") for r in rows}) > 1
    lines = [("| model " if several else "") + "| length | budget | preset | score | needle score | re-selecting | over pairs | recall | cells |",
             ("|---" if several else "") + "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            (f"| {r.get('model') or '-'} " if several else "")
            + f"| {r['length']} | {r['budget'] or 'all'} | {r['preset']} | {_fmt(r['score'])} | "
            f"{_fmt(r['needle_score'])} | {_fmt(r['reselect_share'], True)} | "
            f"{_fmt(r.get('reselect_share_pairs'), True)} | {_fmt(r['recall'], True)} | {r['cells']} |"
        )
    return "\n".join(lines)


def write_outputs(cells: list[CellResult], out_dir: str | Path) -> dict[str, Path]:
    """summary.json, table.md and the plots (when matplotlib is installed) in ``out_dir``."""
    out = Path(out_dir)
    rows = summarize(cells)
    written = {"summary": out / "summary.json", "table": out / "table.md"}
    written["summary"].write_text(json.dumps(rows, indent=2), encoding="utf-8")
    written["table"].write_text(table(rows) + "\n", encoding="utf-8")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    written.update(_plots(plt, rows, cells, out))
    return written


def _plots(plt, rows: list[dict], cells: list[CellResult], out: Path) -> dict[str, Path]:
    written = {}
    presets = sorted({r["preset"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})

    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for name in presets:
            points = [(r["budget"], r["score"]) for r in rows if r["preset"] == name and r["length"] == length]
            if name == "full" and points:
                ax.axhline(points[0][1], color="black", linestyle="--", label="full")
            elif points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=name)
        ax.set(title=f"{length} tokens", xlabel="budget (tokens)", ylabel="score", xscale="log")
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    written["score_vs_budget"] = out / "score_vs_budget.png"
    fig.savefig(written["score_vs_budget"], dpi=100)
    plt.close(fig)

    budget = 512 if 512 in budgets else (budgets[len(budgets) // 2] if budgets else None)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in presets:
        points = [(r["length"], r["score"]) for r in rows
                  if r["preset"] == name and (r["budget"] == budget or name == "full")]
        if points:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name == "full" else "-")
    ax.set(title=f"score vs context length (budget {budget})", xlabel="context (tokens)", ylabel="score")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written["score_vs_length"] = out / "score_vs_length.png"
    fig.savefig(written["score_vs_length"], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in presets:
        per_layer: dict[int, list[float]] = defaultdict(list)
        for c in cells:
            if c.preset == name and c.budget == budget:
                for layer, value in c.recall_per_layer.items():
                    per_layer[int(layer)].append(value)
        if per_layer:
            xs = sorted(per_layer)
            ax.plot(xs, [mean(per_layer[x]) for x in xs], marker=".", label=name)
    ax.set(title=f"attention recall per layer (budget {budget})", xlabel="layer", ylabel="recall of oracle top-budget mass")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written["recall_per_layer"] = out / "recall_per_layer.png"
    fig.savefig(written["recall_per_layer"], dpi=100)
    plt.close(fig)
    return written
