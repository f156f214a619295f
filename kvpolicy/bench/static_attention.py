"""Full attention done well, for the e2e baseline: transformers' StaticCache read by kvpolicy's
split-K decode kernel.

transformers' SDPA path over a StaticCache passes a mask over the whole preallocated cache, so
PyTorch cannot use its flash kernel and GQA is served by repeating K/V; on the H200 that made a
graph-replayed step at 4 x 128K cost 445 ms against 94 ms for the eager DynamicCache (first e2e
run, BENCHMARKS.md). A decode step of full attention should read each K/V byte once at HBM
speed: this attention function does that with the same Triton kernel the policies use (one
part: the whole cache, its validity read off the mask), so the comparison is kernel for kernel.
Prefill (more than one query) runs transformers' SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..integrations.transformers import _token_valid
from ..kernels import dispatch

ATTENTION_NAME = "kvpolicy_static_full"
_BACKEND = {"name": "triton"}


def static_full_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``query (B, Hq, q, D)``; ``key``/``value`` the whole static cache ``(B, H, capacity, D)``."""
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, _, capacity, _ = key.shape
    valid = _token_valid(attention_mask, batch, capacity, key.device)  # slots not written yet are masked
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    attend = dispatch.get("sparse_decode_attention", _BACKEND["name"], query.device)
    out = attend(query[:, :, 0], [(key, value, valid)], scale)
    return out.unsqueeze(1), None


def use_static_full_attention(model, backend: str = "triton") -> None:
    """Route ``model``'s attention through :func:`static_full_attention` (decode on ``backend``)."""
    dispatch.check(backend, next(model.parameters()).device)
    _BACKEND["name"] = backend
    AttentionInterface.register(ATTENTION_NAME, static_full_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    set_attention(model, ATTENTION_NAME)


def set_attention(model, name: str) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name
