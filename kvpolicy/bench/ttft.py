"""Time to first token: a policy's prefill (pool copy + prompt units) against full attention.

A random-weight model of Qwen3-8B's shape (``qwen3_8b_config``; fewer layers with
``layers=``) prefills a random prompt; TTFT is the wall time until the first token is known on
the host. For a policy it includes laying out the tiered store; the prompt's units (and a first
selection from the prompt's last query, ``first_selection="prompt"``) build on a side stream and
are needed only by the second token, so "units ready" is reported too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..integrations.transformers import PolicyCache, cache_argument_name
from ..policy import Policy


def qwen3_8b_config(layers: int = 36, max_positions: int = 1 << 20):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=max_positions,
        rope_theta=1_000_000.0, tie_word_embeddings=False, use_sliding_window=False,
    )


def random_model(config, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """A causal LM with random weights, built directly on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


@dataclass
class FirstToken:
    preset: str
    placement: str | None
    batch: int
    length: int
    ttft_ms: float
    units_ready_ms: float | None  # until every layer's prompt units exist (policies only)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_first_token(model, policy: Policy, batch: int, length: int, *, repeats: int = 3, seed: int = 0) -> FirstToken:
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)
    mask = torch.ones_like(ids)
    ttft, ready = [], []
    with policy.apply(model) as session:
        for _ in range(repeats + 1):  # the first is a warm-up (kernel compilation, allocator)
            cache = session.new_cache()
            _sync(device)
            started = time.perf_counter()
            out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                        **{cache_argument_name(model): cache})
            out.logits[:, -1].argmax(-1).tolist()  # the first token, on the host
            first = time.perf_counter() - started
            if isinstance(cache, PolicyCache):
                for state in cache.policy_layers():
                    state.wait_for_units()
                _sync(device)
                ready.append(1e3 * (time.perf_counter() - started))
            ttft.append(1e3 * first)
            del cache, out
    ttft, ready = ttft[1:], ready[1:]
    return FirstToken(policy.name, None if policy.is_dense else policy.placement, batch, length,
                      sorted(ttft)[len(ttft) // 2], sorted(ready)[len(ready) // 2] if ready else None)
