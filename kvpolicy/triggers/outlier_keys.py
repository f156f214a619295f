"""Each prompt unit's outlier keys: what the score-gap trigger's ``estimate="outlier"`` scores.

A K-means unit's mean key hides a token whose key stands out from the rest of its unit: a needle
token that one query head attends can carry a third of a layer's attention while its unit's
mean-key estimate sits 8 logits under the held units' (EVAL.md, "Trigger candidates on 16
samples"). So each prompt unit keeps its ``m`` keys farthest (Euclidean) from its mean key, one by
one, and the mean and count of its other tokens; a step estimates the unit's attention mass as
its outliers at their own logits plus the rest at their mean key's logit (EVAL.md, "Unit
summaries that keep their outlier keys").

Taken once, at the layer's prefill (the prompt's keys do not change), in whole-tensor ops on the
unit table's device (a host pool's keys copied there, a few heads at a time) with no host read, then
kept as int8 with a float32 scale a unit (its largest element's magnitude over 127): the trigger reads
them every step, and int8 halves those bytes against bf16. Rounded so, SmolLM2's and Gemma 3's needle
cells answered as with 16-bit keys (EVAL.md, "Outlier keys in 8 bits").

Also taken here, where ``ScoreGap.low_rank`` asks for it: each KV head's directions of most prompt key
energy (``prompt_key_basis``), onto which the trigger's low-rank first pass projects the query.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.reference import pool_rows


class OutlierKeys(NamedTuple):
    keys: torch.Tensor  # (B, H, P, m, D) int8: each prompt unit's m keys farthest from its mean, over key_scale
    key_scale: torch.Tensor  # (B, H, P) float32: what a unit's ``keys`` are multiples of
    valid: torch.Tensor  # (B, H, P, m) bool: which are real (a unit of fewer than m + 1 tokens has fewer)
    rest_mean: torch.Tensor  # (B, H, P, D) int8: the mean key of the unit's other tokens, over rest_scale
    rest_scale: torch.Tensor  # (B, H, P) float32: what a unit's ``rest_mean`` is a multiple of
    rest_count: torch.Tensor  # (B, H, P) float32: how many those are (0 where every token is an outlier)

    def key_values(self) -> torch.Tensor:
        """``keys`` as float32 values."""
        return self.keys.float() * self.key_scale[..., None, None]


def to_int8(values: torch.Tensor, unit_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (float) as int8 multiples of a scale a unit (its last ``unit_dims`` dimensions share
    one: the largest magnitude over 127), and those scales (float32)."""
    dims = tuple(range(-unit_dims, 0))
    scale = values.abs().amax(dim=dims).float() / 127.0
    divisor = scale.clamp(min=torch.finfo(torch.float32).tiny).reshape(*scale.shape, *[1] * unit_dims)
    return torch.round(values.float() / divisor).clamp(-127, 127).to(torch.int8), scale


# a sequence's prompt keys are taken a few KV heads at a time, so that the float32 copies of them alive at
# once (about four) stay near this many bytes: at 1M tokens one head's keys are 0.5 GiB in float32, eight
# heads' copies would take 16 GiB of a GPU that placement "split" has filled with pools
_CHUNK_BYTES = 1 << 30


def take_outlier_keys(units, store, m: int) -> OutlierKeys:
    """The prompt units' ``m`` outlier keys each (ties: the earlier token in the unit first), read
    from ``store``'s pool through the unit table's ``order``, on the unit table's device (a host pool's
    keys copied there). One sequence and a few KV heads at a time (``_head_chunks``)."""
    keys = store.pool.keys
    batch, heads, _, dim = keys.shape
    prompt = units.num_prompt_units
    length = units.order_len - units.decode_tokens  # the prompt units' positions of ``order``
    device = units.size.device
    out = OutlierKeys(
        keys=torch.zeros(batch, heads, prompt, m, dim, dtype=torch.int8, device=device),
        key_scale=torch.zeros(batch, heads, prompt, dtype=torch.float32, device=device),
        valid=torch.zeros(batch, heads, prompt, m, dtype=torch.bool, device=device),
        rest_mean=torch.zeros(batch, heads, prompt, dim, dtype=torch.int8, device=device),
        rest_scale=torch.zeros(batch, heads, prompt, dtype=torch.float32, device=device),
        rest_count=torch.zeros(batch, heads, prompt, dtype=torch.float32, device=device),
    )
    if prompt == 0 or length == 0:
        return out
    for b in range(batch):
        for chunk in _head_chunks(heads, length, dim):
            taken = _take_one_sequence(units, store, b, chunk, prompt, length, m)
            for field, value in zip(out, taken):
                field[b, chunk].copy_(value)
    return out


