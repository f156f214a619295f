"""Session 44: the louiskv preset with its first selection from the prompt's last query, against the
preset's cells before (the first step's selection forced), answer by answer.

    python docs/eval/reuse/first_selection_session44/compare.py

Reads each cell's new rows (``*/results.jsonl`` here: s4k, s8k, g8k, g16k, g32k) and the earlier runs of the
same samples listed in BEFORE; prints per cell the mean score and re-selection share (the mean of the
samples', and over all (layer, step) pairs where the rows record their steps), and the samples whose
answers differ; plots each cell's score against its share, before and now (frontier.png).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
REUSE = HERE.parent
# the preset's earlier rows of the same samples (first step forced; see EVAL.md's status table)
BEFORE = {
    "s4k": [(REUSE / "fixed_query_session34/results.jsonl", "fixed"),
            (REUSE / "fixed_query_session35/fixed4k/results.jsonl", "fixed")],
    "s8k": [(REUSE / "first_selection_share_session43/results_seeds0-3.jsonl", "louiskv")],
    "g8k": [(REUSE.parent / "gemma3/session25_8k/results.jsonl", "louiskv"),
            (REUSE / "gemma3_8k_512_seeds23_session34/results.jsonl", "louiskv")],
    "g16k": [(REUSE.parent / "gemma3/session23_out4_cpu", "out4-each+0.5*")],
    "g32k": [(REUSE.parent / "gemma3/session23_out4_cpu", "out4-each+0.5*")],
    "g32k@2048": [(REUSE.parent / "gemma3/session23_out4_cpu", "out4-each+0.5*")],
    # the 4K samples with the first step forced at this session's commit (the rows above are sessions 34-35's)
    "s4k@first_step": [(HERE / "s4kfsA/results.jsonl", "louiskv-first-step"),
                       (HERE / "s4kfsB/results.jsonl", "louiskv-first-step")],
}
# (prompt length, budget) of each cell; a cell's new rows are in the folders named by its part before "@"
CELLS = {"s4k": (4096, 512), "s8k": (8192, 512), "g8k": (8192, 512), "g16k": (16384, 512),
         "g32k": (32704, 512), "g32k@2048": (32704, 2048), "s4k@first_step": (4096, 512)}


def rows(path: Path, preset: str, length: int, budget: int) -> dict:
    """``{(task, seed): row}`` of ``preset``'s rows at ``length`` and ``budget`` in a file or a folder's
    files (``preset`` ending in "*": any label starting so)."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    found = {}
    for file in files:
        for line in file.read_text().splitlines():
            row = json.loads(line)
            label = str(row.get("preset", ""))
            named = label.startswith(preset[:-1]) if preset.endswith("*") else label == preset
            if named and row.get("length") == length and row.get("budget") == budget:
                found[(row["task"], row["seed"])] = row
    return found


def share_over_pairs(cells) -> float | None:
    if any(c.get("decode_steps") is None for c in cells):
        return None
    return sum(c["reselect_share"] * c["decode_steps"] for c in cells) / sum(c["decode_steps"] for c in cells)


# every-step clusterkv's score on the same samples (EVAL.md's status table, "Where issue 14's needle targets
# stand"): the target is louiskv within 2 points of it at no more than 25% re-selecting
CLUSTERKV = {"s4k": 58.6, "s8k": 32.8, "g8k": 43.8, "g16k": 28.1, "g32k": 37.5}
NAMES = {"s4k": "SmolLM2 4K", "s8k": "SmolLM2 8K", "g8k": "Gemma 3 8K", "g16k": "Gemma 3 16K", "g32k": "Gemma 3 32K"}


def plot(points: dict, path: Path) -> None:
    """Each cell's louiskv score against its re-selection share, before and now, beside clusterkv's score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(points), figsize=(3.2 * len(points), 3.4), sharey=True)
    for ax, (cell, (before, now)) in zip(list(getattr(axes, "flat", [axes])), points.items()):
        ax.axvspan(0, 25, color="0.93", label="share target (<= 25%)")
        ax.axhline(CLUSTERKV[cell], color="tab:green", ls="--", label="every-step clusterkv")
        ax.axhspan(CLUSTERKV[cell] - 2, CLUSTERKV[cell] + 100, color="tab:green", alpha=0.08,
                   label="score target (clusterkv - 2 or more)")
        ax.annotate("", xy=now, xytext=before, arrowprops={"arrowstyle": "->", "color": "tab:blue"})
        ax.plot(*before, "o", color="0.5", label="louiskv, first step forced")
        ax.plot(*now, "o", color="tab:blue", label="louiskv, first from the prompt")
        ax.set_title(NAMES[cell])
        ax.set_xlim(0, 35)
        ax.set_xlabel("re-selecting (layer, step) pairs, %")
    first = list(getattr(axes, "flat", [axes]))[0]
    first.set_ylabel("needle score")
    first.set_ylim(0, 70)
    first.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    points = {}
    for cell, sources in BEFORE.items():
        new_rows = {}
        for part in sorted(HERE.glob(f"{cell.split('@')[0]}[AB]/results.jsonl")):
            new_rows.update(rows(part, "louiskv", *CELLS[cell]))
        if not new_rows:
            continue
        before = {}
        for path, preset in sources:
            if path.exists():
                before.update(rows(path, preset, *CELLS[cell]))
        keys = sorted(new_rows)
        new = [new_rows[k] for k in keys]
        old = [before[k] for k in keys if k in before]
        if not old:
            print(f"{cell}: no earlier rows of its samples")
            continue
        print(f"{cell}: {len(new)} samples ({len(old)} with earlier rows)")
        for label, cells in (("before", old), ("now", new)):
            pairs = share_over_pairs(cells)
            print(f"  {label:6}: score {statistics.mean(c['score'] for c in cells):.1f}, re-selecting "
                  f"{100 * statistics.mean(c['reselect_share'] for c in cells):.1f}%"
                  + ("" if pairs is None else f" ({100 * pairs:.1f}% over pairs)"))
        if cell in CLUSTERKV and len(old) == len(new):
            points[cell] = tuple((100 * statistics.mean(c["reselect_share"] for c in cells),
                                  statistics.mean(c["score"] for c in cells)) for cells in (old, new))
        same = sum(new_rows[k]["prediction"] == before[k]["prediction"] for k in keys if k in before)
        print(f"  the same answer: {same} of {len(old)}")
        for k in keys:
            if k in before and new_rows[k]["prediction"] != before[k]["prediction"]:
                print(f"    {k[0]} seed {k[1]}: {before[k]['score']:.0f} -> {new_rows[k]['score']:.0f}  "
                      f"{before[k]['prediction'][:48]!r} -> {new_rows[k]['prediction'][:48]!r}")
    if points:
        plot(points, HERE / "frontier.png")
        print(f"wrote {HERE / 'frontier.png'}")


if __name__ == "__main__":
    main()
