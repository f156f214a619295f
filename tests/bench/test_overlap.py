"""``bench/overlap.py``: a score bias that makes random weights' selections overlap."""

import pytest
import torch

from kvpolicy.bench.overlap import StickyCollisionRerank, StickyTopBudget, pulled_query, unit_hash
from kvpolicy.bench.sweeps import louiskv_interval
from kvpolicy.cli.common import floats
from kvpolicy.errors import KVPolicyError
from kvpolicy.kernels import dispatch
from kvpolicy.selectors import CollisionRerank
from kvpolicy.selectors.top_budget import TopBudget
from kvpolicy.units import Analytic
from kvpolicy.units.table import UnitTable

B, HQ, H, D, U = 2, 4, 2, 16, 64


def _table(device: str = "cpu"):
    """A table of ``U`` units of 4 tokens each per (sequence, head), every one selectable."""
    tokens = U * 4
    keys = torch.randn(B, H, tokens, D, generator=torch.Generator().manual_seed(0)).to(device)
    labels = (torch.arange(tokens, device=device) // 4).expand(B, H, tokens)
    return UnitTable.from_prompt(keys, torch.arange(tokens, device=device),
                                 torch.ones(B, tokens, dtype=torch.bool, device=device), labels, U)


def _selected(selector, table, seed):
    query = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(seed))
    return selector.select(query, table, capacity=64, ops="reference").unit_ids


def test_the_hash_is_fixed_per_unit_and_in_the_unit_interval():
    h = unit_hash(1000, torch.device("cpu"))
    assert torch.equal(h, unit_hash(1000, torch.device("cpu")))
    assert bool((h >= 0).all()) and bool((h < 1).all())
    assert len(torch.unique(h)) == 1000  # distinct: a hash that collapsed would make ties, not overlap


def test_no_stickiness_scores_as_top_budget():
    table = _table()
    for seed in range(3):
        assert torch.equal(_selected(StickyTopBudget(stickiness=0.0), table, seed), _selected(TopBudget(), table, seed))


def test_a_large_bias_selects_the_same_units_for_unrelated_queries_and_a_small_one_does_not():
    table = _table()

    def overlap(selector):
        a, b = _selected(selector, table, 1), _selected(selector, table, 2)
        return sum(len(set(a[i, h].tolist()) & set(b[i, h].tolist()) - {-1}) for i in range(B) for h in range(H))

    chosen = 16 * B * H  # 64 tokens in units of 4
    assert overlap(StickyTopBudget(stickiness=1e4)) == chosen
    assert overlap(StickyTopBudget(stickiness=0.0)) < chosen // 2


def _analytic_index(tokens=2048):
    keys = torch.randn(B, H, tokens, D, generator=torch.Generator().manual_seed(0))
    return Analytic().build_index(keys, torch.ones(B, tokens, dtype=torch.bool), "reference", layer_idx=0)


def _tokens(selector, index, seed, capacity=64) -> list[set]:
    query = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(seed))
    selection = selector.select(query, index, capacity, "reference")
    return [set(selection.unit_ids[i, h].tolist()) - {-1} for i in range(B) for h in range(H)]


def test_the_pull_keeps_the_query_dtype_and_moves_it_by_pull_times_its_norm():
    query = torch.randn(B, HQ, D, dtype=torch.bfloat16)
    pulled = pulled_query(query, 2.0)
    assert pulled.dtype == torch.bfloat16 and pulled.shape == query.shape
    moved = (pulled.float() - query.float()).norm(dim=-1)
    torch.testing.assert_close(moved, 2.0 * query.float().norm(dim=-1), rtol=2e-2, atol=0)
    assert torch.equal(pulled_query(query, 0.0), query)


