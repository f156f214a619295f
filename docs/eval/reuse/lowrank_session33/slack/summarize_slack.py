"""Tables from ``measure_slack.py``'s JSON files: python summarize_slack.py FILE.json ... > tables.md

Bytes as ``../summarize.py`` computes them for the top-k scheme (first pass ``5r + 26`` B a prompt unit; held
and candidate units read whole at ``5D + 26``), projected to 1x128K D=128 (8,192 prompt units a KV head) two
ways: the same candidate count a row (as the study's top-k projection) and the same candidate share of the
prompt units (as its filter projection)."""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from summarize import BIG_D, BIG_P, first_pass_bytes, today_unit_bytes  # noqa: E402  (the study's)


def quantile(hist, q):
    total = sum(hist.values())
    acc = 0
    for n in sorted(hist):
        acc += hist[n]
        if acc >= q * total:
            return n
    return max(hist)


def qs(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main(paths):
    runs = [json.load(open(p)) for p in paths]
    tot = lambda key: sum(r[key] for r in runs)  # noqa: E731
    dim, G = runs[0]["dim"], runs[0]["group"]
    rows, fires = tot("rows"), tot("full_fires")
    measured = sum(r["layer_steps"] - r["no_selection_steps"] for r in runs)
    prompt = statistics.mean(u for r in runs for u in r["prompt_units"])
    decode = statistics.mean(u for r in runs for u in r["decode_units"])
    held = tot("held_units") / rows
    today, today_big = today_unit_bytes(dim), today_unit_bytes(BIG_D)
    print(f"{len(runs)} runs ({', '.join(p.split('/')[-1][:-5] for p in paths)}); D={dim}, {G} query heads a KV "
          f"head; {measured} measured (layer, step) pairs ({tot('no_selection_steps')} first steps left out), "
          f"{rows} (layer, step, KV head) rows; the full trigger fired at {fires} ({fires / measured:.1%}). Units a "
          f"row: {prompt:.0f} prompt, {decode:.1f} decode (mean), {held:.1f} held. Today: {today} B a prompt unit "
          f"({today_big} B at D=128).\n")
    print("Slack threshold: candidates = unheld units with rank-r approx log mass >= T - delta for some query head "
          "of the KV head (T = held log mass + margin), read whole and scored exactly for every query head.\n")
    print("| basis | r | delta | missed fires | share | extra | missed (per-head) | candidates a row: mean | p99 | max "
          "| bytes vs today, 4K D=64 | 1x128K D=128, same count | 1x128K D=128, same share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = sorted(runs[0]["slack"], key=lambda k: (k.split(":")[0], int(k.split(":")[1]), float(k.split(":")[2])))
    for key in keys:
        basis, r, delta = key.split(":")
        s = {n: sum(run["slack"][key][n] for run in runs) for n in ("missed", "extra", "missed_per_head", "extra_per_head")}
        hist = {}
        for run in runs:
            for n, c in run["slack"][key]["cand_hist"].items():
                hist[int(n)] = hist.get(int(n), 0) + c
        mean = sum(n * c for n, c in hist.items()) / sum(hist.values())
        label = f"{basis}:{r}"
        ratio = (prompt * first_pass_bytes(label, dim, False) + (mean + held) * today) / (prompt * today)
        big_count = (BIG_P * first_pass_bytes(label, BIG_D, False) + (mean + held) * today_big) / (BIG_P * today_big)
        big_share = (first_pass_bytes(label, BIG_D, False) + (mean + held) / prompt * today_big) / today_big
        print(f"| {basis} | {r} | {delta} | {s['missed']} of {fires} | {s['missed'] / fires:.2%} | {s['extra']} | "
              f"{s['missed_per_head']} (extra {s['extra_per_head']}) | {mean:.1f} | {quantile(hist, 0.99)} | {max(hist)} | "
              f"{ratio:.2f} | {big_count:.3f} | {big_share:.3f} |")
    print("\nThe delta each full fire needs to be caught (candidate union; nats), over all fires, and the fires "
          "still missed at delta 2/4/6/8 from these values (a check of the direct counts):\n")
    print("| basis | r | median | p90 | p99 | max | <= 0 | missed @2 | @4 | @6 | @8 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    fires_of = {k: [f for run in runs for f in run["fires"].get(k, [])] for k in runs[0]["fires"]}
    order = sorted(fires_of, key=lambda k: (k.split(":")[0], int(k.split(":")[1])))
    for key in order:
        need = [f[0] for f in fires_of[key]]
        basis, r = key.split(":")
        print(f"| {basis} | {r} | {qs(need, .5):.2f} | {qs(need, .9):.2f} | {qs(need, .99):.2f} | {max(need):.2f} | "
              f"{sum(n <= 0 for n in need)} | {sum(n > 2 for n in need)} | {sum(n > 4 for n in need)} | "
              f"{sum(n > 6 for n in need)} | {sum(n > 8 for n in need)} |")
    print("\nMissed fires: approx - exact (nats) at the missed firing pair. 'best': the pair of largest exact gap; "
          "'closest': the firing pair nearest to being a candidate (its underestimate is at least delta plus its "
          "exact gap over the margin). Quantiles over the missed fires (min = heaviest underestimate):\n")
    print("| basis | r | delta | missed | best: median | p10 | min | closest: median | p10 | min | gap over margin: median | max |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key in order:
        basis, r = key.split(":")
        for delta in runs[0]["deltas"]:
            miss = [f for f in fires_of[key] if f[0] > delta]
            if not miss:
                print(f"| {basis} | {r} | {delta:g} | 0 | - | - | - | - | - | - | - | - |")
                continue
            eb, ec, gm = [f[3] for f in miss], [f[4] for f in miss], [f[2] for f in miss]
            print(f"| {basis} | {r} | {delta:g} | {len(miss)} | {statistics.median(eb):.2f} | {qs(eb, .1):.2f} | "
                  f"{min(eb):.2f} | {statistics.median(ec):.2f} | {qs(ec, .1):.2f} | {min(ec):.2f} | "
                  f"{statistics.median(gm):.2f} | {max(gm):.2f} |")
    print("\nKey energy captured by the basis (mean over (layer, KV head, run)):\n")
    print("| basis:r | energy |")
    print("|---|---:|")
    for key in sorted(runs[0]["energy"], key=lambda k: (k.split(":")[0], int(k.split(":")[1]))):
        e = sum(run["energy"][key][0] for run in runs) / sum(run["energy"][key][1] for run in runs)
        print(f"| {key} | {e:.3f} |")
    print("\nBy task (missed fires, candidate union):\n")
    tasks = sorted({p.split("/")[-1].rsplit("_seed", 1)[0] for p in paths})
    show = [k for k in keys if k.split(":")[2] in ("2", "4", "6")]
    print("| task | fires | " + " | ".join(show) + " |")
    print("|---|---:|" + "---:|" * len(show))
    for t in tasks:
        sel = [run for p, run in zip(paths, runs) if p.split("/")[-1].rsplit("_seed", 1)[0] == t]
        print(f"| {t} | {sum(r['full_fires'] for r in sel)} | " + " | ".join(
            str(sum(r["slack"][k]["missed"] for r in sel)) for k in show) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
