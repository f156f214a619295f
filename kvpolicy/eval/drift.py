"""Recall drift over a long generation: do a policy's units go stale as decoding goes on?

Full attention writes one long continuation of a prompt once (sampled with a fixed seed, or
greedy; end-of-turn and other special tokens are suppressed so it runs the whole length). Each
policy then follows that continuation teacher-forced, and at every decode step and layer a
meter compares what the policy attends to with the oracle: the ``budget`` tokens of highest
true attention score of each query head (over the policy's own KV). Reported per window of
steps, averaged over layers and heads:

    topk_recall        share of the oracle top-k tokens the policy attends to
    generated_recall   the same, among oracle top-k tokens that were generated and have left the
                       local window (where stale units would show)
    prompt_recall      the same, among the prompt's retrieval-zone tokens
    mass_recall        the attention mass of the attended tokens over the oracle top-k's
                       (the eval harness's recall)

The baseline with centroids learned on the prompt is ``clusterkv-stale``: ClusterKV's K-means
clusters of the prompt, with generated tokens filed under the nearest prompt centroid, which is
never updated (``nearest_centroid`` units). ParisKV's sign-pattern centroids are
data-independent, so nothing in its index can go stale.

    kvpolicy drift --length 2048 --new-tokens 4096 --budget 512 --window 256
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..errors import ConfigError
from ..integrations.transformers import PolicyCache, cache_argument_name, last_logits_only
from ..presets import PRESETS, preset
from . import decode as decoding
from .defaults import DRIFT_POLICIES

#: Policies of the drift comparison that are not presets: (preset, options).
VARIANTS: dict[str, tuple[str, dict]] = {
    "clusterkv-stale": ("clusterkv", {"decode_units": {"name": "nearest_centroid"}}),
}
DEFAULT_POLICIES = DRIFT_POLICIES
METRICS = ("topk_recall", "generated_recall", "prompt_recall", "mass_recall")


def drift_policy(name: str, budget: int, model: Any = None):
    """The policy ``name`` (a preset or a ``VARIANTS`` label) at ``budget``."""
    if name in VARIANTS:
        base, options = VARIANTS[name]
    elif name in PRESETS and name != "full":
        base, options = name, {}
    else:
        known = [n for n in PRESETS if n != "full"] + list(VARIANTS)
        raise ConfigError(f"unknown drift policy {name!r}; known: {', '.join(known)}")
    policy = preset(base, model=model, budget=budget, **options)
    policy.name = name
    return policy


class DriftMeter:
    """Per (step, layer): hits of the oracle top-``budget`` tokens among the attended ones.

    Eager only (it indexes by the host's step count and cuts the pool at the host's length).
    """

    def __init__(self, budget: int, prompt_length: int, steps: int, layers: Iterable[int]):
        self.budget, self.prompt_length = budget, prompt_length
        self.rows = {layer: row for row, layer in enumerate(sorted(layers))}
        # per (step, layer): topk hits, topk count, generated hits, generated count, prompt hits,
        # prompt count, mass recall
        self.values = torch.zeros(steps, len(self.rows), 7, dtype=torch.float64)

    @torch.inference_mode()
    def __call__(self, state, query: torch.Tensor) -> None:
        store = state.store
        length = store.length
        probs = decoding.true_attention(store, query, length)
        batch, kv_heads, groups = probs.shape[:3]
        top = probs.topk(min(self.budget, length), dim=-1)

        slots, valid = store.attended_slots()
        attended = torch.zeros(batch, kv_heads, length + 1, dtype=torch.bool, device=query.device)
        # invalid entries go to the spare column
        attended.scatter_(-1, torch.where(valid, slots.clamp(max=length - 1), length), True)
        attended = attended[..., :length]
        hit = attended.unsqueeze(2).expand(-1, -1, groups, -1).gather(-1, top.indices)
        generated = (top.indices >= self.prompt_length) & (top.indices < length - state.policy.local)
        # the prompt's retrieval zone: before zone_end, less the sink tokens (always attended)
        sink = torch.zeros(batch, length + 1, dtype=torch.bool, device=query.device)
        sink.scatter_(-1, torch.where(store.sink.valid[:, 0], store.sink.slots, length), True)
        in_sink = sink[:, None, None, :length].expand(-1, kv_heads, groups, -1).gather(-1, top.indices)
        prompt = (top.indices < store.zone_end) & ~in_sink
        held = (probs * attended.unsqueeze(2)).sum(-1)
        mass = (held / top.values.sum(-1).clamp(min=1e-12)).clamp(max=1.0).mean()
        figures = [hit.sum(), hit.numel(), (hit & generated).sum(), generated.sum(), (hit & prompt).sum(),
                   prompt.sum(), mass]
        self.values[state.decode_steps - 1, self.rows[state.layer_idx]] = torch.tensor([float(f) for f in figures],
                                                                                        dtype=torch.float64)

    def windows(self, window: int) -> list[dict[str, float]]:
        """Per window of ``window`` steps: each metric over its steps and layers."""
        out = []
        for start in range(0, self.values.shape[0], window):
            part = self.values[start:start + window].sum(dim=(0, 1))
            count = min(window, self.values.shape[0] - start)

            def share(hits: int, total: int) -> float | None:
                return None if part[total] == 0 else float(part[hits] / part[total])

            out.append({
                "first_step": start, "steps": count,
                "topk_recall": share(0, 1), "generated_recall": share(2, 3), "prompt_recall": share(4, 5),
                "mass_recall": float(part[6] / (count * self.values.shape[1])),
                "generated_in_topk": float(part[3] / part[1]),
            })
        return out


@dataclass
class DriftResult:
    policy: str
    describe: str
    seconds: float
    windows: list[dict] = field(default_factory=list)


@torch.inference_mode()
def write_continuation(model, input_ids: torch.Tensor, new_tokens: int, *, temperature: float, seed: int,
                       banned: Iterable[int], progress: Callable[[int], None] | None = None) -> list[int]:
    """Full attention's ``new_tokens`` tokens after ``input_ids`` (1, P): sampled at ``temperature``
    from a seeded generator (greedy at 0); ``banned`` token ids (special tokens) never chosen."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    name = cache_argument_name(model)
    out = model(input_ids=input_ids, use_cache=True, **last_logits_only(model), **{name: cache})
    generator = torch.Generator().manual_seed(seed)
    banned = torch.tensor(sorted(set(banned)), dtype=torch.long)
    tokens = []
    for step in range(new_tokens):
        logits = out.logits[0, -1].float().cpu()
        logits[banned] = float("-inf")
        if temperature > 0:
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        else:
            token = int(logits.argmax())
        tokens.append(token)
        if progress is not None:
            progress(step + 1)
        if step < new_tokens - 1:
            out = model(input_ids=torch.tensor([[token]], device=input_ids.device), use_cache=True, **{name: cache})
    return tokens


