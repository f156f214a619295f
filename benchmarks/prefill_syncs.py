"""Where a policy's prefill makes the host wait for the GPU: one prefill of a random-weight
Qwen3-8B-shaped model (few layers) under ``torch.cuda.set_sync_debug_mode("warn")``, and each
distinct place in kvpolicy that synchronised, with its count. A host sync per layer stalls the
host's launches, so it shows in TTFT at short prompts (issue "The GPU path at the floor", item 5).

    python3 benchmarks/prefill_syncs.py [--length 8192] [--layers 4] [--presets louiskv,pariskv]
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

import kvpolicy
from kvpolicy.bench.ttft import qwen3_8b_config, random_model
from kvpolicy.integrations.transformers import cache_argument_name


def _kvpolicy_frame(stack) -> str:
    """The innermost frame of kvpolicy's own code (not torch's, not this script's)."""
    for frame in reversed(stack):
        if "/kvpolicy/" in frame.filename and "benchmarks" not in frame.filename:
            return f"{frame.filename.split('/kvpolicy/')[-1]}:{frame.lineno} {frame.line}"
    return "(outside kvpolicy)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--presets", default="louiskv,pariskv")
    parser.add_argument("--placement", default="gpu")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = random_model(qwen3_8b_config(layers=args.layers), device)
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), device=device)
    for name in args.presets.split(","):
        policy = kvpolicy.preset(name, budget=2048, placement=args.placement)
        with torch.inference_mode(), policy.apply(model) as session:
            for attempt in range(2):  # the first compiles kernels and warms the allocator
                cache = session.new_cache()
                torch.cuda.synchronize()
                places: collections.Counter = collections.Counter()

                def record(message, category, filename, lineno, file=None, line=None):
                    places[_kvpolicy_frame(traceback.extract_stack()[:-1])] += 1

                if attempt:
                    torch.cuda.set_sync_debug_mode("warn")
                saved = warnings.showwarning
                warnings.showwarning = record
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("always")
                        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1,
                              **{cache_argument_name(model): cache})
                        for state in cache.policy_layers():
                            state.wait_for_units()
                finally:
                    warnings.showwarning = saved
                    torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                del cache
        print(f"{name} ({args.placement}), {args.layers} layers, {args.length} tokens: "
              f"{sum(places.values())} host syncs")
        for place, count in places.most_common():
            print(f"  {count:5d}  {place}")


if __name__ == "__main__":
    main()
