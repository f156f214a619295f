import glob, json, os, sys
base = {}
for f in ["/work/main/docs/eval/reuse/challengers_session31/smollm2_4k_seeds0-3_default_results.jsonl",
          "/work/main/docs/eval/reuse/outlier_keys_session21/needle_4k_seeds6-9_results.jsonl"]:
    for l in open(f):
        r = json.loads(l)
        t = r["policy"]["trigger"]
        if r["length"] == 4096 and t.get("margin") == -0.5 and "challengers" not in t and "every" not in t:
            base[(r["task"], r["seed"])] = r
for label in sys.argv[1:]:
    rows = [json.loads(l) for f in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results_*.jsonl")) for l in open(f)]
    rows = [r for r in rows if r["preset"] == label]
    both = [(r, base[(r["task"], r["seed"])]) for r in rows if (r["task"], r["seed"]) in base]
    n = len(both)
    if not n: continue
    s = sum(r["score"] for r, _ in both) / n; sb = sum(b["score"] for _, b in both) / n
    sh = sum(r["reselect_share"] for r, _ in both) / n; shb = sum(b["reselect_share"] for _, b in both) / n
    same = sum(r["prediction"] == b["prediction"] for r, b in both)
    print(f"{label}: {n} cells; score {s:.1f} vs default {sb:.1f}; re-selecting {100*sh:.1f}% vs {100*shb:.1f}%; predictions equal {same}/{n}")
    for r, b in both:
        if r["prediction"] != b["prediction"]:
            print("   ", r["task"], r["seed"], repr(r["prediction"]), r["score"], "| default", repr(b["prediction"]), b["score"])
