"""``kvpolicy drift``: recall of the oracle top-k as a long generation goes on, per window of
steps (``kvpolicy.eval.drift``).

    kvpolicy drift --length 2048 --new-tokens 4096 --budget 512 --window 256
"""

from __future__ import annotations

import sys

from ..errors import KVPolicyError
from ..eval.defaults import DRIFT_POLICIES
from .common import add_plugin_flag, check_writable, csv, device_name


def add_parser(sub) -> None:
    dr = sub.add_parser("drift", help="recall of the oracle top-k as a long generation goes on, per window of steps")
    dr.add_argument("--model", default="smollm2", help="as for `run`")
    dr.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default 2048)")
    dr.add_argument("--new-tokens", type=int, default=4096, help="tokens full attention writes (default 4096)")
    dr.add_argument("--budget", type=int, default=512)
    dr.add_argument("--window", type=int, default=256, help="decode steps per reported window (default 256)")
    dr.add_argument("--policies", default=csv(DRIFT_POLICIES),
                    help="presets and/or clusterkv-stale (K-means on the prompt, generated tokens under the nearest "
                         "prompt centroid, never updated); default: " + csv(DRIFT_POLICIES))
    dr.add_argument("--temperature", type=float, default=0.8,
                    help="full attention samples its continuation at this temperature (0: greedy)")
    dr.add_argument("--seed", type=int, default=0, help="seed of the document and of the sampling")
    dr.add_argument("--device", default=None)
    dr.add_argument("--json", default="drift.json", metavar="FILE", help="results (default drift.json)")
    dr.add_argument("--plot", default=None, metavar="FILE",
                    help="PNG plot (default drift.png when matplotlib is installed; naming one requires it)")
    add_plugin_flag(dr)


def main(args) -> int:
    from ..eval import drift
    from ..models import load_model

    names = [n for n in args.policies.split(",") if n]
    if not names:
        raise KVPolicyError("--policies is empty; give at least one policy")
    if args.new_tokens < 2 or args.length < 64 or args.window < 1:
        raise KVPolicyError("--new-tokens must be >= 2, --length >= 64 and --window >= 1")
    if args.temperature < 0:
        raise KVPolicyError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    for name in names:
        drift.drift_policy(name, args.budget)  # a bad name or budget fails before the model loads
    check_writable(args.json, "--json")
    try:
        import matplotlib  # noqa: F401

        plot_path = args.plot or "drift.png"
    except ImportError:
        # the run takes an hour: say now what it will not write
        if args.plot:
            raise KVPolicyError("--plot needs matplotlib: pip install 'kvpolicy[plot]' (or leave out --plot)") from None
        print("no plot: matplotlib is not installed (pip install 'kvpolicy[plot]')", file=sys.stderr)
        plot_path = None
    check_writable(plot_path, "--plot")
    device = device_name(args)
    model, tokenizer = load_model(args.model, device=device)
    payload = drift.run(model, tokenizer, length=args.length, new_tokens=args.new_tokens, budget=args.budget,
                        window=args.window, policies=names, temperature=args.temperature, seed=args.seed,
                        log=lambda line: print(line, flush=True))
    payload["command"] = "kvpolicy " + " ".join(sys.argv[1:]) if sys.argv[1:] else None
    written = drift.save(payload, args.json, plot_path)
    print(drift.table(payload))
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0
