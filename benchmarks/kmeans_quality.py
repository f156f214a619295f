"""How well each K-means variant clusters a real model's prompt keys (CPU, reference op).

Prefills the embedded SmolLM2 with needle prompts (``kvpolicy.eval``'s tasks), takes every
layer's cached keys (after RoPE, as the policy clusters them; the first 4 tokens, the sink, are
left out) and clusters them per KV head with ``reference.kmeans`` at C = n / 16 for each
variant ``INIT/ITERS/PRECISION``. Prints per variant, summed over layers, heads and prompts:

- inertia: the mean squared distance of a key to its cluster's mean, against the first
  variant's (lower is tighter clusters; pages/0 is plain pages, the bound K-means improves on);
- the share of keys whose cluster differs from the first variant's clustering, measured as
  1 - the pair-counting agreement would be costly, so: the share of keys not in the cluster of
  the first variant that holds most of their cluster's keys (0: the same partition).

Accuracy of the policy is the eval harness's business (EVAL.md); this only says which variants
cluster alike. Usage: ``python3 benchmarks/kmeans_quality.py --length 4096 --tasks niah_multikey``.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpolicy.kernels import reference

DEFAULT_VARIANTS = "spaced/8/split,spaced/3/split,pages/0/split,pages/1/split,pages/2/split,pages/3/split,pages/2/bf16,pages/1/bf16"


def parse_variant(text: str) -> dict:
    init, iters, precision = text.split("/")
    return {"init": init, "iters": int(iters), "precision": precision}


def prompt_keys(model, tokenizer, task: str, length: int, seed: int) -> list[torch.Tensor]:
    from transformers import DynamicCache

    from kvpolicy.eval import build_chat, make_sample

    sample = make_sample(task, tokenizer, length, seed)
    chat = build_chat(tokenizer, sample)
    ids = chat["input_ids"] if isinstance(chat, dict) else chat
    if not torch.is_tensor(ids):
        ids = torch.tensor([ids])
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [layer.keys.clone() for layer in cache.layers]


def inertia(keys: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor, clusters: int) -> torch.Tensor:
    """Sum over valid keys of the squared distance to their cluster's mean, per (B, H)."""
    x = keys.double()
    w = valid[:, None, :].expand_as(labels).double()
    sums = torch.zeros(*labels.shape[:2], clusters, x.shape[-1], dtype=torch.float64).scatter_add_(
        2, labels[..., None].expand_as(x), x * w[..., None])
    counts = torch.zeros(*labels.shape[:2], clusters, dtype=torch.float64).scatter_add_(2, labels, w)
    means = sums / counts.clamp(min=1)[..., None]
    d = (x - means.gather(2, labels[..., None].expand_as(x))).pow(2).sum(-1)
    return (d * w).sum(-1)


def disagreement(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor, clusters: int) -> float:
    """Share of valid keys outside the majority ``a``-cluster of their ``b``-cluster."""
    wrong = total = 0
    for bh in range(a.shape[0] * a.shape[1]):
        i, h = divmod(bh, a.shape[1])
        m = valid[i]
        pair = b[i, h][m] * clusters + a[i, h][m]
        counts = torch.bincount(pair, minlength=clusters * clusters).view(clusters, clusters)
        wrong += int(m.sum()) - int(counts.max(1).values.sum())
        total += int(m.sum())
    return wrong / max(total, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--tasks", default="niah_multikey,niah_multivalue")
    p.add_argument("--seeds", default="0")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--sink", type=int, default=4)
    args = p.parse_args(argv)

    from kvpolicy.models import load_model

    model, tokenizer = load_model(args.model)
    variants = args.variants.split(",")
    tot_inertia = {v: 0.0 for v in variants}
    tot_dis = {v: [] for v in variants}
    seconds = {v: 0.0 for v in variants}
    for task in args.tasks.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            layers = prompt_keys(model, tokenizer, task, args.length, seed)
            for keys in layers:
                n = keys.shape[2]
                valid = torch.ones(keys.shape[0], n, dtype=torch.bool)
                valid[:, : args.sink] = False
                clusters = -(-n // 16)
                first = None
                for v in variants:
                    o = parse_variant(v)
                    started = time.perf_counter()
                    labels, _ = reference.kmeans(keys, valid, clusters, o["iters"], init=o["init"],
                                                 precision=o["precision"])
                    seconds[v] += time.perf_counter() - started
                    tot_inertia[v] += float(inertia(keys, valid, labels, clusters).sum())
                    if first is None:
                        first = labels
                    tot_dis[v].append(disagreement(first, labels, valid, clusters))
            print(f"{task} seed {seed}: {len(layers)} layers of {tuple(layers[0].shape)} keys", flush=True)
    base = tot_inertia[variants[0]]
    print(f"\n{'variant':>15s} {'inertia vs first':>16s} {'keys moved vs first':>20s} {'CPU s':>7s}")
    for v in variants:
        moved = sum(tot_dis[v]) / len(tot_dis[v])
        print(f"{v:>15s} {tot_inertia[v] / base:16.4f} {100 * moved:19.1f}% {seconds[v]:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
