"""A real model's re-selection share and miss fraction, by GPU unit cache size.

The pinned pool's cost of a re-selection is the rows it reads across PCIe: the miss fraction
(rows neither the retrieved buffer nor the unit cache held, of those the re-selection asked
for). Random-weight benchmarks select afresh each time (miss 1.0); this measures it on the
embedded model, on the demo's needle prompts (one per seed), so ``bench e2e``'s pinned rows can be
read at a real model's rate (issue "The GPU path at the floor", item 3).

    python3 benchmarks/miss_fraction.py [--model smollm2] [--tokens 4096] [--budget 512]
        [--presets louiskv] [--cache-multiples 0,1,2,4] [--seeds 0,1,2] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json

import torch

import kvpolicy
from kvpolicy.demo import answer_is_correct, needle_prompt
from kvpolicy.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--presets", default="louiskv")
    parser.add_argument("--cache-multiples", default="0,1,2,4",
                        help="unit cache sizes as multiples of the retrieved rows (0: no cache)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    rows = []
    print(f"{args.model}, {args.tokens}-token needle prompts, budget {args.budget}, {args.new_tokens} new tokens")
    print(f"{'preset':10s} {'cache':>6s} {'seed':>4s} {'re-select':>9s} {'miss':>6s} {'answer':>7s}")
    for name in args.presets.split(","):
        for multiple in (int(m) for m in args.cache_multiples.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                policy = kvpolicy.preset(name, budget=args.budget)
                policy = kvpolicy.preset(name, budget=args.budget, unit_cache_rows=multiple * policy.retrieval_budget)
                demo = needle_prompt(tokenizer, target_tokens=args.tokens, seed=seed)
                with policy.apply(model) as session, torch.inference_mode():
                    out = model.generate(input_ids=demo.input_ids, attention_mask=demo.attention_mask,
                                         max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
                    stats = session.stats()
                answer = tokenizer.decode(out[0, demo.input_ids.shape[1]:], skip_special_tokens=True)
                ok = answer_is_correct(answer, demo)
                rows.append({"preset": name, "cache_multiple": multiple, "seed": seed,
                             "reselect_share": stats.reselect_share, "miss_fraction": stats.miss_fraction_warm,
                             "correct": ok})
                print(f"{name:10s} {multiple:5d}R {seed:4d} {stats.reselect_share:9.3f} {stats.miss_fraction_warm:6.3f} "
                      f"{'right' if ok else 'wrong':>7s}", flush=True)
    for name in args.presets.split(","):
        for multiple in (int(m) for m in args.cache_multiples.split(",")):
            cell = [r for r in rows if r["preset"] == name and r["cache_multiple"] == multiple]
            print(f"{name:10s} {multiple:5d}R  mean re-select {sum(r['reselect_share'] for r in cell) / len(cell):.3f}, "
                  f"mean miss {sum(r['miss_fraction'] for r in cell) / len(cell):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
