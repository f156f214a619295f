"""Tables from ``measure_lowrank.py``'s JSON files: python summarize.py FILE.json ... > tables.md"""
import json
import statistics
import sys

M = 4  # outlier keys a prompt unit
BIG_D, BIG_P = 128, 8192  # Qwen3-8B's head dim, and its prompt units a KV head at 128K (16 tokens a unit)


def today_unit_bytes(dim):
    """What the blocks kernel reads a prompt unit (benchmarks/outlier_blocks.py): 5 int8 vectors, key and
    rest scales and the rest count (float32), m valid flags, selectable, size (int64) and held mark."""
    return (M + 1) * dim + 3 * 4 + M + 1 + 8 + 1


def first_pass_bytes(label, dim, norms):
    """A prompt unit in a first pass: ``label`` ``basis:r`` (r int8 coordinates a vector) or ``bits:b`` (D
    dimensions at b bits); ``norms``: with a float16 residual norm a vector (the exact filter's bound)."""
    basis, n = label.split(":")[:2]
    per_vector = int(n) if basis != "bits" else dim * int(n) / 8
    return (M + 1) * (per_vector + (2 if norms else 0)) + 3 * 4 + M + 1 + 8 + 1


def rank_list(found):
    """``best_rank`` as a list of ranks (stored as a list, or as a ``{rank: count}`` histogram)."""
    if isinstance(found, dict):
        return [int(r) for r, c in found.items() for _ in range(c)]
    return found