def measure_drift(model, prefilled: decoding.Prefilled, continuation: list[int], policy, window: int,
                  progress: Callable[[int], None] | None = None) -> DriftResult:
    """Teacher-force ``continuation`` under ``policy``; recall per window of decode steps."""
    prompt_length = prefilled.input_ids.shape[1]
    # the layers the policy serves (the meter sees no other): not Gemma 3's sliding-window layers,
    # whose KV the prefill also holds
    layers = PolicyCache(policy, model.config, torch.device("cpu")).served
    steps = len(continuation) - 1  # the last token is never fed
    meter = DriftMeter(policy.budget, prompt_length, steps, layers)
    observers = [meter]
    if progress is not None:
        first = layers[0]

        def tick(state, query):
            if state.layer_idx == first:
                progress(state.decode_steps)

        observers.append(tick)
    started = time.perf_counter()
    decoding.decode(model, prefilled, policy, len(continuation), forced=continuation, graph=False,
                    observers=observers)
    return DriftResult(policy.name, policy.describe(), time.perf_counter() - started, meter.windows(window))


def plot(results: list[DriftResult], path: str | Path, title: str) -> bool:
    """One panel per metric, recall against generated tokens; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [("topk_recall", "oracle top-k recall (all tokens)"),
              ("generated_recall", "top-k recall: generated tokens past the local window"),
              ("prompt_recall", "top-k recall: prompt tokens"),
              ("mass_recall", "attention-mass recall (eval harness)")]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharex=True)
    for axis, (metric, label) in zip(axes, panels):
        for result in results:
            xs = [w["first_step"] + w["steps"] / 2 for w in result.windows if w[metric] is not None]
            ys = [w[metric] for w in result.windows if w[metric] is not None]
            axis.plot(xs, ys, marker="o", markersize=3, label=result.policy)
        axis.set_title(label, fontsize=10)
        axis.set_xlabel("generated tokens")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("recall")
    axes[0].legend()
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(model, tokenizer, *, length: int, new_tokens: int, budget: int, window: int, policies: list[str],
        temperature: float, seed: int, log: Callable[[str], None] = print) -> dict:
    """The whole experiment; returns the JSON-ready payload."""
    from .fidelity import long_output_prompt

    built = [drift_policy(name, budget, model) for name in policies]
    device = next(model.parameters()).device
    chat = long_output_prompt(tokenizer, length, seed)
    input_ids = chat["input_ids"].to(device)
    prompt_length = input_ids.shape[1]
    started = time.perf_counter()

    def every(n: int, label: str) -> Callable[[int], None]:
        def report(done: int) -> None:
            if done % n == 0:
                log(f"  {label}: {done} tokens, {time.perf_counter() - started:.0f} s")
        return report

    log(f"prompt {prompt_length} tokens; full attention writes {new_tokens} tokens "
        f"({'greedy' if temperature <= 0 else f'sampled at temperature {temperature}, seed {seed}'})")
    continuation = write_continuation(model, input_ids, new_tokens, temperature=temperature, seed=seed,
                                      banned=tokenizer.all_special_ids, progress=every(512, "full attention"))
    prefilled = decoding.prefill(model, input_ids, torch.ones_like(input_ids))
    results = []
    for policy in built:
        started = time.perf_counter()
        log(f"{policy.describe()}")
        result = measure_drift(model, prefilled, continuation, policy, window, progress=every(512, policy.name))
        first, last = result.windows[0], result.windows[-1]
        log(f"  {policy.name}: {result.seconds:.0f} s; top-k recall first window {first['topk_recall']:.3f}, "
            f"last {last['topk_recall']:.3f}")
        results.append(result)
    text = tokenizer.decode(continuation)
    return {
        "length": prompt_length, "new_tokens": new_tokens, "budget": budget, "window": window,
        "temperature": temperature, "seed": seed,
        "continuation_distinct_token_share": len(set(continuation)) / len(continuation),
        "continuation_start": text[:600], "continuation_end": text[-600:],
        "results": [asdict(r) for r in results],
    }


def table(payload: dict, metric: str = "topk_recall", every: int = 1) -> str:
    """A markdown table: one row per window (every ``every``-th), one column per policy."""
    results = payload["results"]
    lines = ["| generated tokens | " + " | ".join(r["policy"] for r in results) + " |",
             "|---:|" + "---:|" * len(results)]
    for i, w in enumerate(results[0]["windows"]):
        if i % every and i != len(results[0]["windows"]) - 1:
            continue
        cells = []
        for r in results:
            value = r["windows"][i][metric]
            cells.append("-" if value is None else f"{value:.3f}")
        lines.append(f"| {w['first_step']}-{w['first_step'] + w['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save(payload: dict, json_path: str | Path, plot_path: str | Path | None) -> list[Path]:
    written = [Path(json_path)]
    Path(json_path).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    if plot_path is not None:
        results = [DriftResult(**r) for r in payload["results"]]
        title = (f"SmolLM2-135M recall drift: prompt {payload['length']} tokens, budget {payload['budget']}, "
                 f"windows of {payload['window']} steps")
        if plot(results, plot_path, title):
            written.append(Path(plot_path))
    return written
