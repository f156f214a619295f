"""Plot a ``kvpolicy bench layer --json`` file: full attention's layer time over each policy's
amortised layer time, per context, one panel per batch size (above 1: the policy is faster).

    python3 benchmarks/plot_layer.py docs/bench/session4/call4_layer_grid.json docs/bench/session4/layer_grid.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def speedups(rows: list[dict]) -> dict[tuple[str, str, int], list[tuple[int, float]]]:
    """``(preset, pool, batch) -> [(context, full / amortised)]``; full is the cell's SDPA row."""
    full = {(r["batch"], r["context"]): r["full_sdpa_ms"] for r in rows if r.get("full_sdpa_ms") is not None}
    lines: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for r in rows:
        base = full.get((r["batch"], r["context"]))
        if base is None:
            raise ValueError(f"no full-attention row for batch {r['batch']}, context {r['context']}")
        lines.setdefault((r["preset"], r["placement"], r["batch"]), []).append((r["context"], base / r["amortised_ms"]))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args()
    payload = json.loads(args.json.read_text(encoding="utf-8"))
    lines = speedups(payload["rows"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({batch for _, _, batch in lines})
    presets = sorted({preset for preset, _, _ in lines})
    colour = {preset: f"C{i}" for i, preset in enumerate(presets)}  # one colour a preset, line style the pool
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for (preset, pool, b), points in sorted(lines.items()):
            if b != batch:
                continue
            contexts, ratios = zip(*sorted(points))
            ax.plot(contexts, ratios, marker="o", color=colour[preset], linestyle="-" if pool == "cpu" else "--",
                    label=f"{preset}, {pool} pool")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("full attention / policy layer time")
    axes[0][-1].legend(fontsize=8)
    meta = payload.get("meta", {})
    fig.suptitle(f"one decode layer, graph-replayed, amortised ({meta.get('device', '?')}, torch {meta.get('torch', '?')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
