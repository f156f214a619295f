"""Triton scores of collision_rerank's ``rerank="head_softmax"`` (``reference_analytic.head_softmax_scores``):
each query head's 4-bit logits softmaxed over the row's candidates, the group's softmaxes summed, as a
log. For the ops ``rerank`` (the scores, then ``torch.topk``) and ``rerank_select`` (its keys and
first histogram, then its top-k passes).

A head's softmax needs its max and sum over every candidate of the row before any candidate's
score, so two launches:

1. ``_logits_kernel``, one program per (row, chunk of candidates), laid out as the group mean's score
   pass (``rerank_select._radix_score_kernel``): a step of ``SUB`` candidates reads their packed codes
   as one ``[SUB, D / 2]`` byte tile (a candidate's ``D / 2`` bytes contiguous), the next step's
   candidate ids loaded a step ahead; the nibbles' values are looked up once and dotted with each of
   the ``G`` query heads of its KV head (each head's query loaded as the score pass loads its one, in
   the tile's column layout: no shuffle of the values between heads). Writes the ``G`` logits (-inf
   where not listed) and the chunk's max and sum of ``exp(logit - max)`` per head; the row's last
   program to finish (an atomic ticket, self-clearing scratch) combines its chunks' into each head's
   softmax denominator as a log, ``max + log(sum)``.
2. ``_mass_kernel``, one program per (row, chunk): each candidate's log-sum-exp over the heads of
   ``logit - normalizer``, written as ``OUTPUT`` says: the float score (``rerank``), or the key
   ``rerank_select``'s score pass writes with its histogram ("radix", "split") or alone ("wide").

Per candidate: its codes, weight, norm and position once, its ``G`` logits written and read once
(4 bytes each: 16 at G=4 against 64 bytes of codes at D=128). The sums run in another order than
the reference's, so scores agree to float rounding (about 1e-6 relative), not bit for bit.

Before (session 29): the logits pass held every head's query as one ``[G, D / 2]`` tile and picked
a head's row out of it, and built each step's ``[SUB, G]`` logits tile, at every step (a layout
change through shared memory per head); a third launch computed the normalisers; and the selector
built the logit queries with ~20 PyTorch launches a layer (``query_votes(logit_queries=True)``
writes them now). Measured then on an H100 at 1x128K: the logits pass 36.3 us a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...analytic import nibble_values
from . import scratch
from .pdl import pdl_kernel, wait_for_previous

OUTPUTS = ("scores", "radix", "split", "wide")
# candidates a step of the logits pass and its warps: SUB x D / 2 code bytes and their two value
# tiles in registers across the G heads (32 + 32 registers a thread at 128 x 8 warps, D=128; the
# group mean's pass at 128 x 4 holds one value tile at a time). benchmarks/head_softmax_rerank.py times six
# settings beside group_mean: on an H100 (session 30) 128 x 4 warps was the fastest at 1x32K to 4x128K
# (0.057 against these 0.069 ms a layer at 1x128K, rerank_select alone); not yet run end to end
_LOGITS_SUB = 128
_LOGITS_WARPS = 8
# candidates a step of the mass pass (G logits each)
_MASS_SUB = 256
# chunks a step of the normaliser (the logits pass's last program of a row)
_CHUNK_BLOCK = 64
# the rerank op's chunk: about _CHUNKS_PER_ROW programs a row, at most _MAX_CHUNK candidates each
_CHUNKS_PER_ROW = 32
_MAX_CHUNK = 4096


@pdl_kernel
@triton.jit
def _logits_kernel(
    query_ptr, codes_ptr, weight_ptr, norms_ptr, cand_ptr, values_ptr, logits_ptr, stats_ptr, normalizer_ptr,
    done_ptr,
    H, W, CHUNKS,
    q_sb, q_sh, q_sg, q_sd,
    code_sb, code_sh, code_sn, code_sd,
    weight_sb, weight_sh, weight_sn,
    norm_sb, norm_sh, norm_sn,
    cand_sb, cand_sh, cand_sc,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, CHUNK_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // H
    h = row % H
    i = tl.arange(0, BLOCK_HALF)
    in_i = i < HALF
    heads = tl.arange(0, BLOCK_G)
    in_g = heads < G
    q_base = query_ptr + b * q_sb + h * q_sh
    cand_row = cand_ptr + b * cand_sb + h * cand_sh
    # each head's max and sum of exp(logit - max) over the chunk's candidates so far
    head_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    head_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    # the next step's candidates are loaded a step ahead (as the score pass), so a step waits on one
    # load (its codes), not two
    c = chunk * CHUNK + tl.arange(0, SUB).to(tl.int64)
    cand_next = tl.load(cand_row + c * cand_sc, mask=c < W, other=-1).to(tl.int64)
    for s0 in range(0, CHUNK, SUB):
        c = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_c = c < W
        cand = cand_next
        ahead = c + SUB
        cand_next = tl.load(cand_row + ahead * cand_sc, mask=(ahead < W) & (s0 + SUB < CHUNK), other=-1).to(tl.int64)
        listed = cand >= 0
        token = tl.maximum(cand, 0)
        rows = listed[:, None] & in_i[None, :]
        packed = tl.load(
            codes_ptr + b * code_sb + h * code_sh + token[:, None] * code_sn + i[None, :] * code_sd,
            mask=rows, other=0,
        ).to(tl.int32)
        # the codes' values once for all G heads: the codes are the bytes that cost; a masked byte
        # is 0, whose value is the smallest level, so the masked terms are zeroed below
        low_val = tl.where(rows, tl.load(values_ptr + (packed & 15)), 0.0)
        high_val = tl.where(rows, tl.load(values_ptr + (packed >> 4)), 0.0)
        weight = tl.load(weight_ptr + b * weight_sb + h * weight_sh + token * weight_sn, mask=listed, other=0.0)
        norm = tl.load(norms_ptr + b * norm_sb + h * norm_sh + token * norm_sn, mask=listed, other=0.0)
        scale = weight.to(tl.float32) * norm.to(tl.float32)
        step_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        step_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
        for g in tl.static_range(G):
            # head g's query as the score pass loads its one (coordinate 2i: byte i's low nibble,
            # 2i + 1 its high nibble): L1-resident after the first step
            q_even = tl.load(q_base + g * q_sg + (2 * i) * q_sd, mask=in_i, other=0.0).to(tl.float32)
            q_odd = tl.load(q_base + g * q_sg + (2 * i + 1) * q_sd, mask=in_i, other=0.0).to(tl.float32)
            dot = tl.sum(low_val * q_even[None, :] + high_val * q_odd[None, :], axis=1)
            logit = tl.where(listed, scale * dot, float("-inf"))
            tl.store(logits_ptr + (row * G + g) * W + c, logit, mask=in_c)
            top = tl.max(logit, axis=0)
            # a step with no listed candidate has nothing to sum (and -inf - -inf is NaN)
            shift = tl.where(top > float("-inf"), top, 0.0)
            total = tl.sum(tl.exp(logit - shift), axis=0)
            step_max = tl.where(heads == g, top, step_max)
            step_sum = tl.where(heads == g, total, step_sum)
        new_max = tl.maximum(head_max, step_max)
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        head_sum = head_sum * tl.exp(head_max - shift) + step_sum * tl.exp(step_max - shift)
        head_max = new_max
    stats = stats_ptr + (row * CHUNKS + chunk) * 2 * G
    tl.store(stats + heads, head_max, mask=in_g)
    tl.store(stats + G + heads, head_sum, mask=in_g)
    # the row's last program to finish combines its chunks' stats into the heads' normalisers; its
    # ticket (acq_rel) comes after every program's stats (the barrier puts this program's stores
    # first), and it leaves the ticket zero for the next call (self-clearing scratch)
    tl.debug_barrier()
    if tl.atomic_add(done_ptr + row, 1, sem="acq_rel") == CHUNKS - 1:
        lanes = tl.arange(0, CHUNK_BLOCK)
        top = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], dtype=tl.float32)
        for c0 in range(0, CHUNKS, CHUNK_BLOCK):
            k = c0 + lanes
            at = stats_ptr + (row * CHUNKS + k)[:, None] * 2 * G + heads[None, :]
            mask = (k < CHUNKS)[:, None] & in_g[None, :]
            # other programs' stores: read past L1
            chunk_max = tl.load(at, mask=mask, other=float("-inf"), cache_modifier=".cg")
            chunk_sum = tl.load(at + G, mask=mask, other=0.0, cache_modifier=".cg")
            new_top = tl.maximum(top, tl.max(chunk_max, axis=0))
            shift = tl.where(new_top > float("-inf"), new_top, 0.0)
            total = total * tl.exp(top - shift) + tl.sum(chunk_sum * tl.exp(chunk_max - shift[None, :]), axis=0)
            top = new_top
        # total >= 1 where the head has a candidate (its max's own term); -inf where the row lists none
        tl.store(normalizer_ptr + row * G + heads, top + tl.log(tl.maximum(total, 1.0)), mask=in_g)
        tl.store(done_ptr + row, 0)


@pdl_kernel
@triton.jit
def _mass_kernel(
    logits_ptr, normalizer_ptr, out_ptr, hist_ptr,
    W, CHUNKS,
    G: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
    OUTPUT: tl.constexpr, BINS: tl.constexpr, LEVELS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    heads = tl.arange(0, BLOCK_G)
    in_g = heads < G
    normalizer = tl.load(normalizer_ptr + row * G + heads, mask=in_g, other=0.0)
    # a row with no candidate: every logit is -inf, and -inf - -inf would be NaN
    normalizer = tl.where(normalizer > float("-inf"), normalizer, 0.0)
    unlisted = tl.full([SUB], -2147483648, tl.int32)
    bins = tl.arange(0, BINS)
    hist = tl.zeros([BINS], dtype=tl.int32)
    for s0 in range(0, CHUNK, SUB):
        c = chunk * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_c = c < W
        logit = tl.load(logits_ptr + (row * G + heads[None, :]) * W + c[:, None],
                        mask=in_c[:, None] & in_g[None, :], other=float("-inf"))
        # the logits pass wrote -inf in every head where the candidate is not listed
        listed = tl.max(logit, axis=1) > float("-inf")
        log_prob = tl.where(listed[:, None] & in_g[None, :], logit - normalizer[None, :], float("-inf"))
        shift = tl.where(listed, tl.max(log_prob, axis=1), 0.0)
        # the sum is >= 1 where listed (the max head's own term), 0 where not (log 0 avoided)
        mass = shift + tl.log(tl.maximum(tl.sum(tl.exp(log_prob - shift[:, None]), axis=1), 1.0))
        score = tl.where(listed, mass, float("-inf")) + 0.0  # + 0.0: -0.0 ties +0.0
        if OUTPUT == "scores":
            tl.store(out_ptr + row * W + c, score, mask=in_c)
        else:
            # rerank_select's key (see its score passes): the float's bits as an int32 that orders
            # as the float does, negatives flipping their magnitude; -inf (and NaN) never chosen
            listed = listed & (score > float("-inf"))
            bits = score.to(tl.int32, bitcast=True)
            key = tl.where(listed, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), unlisted)
            if OUTPUT == "wide":
                # (key, then the lower index first) as one int64 for torch.topk: unique, so its order is fixed
                tl.store(out_ptr + row * W + c, (key.to(tl.int64) << 32) | (W - 1 - c), mask=in_c)
            else:
                tl.store(out_ptr + row * W + c, key, mask=in_c)
                if OUTPUT == "radix":
                    # the top digit (rerank_select._key_digit(key, 0)); the unlisted and the padding
                    # go to bin 0, then out of it
                    ok = in_c & listed
                    hist += tl.histogram(tl.where(ok, ((key >> 24) & 255) ^ 128, 0), BINS)
                    hist -= tl.where(bins == 0, SUB - tl.sum(ok.to(tl.int32), axis=0), 0)
                else:  # "split": the top 10 bits, bin 0 for the unlisted and the padding
                    hist += tl.histogram(tl.where(in_c, (key >> 22) + 512, 0), BINS)
    if OUTPUT == "radix":
        tl.atomic_add(hist_ptr + row * LEVELS * BINS + bins, hist, mask=hist != 0, sem="relaxed")
    if OUTPUT == "split":
        tl.store(hist_ptr + (row * CHUNKS + chunk) * BINS + bins, hist)


def check_query(op: str, query: torch.Tensor, codes: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``query`` is one of the rerank's two shapes for ``codes (B, H, N, D // 2)``:
    the group's mean, rotated, ``(B, H, D)`` (``rerank="group_mean"``), or each query head's logit
    query, ``(B, H, G, D)`` (``rerank="head_softmax"``)."""
    batch, heads, _, half = codes.shape
    mean = (batch, heads, 2 * half)
    shape = tuple(query.shape)
    if shape == mean or (len(shape) == 4 and shape[:2] == mean[:2] and shape[3] == mean[2] and shape[2] >= 1):
        return
    raise ValueError(
        f"triton {op}: query {shape} does not fit codes {tuple(codes.shape)}; accepted: (B, H, D) = {mean} "
        f"(rerank='group_mean': the group's mean, rotated) or (B, H, G, D) = ({batch}, {heads}, G, {2 * half}) "
        f"(rerank='head_softmax': each query head's logit query)"
    )


