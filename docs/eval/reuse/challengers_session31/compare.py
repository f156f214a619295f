"""Per-cell needle scores and re-selection shares: louiskv's SmolLM2 trigger with every=4 and 8 challengers
(e4c8) against the every-step default (and every-step clusterkv), budget 512, the four needle tasks.

Run from the repository root: python docs/eval/reuse/challengers_session31/compare.py > docs/eval/reuse/challengers_session31/compare.txt

Baselines (the default's cells as they exist in the repository):
- 4K seeds 0-3: session 20's out4-each-0.5 column (16-bit outlier keys; reuse/outlier_keys_4k_16samples/results.jsonl),
  and, where present, this session's rerun of the shipped louiskv preset (int8 keys; smollm2_4k_seeds0-3_default_results.jsonl).
- 4K seeds 6-9: session 25's shipped int8 default (int8_keys_session25/smollm2_4k_seeds6-9_int8_shipped_results.jsonl);
  e4c8 from session 29.
- 8K seeds 0-3: session 25's int8 trial patch (int8_keys_session25/smollm2_8k_seeds0-3_int8_patch_results.jsonl),
  the 16-bit session 21 cells beside it (outlier_keys_session21/needle_8k_results.jsonl); e4c8 niah_single from session 29.
- clusterkv (every step): reuse/needle_4k_512_16samples, outlier_keys_session21/needle_4k_seeds6-9_results.jsonl,
  reuse/needle_8k_512_16samples.
"""
import json
import os

R = "docs/eval/reuse/"
H = R + "challengers_session31/"


def load(path, preset=None):
    out = {}
    if not os.path.exists(path):
        return out
    for line in open(path):
        if not line.strip():
            continue
        r = json.loads(line)
        if preset is not None and r["preset"] != preset:
            continue
        out[(r["length"], r["task"], r["seed"])] = (r["score"], r["reselect_share"])
    return out


def merge(*ds):
    m = {}
    for d in ds:
        m.update(d)
    return m


cols = {
    "clusterkv": merge(load(R + "needle_4k_512_16samples/results.jsonl", "clusterkv"),
                       load(R + "outlier_keys_session21/needle_4k_seeds6-9_results.jsonl", "clusterkv"),
                       load(R + "needle_8k_512_16samples/results.jsonl", "clusterkv")),
    "default16": merge(load(R + "outlier_keys_4k_16samples/results.jsonl", "out4-each-0.5"),
                       load(R + "outlier_keys_session21/needle_4k_seeds6-9_results.jsonl", "out4-each-0.5"),
                       load(R + "outlier_keys_session21/needle_8k_results.jsonl", "out4-each-0.5")),
    "default8": merge(load(H + "smollm2_4k_seeds0-3_default_results.jsonl", "louiskv"),
                      load(R + "int8_keys_session25/smollm2_4k_seeds6-9_int8_shipped_results.jsonl", "louiskv"),
                      load(R + "int8_keys_session25/smollm2_8k_seeds0-3_int8_patch_results.jsonl", "louiskv")),
    "e4c8": merge(load(H + "smollm2_4k_seeds0-3_e4c8_results.jsonl", "e4c8"),
                  load(R + "challengers_session29/smollm2_4k_seeds6-9_e4c8_results.jsonl", "e4c8"),
                  load(R + "challengers_session29/smollm2_8k_seeds0-3_e4c8_partial_results.jsonl", "e4c8"),
                  load(H + "smollm2_8k_seeds0-3_e4c8_results.jsonl", "e4c8")),
}
# the default column compared against: int8 (shipped storage) where it exists, else 16-bit keys
default = merge(cols["default16"], cols["default8"])
src = {k: ("int8" if k in cols["default8"] else "16-bit") for k in default}

print("columns: clusterkv = every-step clusterkv; default = louiskv's SmolLM2 default trigger (every step, no")
print("challengers), int8 keys where such a cell exists, else 16-bit keys (marked); e4c8 = every=4, challengers=8.")
print("score = needle score; share = re-selection share (% of (layer, step) pairs).\n")

groups = [("4K seeds 0-3", 4096, (0, 1, 2, 3)), ("4K seeds 6-9", 4096, (6, 7, 8, 9)),
          ("4K all 32", 4096, (0, 1, 2, 3, 6, 7, 8, 9)), ("8K seeds 0-3", 8192, (0, 1, 2, 3))]
tasks = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"]


def fmt(v):
    return "-" if v is None else f"{v[0]:5.1f} {100 * v[1]:5.1f}%"


for name, length, seeds in groups:
    keys = [(length, t, s) for t in tasks for s in seeds]
    if name != "4K all 32":
        print(f"## {name}")
        print(f"{'cell':22s} {'clusterkv':>8s} {'default (keys)':>22s} {'e4c8':>14s} {'diff':>6s}")
        for k in keys:
            d, e, c = default.get(k), cols["e4c8"].get(k), cols["clusterkv"].get(k)
            diff = f"{e[0] - d[0]:+6.1f}" if d and e else "     -"
            print(f"{k[1]:16s} s{k[2]:<4d} {c[0] if c else float('nan'):8.1f} {fmt(d):>14s} ({src.get(k, '-'):6s}) {fmt(e):>14s} {diff}")
    both = [k for k in keys if k in default and k in cols["e4c8"]]
    print(f"-- {name}: {len(both)} cells with both default and e4c8 (of {len(keys)})")
    for label, col in [("clusterkv", cols["clusterkv"]), ("default (mixed keys)", default),
                       ("default 16-bit", cols["default16"]), ("default int8", cols["default8"]),
                       ("e4c8", cols["e4c8"])]:
        got = [col[k] for k in both if k in col]
        if not got:
            continue
        share = "" if label == "clusterkv" else f", re-selecting {100 * sum(r for _, r in got) / len(got):.1f}%"
        print(f"   {label:22s} mean score {sum(s for s, _ in got) / len(got):5.1f}{share} ({len(got)} cells)")
    if both:
        up = sum(cols["e4c8"][k][0] > default[k][0] for k in both)
        down = sum(cols["e4c8"][k][0] < default[k][0] for k in both)
        print(f"   e4c8 vs default: {up} cells up, {down} down, {len(both) - up - down} equal")
    print()
