"""The re-selection's branch in a captured step: a conditional node, or kernels inline.

On a CPU only the choice and the inline path run; on a CUDA machine both kinds of capture must
decode exactly as eager decode does, through steps that re-select and steps that reuse.
"""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy import graph_branch
from kvpolicy.errors import KVPolicyError
from kvpolicy.graph import DecodeGraph, greedy_decode
from kvpolicy.integrations.transformers import cache_argument_name

from conftest import build_model, left_padded_batch

CUDA = torch.cuda.is_available()


def test_unknown_kind_names_the_accepted_ones():
    with pytest.raises(KVPolicyError, match="accepted: auto, node, inline"):
        graph_branch.resolve("sometimes", torch.device("cpu"))


def test_nodes_on_a_cpu_are_refused_and_auto_keeps_kernels_inline():
    cpu = torch.device("cpu")
    with pytest.raises(KVPolicyError, match="need a CUDA device"):
        graph_branch.resolve("node", cpu)
    assert graph_branch.resolve("auto", cpu) == "inline"
    assert graph_branch.resolve("inline", cpu) == "inline"
    with pytest.raises(KVPolicyError, match="emulated graph"):
        graph_branch.resolve("node", torch.device("cuda"), emulate=True)
    assert graph_branch.resolve("auto", torch.device("cuda"), emulate=True) == "inline"


def test_outside_a_capture_the_body_runs_whatever_the_flags():
    ran = []
    graph_branch.run_if_any(torch.zeros(3, dtype=torch.bool), lambda: ran.append("none set"))
    graph_branch.run_if_any(torch.ones(3, dtype=torch.bool), lambda: ran.append("all set"))
    assert ran == ["none set", "all set"]


def test_decode_graph_refuses_a_bad_kind_before_capturing():
    model = build_model("llama")
    ids, mask = left_padded_batch(60)
    policy = kvpolicy.preset("quest", budget=48, sink=4, local=16)
    with policy.apply(model) as session:
        cache = session.new_cache()
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_argument_name(model): cache})
        with pytest.raises(KVPolicyError, match="unknown branch kind 'yes'"):
            DecodeGraph(model, cache, mask.sum(-1), 4, emulate=True, branches="yes")
        assert DecodeGraph(model, cache, mask.sum(-1), 4, emulate=True).branches == "inline"


@pytest.mark.skipif(not CUDA, reason="conditional graph nodes need a CUDA device")
@pytest.mark.parametrize("name,trigger,budget", [
    ("louiskv", {"name": "interval", "n": 3}, 96), ("louiskv", None, 96), ("quest", None, 96), ("pariskv", None, 96),
    ("louiskv", {"name": "interval", "n": 3}, 512),  # a budget past the context
    ("clusterkv", {"name": "interval", "n": 2}, 512),
])
def test_both_kinds_decode_as_eager_decode(name, trigger, budget):
    device = torch.device("cuda")
    model = build_model("qwen3").to(device)
    ids, mask = left_padded_batch(200)
    ids, mask = ids.to(device), mask.to(device)
    options = {"budget": budget, "sink": 4, "local": 16}
    if trigger:
        options["trigger"] = trigger
    policy = kvpolicy.preset(name, **options)
    steps = 24
    with policy.apply(model):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False)
    want = out[:, ids.shape[1]:]
    assert graph_branch.resolve("node", device) == "node"
    differ = [kind for kind in ("node", "inline")
              if not torch.equal(greedy_decode(model, policy, ids, mask, steps, branches=kind), want)]
    assert not differ, f"{differ} decode differently from eager decode"
