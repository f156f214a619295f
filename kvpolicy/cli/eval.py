"""``kvpolicy eval``: the presets side by side on local RULER-style tasks, resumable
(``kvpolicy.eval.runner.run_grid``; ``kvpolicy.eval.report`` writes the table and plots).

    kvpolicy eval --lengths 4096 --budgets 512 --presets full,louiskv,quest --seeds 0
"""

from __future__ import annotations

import json
import sys

from ..errors import KVPolicyError
from ..eval.defaults import GRID_BUDGETS, GRID_LENGTHS, GRID_PRESETS, GRID_SEEDS
from .common import add_plugin_flag, csv, device_name, ints, warn_past_positions


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="accuracy of presets side by side on local RULER-style tasks (resumable)")
    ev.add_argument("--model", default="smollm2", help="as for `run`")
    ev.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    ev.add_argument("--lengths", default=csv(GRID_LENGTHS), help="comma-separated context lengths in tokens")
    ev.add_argument("--budgets", default=csv(GRID_BUDGETS), help="comma-separated token budgets")
    ev.add_argument("--presets", default=csv(GRID_PRESETS))
    ev.add_argument("--seeds", default=csv(GRID_SEEDS), help="comma-separated sample seeds")
    ev.add_argument("--variant", action="append", default=[], metavar="LABEL=PRESET:JSON",
                    help="an extra column: a preset with options, e.g. "
                         "'louis-anchor=louiskv:{\"trigger\": {\"name\": \"query_cosine\", \"tau\": 0.8, \"against\": \"anchor\"}}'; "
                         "list LABEL in --presets to run it")
    ev.add_argument("--out", default="eval-out", help="output folder (results.jsonl, summary.json, table.md, PNGs)")
    ev.add_argument("--add-model", action="store_true",
                    help="add this model's results to an --out folder that holds another model's (default: refused)")
    ev.add_argument("--device", default=None)
    add_plugin_flag(ev)


def variants(specs: list[str]) -> dict[str, tuple[str, dict]]:
    variants = {}
    for spec in specs:
        label, sep, rest = spec.partition("=")
        base, sep2, options = rest.partition(":")
        if not (sep and sep2 and label and base):
            raise KVPolicyError(f"--variant takes LABEL=PRESET:JSON, got {spec!r}")
        try:
            parsed = json.loads(options)
        except json.JSONDecodeError as exc:
            raise KVPolicyError(f"--variant {label}: options are not valid JSON ({exc.msg}): {options!r}") from None
        if not isinstance(parsed, dict):
            raise KVPolicyError(f"--variant {label}: options must be a JSON object, got {options!r}")
        variants[label] = (base, parsed)
    return variants


def main(args) -> int:
    from ..eval.report import summarize, table, write_outputs
    from ..eval.runner import check_out_dir, model_identity, run_grid
    from ..eval.tasks import TASKS, get_task
    from ..models import load_model

    tasks = args.tasks.split(",") if args.tasks else list(TASKS)
    options = dict(tasks=tasks, lengths=ints(args.lengths, "lengths"), budgets=ints(args.budgets, "budgets"),
                   presets=args.presets.split(","), seeds=ints(args.seeds, "seeds"),
                   variants=variants(args.variant))
    run_grid(None, None, out_dir=args.out, dry_run=True, **options)  # validate names before loading
    model_name = model_identity(args.model)
    check_out_dir(args.out, model_name, add_model=args.add_model)  # --out a file, or another model's folder
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("kvpolicy: note: no plots: matplotlib is not installed (pip install 'kvpolicy[plot]'); "
              "results.jsonl, summary.json and table.md are written", file=sys.stderr, flush=True)
    device = device_name(args)
    model, tokenizer = load_model(args.model, device=device)
    # a prompt fills up to its length, then the answer is decoded after it: both need positions
    longest, answer = max(options["lengths"]), max(get_task(name).max_new_tokens for name in tasks)
    warn_past_positions(model, longest + answer, f"--lengths {longest} plus a {answer}-token answer")
    cells = run_grid(model, tokenizer, out_dir=args.out, model_name=model_name, add_model=args.add_model, **options)
    written = write_outputs(cells, args.out)
    print(table(summarize(cells)))
    print("\nwrote " + ", ".join(str(p) for p in written.values()))
    return 0
