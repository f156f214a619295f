"""Triton unit scoring (op ``unit_scores``) against the reference, and selection through it.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (conftest turns it
on); with CUDA the same cases run on the GPU, plus decode-sized ones. Random float inputs agree
to float32 rounding (the sums run in another order): the error is measured against
``sum |q| |k|``, the size of the terms summed. Small-integer inputs make every sum exact, so
there the scores, and the selections built on them (ties included), must be identical.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvpolicy.kernels import dispatch, reference
from kvpolicy.selectors import Bound, TopBudget
from kvpolicy.selectors.oracle import Oracle

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
INF = float("inf")


def _unit_scores():
    return dispatch.get("unit_scores", "triton", DEVICE)


def _tables(batch, heads, units, dim, seed, integer=False, p_empty=0.15, tokens=64):
    """A unit table's statistics: sizes (some 0, then not selectable, with +-inf bounds as the
    table keeps them), key sums and bounds (min <= max), starts and orders."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (batch, heads, units)
    size = torch.randint(1, 9, shape, generator=g, device=DEVICE)
    size = size.masked_fill(torch.rand(shape, generator=g, device=DEVICE) < p_empty, 0)
    selectable = size > 0
    if integer:
        low = torch.randint(-4, 3, (*shape, dim), generator=g, device=DEVICE).float()
        high = low + torch.randint(0, 4, (*shape, dim), generator=g, device=DEVICE).float()
        # sums of whole multiples of the size: the float16 means are small integers, exact
        # (a mean like 7/3 rounds, and the GPU's dot then sums the rounded terms in its own order)
        key_sum = torch.randint(-20, 21, (*shape, dim), generator=g, device=DEVICE).float() * size.unsqueeze(-1)
    else:
        low = torch.randn(*shape, dim, generator=g, device=DEVICE)
        high = low + torch.rand(*shape, dim, generator=g, device=DEVICE) * 2
        key_sum = torch.randn(*shape, dim, generator=g, device=DEVICE) * size.unsqueeze(-1)
    filled = selectable.unsqueeze(-1)
    key_min = torch.where(filled, low, INF)
    key_max = torch.where(filled, high, -INF)
    key_sum = torch.where(filled, key_sum, 0.0)
    start = (torch.rand(shape, generator=g, device=DEVICE) * (tokens - size + 1)).long()
    order = torch.argsort(torch.rand(batch, heads, tokens, generator=g, device=DEVICE), dim=-1)
    t = SimpleNamespace(key_sum=key_sum, key_min=key_min, key_max=key_max, size=size, selectable=selectable,
                        start=start, order=order, key_mean=reference.half_mean(key_sum, size))
    t.mean_keys = lambda: t.key_sum / t.size.clamp(min=1).unsqueeze(-1)  # for Oracle
    return t


