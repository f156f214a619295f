"""Gemma 3 against SmolLM2: the approximate top-k's missed fires at several margins, and where each query head's exact
best unheld unit falls in its own rank-r order (margin-free).

    python compare.py GEMMA_RAW_DIR SMOLLM2_RAW_DIR > compare.md

Gemma 3's runs count misses at its preset margin (0.5) and, beside it, at -0.5 (SmolLM2's) and 0.0
(``topk_missed_at``, measure_lowrank.py here). SmolLM2's runs (../raw) counted only at -0.5; at +0.5 this gives
its full fires exactly (from ``full_gap_minus_margin``, one sample a run) and its misses as a lower bound (a miss at
-0.5 whose full gap is over +0.5: the top-k's gap is under -0.5, so it misses at +0.5 too)."""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from summarize import rank_list  # noqa: E402


def load(folder):
    paths = sorted(p for p in glob.glob(os.path.join(folder, "niah_*_seed*.json")) if "_closed_" not in p)
    return [json.load(open(p)) for p in paths]


def ranks_share(runs, key, below):
    ranks = [x for run in runs for x in rank_list(run["approx"][key]["best_rank"])]
    return sum(1 for x in ranks if x < below) / len(ranks), len(ranks)


def main(gdir, sdir):
    g, s = load(gdir), load(sdir)
    gD, sD = g[0]["dim"], s[0]["dim"]
    gm = {m: sum(r["full_fires_at"][m] for r in g) for m in g[0]["full_fires_at"]}
    gm["0.5"] = sum(r["full_fires"] for r in g)
    s_fires_m = sum(r["full_fires"] for r in s)  # at -0.5
    s_fires_p = sum(1 for r in s for x in r["full_gap_minus_margin"] if x > 1.0)  # at +0.5
    print(f"Gemma 3: {len(g)} runs, D={gD}; full fires at margin +0.5 (preset) {gm['0.5']}, 0.0 {gm['0.0']}, "
          f"-0.5 {gm['-0.5']}. SmolLM2: {len(s)} runs, D={sD}; full fires at -0.5 (preset) {s_fires_m}, at +0.5 "
          f"{s_fires_p}.\n")
    print("Missed fires of the approximate top-k (then exact), by margin. SmolLM2 at +0.5: a lower bound.\n")
    print("| basis | r | r/D | k | Gemma +0.5 (preset) | Gemma 0.0 | Gemma -0.5 | SmolLM2 -0.5 (preset) | SmolLM2 +0.5 (>=) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = sorted(g[0]["topk"], key=lambda k: (k.startswith("bits"), k.split(":")[0], int(k.split(":")[1]), int(k.split(":")[2])))

    def pct(a, b):
        return f"{a} ({a / b:.1%})" if b else "-"

    for key in keys:
        basis, r, k = key.split(":")
        gp = sum(run["topk"][key]["missed"] for run in g)
        g0 = sum(run["topk_missed_at"][key]["0.0"] for run in g)
        gn = sum(run["topk_missed_at"][key]["-0.5"] for run in g)
        if key in s[0]["topk"]:
            sn = pct(sum(run["topk"][key]["missed"] for run in s), s_fires_m)
            sp = pct(sum(1 for run in s for x in run["missed_gaps"].get(key, []) if x > 1.0), s_fires_p)
        else:
            sn = sp = "-"
        rd = "-" if basis == "bits" else f"1/{gD // int(r)}"
        print(f"| {basis} | {r} | {rd} | {k} | {pct(gp, gm['0.5'])} | {pct(g0, gm['0.0'])} | {pct(gn, gm['-0.5'])} | {sn} | {sp} |")
    print("\nShare of query-head rows whose exact best unheld unit ranks under 8 / 16 / 32 in the head's own rank-r "
          "order (no margin, no union over the query heads):\n")
    print("| basis | r | Gemma r/D | Gemma < 8 | Gemma < 16 | Gemma < 32 | SmolLM2 r/D | SmolLM2 < 8 | SmolLM2 < 16 | SmolLM2 < 32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key in sorted(g[0]["approx"], key=lambda k: (k.startswith("bits"), k.split(":")[0], int(k.split(":")[1]))):
        basis, r = key.split(":")
        gs = [ranks_share(g, key, b)[0] for b in (8, 16, 32)]
        if key in s[0]["approx"]:
            ss = [f"{ranks_share(s, key, b)[0]:.3f}" for b in (8, 16, 32)]
            srd = "-" if basis == "bits" else f"1/{sD // int(r)}"
        else:
            ss, srd = ["-"] * 3, "-"
        grd = "-" if basis == "bits" else f"1/{gD // int(r)}"
        print(f"| {basis} | {r} | {grd} | " + " | ".join(f"{x:.3f}" for x in gs) + f" | {srd} | " + " | ".join(ss) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