def keys(
    query_logits: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
    out: torch.Tensor,
    hist: torch.Tensor,
    chunk: int,
    output: str,
    bins: int = 1,
    levels: int = 1,
) -> None:
    """Each candidate's ``head_softmax`` score into ``out``, as ``output`` says (``OUTPUTS``, the
    module docstring); two launches over chunks of ``chunk`` candidates (a power of two).

    ``query_logits (B, H, G, D)``; ``codes``, ``weight``, ``norms``, ``candidates (B, H, W)`` as in
    ``reference_analytic.head_softmax_scores``. ``out``: ``(B * H, W)`` contiguous, float32
    ("scores"), int32 ("radix", "split") or int64 ("wide"). ``hist``: "radix": the row histograms
    ``(B * H, levels, bins)`` (the top digit's added into level 0), "split": ``(B * H, chunks, bins)``
    (each chunk's, stored); not read otherwise.
    """
    if output not in OUTPUTS:
        raise ValueError(f"triton head_softmax: output {output!r}; accepted: {', '.join(OUTPUTS)}")
    batch, heads, group, dim = query_logits.shape
    half = codes.shape[-1]
    width = candidates.shape[-1]
    rows = batch * heads
    device = codes.device
    chunks = max(1, triton.cdiv(width, chunk))
    span = max(1, width)
    logits = torch.empty(rows, group, span, dtype=torch.float32, device=device)
    stats = torch.empty(rows, chunks, 2, group, dtype=torch.float32, device=device)
    normalizer = torch.empty(rows, group, dtype=torch.float32, device=device)
    block_g = triton.next_power_of_2(group)
    # zero between calls, as the logits pass's last program of a row leaves it: no fill launched
    done = scratch.zeroed(device, "head_softmax.done", (rows,))
    _logits_kernel[(rows, chunks)](
        query_logits, codes, weight, norms, candidates, nibble_values(2 * half, device), logits, stats, normalizer,
        done,
        heads, width, chunks,
        *query_logits.stride(), *codes.stride(), *weight.stride(), *norms.stride(), *candidates.stride(),
        G=group, BLOCK_G=block_g, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        CHUNK=chunk, SUB=min(chunk, _LOGITS_SUB), CHUNK_BLOCK=min(_CHUNK_BLOCK, triton.next_power_of_2(chunks)),
        num_warps=_LOGITS_WARPS,
    )
    _mass_kernel[(rows, chunks)](
        logits, normalizer, out, hist, width, chunks,
        G=group, BLOCK_G=block_g, CHUNK=chunk, SUB=min(chunk, _MASS_SUB), OUTPUT=output, BINS=bins, LEVELS=levels,
    )


def scores(
    query_logits: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    norms: torch.Tensor,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """``(B, H, C)`` float32, -inf where -1; see ``reference_analytic.head_softmax_scores``."""
    batch, heads, _, _ = query_logits.shape
    width = candidates.shape[-1]
    out = torch.empty(batch, heads, width, dtype=torch.float32, device=codes.device)
    if out.numel() == 0:
        return out
    chunk = min(_MAX_CHUNK, max(_LOGITS_SUB, triton.next_power_of_2(triton.cdiv(width, _CHUNKS_PER_ROW))))
    keys(query_logits, codes, weight, norms, candidates, out.view(batch * heads, width), out, chunk, "scores")
    return out