def _query(batch, q_heads, dim, seed, integer=False):
    """``(B, Hq, D)``, not contiguous (its head axis has stride 1)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if integer:
        q = torch.randint(-3, 4, (batch, dim, q_heads), generator=g, device=DEVICE).float()
    else:
        q = torch.randn(batch, dim, q_heads, generator=g, device=DEVICE)
    return q.transpose(1, 2)


def _scale(method, group, t):
    """Per unit, the size of the terms the score sums (its float32 rounding is relative to it)."""
    a = group.abs()
    if method == "mean":
        return torch.einsum("bhgd,bhud->bhu", a, t.key_mean.float().abs()) / group.shape[2]
    filled = t.selectable.unsqueeze(-1)
    box = torch.where(filled, torch.maximum(t.key_min.abs(), t.key_max.abs()), 0.0)
    return torch.einsum("bhgd,bhud->bhgu", a, box).amax(2)


def _check(method, group, t, take=None, exact=False):
    got = _unit_scores()(group, t.key_mean, t.key_min, t.key_max, t.selectable, method, take)
    want = reference.unit_scores(group, t.key_mean, t.key_min, t.key_max, t.selectable, method)
    assert got.dtype == torch.float32 and got.shape == want.shape
    rows = torch.ones(group.shape[0], dtype=torch.bool, device=DEVICE) if take is None else take
    g, w = got[rows], want[rows]
    assert torch.equal(torch.isneginf(g), ~t.selectable[rows]) and torch.equal(torch.isneginf(w), ~t.selectable[rows])
    if exact:
        assert torch.equal(g, w)
    else:
        ok = t.selectable[rows]
        error = (g[ok] - w[ok]).abs() / _scale(method, group, t)[rows][ok].clamp(min=1e-30)
        assert error.numel() == 0 or error.max().item() < 1e-5
    assert torch.isneginf(got[~rows]).all()  # skipped sequences: -inf, their table unread
    return got


@pytest.mark.parametrize("method", ["mean", "bound"])
@pytest.mark.parametrize(
    "batch, kv_heads, group, units, dim",
    [
        (2, 3, 4, 100, 16),  # U not a multiple of the unit block
        (1, 2, 1, 37, 24),  # D not a power of two, a group of one
        (2, 2, 3, 300, 128),  # decode head size, several unit blocks
        (3, 1, 2, 1, 8),  # a single unit
    ],
)
def test_unit_scores_match_reference(method, batch, kv_heads, group, units, dim):
    seed = units * 13 + dim + group
    t = _tables(batch, kv_heads, units, dim, seed)
    q = _query(batch, kv_heads * group, dim, seed + 1).reshape(batch, kv_heads, group, dim)
    _check(method, q, t)
    take = torch.arange(batch, device=DEVICE) % 2 == 0  # every other sequence
    _check(method, q, t, take)


@pytest.mark.parametrize("method", ["mean", "bound"])
def test_unit_scores_are_exact_on_small_integers(method):
    # a group of 4: the mean over the group divides by a power of two, exact in either order
    t = _tables(2, 2, 90, 20, seed=5, integer=True)
    q = _query(2, 8, 20, seed=6, integer=True).reshape(2, 2, 4, 20)
    _check(method, q, t, exact=True)
    _check(method, q, t, torch.tensor([False, True], device=DEVICE), exact=True)


@pytest.mark.parametrize("method", ["mean", "bound"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_dtype_query_scores_as_its_float32_widening(method, dtype):
    # the op reads the model's query as it is (no float32 copy launched), widened exactly in-kernel
    # a slice of a wider projection output (the query of a fused qkv): 2-byte elements at strides
    t = _tables(2, 2, 300, 128, seed=9)
    qkv = torch.randn(2, 12, 128, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    q = qkv[:, :8].view(2, 2, 4, 128)
    assert q.stride(0) == 12 * 128  # not contiguous
    take = torch.tensor([True, False], device=DEVICE)
    got = _unit_scores()(q, t.key_mean, t.key_min, t.key_max, t.selectable, method, take)
    assert torch.equal(got, _unit_scores()(q.float(), t.key_mean, t.key_min, t.key_max, t.selectable, method, take))
    _check(method, q.float(), t, take)


def test_unit_scores_rejects_bad_arguments():
    t = _tables(1, 1, 4, 8, seed=1)
    q = torch.zeros(1, 1, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="method"):
        _unit_scores()(q, t.key_mean, t.key_min, t.key_max, t.selectable, "dot")
    with pytest.raises(ValueError, match="key_min"):
        _unit_scores()(q, t.key_mean, None, None, t.selectable, "bound")
    with pytest.raises(ValueError, match="do not fit"):
        _unit_scores()(q[..., :4], t.key_mean, t.key_min, t.key_max, t.selectable, "mean")
    for scores in (_unit_scores(), reference.unit_scores):  # both backends name the accepted dtypes
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            scores(q.double(), t.key_mean, t.key_min, t.key_max, t.selectable, "mean")
    with pytest.raises(ValueError, match="key statistics torch.float16 for method 'mean'"):
        _unit_scores()(q, t.key_sum, t.key_min, t.key_max, t.selectable, "mean")  # the float32 sums


def test_half_means_round_and_clamp():
    # the float16 means are the float32 division rounded to nearest, clamped to float16's range
    key_sum = torch.tensor([[[[3.0, -1e9, 1e9, float("nan")], [1.0, 2.0, 3.0, 4.0]]]], device=DEVICE)
    size = torch.tensor([[[3, 0]]], device=DEVICE)
    mean = reference.half_mean(key_sum, size)
    assert mean.dtype == torch.float16
    assert mean[0, 0, 0, :3].tolist() == [1.0, -65504.0, 65504.0] and torch.isnan(mean[0, 0, 0, 3])
    assert mean[0, 0, 1].tolist() == [1.0, 2.0, 3.0, 4.0]  # an empty unit divides by 1


def test_dispatch_reaches_the_triton_op():
    from kvpolicy.kernels.triton import score

    assert dispatch.why_unavailable("triton", "unit_scores", DEVICE) is None
    assert dispatch.get("unit_scores", "triton", DEVICE) is score.unit_scores
    assert dispatch.get("unit_scores", "reference", DEVICE) is reference.unit_scores


# ---- selection: Selector.select(..., take) on the triton backend ---------------------------

def _selection_check(selector, units, capacity, take, seed):
    batch, kv_heads, group, dim = 3, 2, 2, 16
    t = _tables(batch, kv_heads, units, dim, seed, integer=True, tokens=4 * units)
    query = _query(batch, kv_heads * group, dim, seed + 1, integer=True)
    got = selector.select(query, t, capacity, "triton", take)
    want = selector.select(query, t, capacity, "reference")
    rows = torch.ones(batch, dtype=torch.bool, device=DEVICE) if take is None else take
    for name in ("unit_ids", "num_units", "slots", "slot_valid"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a[rows], b[rows]), name
    # the others: safe to consume (the Triton fill writes an empty selection)
    n = t.order.shape[-1]
    assert ((got.slots[~rows] >= 0) & (got.slots[~rows] < n)).all()
    assert ((got.unit_ids[~rows] >= -1) & (got.unit_ids[~rows] < units)).all()
    assert not got.slot_valid[~rows].any()


@pytest.mark.parametrize("selector", [TopBudget(), Bound(), Oracle()], ids=["top_budget", "bound", "oracle"])
@pytest.mark.parametrize("take", [None, [True, False, True], [False, False, False]])
def test_select_with_take_matches_the_reference_backend(selector, take):
    take = None if take is None else torch.tensor(take, device=DEVICE)
    # integer queries and keys: exact scores, many ties
    _selection_check(selector, 70, 40, take, seed=3)


def test_built_in_selectors_score_through_the_op_and_overrides_do_not():
    assert TopBudget._unit_score_method() == "mean"
    assert Bound._unit_score_method() == "bound"
    assert Oracle._unit_score_method() is None

    @dataclass
    class Shifted(TopBudget):
        def score(self, query_group, units):
            return super().score(query_group, units) * -1.0

    @dataclass
    class Renamed(Bound):
        pass

    assert Shifted._unit_score_method() is None
    assert Renamed._unit_score_method() == "bound"
    t = _tables(1, 1, 30, 8, seed=9, integer=True, tokens=120)
    query = _query(1, 2, 8, seed=10, integer=True)
    flipped = Shifted().select(query, t, 20, "triton")
    plain = TopBudget().select(query, t, 20, "triton")
    reverse = reference.select_budget(
        (-reference.mean_key_scores(query.reshape(1, 1, 2, 8), t.key_mean)).masked_fill(~t.selectable, -INF),
        t.size, t.start, t.order, 20,
    )
    assert torch.equal(flipped.unit_ids, reverse[0]) and not torch.equal(flipped.unit_ids, plain.unit_ids)


def test_selector_score_stays_finite_and_matches_the_op():
    # ``score`` (plain PyTorch, finite) is the op's reference before masking
    t = _tables(2, 2, 25, 8, seed=12)
    q = _query(2, 4, 8, seed=13).reshape(2, 2, 2, 8)
    for selector, method in ((TopBudget(), "mean"), (Bound(), "bound")):
        raw = selector.score(q, t)
        assert torch.isfinite(raw).all()
        masked = reference.unit_scores(q, t.key_mean, t.key_min, t.key_max, t.selectable, method)
        assert torch.equal(raw.masked_fill(~t.selectable, -INF), masked)


# ---- CUDA only: decode-sized problems --------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("method", ["mean", "bound"])
def test_unit_scores_at_decode_sizes(method):
    t = _tables(4, 8, 8192, 128, seed=1)
    q = _query(4, 32, 128, seed=2).reshape(4, 8, 4, 128)
    _check(method, q, t, torch.tensor([True, False, True, True], device=DEVICE))


@needs_cuda
def test_select_with_take_replays_in_a_cuda_graph():
    batch, kv_heads, group, dim, units = 4, 8, 4, 128, 8192
    # integer queries and keys: exact scores, so the selections must be identical
    t = _tables(batch, kv_heads, units, dim, seed=1, integer=True, tokens=131072)
    query = _query(batch, kv_heads * group, dim, seed=2, integer=True).contiguous()
    take = torch.tensor([True, False, True, False], device=DEVICE)
    selector = Bound()
    selector.select(query, t, 2048, "triton", take)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = selector.select(query, t, 2048, "triton", take)
    for seed, rows in ((3, [False, True, True, True]), (4, [False] * 4)):
        fresh = _tables(batch, kv_heads, units, dim, seed=seed, integer=True, tokens=131072)
        for name in ("key_sum", "key_min", "key_max", "key_mean", "size", "selectable", "start", "order"):
            getattr(t, name).copy_(getattr(fresh, name))
        query.copy_(_query(batch, kv_heads * group, dim, seed=seed + 10, integer=True))
        take.copy_(torch.tensor(rows, device=DEVICE))
        graph.replay()
        want = selector.select(query, t, 2048, "reference")
        for name in ("unit_ids", "num_units", "slots", "slot_valid"):
            assert torch.equal(getattr(got, name)[take], getattr(want, name)[take]), name
        assert not got.slot_valid[~take].any() and (got.slots[~take] == 0).all()
