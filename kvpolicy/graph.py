"""Decode steps replayed as a CUDA graph.

In transformers' eager mode a decode step of an 8B model costs about 100 ms of host time
(kernel launches) against 8-22 ms of GPU work, so without graphs no policy can be faster
than another. ``DecodeGraph`` runs the first decode step eagerly (it compiles the Triton
kernels and warms the libraries), captures the second, and replays that capture for every
later step: only the new token ids change between replays, everything else (slots, ring
positions, unit counters, the trigger's decision) is read from device tensors by the step
itself (``tests/test_graph_ready.py`` checks that contract).

``emulate=True`` runs the same protocol without CUDA: each "replay" re-runs the captured
Python with the host state frozen at capture time, so the contract is testable on a CPU.

``branches``: how a captured step holds the work that only re-selecting steps do (scoring,
ranking, the fetch). "node" puts it in a CUDA graph conditional node that a reusing step skips
(``graph_branch``); "inline" keeps it in the graph, where its kernels exit at once on rows that
keep their selection; "auto" (default) takes "node" where the driver has conditional nodes.
"""

from __future__ import annotations

import contextlib

import torch

from . import graph_branch
from .errors import KVPolicyError
from .integrations.transformers import PolicyCache, PolicyCacheLayer, cache_argument_name


class DecodeGraph:
    """Greedy or fed decode of ``model`` over a prefilled ``PolicyCache``, one token per call.

    ``positions``: ``(B,)`` the position id of the first decode token of each sequence (its
    count of real prompt tokens); ``steps``: how many decode steps will run at most (room is
    reserved up front, since a replay cannot grow a buffer).
    """

    def __init__(self, model, cache: PolicyCache, positions: torch.Tensor, steps: int, *, emulate: bool = False,
                 branches: str = "auto"):
        if not isinstance(cache, PolicyCache):
            raise KVPolicyError("DecodeGraph replays a PolicyCache; dense caches are not captured here")
        unserved = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, PolicyCacheLayer)]
        if unserved:
            raise KVPolicyError(
                f"layers {unserved} keep transformers' own cache, which grows by concatenation and cannot be "
                "captured; DecodeGraph needs every layer served by the policy"
            )
        states = cache.policy_layers()
        if any(s.store is None for s in states):
            raise KVPolicyError("DecodeGraph needs a prefilled cache: run the prompt through the model first")
        self.device = positions.device
        if not emulate and self.device.type != "cuda":
            raise KVPolicyError(f"CUDA graphs need a CUDA device, got {self.device}; use emulate=True to test on CPU")
        self.model, self.cache, self.states, self.emulate = model, cache, states, emulate
        self.branches = graph_branch.resolve(branches, self.device, emulate=emulate)  # "node" or "inline"
        for state in states:
            state.wait_for_units()
            state.plan.reserve(steps)
        self.steps_left = steps
        batch = positions.shape[0]
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.position_ids = positions.view(batch, 1).clone().long()
        self.cache_position = torch.tensor([states[0].store.length], dtype=torch.long, device=self.device)
        self.logits: torch.Tensor | None = None
        self.graph = None
        self.conditional_nodes: graph_branch.ConditionalNodes | None = None
        self.captured_counters: list[dict] | None = None
        self.cache_arg = cache_argument_name(model)

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.input_ids, position_ids=self.position_ids, cache_position=self.cache_position,
                         use_cache=True, logits_to_keep=1, **{self.cache_arg: self.cache})
        return out.logits[:, -1]

    def _advance_inputs(self) -> None:
        self.position_ids.add_(1)
        self.cache_position.add_(1)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens (B,)``; returns the next-token logits ``(B, vocab)`` (a buffer reused by later calls)."""
        if self.steps_left <= 0:
            raise KVPolicyError("DecodeGraph: all reserved steps are used; make a new one with more steps")
        self.steps_left -= 1
        self.input_ids.copy_(tokens.view(-1, 1))
        if self.logits is None:  # first step: eager, on a side stream (warms up kernels and libraries)
            if self.emulate:
                out = self._forward()
            else:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    out = self._forward()
                torch.cuda.current_stream(self.device).wait_stream(side)
            self.logits = out.clone()
            self._advance_inputs()
            return self.logits
        if self.captured_counters is None:
            self._capture()
        self._replay()
        self._advance_inputs()
        return self.logits

    def _capture(self) -> None:
        self.captured_counters = [s.plan.counters() for s in self.states]
        if self.emulate:
            return
        self.graph = torch.cuda.CUDAGraph()
        # the bodies' pool lives as long as the graph that points into it
        self.conditional_nodes = graph_branch.ConditionalNodes(self.device) if self.branches == "node" else None
        capturing = self.conditional_nodes.capturing() if self.conditional_nodes else contextlib.nullcontext()
        with capturing, torch.cuda.graph(self.graph):
            captured = self._forward()
        self.captured_logits = captured
        # capturing ran the step's Python (host counters moved) but none of its kernels
        for state, counters in zip(self.states, self.captured_counters):
            state.plan.restore(counters)

    def _replay(self) -> None:
        if self.emulate:
            # what a replay does: the captured step's work, with the host state of capture time
            now = [s.plan.counters() for s in self.states]
            for state, counters in zip(self.states, self.captured_counters):
                state.plan.restore(counters)
            self.logits.copy_(self._forward())
            for state, counters in zip(self.states, now):
                state.plan.restore(counters)
        else:
            self.graph.replay()
            self.logits.copy_(self.captured_logits)
        for state in self.states:
            state.plan.count_replayed_step()


@torch.inference_mode()
def greedy_decode(model, policy, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                  *, emulate: bool = False, branches: str = "auto") -> torch.Tensor:
    """Prefill with ``policy`` applied, then ``max_new_tokens`` greedy tokens through ``DecodeGraph``.

    Returns ``(B, max_new_tokens)`` token ids (no early stop: every step has the same shape).
    """
    with policy.apply(model) as session:
        cache = session.new_cache()
        # positions count real tokens only, as generate numbers a left-padded prompt
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                    logits_to_keep=1, **{cache_argument_name(model): cache})
        token = out.logits[:, -1].argmax(-1)
        positions = attention_mask.long().sum(-1)
        runner = DecodeGraph(model, cache, positions, max_new_tokens - 1, emulate=emulate, branches=branches)
        tokens = [token]
        for _ in range(max_new_tokens - 1):
            token = runner.step(token).argmax(-1)
            tokens.append(token)
    return torch.stack(tokens, dim=1)
