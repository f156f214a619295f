"""A louiskv layer's outlier score-gap trigger state mid-decode, made up at decode sizes: what
``benchmarks/outlier_blocks.py`` times and the GPU tests check the fused op on at a real head dimension."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..triggers.outlier_keys import OutlierKeys, to_int8
from ..triggers.score_gap import ScoreGapState


def decode_trigger_state(gen: torch.Generator, batch: int, heads: int, prompt_units: int, unit_size: int, budget: int,
                         dim: int, outliers: int) -> ScoreGapState:
    """A louiskv layer's trigger state mid-decode, on ``gen``'s device: ``prompt_units`` prompt units of
    ``unit_size`` tokens with their int8 outlier keys, a few decode units, and a held selection filling
    ``budget`` tokens."""
    device = gen.device
    on = {"device": device}
    units = prompt_units + 64
    room = budget // unit_size
    held = torch.stack([torch.randperm(prompt_units, generator=gen, **on)[:room] for _ in range(batch * heads)])
    size = torch.full((batch, heads, units), unit_size, **on)
    size[..., prompt_units + 8:] = 0  # decode units not opened yet
    open_unit = torch.full((batch,), prompt_units + 7, **on)
    table = SimpleNamespace(size=size, open_unit=open_unit, num_prompt_units=prompt_units, capacity=units,
                            decode_units=torch.full((batch,), 8, **on),
                            key_mean=torch.randn(batch, heads, units, dim, generator=gen, **on).half(),
                            selectable=size > 0)
    store = SimpleNamespace(admitted=torch.zeros(batch, heads, dtype=torch.long, **on),
                            kept=torch.zeros(batch, heads, dtype=torch.long, **on), retrieval_capacity=room * unit_size)
    layer = SimpleNamespace(units=table, store=store, policy=SimpleNamespace(admit="room"), layer_idx=1,
                            reselect=torch.zeros(batch, dtype=torch.bool, **on))
    keys, key_scale = to_int8(3 * torch.randn(batch, heads, prompt_units, outliers, dim, generator=gen, **on),
                              unit_dims=2)
    rest, rest_scale = to_int8(torch.randn(batch, heads, prompt_units, dim, generator=gen, **on), unit_dims=1)
    return ScoreGapState(
        has_selection=torch.ones(batch, dtype=torch.bool, **on), layer=layer, gap=torch.zeros(batch, **on),
        held=held.view(batch, heads, room), held_count=torch.full((batch, heads), room, **on),
        seen_open=open_unit.clone(), seen_size=torch.full((batch, heads), unit_size, **on),
        seen_admitted=torch.zeros(batch, heads, dtype=torch.long, **on),
        held_end=torch.arange(1, room + 1, **on).mul(unit_size).expand(batch, heads, room).contiguous(),
        units_at_selection=torch.full((batch,), 8, **on), age=torch.zeros(batch, dtype=torch.long, **on),
        steps=torch.zeros(batch, dtype=torch.long, **on),
        outliers=OutlierKeys(keys=keys, key_scale=key_scale,
                             valid=torch.ones(batch, heads, prompt_units, outliers, dtype=torch.bool, **on),
                             rest_mean=rest, rest_scale=rest_scale,
                             rest_count=torch.full((batch, heads, prompt_units), float(unit_size - outliers), **on)))
