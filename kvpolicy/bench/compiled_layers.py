"""A lower floor for both sides of a benchmark: each decoder layer's MLP and RMSNorms compiled.

transformers' Qwen3 runs an RMSNorm as 6-7 small kernels and an MLP as three GEMMs with the
SiLU and the product as two more; at a 2K-token context that is about 2 ms of a ~9 ms step
(ISSUE 12: a plain-PyTorch decoder of the same shape takes 6.7-7.2 ms). ``compile_mlp_and_norms``
routes every ``*MLP`` and ``*RMSNorm`` module of the model through two ``torch.compile``d
functions that take the weights as arguments, so one compilation per shape serves every layer
(compiling each module would compile 36 times and hit dynamo's recompile limit). The compiled
kernels are ordinary launches, so a decode step still captures as one CUDA graph. Benchmarks
apply it to full attention and to the policies alike, in the same run; attention is untouched.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' RMSNorm, step for step (float32 statistics, the product in the input dtype)
    dtype = hidden.dtype
    h = hidden.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@functools.cache
def _compiled(backend: str):
    # a shape per (batch, which norm): room for several batches in one process
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
    return (torch.compile(_rms_norm, backend=backend, dynamic=False),
            torch.compile(_gated_mlp, backend=backend, dynamic=False))


def compile_mlp_and_norms(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Route ``model``'s gated MLPs (SiLU) and RMSNorms through compiled functions; returns how
    many modules were routed. ``backend``: torch.compile's (tests use "eager")."""
    rms_norm, gated_mlp = _compiled(backend)
    routed = 0
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = functools.partial(_norm_forward, rms_norm, module)
            routed += 1
        elif kind.endswith("MLP") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            if getattr(module.gate_proj, "bias", None) is not None or not _is_silu(module):
                raise ValueError(f"compile_mlp_and_norms: {kind} is not a bias-free SiLU-gated MLP")
            module.forward = functools.partial(_mlp_forward, gated_mlp, module)
            routed += 1
    if routed == 0:
        raise ValueError(f"compile_mlp_and_norms: {type(model).__name__} has no *RMSNorm or gated *MLP modules")
    return routed


def _is_silu(mlp: torch.nn.Module) -> bool:
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _norm_forward(rms_norm, module, hidden: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden, module.weight, float(module.variance_epsilon))


def _mlp_forward(gated_mlp, module, x: torch.Tensor) -> torch.Tensor:
    return gated_mlp(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)
