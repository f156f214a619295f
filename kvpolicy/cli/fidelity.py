"""``kvpolicy fidelity``: long-output fidelity of presets against full attention's own output
(``kvpolicy.eval.fidelity.measure``): teacher-forced KL and top-1 agreement, then free-running
agreement and the first divergence.

    kvpolicy fidelity --length 2048 --new-tokens 1024 --budget 512
"""

from __future__ import annotations

import json
import time

from ..errors import KVPolicyError
from ..eval.defaults import FIDELITY_NEW_TOKENS
from .common import add_plugin_flag, check_writable, device_name, write_text


def add_parser(sub) -> None:
    fid = sub.add_parser("fidelity", help="long-output fidelity of presets against full attention's own output")
    fid.add_argument("--model", default="smollm2", help="as for `run`")
    fid.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default 2048)")
    fid.add_argument("--new-tokens", type=int, default=FIDELITY_NEW_TOKENS,
                     help=f"tokens full attention generates (default {FIDELITY_NEW_TOKENS})")
    fid.add_argument("--budget", type=int, default=512)
    fid.add_argument("--presets", default="streaming,quest,arkvale,clusterkv,louiskv,pariskv,oracle")
    fid.add_argument("--seed", type=int, default=0, help="seed of the synthetic document")
    fid.add_argument("--device", default=None)
    fid.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    add_plugin_flag(fid)


def main(args) -> int:
    from ..eval import decode as decoding
    from ..eval.fidelity import long_output_prompt, measure
    from ..eval.runner import check_names
    from ..models import load_model
    from ..presets import PRESETS, preset

    names = [n for n in args.presets.split(",") if n]
    if not names:
        raise KVPolicyError("--presets is empty; give at least one preset name")
    check_names(names, PRESETS, "preset")
    if args.new_tokens < 2 or args.length < 64:
        raise KVPolicyError("--new-tokens must be >= 2 and --length >= 64")
    for name in names:
        if name != "full":
            preset(name, budget=args.budget)  # a bad budget fails before the model loads
    check_writable(args.json, "--json")
    device = device_name(args)
    model, tokenizer = load_model(args.model, device=device)
    policies = [preset(n, model=model, budget=args.budget) for n in names if n != "full"]
    chat = long_output_prompt(tokenizer, args.length, args.seed)
    shared = decoding.prefill(model, chat["input_ids"].to(device), chat["attention_mask"].to(device))
    print(f"prompt {chat['input_ids'].shape[1]} tokens; full attention writes {args.new_tokens} tokens, then "
          f"each of {len(policies)} policies follows it (teacher-forced, then free-running)", flush=True)
    results = []
    for policy in policies:
        started = time.perf_counter()
        (result,) = measure(model, shared, [policy], new_tokens=args.new_tokens)
        results.append(result)
        print(f"  {policy.name}: done in {time.perf_counter() - started:.0f} s", flush=True)
    print(f"{'preset':10s} {'budget':>6s} {'KL/token':>9s} {'top-1':>7s} {'free agree':>10s} {'first diverge':>13s} {'re-selecting':>12s}")
    for r in results:
        share = "-" if r.reselect_share is None else f"{100 * r.reselect_share:.1f}%"
        print(f"{r.preset:10s} {r.budget:6d} {r.kl_mean:9.4f} {100 * r.top1_agreement:6.1f}% "
              f"{100 * r.free_agreement:9.1f}% {r.free_prefix:13d} {share:>12s}")
    if args.json:
        from dataclasses import asdict

        payload = {"length": int(chat["input_ids"].shape[1]), "new_tokens": args.new_tokens, "seed": args.seed,
                   "results": [asdict(r) for r in results]}
        write_text(args.json, json.dumps(payload, indent=2), "--json")
    return 0
