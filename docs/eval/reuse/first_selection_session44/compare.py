"""Session 44: the louiskv preset with its first selection from the prompt's last query, against the
preset's cells before (the first step's selection forced), answer by answer.

    python docs/eval/reuse/first_selection_session44/compare.py

Reads each cell's new rows (``*/results.jsonl`` here: s4k, s8k, g8k, g16k, g32k) and the earlier runs of the
same samples listed in BEFORE; prints per cell the mean score and re-selection share (the mean of the
samples', and over all (layer, step) pairs where the rows record their steps), and the samples whose
answers differ.
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
}
# (prompt length, budget) of each cell; a cell's new rows are in the folders named by its part before "@"
CELLS = {"s4k": (4096, 512), "s8k": (8192, 512), "g8k": (8192, 512), "g16k": (16384, 512),
         "g32k": (32704, 512), "g32k@2048": (32704, 2048)}


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


def main() -> None:
    for cell, sources in BEFORE.items():
        new_rows = {}
        for part in sorted(HERE.glob(f"{cell.split('@')[0]}[AB]/results.jsonl")):
            new_rows.update(rows(part, "louiskv", *CELLS[cell]))
        if not new_rows:
            continue
        before = {}
        for path, preset in sources:
            before.update(rows(path, preset, *CELLS[cell]))
        keys = sorted(new_rows)
        new = [new_rows[k] for k in keys]
        old = [before[k] for k in keys if k in before]
        print(f"{cell}: {len(new)} samples ({len(old)} with earlier rows)")
        for label, cells in (("before", old), ("now", new)):
            pairs = share_over_pairs(cells)
            print(f"  {label:6}: score {statistics.mean(c['score'] for c in cells):.1f}, re-selecting "
                  f"{100 * statistics.mean(c['reselect_share'] for c in cells):.1f}%"
                  + ("" if pairs is None else f" ({100 * pairs:.1f}% over pairs)"))
        same = sum(new_rows[k]["prediction"] == before[k]["prediction"] for k in keys if k in before)
        print(f"  the same answer: {same} of {len(old)}")
        for k in keys:
            if k in before and new_rows[k]["prediction"] != before[k]["prediction"]:
                print(f"    {k[0]} seed {k[1]}: {before[k]['score']:.0f} -> {new_rows[k]['score']:.0f}  "
                      f"{before[k]['prediction'][:48]!r} -> {new_rows[k]['prediction'][:48]!r}")


if __name__ == "__main__":
    main()