def _head_chunks(heads: int, length: int, dim: int) -> list[slice]:
    """KV heads ``0..heads`` in slices whose prompt keys (``length`` of ``dim``) take about
    ``_CHUNK_BYTES`` in four float32 copies; one head at least."""
    step = max(1, min(heads, _CHUNK_BYTES // (4 * length * dim * 4)))
    return [slice(h, min(h + step, heads)) for h in range(0, heads, step)]


def _prompt_keys(units, store, b: int, heads: slice, prompt: int, length: int) -> tuple:
    """Sequence ``b``'s prompt keys of KV ``heads`` as the table's prompt units hold them: ``k (1, h, length,
    D)`` float32 on the unit table's device, in ``order``, zero at positions in no unit, with each position's
    unit (``label``: ``prompt`` where none), whether it is in one (``inside``) and the units' sizes."""
    device = units.size.device
    keys = store.pool.keys[b : b + 1, heads].to(device)  # a host pool's: copied once here
    start = units.start[b : b + 1, heads, :prompt]
    size = units.size[b : b + 1, heads, :prompt]
    n_heads, dim = start.shape[1], keys.shape[-1]
    position = torch.arange(length, device=device)
    # each position's unit: the last unit starting at or before it, if the position is inside it
    # (units are ranges of ``order``; a unit of no tokens starts nowhere: the spare column)
    real = size > 0
    marker = torch.full((1, n_heads, length + 1), -1, dtype=torch.long, device=device)
    unit_ids = torch.arange(prompt, device=device).expand(1, n_heads, prompt)
    marker.scatter_(2, torch.where(real, start.clamp(max=length), length), unit_ids)
    marker = marker[..., :length]
    last_start = torch.cummax(torch.where(marker >= 0, position, -1), dim=-1).values
    label = marker.gather(2, last_start.clamp(min=0))
    end = (start + size).gather(2, label.clamp(min=0))
    inside = (last_start >= 0) & (position < end)
    label = torch.where(inside, label, prompt)  # ``prompt``: the bucket of positions in no unit
    slots = units.order[b : b + 1, heads, :length]
    zone_rows = store.pool.zone_rows
    zone_rows = None if zone_rows is None else zone_rows[b : b + 1, heads].to(device)
    rows = pool_rows(torch.where(inside, slots, 0), zone_rows)
    k = keys.gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, dim)).float()
    k = k.masked_fill(~inside.unsqueeze(-1), 0.0)
    return k, label, inside, size


def _take_one_sequence(units, store, b: int, heads: slice, prompt: int, length: int, m: int) -> tuple:
    k, label, inside, size = _prompt_keys(units, store, b, heads, prompt, length)
    device, n_heads, dim = k.device, k.shape[1], k.shape[-1]
    position = torch.arange(length, device=device)
    buckets = prompt + 1
    total = torch.zeros(1, n_heads, buckets, dim, device=device).scatter_add_(
        2, label.unsqueeze(-1).expand(-1, -1, -1, dim), k)
    count = torch.cat([size, size.new_zeros(1, n_heads, 1)], dim=-1).clamp(min=1).unsqueeze(-1).float()
    mean = total / count
    distance = (k - mean.gather(2, label.unsqueeze(-1).expand(-1, -1, -1, dim))).norm(dim=-1)
    distance = torch.cat([distance.masked_fill(~inside, float("-inf")),
                          distance.new_full((1, n_heads, 1), float("-inf"))], dim=-1)  # a spare column
    chosen_keys, chosen_valid = [], []
    outlier_sum = torch.zeros(1, n_heads, prompt, dim, device=device)
    spare = torch.full((1, n_heads, prompt), length, dtype=torch.long, device=device)
    for _ in range(m):
        # each unit's farthest remaining token (the earliest of equals), then it is no longer a candidate
        farthest = torch.full((1, n_heads, buckets), float("-inf"), device=device).scatter_reduce(
            2, label, distance[..., :length], "amax")
        at_max = (distance[..., :length] == farthest.gather(2, label)) & (distance[..., :length] > float("-inf"))
        first = spare.new_full((1, n_heads, buckets), length).scatter_reduce(
            2, label, torch.where(at_max, position.expand_as(label), length), "amin")[..., :prompt]
        has = first < length
        key = k.gather(2, first.clamp(max=length - 1).unsqueeze(-1).expand(-1, -1, -1, dim))
        key = key.masked_fill(~has.unsqueeze(-1), 0.0)
        chosen_keys.append(key)
        chosen_valid.append(has)
        outlier_sum += key
        distance.scatter_(2, torch.where(has, first, spare), float("-inf"))
    valid = torch.stack(chosen_valid, dim=-1)
    rest_count = (size - valid.sum(-1)).clamp(min=0).float()
    rest_mean = (total[..., :prompt, :] - outlier_sum) / rest_count.clamp(min=1).unsqueeze(-1)
    chosen, key_scale = to_int8(torch.stack(chosen_keys, dim=-2)[0], unit_dims=2)
    rest_mean, rest_scale = to_int8(rest_mean[0], unit_dims=1)
    return chosen, key_scale, valid[0], rest_mean, rest_scale, rest_count[0]


def prompt_key_basis(units, store, rank: int) -> torch.Tensor:
    """``(B, H, D, rank)`` float32 on the unit table's device: each KV head's ``rank`` directions of most
    prompt key energy (the top eigenvectors of its prompt keys' second moment, uncentred; EVAL.md, "A
    low-rank first pass"), what ``ScoreGap.low_rank``'s first pass projects the query on. Zeros where there
    is no prompt."""
    keys = store.pool.keys
    batch, heads, _, dim = keys.shape
    prompt = units.num_prompt_units
    length = units.order_len - units.decode_tokens
    basis = torch.zeros(batch, heads, dim, rank, dtype=torch.float32, device=units.size.device)
    if prompt == 0 or length == 0:
        return basis
    for b in range(batch):
        for chunk in _head_chunks(heads, length, dim):
            k = _prompt_keys(units, store, b, chunk, prompt, length)[0][0].double()  # (heads, length, D)
            _, vectors = torch.linalg.eigh(k.transpose(1, 2) @ k)  # ascending eigenvalues
            basis[b, chunk].copy_(vectors.flip(-1)[..., :rank].float())
    return basis