def main(paths):
    runs = [json.load(open(p)) for p in paths]
    tot = lambda key: sum(r[key] for r in runs)  # noqa: E731
    dim = runs[0]["dim"]
    G = runs[0]["group"]
    rows, pairs, fires = tot("rows"), tot("pairs"), tot("full_fires")
    measured = sum(r["layer_steps"] - r["no_selection_steps"] for r in runs)
    prompt = statistics.mean(u for r in runs for u in r["prompt_units"])
    decode = statistics.mean(u for r in runs for u in r["decode_units"])
    held = tot("held_units") / rows
    print(f"{len(runs)} runs ({', '.join(p.split('/')[-1][:-5] for p in paths)}); D={dim}, {G} query heads a KV "
          f"head; {measured} measured (layer, step) pairs ({tot('no_selection_steps')} first steps left out), "
          f"{rows} (layer, step, KV head) rows, {pairs} (query head, unit) candidate pairs; the full trigger "
          f"fired at {fires} of them ({fires / measured:.1%}). Units a row: {prompt:.0f} prompt, {decode:.1f} "
          f"decode (mean), {held:.1f} held (scored exactly by every scheme).\n")
    today = today_unit_bytes(dim)
    er, ep, eu = tot("exact_reach_rows"), tot("exact_reach_pairs"), tot("exact_reach_units")
    print("Exact filter: candidate pairs whose bound reaches the threshold (held log mass + margin), rows with any, "
          "units an exact pass reads a row (the union over the KV head's query heads, held units apart), and "
          "bytes a step against today's table at this shape (D=%d, %.0f prompt units a row; first pass + held + "
          "reached units read whole, %d B a prompt unit today):\n" % (dim, prompt, today))
    print("| basis | r | coords | pairs reached | rows reached | units read exactly a row | bytes vs today | "
          "violations (>1e-4) | mean bound slack (nats) | key energy captured | bytes vs today, 1x128K D=128 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| (exact estimate itself) | - | - | {ep / pairs:.4f} | {er / rows:.4f} | {eu / rows:.1f} | - | - | - | - |")
    keys = sorted(runs[0]["filter"], key=lambda k: (k.startswith("bits"), k.split(":")[0], int(k.split(":")[1]), k.split(":")[2]))
    for key in keys:
        basis, r, coords = key.split(":")
        f = {n: sum(run["filter"][key][n] for run in runs) for n in
             ("reach_pairs", "rows_reached", "exact_units", "violations")}
        slack = sum(run["filter"][key]["mean_slack"][0] for run in runs) / sum(
            run["filter"][key]["mean_slack"][1] for run in runs)
        energy = "-" if basis == "bits" else "%.3f" % (sum(run["energy"][f"{basis}:{r}"][0] for run in runs) / sum(
            run["energy"][f"{basis}:{r}"][1] for run in runs))
        units = f["exact_units"] / rows
        ratio = (prompt * first_pass_bytes(key, dim, True) + (units + held) * today) / (prompt * today)
        # at 1x128K on the Qwen3-8B shape (D=128, 8,192 prompt units a KV head), the same share of units reached
        big = (first_pass_bytes(key, BIG_D, True) + (units / prompt) * today_unit_bytes(BIG_D)) / today_unit_bytes(BIG_D)
        print(f"| {basis} | {r} | {coords} | {f['reach_pairs'] / pairs:.4f} | {f['rows_reached'] / rows:.4f} | "
              f"{units:.1f} | {ratio:.2f} | {f['violations']} | {slack:.2f} | {energy} | {big:.2f} |")
    print("\nApproximate top-k then exact: (layer, step) decisions against the full trigger's; the units scored "
          "exactly a row (the union of the query heads' top k); the query heads whose exact best unheld unit is "
          "in that union; bytes a step against today's table at this shape:\n")
    print("| basis | r | k | missed fires | extra fires | units read exactly a row | best unit scored | "
          "bytes vs today | bytes vs today, 1x128K D=128 | mean abs approx. error (nats) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    qrows = sum(len(rank_list(run["approx"][next(iter(run["approx"]))]["best_rank"])) for run in runs)
    keys = sorted(runs[0]["topk"], key=lambda k: (k.startswith("bits"), k.split(":")[0], int(k.split(":")[1]), int(k.split(":")[2])))
    for key in keys:
        basis, r, k = key.split(":")
        t = {n: sum(run["topk"][key][n] for run in runs) for n in ("missed", "extra", "exact_units", "best_found")}
        err = sum(run["approx"][f"{basis}:{r}"]["abs_err"][0] for run in runs) / sum(
            run["approx"][f"{basis}:{r}"]["abs_err"][1] for run in runs)
        units = t["exact_units"] / rows
        ratio = (prompt * first_pass_bytes(key, dim, False) + (units + held) * today) / (prompt * today)
        # at 1x128K (D=128, 8,192 prompt units a KV head): the same units scored exactly (k does not grow)
        big = (BIG_P * first_pass_bytes(key, BIG_D, False) + (units + held) * today_unit_bytes(BIG_D)) / (
            BIG_P * today_unit_bytes(BIG_D))
        print(f"| {basis} | {r} | {k} | {t['missed']} of {fires} | {t['extra']} | {units:.1f} | "
              f"{t['best_found'] / qrows:.4f} | {ratio:.2f} | {big:.3f} | {err:.3f} |")
    print("\nWhere the exact best unheld unit falls in its query head's rank-r order (share of query-head rows):\n")
    print("| basis | r | rank 0 | < 4 | < 8 | < 16 | < 32 | >= 32 | worst |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key in sorted(runs[0]["approx"], key=lambda k: (k.startswith("bits"), k.split(":")[0], int(k.split(":")[1]))):
        ranks = [x for run in runs for x in rank_list(run["approx"][key]["best_rank"])]
        n = len(ranks)
        share = lambda c: sum(1 for x in ranks if x < c) / n  # noqa: E731
        basis, r = key.split(":")
        print(f"| {basis} | {r} | {share(1):.4f} | {share(4):.4f} | {share(8):.4f} | {share(16):.4f} | "
              f"{share(32):.4f} | {1 - share(32):.4f} | {max(ranks)} |")
    gaps = {k: sorted(g for run in runs for g in run["missed_gaps"].get(k, [])) for k in runs[0]["topk"]}
    print("\nMissed fires' full gap over the margin (nats), median and largest, for k = 8:\n")
    print("| basis:r:k | missed | median | largest |")
    print("|---|---:|---:|---:|")
    for key in keys:
        if key.endswith(":8") and gaps[key]:
            print(f"| {key} | {len(gaps[key])} | {statistics.median(gaps[key]):.2f} | {gaps[key][-1]:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
