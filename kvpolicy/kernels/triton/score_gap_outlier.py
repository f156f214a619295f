"""Triton score-gap trigger step with outlier keys (op ``score_gap_outlier_fire``): the reference
(``reference_step.score_gap_outlier_fire``) in one launch up to 16 blocks a row (with the preset's options), two or
three past that, three to five with challengers, ``every``, ``admit="evict"`` or ``leaving="unheld"``, scoring
included.

``estimate="outlier"`` estimates a prompt unit's attention mass from its few keys that stand out
of it, one by one, plus its other tokens at their mean key (``triggers/outlier_keys.py``), for
each query head (``group="each"``) or the query group's mean. So the op scores the keys itself
instead of taking the selector's unit scores:

1. ``score_gap._follow_kernel``: follows the token that left the local window in the held list
   and keeps the held marks in step with it (as ``score_gap_fire``). With the preset's options
   (``_LEAVING_IN_BLOCKS``) there is no such launch: the blocks launch reads what it would add, and
   the decision makes its writes (``score_gap.write_leaving_token``).
2. ``_outlier_gap_blocks_kernel``, one program per block of units of each (KV head, sequence):
   the block's decode-unit means and prompt-unit rest means in one tile, then its outlier keys a
   tile each, each tile scored against every query head with one ``tl.dot``, and a running
   logsumexp a unit; then, per query head, the block's best unheld log mass and its held units'
   logsumexp parts.
3. ``score_gap._decide_kernel`` over the ``H * G`` query heads' rows: the largest gap decides; it
   notes the layer's ``Decision`` when given one. Up to 16 blocks a row (``_DECIDE_IN_BLOCKS_UP_TO``),
   without challengers and measuring every step, the blocks launch's last program of each sequence does this
   instead: on an H100 the op then took 10.5 us a layer against 11.7 at a 2,304-token context and 12.2 against
   13.3 at 8K, and the same 18.1 at 32K (32 blocks a row; 18.1 against 17.3 in another run), so not past 16
   (BENCHMARKS.md, session 38).

With ``challengers`` (``score_gap_challengers.py``) the first launch also checks each head's
challengers; on measured steps the blocks launch also stores every candidate's mass; between them
``_between_program`` reads only the held units (a chunk of the held list a program) and the challengers,
in a launch of its own or in the blocks launch's first programs (``_BETWEEN_LAUNCH``); and the row stage
always runs, merging the masses into the next challengers.

The sums run in another order than the reference's einsums and its logsumexp is a running one,
and for a 16-bit query the outlier keys' products run in its type and the rest means' and decode
means' in tf32 (all exact: int8 keys fit a 16-bit type's mantissa; int8 rest means, float16 decode
means and bfloat16 queries fit tf32's 10 bits; each row's scale applies after the product, sums in
float32), and in float32 for a float32 query (a group's mean), so gaps agree to float32 rounding, not
bitwise. With ``ScoreGap.fixed_query`` the prompt units' products are int8 by int8 on tensor cores, the
query's two fixed-point digits (``kernels/fixed_point.py``) against the int8 keys and rest means, exact in
int32 and rounded once to float32; no key is converted (the conversion's byte permutes were most of the
blocks kernel's instructions: ``benchmarks/int8_product_probe.py``). No host reads: a captured step replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ConfigError
from .. import fixed_point
from ..dispatch import implement, triton_runs_on
from .pdl import pdl_kernel, wait_for_previous
from .scratch import zeroed
from .score_gap import (_DECIDE_BLOCK, _measures, decide_from_parts, decide_sequence, decision_inputs,
                        follow_and_mark, held_marks, leaving_inputs, read_leaving_token, step_offset, unsupported,
                        write_leaving_token)
from .score_gap_challengers import challenger_buffers, measures_whole

# The blocks kernel's settings (benchmarks/outlier_blocks.py times them side by side; session 28, H100,
# 1x128K: 28.0 us a layer as set here, against 33.5 with float32 key operands and 39.6 pipelined).
# Key elements of one tile (a block of units x D): 64 units at D = 128.
_TILE_ELEMENTS = 8192
_BLOCKS_WARPS = 4  # warps a program
# the most registers a thread of the blocks kernel may take (None: the compiler's choice). Offline (session 36,
# sm_90, Triton 3.6, the decode shape with fixed_query): 76 registers and 12 KB of shared memory, 6 programs an
# SM; 64 spill 32 bytes and allow 8, so 1x128K's 1,024 programs run as one wave. On an H100 (session 37, 1x128K,
# with 16-dim decode tiles) no cap was faster: 26.8 us at 80, 25.9 at 64, 26.0 uncapped
_BLOCKS_MAXNREG = None
# with ``fixed_query``, the decode units' float16 means are scored this many dims a product (``_block_log_mass``;
# the head dimension or more: one product over the whole tile). In tiles of 16 the kernel takes fewer registers
# and less shared memory (offline, session 36: 6 programs an SM instead of 4), but ran slower on an H100 (session
# 37, 1x128K: 26.0 us a layer against 23.5 for the whole tile), so the whole tile it is
_DECODE_DIMS = 1024
# the outlier keys' product: "query" (the 16-bit query's own type, when it is one: half the shared
# memory of float32 operands) or "tf32" (float32 operands); and the key loop's software-pipeline stages
# (0: unrolled)
_KEY_PRODUCT = "query"
_KEY_STAGES = 0
# With challengers, a step between measured ones (latency-bound: a few programs, each a chain of dependent
# loads): its programs run in "blocks" (the blocks launch: one launch fewer a step) or "own" (a launch of
# their own); and their outlier keys are read "tile" (every key of a unit at once: one load, one product) or
# "loop" (a key a unit at a time, as a measured step reads them). benchmarks/outlier_blocks.py
# --challenger-variants times them side by side. "own" and "loop" as timed on an H100 in session 31 (a step
# between 23.3 us a layer at 1x128K); "blocks" and "tile" are written and tested, not yet timed on a GPU.
# (A measured step's keys as one tile a block ran slower at every tile on an H100, 34-44 us against 28.6:
# session 31, removed.)
_BETWEEN_LAUNCH = "own"
_BETWEEN_KEYS = "loop"
# Without challengers, measuring every step, and with at most this many blocks a row: the decision in the blocks
# launch (its last program of each sequence) instead of a launch of its own after it (0: always the decide launch,
# benchmarks/outlier_blocks.py's "decide-launch"). At most ``score_gap._DECIDE_BLOCK``: one read of the parts
_DECIDE_IN_BLOCKS_UP_TO = 16
# Without challengers, measuring every step, and with options that never drop a held unit (not ``admit="evict"``
# nor ``leaving="unheld"``): the follow launch's work in the blocks launch (the program whose block holds the open
# unit counts it held where the follow would list it) and its writes in the decision (``score_gap.
# write_leaving_token``, in the blocks launch's last program or the decide launch): one launch fewer a step. False:
# the follow launch (benchmarks/outlier_blocks.py's "follow-launch")
_LEAVING_IN_BLOCKS = True
# ``kernels/fixed_point.py``'s constants, for the kernels (``ScoreGap.fixed_query``)
_FRACTION_BITS = tl.constexpr(fixed_point.FRACTION_BITS)
_LOWEST_STEP_EXPONENT = tl.constexpr(fixed_point.LOWEST_STEP_EXPONENT)


def _setting(name: str, accepted: tuple[str, ...]) -> str:
    """Module constant ``name``, checked against its ``accepted`` values."""
    value = globals()[name]
    if value not in accepted:
        raise ValueError(f"score_gap_outlier.{name} must be one of {accepted}, got {value!r}")
    return value


def _key_dtype(trigger, query_dtype: torch.dtype, device: torch.device):
    """The outlier keys' operand type in the blocks kernel's product: int8 with ``trigger.fixed_query`` (the
    query as fixed-point digits), else ``_KEY_PRODUCT``'s. Triton's interpreter (on the CPU) multiplies
    bfloat16 tiles as their raw bits, so there the product takes float32 operands, exact too."""
    if _KEY_PRODUCT not in ("tf32", "query"):
        raise ValueError(f"score_gap_outlier._KEY_PRODUCT must be 'tf32' or 'query', got {_KEY_PRODUCT!r}")
    if trigger.fixed_query:
        return tl.int8
    if _KEY_PRODUCT == "query" and device.type == "cuda" and query_dtype in (torch.float16, torch.bfloat16):
        return tl.float16 if query_dtype == torch.float16 else tl.bfloat16
    return tl.float32


@triton.jit
def _query_logits(tile, q_t, row_scale, G: tl.constexpr, BLOCK_G: tl.constexpr, PRECISION: tl.constexpr):
    """``[BLOCK_U, BLOCK_G]``: each query head's logit of each key of ``tile`` times its row's
    ``row_scale`` (-inf past ``G``), one ``tl.dot`` against the transposed query group ``q_t
    [BLOCK_D, BLOCK_G]`` (its columns past ``G`` zero): a reduction a query head over the head
    dimension ran latency-bound on the GPU. Scaled after the product, so int8 keys stay exact in tf32."""
    if tile.dtype == tl.float32:
        logits = tl.dot(tile, q_t, input_precision=PRECISION) * row_scale[:, None]
    else:
        logits = tl.dot(tile, q_t, out_dtype=tl.float32) * row_scale[:, None]
    return tl.where((tl.arange(0, BLOCK_G) < G)[None, :], logits, float("-inf"))


@triton.jit
def _fixed_digits(q_t):
    """``q_t [BLOCK_D, BLOCK_G]`` (float32) in 14-bit fixed point, as ``kernels/fixed_point.py`` takes it: the two
    int8 digits of each element's integer ``x = 256 * hi + lo``, and each column's ``step`` (a power of two, from
    the float's exponent bits: exact)."""
    largest = tl.max(tl.abs(q_t), axis=0)
    exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    shift = tl.maximum(exponent - _FRACTION_BITS, _LOWEST_STEP_EXPONENT)
    step = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    x = tl.floor(q_t * inverse[None, :] + 0.5).to(tl.int32)
    hi = (x + 128) >> 8
    return hi.to(tl.int8), (x - hi * 256).to(tl.int8), step


@triton.jit
def _fixed_product(tile, q_hi, q_lo, step):
    """An int8 ``tile`` times a query in fixed point (``_fixed_digits``), float32 and unscaled: two int8 products
    on tensor cores, ``256 * (k . hi) + k . lo = k . x`` exactly in int32, then one rounding to float32."""
    exact = tl.dot(tile, q_hi, out_dtype=tl.int32) * 256 + tl.dot(tile, q_lo, out_dtype=tl.int32)
    return exact.to(tl.float32) * step[None, :]


@triton.jit
def _fixed_logits(tile, q_hi, q_lo, step, row_scale, G: tl.constexpr, BLOCK_G: tl.constexpr):
    """``_query_logits`` for an int8 ``tile`` and a query in fixed point (``_fixed_product``)."""
    logits = _fixed_product(tile, q_hi, q_lo, step) * row_scale[:, None]
    return tl.where((tl.arange(0, BLOCK_G) < G)[None, :], logits, float("-inf"))


@triton.jit
def _block_log_mass(ids, ok, b, h, q_t, q_head, q_sg, scale, P,
                    mean_ptr, selectable_ptr, size_ptr, keys_ptr, key_scale_ptr, valid_ptr, rest_ptr,
                    rest_scale_ptr, rest_count_ptr, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh,
                    ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh,
                    D: tl.constexpr, G: tl.constexpr, M: tl.constexpr, BLOCK_U: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, PRECISION: tl.constexpr,
                    KEY_DTYPE: tl.constexpr, KEY_STAGES: tl.constexpr, KEYS_AT_ONCE: tl.constexpr,
                    BLOCK_M: tl.constexpr, DECODE_DIMS: tl.constexpr):
    """``[BLOCK_U, BLOCK_G]``: the log mass of units ``ids`` for each query head (``-inf`` where a unit
    is not selectable or not ``ok``: no byte of it is read): a decode unit's tokens at its mean key; a
    prompt unit's other tokens at their mean key and its outlier keys one by one, each tile of keys
    scored against every query head with one ``tl.dot`` (with ``KEYS_AT_ONCE``, all ``M <= BLOCK_M``
    keys of every unit in one tile and one ``tl.dot``)."""
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    # the loads are masked by position alone, so all of them issue at once: masks from loaded flags
    # (selectable, then a key's valid flag) chained three dependent loads. A unit that is not
    # selectable may hold anything (never written): its row is dropped at the end, row by row.
    in_prompt = ok & (ids < P)
    in_decode = ok & (ids >= P)
    selectable = ok & (tl.load(selectable_ptr + b * sl_sb + h * sl_sh + ids, mask=ok, other=0) != 0)
    sizes = tl.load(size_ptr + b * sz_sb + h * sz_sh + ids, mask=ok, other=1)
    # per prompt unit (one stride for its count and both int8 scales: the launcher checks)
    per_unit = b * rc_sb + h * rc_sh + ids
    count = tl.where(in_prompt, tl.load(rest_count_ptr + per_unit, mask=in_prompt, other=0.0),
                     tl.maximum(sizes, 1).to(tl.float32))
    rest_scale = tl.where(in_prompt, tl.load(rest_scale_ptr + per_unit, mask=in_prompt, other=0.0), 1.0)
    mean_at = mean_ptr + b * mn_sb + h * mn_sh + ids[:, None] * mn_su + dims[None, :]
    rest_at = rest_ptr + b * rs_sb + h * rs_sh + ids[:, None] * rs_su + dims[None, :]
    if KEY_DTYPE == tl.int8:  # ``ScoreGap.fixed_query``: int8 products with the query's fixed-point digits
        q_keys, q_lo, q_step = _fixed_digits(q_t)
        rest = tl.load(rest_at, mask=in_prompt[:, None] & d_ok[None, :], other=0)
        top = _fixed_logits(rest, q_keys, q_lo, q_step, rest_scale * scale, G, BLOCK_G)
        if tl.max(in_decode.to(tl.int32), axis=0) > 0:  # a block with decode units: their float16 means
            # in tiles of DECODE_DIMS dims, the query's rows reloaded from ``q_head``: a whole [BLOCK_U, D] float
            # tile took 16 KB of shared memory and 24 registers from every program of the launch, where only the
            # table's last block or two hold a decode unit (session 36, offline, sm_90: 28 KB and 104 registers, 4
            # programs an SM; in tiles of 16 dims 12 KB and 76, 6 programs)
            columns = tl.arange(0, BLOCK_G)
            decode = tl.zeros([BLOCK_U, BLOCK_G], tl.float32)
            for d0 in tl.static_range(0, BLOCK_D, DECODE_DIMS):
                d = d0 + tl.arange(0, DECODE_DIMS)
                mean = tl.load(mean_ptr + b * mn_sb + h * mn_sh + ids[:, None] * mn_su + d[None, :],
                               mask=in_decode[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
                q_rows = tl.load(q_head + columns[None, :] * q_sg + d[:, None],
                                 mask=(columns < G)[None, :] & (d < D)[:, None], other=0.0).to(tl.float32)
                decode += tl.dot(mean, q_rows, input_precision=PRECISION)
            decode = tl.where((columns < G)[None, :], decode * (rest_scale * scale)[:, None], float("-inf"))
            top = tl.where(in_decode[:, None], decode, top)
        top += tl.log(count)[:, None]
    else:
        # a decode unit's tokens at its mean key, a prompt unit's other tokens at theirs (two masked
        # loads into one tile: a unit is one or the other)
        base = tl.load(mean_at, mask=in_decode[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        base += tl.load(rest_at, mask=in_prompt[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        top = _query_logits(base, q_t, rest_scale * scale, G, BLOCK_G, PRECISION) + tl.log(count)[:, None]
        # the keys' product in the query's own 16-bit type where KEY_DTYPE says so (exact: int8 keys and a
        # 16-bit query; half the shared memory of tf32's float32 operands)
        q_keys = q_t.to(KEY_DTYPE)
        q_lo, q_step = q_keys, rest_scale  # (read with int8 keys only)
    key_scale = tl.load(key_scale_ptr + per_unit, mask=in_prompt, other=0.0) * scale
    # a running logsumexp over the outlier keys, one key a unit at a time: ``top + log(total)`` (all
    # of a block's keys in one tile ran twice as long on an H100: session 25)
    total = tl.where(top > float("-inf"), 1.0, 0.0)
    keys_at = keys_ptr + b * ok_sb + h * ok_sh + ids[:, None] * ok_su + dims[None, :]
    valid_at = valid_ptr + b * ov_sb + h * ov_sh + ids * ov_su
    key_mask = in_prompt[:, None] & d_ok[None, :]
    if KEYS_AT_ONCE:
        top, total = _outlier_keys_at_once(top, total, keys_at, valid_at, key_mask, in_prompt, q_keys, q_lo, q_step,
                                           key_scale, ok_sm, G, M, BLOCK_U, BLOCK_D, BLOCK_G, BLOCK_M, PRECISION,
                                           KEY_DTYPE)
    elif KEY_STAGES > 0:  # a loop Triton software-pipelines: the next keys' loads in flight during a product
        for j in tl.range(0, M, num_stages=KEY_STAGES):
            top, total = _outlier_key_step(j, top, total, keys_at, valid_at, key_mask, in_prompt, q_keys, q_lo, q_step,
                                           key_scale, ok_sm, G, BLOCK_G, PRECISION, KEY_DTYPE)
    else:
        for j in tl.static_range(M):
            top, total = _outlier_key_step(j, top, total, keys_at, valid_at, key_mask, in_prompt, q_keys, q_lo, q_step,
                                           key_scale, ok_sm, G, BLOCK_G, PRECISION, KEY_DTYPE)
    return tl.where(selectable[:, None] & (top > float("-inf")), top + tl.log(total), float("-inf"))


@triton.jit
def _outlier_key_step(j, top, total, keys_at, valid_at, key_mask, in_prompt, q_keys, q_lo, q_step, key_scale,
                      ok_sm, G: tl.constexpr, BLOCK_G: tl.constexpr, PRECISION: tl.constexpr, KEY_DTYPE: tl.constexpr):
    """The running logsumexp ``(top, total)`` of each unit's log masses after its outlier key ``j`` (with int8
    ``KEY_DTYPE``, ``q_keys`` and ``q_lo`` are the query's fixed-point digits, ``q_step`` their steps)."""
    real = in_prompt & (tl.load(valid_at + j, mask=in_prompt, other=0) != 0)
    key = tl.load(keys_at + j * ok_sm, mask=key_mask, other=0)
    if KEY_DTYPE == tl.int8:
        logit = _fixed_logits(key, q_keys, q_lo, q_step, key_scale, G, BLOCK_G)
    else:
        logit = _query_logits(key.to(KEY_DTYPE), q_keys, key_scale, G, BLOCK_G, PRECISION)
    logit = tl.where(real[:, None], logit, float("-inf"))
    new_top = tl.maximum(top, logit)
    shift = tl.where(new_top > float("-inf"), new_top, 0.0)
    total = total * tl.exp(top - shift) + tl.exp(logit - shift)
    return new_top, total


@triton.jit
def _outlier_keys_at_once(top, total, keys_at, valid_at, key_mask, in_prompt, q_keys, q_lo, q_step, key_scale,
                          ok_sm,
                          G: tl.constexpr, M: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
                          KEY_DTYPE: tl.constexpr):
    """``_outlier_key_step`` over all ``M`` keys at once: one load of ``[BLOCK_U, BLOCK_M, BLOCK_D]`` keys (a
    few programs' latency, not a block's bandwidth: a step between measured ones) and one product."""
    j = tl.arange(0, BLOCK_M)
    listed = in_prompt[:, None] & (j < M)[None, :]
    real = listed & (tl.load(valid_at[:, None] + j[None, :], mask=listed, other=0) != 0)
    keys = tl.load(keys_at[:, None, :] + (j * ok_sm)[None, :, None],
                   mask=key_mask[:, None, :] & (j < M)[None, :, None], other=0)
    flat = tl.reshape(keys, [BLOCK_U * BLOCK_M, BLOCK_D])
    if KEY_DTYPE == tl.int8:  # the query's fixed-point digits
        logits = _fixed_product(flat, q_keys, q_lo, q_step)
    elif KEY_DTYPE == tl.float32:
        logits = tl.dot(flat.to(KEY_DTYPE), q_keys, input_precision=PRECISION)
    else:
        logits = tl.dot(flat.to(KEY_DTYPE), q_keys, out_dtype=tl.float32)
    logits = tl.reshape(logits, [BLOCK_U, BLOCK_M, BLOCK_G]) * key_scale[:, None, None]
    logits = tl.where(real[:, :, None] & (tl.arange(0, BLOCK_G) < G)[None, None, :], logits, float("-inf"))
    new_top = tl.maximum(top, tl.max(logits, axis=1))
    shift = tl.where(new_top > float("-inf"), new_top, 0.0)
    total = total * tl.exp(top - shift) + tl.sum(tl.exp(logits - shift[:, None, :]), axis=1)
    return new_top, total


@triton.jit
def _store_parts(out, parts_sk, real_column, best_unheld, held_count, best_held, held_sum):
    """A column of measure "mass"'s parts, a query head a row (``score_gap._combine_parts`` reads them)."""
    tl.store(out, best_unheld, mask=real_column)
    tl.store(out + parts_sk, held_count, mask=real_column)
    tl.store(out + 2 * parts_sk, best_held, mask=real_column)
    tl.store(out + 3 * parts_sk, held_sum, mask=real_column)


@pdl_kernel
@triton.jit
def _outlier_gap_blocks_kernel(
    q_ptr, mean_ptr, selectable_ptr, size_ptr, mask_ptr, at_selection_ptr,
    keys_ptr, key_scale_ptr, valid_ptr, rest_ptr, rest_scale_ptr, rest_count_ptr, parts_ptr, steps_ptr,
    flags_ptr, mass_ptr,
    scale, U, P, parts_sk, offset, H,
    q_sb, q_sh, q_sg, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh, mk_sb, mk_sh,
    ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh, pt_sb, pt_sh,
    ms_sb, ms_sr, held_ptr, chal_ptr, R, S_BETWEEN, hl_sb, hl_sh, ch_sb, ch_sh,
    tickets_ptr, has_ptr, above_ptr, open_ptr, seen_open_ptr, fire_ptr, out_gap_ptr, age_ptr, margin, follow_margin,
    cap, noted_ptr, count_ptr, boundary_ptr, slot_ptr, reselect_ptr, boundary_sb,
    lv_open_ptr, lv_seen_open_ptr, lv_size_ptr, lv_seen_size_ptr, lv_admitted_ptr, lv_seen_admitted_ptr, lv_marks_ptr,
    lv_held_ptr, lv_end_ptr, lv_count_ptr, KV, lv_U, lv_R,
    lv_sz_sb, lv_sz_sh, lv_ss_sb, lv_ad_sb, lv_sa_sb, lv_mk_sb, lv_mk_sh, lv_hl_sb, lv_hl_sh, lv_he_sb, lv_he_sh,
    lv_hc_sb,
    D: tl.constexpr, G: tl.constexpr, M: tl.constexpr, LEAVING_IGNORED: tl.constexpr,
    EVERY: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr, KEY_DTYPE: tl.constexpr, KEY_STAGES: tl.constexpr,
    C: tl.constexpr, BLOCK_H: tl.constexpr, BETWEEN_HERE: tl.constexpr, BLOCK_GC: tl.constexpr,
    KEYS_AT_ONCE: tl.constexpr, BLOCK_M: tl.constexpr, DECODE_DIMS: tl.constexpr,
    DECIDE: tl.constexpr, FOLLOW: tl.constexpr, CAP: tl.constexpr, NOTE: tl.constexpr, DECIDE_BLOCK_H: tl.constexpr,
    DECIDE_BLOCK_S: tl.constexpr, LEAVING_HERE: tl.constexpr, BLOCK_KV: tl.constexpr, PDL: tl.constexpr,
):
    """A measured step: program ``block`` scores a block of the table. With challengers, a step between
    measured ones is ``_between_program``'s: in this launch (``BETWEEN_HERE``, its first ``S_BETWEEN``
    programs; the launch is as wide as the larger of the two) or in ``_between_kernel``'s. With ``DECIDE``
    (no challengers, every step measured), a sequence's last program to finish (a ticket a sequence) also
    decides for it (``score_gap.decide_sequence``, the arguments from ``has_ptr`` on), in place of the decide
    launch. With ``LEAVING_HERE`` no follow launch ran: each program reads what it would have read, the program
    whose block holds the open unit counts it held where the follow launch would have listed it, and the decision
    makes that launch's writes (the arguments from ``lv_open_ptr`` on, ``score_gap.leaving_inputs``)."""
    wait_for_previous(PDL)
    block = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if C > 0:
        if BETWEEN_HERE:
            # the chunk of the held list a step between reads, loaded before the flags that say which step
            # this is: the two loads are in flight together
            rows = block * BLOCK_U + tl.arange(0, BLOCK_U)
            held_ids = tl.load(held_ptr + b * hl_sb + h * hl_sh + rows, mask=rows < R, other=-1)
            if not measures_whole(flags_ptr, steps_ptr, b, offset, H, EVERY, BLOCK_H):
                if block < S_BETWEEN:
                    _between_program(
                        block, S_BETWEEN - 1, held_ids, h, b, q_ptr, mean_ptr, selectable_ptr, size_ptr, mask_ptr,
                        keys_ptr, key_scale_ptr, valid_ptr, rest_ptr, rest_scale_ptr, rest_count_ptr, parts_ptr,
                        chal_ptr, scale, U, P, parts_sk,
                        q_sb, q_sh, q_sg, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh, mk_sb, mk_sh,
                        ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh, pt_sb,
                        pt_sh, ch_sb, ch_sh, D, G, M, C, BLOCK_U, BLOCK_D, BLOCK_G, BLOCK_GC, PRECISION, KEY_DTYPE,
                        KEY_STAGES, KEYS_AT_ONCE, BLOCK_M, DECODE_DIMS)
                return
            if block * BLOCK_U >= U:  # a program only a step between has work for
                return
        elif not measures_whole(flags_ptr, steps_ptr, b, offset, H, EVERY, BLOCK_H):
            return  # a step between measured ones is ``_between_kernel``'s
    elif EVERY > 1:
        if not _measures(steps_ptr, b, offset, EVERY):
            return  # a step between measured ones (``ScoreGap.every``): no key is read
    if LEAVING_HERE:
        # what the follow launch would read, for every KV head of the sequence (the decision writes it): loaded
        # first, so its latency passes under the scoring's
        lv_unit, lv_add, lv_count, lv_replaced, lv_size, lv_admitted = read_leaving_token(
            b, lv_open_ptr, lv_seen_open_ptr, lv_size_ptr, lv_seen_size_ptr, lv_admitted_ptr, lv_seen_admitted_ptr,
            lv_marks_ptr, lv_held_ptr, lv_end_ptr, lv_count_ptr, KV, lv_U, lv_R, lv_sz_sb, lv_sz_sh, lv_ss_sb,
            lv_ad_sb, lv_sa_sb, lv_mk_sb, lv_mk_sh, lv_hl_sb, lv_hl_sh, lv_he_sb, lv_he_sh, lv_hc_sb, BLOCK_KV)
    # the query group transposed, ``[BLOCK_D, BLOCK_G]``: a ``tl.dot`` operand (zero past ``G``)
    dims = tl.arange(0, BLOCK_D)
    columns = tl.arange(0, BLOCK_G)
    q_t = tl.load(q_ptr + b * q_sb + h * q_sh + columns[None, :] * q_sg + dims[:, None],
                  mask=(columns < G)[None, :] & (dims < D)[:, None], other=0.0).to(tl.float32)
    first = block.to(tl.int64) * BLOCK_U
    ids = first + tl.arange(0, BLOCK_U).to(tl.int64)
    ok = ids < U
    log_mass = _block_log_mass(
        ids, ok, b, h, q_t, q_ptr + b * q_sb + h * q_sh, q_sg, scale, P,
        mean_ptr, selectable_ptr, size_ptr, keys_ptr, key_scale_ptr, valid_ptr, rest_ptr, rest_scale_ptr,
        rest_count_ptr, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh,
        ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh,
        D, G, M, BLOCK_U, BLOCK_D, BLOCK_G, PRECISION, KEY_DTYPE, KEY_STAGES, False, BLOCK_M, DECODE_DIMS)
    held = tl.load(mask_ptr + b * mk_sb + h * mk_sh + ids, mask=ok, other=0) != 0
    if LEAVING_HERE:
        # the follow's add in this head: the open unit is held from this step where the buffer admitted its token,
        # in the list's next entry, and what that entry listed is not (as the follow launch replaces it)
        mine = tl.arange(0, BLOCK_KV) == h
        add = tl.sum(tl.where(mine, lv_add.to(tl.int32), 0), axis=0) > 0
        replaced = tl.sum(tl.where(mine, lv_replaced, 0), axis=0)
        held = tl.where(ids == lv_unit, held | add, tl.where(ids == replaced, False, held))
    finite = log_mass > float("-inf")
    candidate = ~held[:, None] & finite
    if LEAVING_IGNORED:  # units opened since the selection that the buffer did not admit
        candidate = candidate & (ids < P + tl.load(at_selection_ptr + b))[:, None]
    counted = held[:, None] & finite
    # per query head (row h * G + g of the parts), as ``score_gap._gap_blocks_kernel``'s measure "mass"
    out = parts_ptr + b * pt_sb + (h * G + columns) * pt_sh + block
    real_column = columns < G
    unheld = tl.where(candidate, log_mass, float("-inf"))
    if C > 0:  # every candidate's mass, for the row stage to take the next challengers from
        tl.store(mass_ptr + b * ms_sb + (h * G + columns)[None, :] * ms_sr + ids[:, None], unheld,
                 mask=ok[:, None] & real_column[None, :])
    best_held = tl.max(tl.where(counted, log_mass, float("-inf")), axis=0)
    shift = tl.where((best_held > float("-inf")) & (best_held < float("inf")), best_held, 0.0)
    _store_parts(out, parts_sk, real_column, tl.max(unheld, axis=0), tl.sum(counted.to(tl.float32), axis=0),
                 best_held, tl.sum(tl.where(counted, tl.exp(log_mass - shift[None, :]), 0.0), axis=0))
    if DECIDE:
        # the ticket (acq_rel) after this program's parts (the barrier puts every warp's stores first); the
        # last program of the sequence reads them all past L1 and leaves the ticket zero for the next step
        tl.debug_barrier()
        if tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel") == tl.num_programs(0) * tl.num_programs(1) - 1:
            if LEAVING_HERE:  # every program of the sequence has read the marks and the last look
                write_leaving_token(
                    b, lv_unit, lv_add, lv_count, lv_replaced, lv_size, lv_admitted, lv_open_ptr, lv_seen_open_ptr,
                    lv_size_ptr, lv_seen_size_ptr, lv_admitted_ptr, lv_seen_admitted_ptr, lv_marks_ptr, lv_held_ptr,
                    lv_end_ptr, lv_count_ptr, KV, lv_U, lv_R, lv_sz_sb, lv_sz_sh, lv_ss_sb, lv_ad_sb, lv_sa_sb,
                    lv_mk_sb, lv_mk_sh, lv_hl_sb, lv_hl_sh, lv_he_sb, lv_he_sh, lv_hc_sb, BLOCK_KV)
                tl.debug_barrier()  # its reads of ``seen_open`` before the decision writes it
            decide_sequence(
                b, parts_ptr, H * G, tl.num_programs(0), parts_sk, pt_sb, pt_sh, steps_ptr, offset,
                has_ptr, above_ptr, open_ptr, seen_open_ptr, fire_ptr, out_gap_ptr, age_ptr, margin, follow_margin,
                cap, noted_ptr, count_ptr, boundary_ptr, slot_ptr, reselect_ptr, boundary_sb,
                True, False, FOLLOW, CAP, NOTE, EVERY, False, DECIDE_BLOCK_H, DECIDE_BLOCK_S, ".cg")
            tl.store(tickets_ptr + b, 0)


@pdl_kernel
@triton.jit
def _between_kernel(
    q_ptr, mean_ptr, selectable_ptr, size_ptr, mask_ptr,
    keys_ptr, key_scale_ptr, valid_ptr, rest_ptr, rest_scale_ptr, rest_count_ptr, parts_ptr, steps_ptr,
    flags_ptr, held_ptr, chal_ptr,
    scale, U, P, R, parts_sk, offset, H,
    q_sb, q_sh, q_sg, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh, mk_sb, mk_sh,
    ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh, pt_sb, pt_sh,
    hl_sb, hl_sh, ch_sb, ch_sh,
    D: tl.constexpr, G: tl.constexpr, M: tl.constexpr, EVERY: tl.constexpr, C: tl.constexpr,
    BLOCK_U: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GC: tl.constexpr,
    BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, KEY_DTYPE: tl.constexpr, KEY_STAGES: tl.constexpr,
    KEYS_AT_ONCE: tl.constexpr, BLOCK_M: tl.constexpr, DECODE_DIMS: tl.constexpr, PDL: tl.constexpr,
):
    """A step between measured ones in a launch of its own (``_BETWEEN_LAUNCH = "own"``): a program a chunk
    of the held list, then one for the challengers (``_between_program``). On a measured step it returns at
    once (the blocks launch's)."""
    wait_for_previous(PDL)
    chunk = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = chunk * BLOCK_U + tl.arange(0, BLOCK_U)
    held_ids = tl.load(held_ptr + b * hl_sb + h * hl_sh + rows, mask=rows < R, other=-1)  # none in the last program
    if measures_whole(flags_ptr, steps_ptr, b, offset, H, EVERY, BLOCK_H):
        return
    _between_program(
        chunk, tl.num_programs(0) - 1, held_ids, h, b, q_ptr, mean_ptr, selectable_ptr, size_ptr, mask_ptr,
        keys_ptr, key_scale_ptr, valid_ptr, rest_ptr, rest_scale_ptr, rest_count_ptr, parts_ptr, chal_ptr,
        scale, U, P, parts_sk, q_sb, q_sh, q_sg, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh, mk_sb, mk_sh,
        ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh, pt_sb, pt_sh,
        ch_sb, ch_sh, D, G, M, C, BLOCK_U, BLOCK_D, BLOCK_G, BLOCK_GC, PRECISION, KEY_DTYPE, KEY_STAGES,
        KEYS_AT_ONCE, BLOCK_M, DECODE_DIMS)


@triton.jit
def _between_program(
    chunk, chunks, ids, h, b, q_ptr, mean_ptr, selectable_ptr, size_ptr, mask_ptr,
    keys_ptr, key_scale_ptr, valid_ptr, rest_ptr, rest_scale_ptr, rest_count_ptr, parts_ptr, chal_ptr,
    scale, U, P, parts_sk, q_sb, q_sh, q_sg, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh, mk_sb, mk_sh,
    ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh, pt_sb, pt_sh,
    ch_sb, ch_sh, D: tl.constexpr, G: tl.constexpr, M: tl.constexpr, C: tl.constexpr,
    BLOCK_U: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GC: tl.constexpr,
    PRECISION: tl.constexpr, KEY_DTYPE: tl.constexpr, KEY_STAGES: tl.constexpr, KEYS_AT_ONCE: tl.constexpr,
    BLOCK_M: tl.constexpr, DECODE_DIMS: tl.constexpr,
):
    """A step between measured ones, with challengers: ``chunk < chunks`` scores the held units ``ids`` (its
    chunk of the held list); ``chunk == chunks`` each query head's challengers (none
    held: the follow launch's check saw to that), each into its column of the parts. No other unit's byte is
    read."""
    # (branches without an early return: Triton 3.6 does not compile a return inside a called function's if)
    columns = tl.arange(0, BLOCK_G)
    out = parts_ptr + b * pt_sb + (h * G + columns) * pt_sh + chunk
    real_column = columns < G
    nothing = tl.full([BLOCK_G], float("-inf"), tl.float32)
    listed = (ids >= 0) & (ids < U)
    dims = tl.arange(0, BLOCK_D)
    q_at = q_ptr + b * q_sb + h * q_sh + columns[None, :] * q_sg + dims[:, None]
    q_ok = (columns < G)[None, :] & (dims < D)[:, None]
    if chunk == chunks:  # query head g's challengers are rows g * C ..
        q_t = tl.load(q_at, mask=q_ok, other=0.0).to(tl.float32)
        k = tl.arange(0, BLOCK_GC)
        chal_ids = tl.load(chal_ptr + b * ch_sb + h * ch_sh + k, mask=k < G * C, other=-1)
        chal_listed = (chal_ids >= 0) & (chal_ids < U)
        chal_mass = _block_log_mass(
            chal_ids, chal_listed, b, h, q_t, q_ptr + b * q_sb + h * q_sh, q_sg, scale, P,
            mean_ptr, selectable_ptr, size_ptr, keys_ptr, key_scale_ptr, valid_ptr, rest_ptr, rest_scale_ptr,
            rest_count_ptr, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh,
            ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh,
            D, G, M, BLOCK_GC, BLOCK_D, BLOCK_G, PRECISION, KEY_DTYPE, KEY_STAGES, KEYS_AT_ONCE, BLOCK_M,
            DECODE_DIMS)
        own = chal_listed[:, None] & ((k // C)[:, None] == columns[None, :])
        _store_parts(out, parts_sk, real_column, tl.max(tl.where(own, chal_mass, float("-inf")), axis=0),
                     tl.zeros([BLOCK_G], tl.float32), nothing, tl.zeros([BLOCK_G], tl.float32))
    elif tl.max(listed.to(tl.int32), axis=0) == 0:  # a chunk of the held list with no unit in it
        _store_parts(out, parts_sk, real_column, nothing, tl.zeros([BLOCK_G], tl.float32), nothing,
                     tl.zeros([BLOCK_G], tl.float32))
    else:
        q_t = tl.load(q_at, mask=q_ok, other=0.0).to(tl.float32)
        log_mass = _block_log_mass(
            ids, listed, b, h, q_t, q_ptr + b * q_sb + h * q_sh, q_sg, scale, P,
            mean_ptr, selectable_ptr, size_ptr, keys_ptr, key_scale_ptr, valid_ptr, rest_ptr, rest_scale_ptr,
            rest_count_ptr, mn_sb, mn_sh, mn_su, sl_sb, sl_sh, sz_sb, sz_sh,
            ok_sb, ok_sh, ok_su, ok_sm, ov_sb, ov_sh, ov_su, rs_sb, rs_sh, rs_su, rc_sb, rc_sh,
            D, G, M, BLOCK_U, BLOCK_D, BLOCK_G, PRECISION, KEY_DTYPE, KEY_STAGES, KEYS_AT_ONCE, BLOCK_M,
            DECODE_DIMS)
        counted = listed[:, None] & (log_mass > float("-inf"))
        top = tl.max(tl.where(counted, log_mass, float("-inf")), axis=0)
        shift = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
        total = tl.sum(tl.where(counted, tl.exp(log_mass - shift[None, :]), 0.0), axis=0)
        _store_parts(out, parts_sk, real_column, nothing, tl.sum(counted.to(tl.float32), axis=0), top, total)


def _no_decision(fire: torch.Tensor) -> tuple[torch.Tensor, tuple, dict]:
    """The blocks kernel's ticket and decision arguments where it does not decide (never read): one placeholder
    tensor and fixed settings, so that kernel compiles once whatever the table's size or the layer's options."""
    flag = fire.view(torch.uint8)
    inputs = (flag,) * 7 + (0.0, 0.0, 0) + (flag,) * 5 + (0,)  # as decision_inputs' kinds
    return flag, inputs, dict(FOLLOW=False, CAP=False, NOTE=False, DECIDE_BLOCK_H=1, DECIDE_BLOCK_S=1)


@implement("triton", "score_gap_outlier_fire", supports=triton_runs_on)
def score_gap_outlier_fire(trigger, state, query: torch.Tensor, scale: float, *, decision=None) -> torch.Tensor:
    """Three or four launches of ``reference_step.score_gap_outlier_fire`` (the last also writes ``decision``);
    five with ``challengers`` (the steps between measured ones, and the row stage always)."""
    layer = state.layer
    table, outliers = layer.units, state.outliers
    batch, q_heads, dim = query.shape
    heads, units = table.size.shape[1], table.capacity
    device = query.device
    fire = torch.empty(batch, dtype=torch.bool, device=device)
    if batch == 0:
        return fire
    why = unsupported(trigger)
    if why is not None:
        raise ConfigError(why)
    group = query.view(batch, heads, q_heads // heads, dim)
    if trigger.group != "each":  # the query group's mean, in float32 as the reference takes it
        group = group.float().mean(2, keepdim=True)
    for name, t in (("query", group), ("held", state.held), ("held_end", state.held_end),
                    ("units.size", table.size), ("units.key_mean", table.key_mean), ("outlier keys", outliers.keys),
                    ("outlier rest means", outliers.rest_mean)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton score_gap_outlier_fire: {name} must be contiguous in its last dim")
    if not (outliers.key_scale.stride() == outliers.rest_scale.stride() == outliers.rest_count.stride()):
        raise ValueError("triton score_gap_outlier_fire: the outlier keys' scales and rest counts must share "
                         f"strides, got {outliers.key_scale.stride()}, {outliers.rest_scale.stride()} and "
                         f"{outliers.rest_count.stride()}")
    mask = held_marks(state, units)
    per_head = group.shape[2]
    block_d = triton.next_power_of_2(dim)
    block = max(16, min(_TILE_ELEMENTS // block_d, triton.next_power_of_2(max(units, 1))))
    # a program a block: a few blocks a program, looping, ran at 74-79 us a layer against 50 at 1x128K
    # on an H100 (session 25: fewer programs in flight)
    blocks = triton.cdiv(units, block)
    rows = heads * per_head
    room = state.held.shape[-1]
    chal = None
    if trigger.challengers:
        chal = challenger_buffers(trigger, state, batch, heads, per_head, units, block, device)
    # the follow launch's work in the blocks launch and the decision, where the options leave it a unit to add
    # and none to drop (``_LEAVING_IN_BLOCKS``)
    leaving_here = (_LEAVING_IN_BLOCKS and chal is None and trigger.every == 1 and trigger.leaving != "unheld"
                    and layer.policy.admit != "evict")
    if not leaving_here:
        # measure "mass": no rank, so the scores and middle tensors are never read (any tensors)
        follow_and_mark(trigger, state, mask, table.size, state.gap, scale, rank=False,
                        challengers=chal.ids if chal else None, flags=chal.flags if chal else None)
    # a step between measured ones (challengers) writes a column a chunk of the held list, then the challengers'
    between_parts = triton.cdiv(room, block) + 1
    parts = torch.empty(4, batch, rows, max(blocks, between_parts) if chal else blocks, dtype=torch.float32,
                        device=device)
    # without challengers, any tensors of the right kinds as placeholders (never read)
    flags, mass = (chal.flags, chal.mass) if chal else (state.held_count, parts[0])
    table_args = (table.key_mean, table.selectable.view(torch.uint8), table.size, mask)
    outlier_args = (outliers.keys, outliers.key_scale, outliers.valid.view(torch.uint8), outliers.rest_mean,
                    outliers.rest_scale, outliers.rest_count, parts, state.steps)
    strides = (*group.stride()[:3], *table.key_mean.stride()[:3], *table.selectable.stride()[:2],
               *table.size.stride()[:2], *mask.stride()[:2],
               *outliers.keys.stride()[:4], *outliers.valid.stride()[:3], *outliers.rest_mean.stride()[:3],
               *outliers.rest_count.stride()[:2], *parts.stride()[1:3])
    settings = dict(BLOCK_U=block, BLOCK_D=block_d, BLOCK_G=max(16, triton.next_power_of_2(per_head)),
                    PRECISION="ieee" if group.dtype == torch.float32 else "tf32",  # see the module's docstring
                    KEY_DTYPE=_key_dtype(trigger, group.dtype, device), KEY_STAGES=_KEY_STAGES,
                    BLOCK_H=triton.next_power_of_2(heads), DECODE_DIMS=min(_DECODE_DIMS, block_d),
                    num_warps=_BLOCKS_WARPS)
    if _BLOCKS_MAXNREG is not None:
        settings["maxnreg"] = _BLOCKS_MAXNREG
    count = chal.ids.shape[-1] if chal else 0
    offset = step_offset(trigger, layer)
    between_here = _setting("_BETWEEN_LAUNCH", ("own", "blocks")) == "blocks" and chal is not None
    outlier_count = outliers.keys.shape[3]
    between = dict(BLOCK_GC=max(16, triton.next_power_of_2(per_head * count)),
                   KEYS_AT_ONCE=_setting("_BETWEEN_KEYS", ("loop", "tile")) == "tile",
                   BLOCK_M=triton.next_power_of_2(outlier_count))
    challengers = chal.ids if chal else state.held  # a placeholder without challengers (never read)
    # the decision in the blocks launch's last program of each sequence, for a table of a few blocks a row
    # (``_DECIDE_IN_BLOCKS_UP_TO``); else the decide launch (past 64 blocks a row, a row stage before it)
    decide_here = chal is None and trigger.every == 1 and blocks <= min(_DECIDE_IN_BLOCKS_UP_TO, _DECIDE_BLOCK)
    if decide_here:
        inputs, decide_settings = decision_inputs(trigger, state, fire, decision)
        decide_settings.update(DECIDE_BLOCK_H=triton.next_power_of_2(rows), DECIDE_BLOCK_S=triton.next_power_of_2(blocks))
        tickets = zeroed(device, "score_gap_outlier_decide", (batch,))
    else:
        tickets, inputs, decide_settings = _no_decision(fire)
    _outlier_gap_blocks_kernel[(max(blocks, between_parts) if between_here else blocks, heads, batch)](
        group, *table_args, state.units_at_selection, *outlier_args, flags, mass,
        float(scale), units, int(table.num_prompt_units), parts.stride(0), offset, heads,
        *strides, *mass.stride()[:2], state.held, challengers, room, between_parts,
        *state.held.stride()[:2], *challengers.stride()[:2], tickets, *inputs, *leaving_inputs(state),
        D=dim, G=per_head, M=outlier_count, LEAVING_IGNORED=trigger.leaving == "ignored",
        EVERY=trigger.every, C=count, BETWEEN_HERE=between_here, DECIDE=decide_here, LEAVING_HERE=leaving_here,
        BLOCK_KV=triton.next_power_of_2(heads), **decide_settings, **between, **settings,
    )
    if decide_here:
        return fire
    if chal:
        if not between_here:
            _between_kernel[(between_parts, heads, batch)](
                group, *table_args, *outlier_args, flags, state.held, chal.ids,
                float(scale), units, int(table.num_prompt_units), room, parts.stride(0), offset, heads,
                *strides, *state.held.stride()[:2], *chal.ids.stride()[:2],
                D=dim, G=per_head, M=outlier_count, EVERY=trigger.every, C=count, **between, **settings,
            )
        chal = chal._replace(blocks=blocks, between_parts=between_parts)
    decide_from_parts(trigger, state, parts, fire, mass=True, rank=False, decision=decision, challenge=chal,
                      leaving=leaving_here)
    return fire
