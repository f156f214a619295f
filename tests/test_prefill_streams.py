"""The order of a CUDA prefill's work across streams, checked on the CPU with fake streams.

On CUDA a served layer's prefill builds the prompt's units (K-means, the unit table, the pool's
layout) on a side stream while the main stream goes on; the first decode step waits for them
(``units_ready``). Anything else that reads the units must be ordered after that build. The
score_gap trigger's ``attach`` reads the unit table (it gathers the table's sizes at the open
unit): run on the main stream, unordered after the build, it gathered with an index read from
memory the side stream had not written yet. That was the Gemma 3 32K eval's crash (louiskv, whose
calibrated trigger is score_gap): a device-side assert "scatter gather kernel index out of
bounds", reported later at the next layer's cache update.

The CPU has no streams, so these tests fake them: ``torch.cuda.stream``/``current_stream``/
``Event`` record which fake stream each step of the prefill runs on.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvpolicy
from kvpolicy import layer as layer_module
from kvpolicy.layer import PolicyLayerState
from kvpolicy.triggers.score_gap import ScoreGap

from conftest import prompt_query

pytestmark = pytest.mark.usefixtures("single_thread")

B, HQ, H, D, PROMPT = 1, 4, 1, 16, 300


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "_Event") -> None:
        self.log.append(("wait_event", self.name, event))


@pytest.fixture
def fake_streams(monkeypatch: pytest.MonkeyPatch) -> list:
    """Make a CPU prefill take the CUDA path, on fake streams; returns the log of what ran where."""
    log: list = []
    main, side = _Stream("main", log), _Stream("side", log)
    current = [main]

    class _Event:
        def record(self, stream: _Stream) -> None:
            log.append(("ready", stream.name))

    @contextlib.contextmanager
    def stream(s: _Stream):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    def where(name: str, fn):
        def wrapped(*args, **kwargs):
            log.append((name, current[-1].name))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(layer_module, "_builds_on_side_stream", lambda device: True)
    monkeypatch.setattr(layer_module, "_side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(PolicyLayerState, "_build_index_and_pool",
                        where("build", PolicyLayerState._build_index_and_pool))
    monkeypatch.setattr(ScoreGap, "attach", where("attach", ScoreGap.attach))
    monkeypatch.setattr(PolicyLayerState, "_reselect", where("select", PolicyLayerState._reselect))
    return log


def _louiskv_score_gap() -> kvpolicy.Policy:
    # louiskv as the Gemma 3 eval ran it: its calibrated trigger is score_gap
    return kvpolicy.preset("louiskv", budget=128, trigger={"name": "score_gap", "margin": -1.5, "measure": "mass"})


def test_score_gap_attaches_after_the_side_stream_built_the_units(fake_streams: list) -> None:
    gen = torch.Generator().manual_seed(0)
    state = PolicyLayerState(_louiskv_score_gap(), 1, torch.device("cpu"))
    state.prefill(torch.randn(B, H, PROMPT, D, generator=gen), torch.randn(B, H, PROMPT, D, generator=gen),
                  torch.ones(B, PROMPT, dtype=torch.bool), HQ, last_query=prompt_query(B, HQ, D))
    log = fake_streams
    steps = [entry[0] for entry in log]
    assert steps.count("build") == 1 and steps.count("attach") == 1, log
    build, attach = steps.index("build"), steps.index("attach")
    assert log[build] == ("build", "side"), log
    # the trigger reads the units on the stream that built them, after them...
    assert log[attach] == ("attach", "side"), f"score_gap attached on the {log[attach][1]} stream: {log}"
    assert attach > build
    # ...and so does the first selection, from the prompt's last query (the louiskv preset's)...
    assert steps.count("select") == 1 and log[steps.index("select")] == ("select", "side"), log
    assert steps.index("select") > attach
    # ...and the event the first decode step waits for is recorded after them
    assert log[-1] == ("ready", "side") and len(log) - 1 > steps.index("select"), log

    # the decode then runs as on the CPU, its first step waiting for that event
    for _ in range(3):
        state.decode(torch.randn(B, HQ, D, generator=gen), torch.randn(B, H, D, generator=gen),
                     torch.randn(B, H, D, generator=gen), D**-0.5)
    assert sum(entry[0] == "wait_event" for entry in log) == 1
    assert state.decode_steps == 3 and int(state.reselections[0]) >= 1