def test_no_pull_selects_as_collision_rerank_and_a_strong_one_keeps_the_tokens_of_unrelated_queries():
    index = _analytic_index()
    for seed in range(2):
        assert _tokens(StickyCollisionRerank(pull=0.0), index, seed) == _tokens(CollisionRerank(), index, seed)

    def overlap(selector):
        a, b = _tokens(selector, index, 1), _tokens(selector, index, 2)
        return sum(len(x & y) for x, y in zip(a, b)) / sum(len(x) for x in a)

    assert overlap(StickyCollisionRerank(pull=100.0)) > 0.9
    assert overlap(StickyCollisionRerank(pull=0.0)) < 0.5


def test_the_interval_never_re_selects_less_often_than_the_rate():
    assert louiskv_interval(0.176) == 5 and louiskv_interval(0.2) == 5 and louiskv_interval(0.117) == 8
    assert louiskv_interval(1.0) == 1 and louiskv_interval(2.0) == 1


@pytest.mark.parametrize("text", ["", "a,1", "1;2"])
def test_bad_numbers_are_a_clear_error(text):
    with pytest.raises(KVPolicyError, match="--stickiness"):
        floats(text, "stickiness")


@pytest.mark.parametrize("shape", [(2, 3, 100), (1, 2, 2500)], ids=["one-block", "three-blocks"])
def test_the_fused_bias_matches_the_reference(shape):
    from kvpolicy.bench.overlap import sticky_bias
    from kvpolicy.bench.sticky_bias import sticky_bias as fused

    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: the interpreter (conftest)
    scores = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])) * 3 + 1
    scores[..., ::7] = float("-inf")  # unselectable units: out of the spread, and stay -inf
    scores[0, 0] = float("-inf")  # a whole row unscored (a sequence that does not re-select)
    scores = scores.to(device)
    want, got = sticky_bias(scores, 32.0), fused(scores, 32.0)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got[finite], scores[finite])  # the bias was added


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_policy_scoring_with_triton_biases_with_the_fused_kernel(backend, monkeypatch):
    import kvpolicy.bench.sticky_bias as fused

    # on CPU Triton runs under the interpreter (conftest), and auto picks the reference there
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = _table(device.type)
    query = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(4)).to(device)
    sticky = StickyTopBudget(stickiness=8.0)
    want = sticky.unit_scores(query, table, dispatch.bind("reference", device))
    launches = []
    monkeypatch.setattr(fused, "_sticky_kernel", _Counted(fused._sticky_kernel, launches))
    got = sticky.unit_scores(query, table, dispatch.bind(backend, device))
    triton_scores = backend == "triton" or device.type == "cuda"
    assert len(launches) == (1 if triton_scores else 0)  # the fused kernel, not the reference's ops
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


class _Counted:
    """A Triton kernel whose launches (``kernel[grid](...)``) are recorded."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def test_the_sweep_runs_a_pariskv_row_a_pull_with_the_presets_selection_pulled(monkeypatch):
    import kvpolicy
    from kvpolicy.bench import e2e, sweeps

    from conftest import build_model

    policies = {}

    def record(model, policy, batch, context, steps, **options):
        policies[len(policies)] = policy
        return e2e.Throughput("policy", batch, context, steps, 1.0)

    monkeypatch.setattr(e2e, "full_throughput", lambda model, kind, batch, context, steps, **options:
                        e2e.Throughput(kind, batch, context, steps, 1.0))
    monkeypatch.setattr(e2e, "policy_throughput", record)
    rows = list(sweeps.e2e(build_model("llama"), contexts=[256], batches=[1], cells=[("pariskv", ["cpu"])], budget=128,
                           steps=1, backend="reference", full_kinds=["full-graph"], branch_kinds=["auto"], rate=0.1,
                           pulls=[0.0, 2.5]))
    assert [row["kind"] for row in rows] == ["full-graph", "budget-floor", "pariskv/cpu/~p0", "pariskv/cpu/~p2.5"]
    plain = kvpolicy.preset("pariskv", budget=128).selector
    assert type(policies[0].selector) is type(plain)  # no pull: the preset's own selector
    pulled = policies[1].selector
    assert isinstance(pulled, StickyCollisionRerank) and pulled.pull == 2.5
    assert {name: getattr(pulled, name) for name in vars(plain)} == vars(plain)
