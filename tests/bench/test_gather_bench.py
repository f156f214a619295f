"""``bench gather``'s measurement runs both ops on the CPU's reference and names bad input."""

import pytest
import torch

from kvpolicy.bench.gather import OPS, measure_gather


@pytest.mark.parametrize("op", OPS)
def test_each_op_is_measured_against_a_copy_of_its_bytes(op):
    r = measure_gather(torch.device("cpu"), backend="reference", batch=2, heads=2, context=256, rows=32,
                       head_dim=16, repeats=2, run=4, op=op)
    assert r.op == op and r.gather_gbps > 0 and r.copy_gbps > 0
    assert r.row_bytes == 16 * 2  # bf16


def test_an_unknown_op_is_a_clear_error():
    with pytest.raises(ValueError, match="accepted: gather, refresh"):
        measure_gather(torch.device("cpu"), backend="reference", context=256, rows=32, head_dim=16, op="copy")


def test_the_cli_names_bad_gather_ops_and_a_reference_replay():
    import argparse

    from kvpolicy.cli import bench
    from kvpolicy.errors import KVPolicyError

    args = argparse.Namespace(gather_ops="refresh", eager=False, backend="triton", resident="0,1.5")
    with pytest.raises(KVPolicyError, match="--resident takes shares in"):
        bench.gather(args, torch.device("cpu"), [])
    args = argparse.Namespace(gather_ops="gather,copy", eager=False, backend="triton", resident="0")
    with pytest.raises(KVPolicyError, match="accepted: a comma-separated list of gather, refresh"):
        bench.gather(args, torch.device("cpu"), [])
    args = argparse.Namespace(gather_ops="refresh", eager=False, backend="reference", resident="0")
    with pytest.raises(KVPolicyError, match="pass --eager"):
        bench.gather(args, torch.device("cuda"), [])  # refused before anything touches the device


@pytest.mark.parametrize("resident", [0.0, 0.75, 1.0])
def test_a_refresh_finds_its_resident_share_of_rows_in_the_buffer(monkeypatch, resident):
    from kvpolicy.kernels import dispatch

    sources = []
    get = dispatch.get

    def spying(name, backend, device):
        op = get(name, backend, device)
        if name != "refresh_rows":
            return op
        return lambda pools, slots, take, source, outs, scratches: (sources.append(source.clone()),
                                                                    op(pools, slots, take, source, outs, scratches))

    monkeypatch.setattr(dispatch, "get", spying)
    r = measure_gather(torch.device("cpu"), backend="reference", batch=2, heads=2, context=256, rows=32,
                       head_dim=16, repeats=2, op="refresh", resident=resident)
    assert r.resident == resident and r.call_ms > 0 and sources
    source = sources[0]
    found = source >= 0
    assert found.sum(-1).eq(round(32 * resident)).all()  # the share, in every (sequence, head)
    for row in source.view(-1, 32):  # distinct buffer rows: each found row is read once
        rows = row[row >= 0]
        assert len(rows.unique()) == len(rows) and bool((rows < 32).all())


def test_a_resident_share_outside_zero_to_one_or_for_the_gather_is_refused():
    for op, resident in (("refresh", 1.5), ("refresh", -0.1), ("gather", 0.5)):
        with pytest.raises(ValueError, match="resident must be a share in"):
            measure_gather(torch.device("cpu"), backend="reference", context=256, rows=32, head_dim=16, op=op,
                           resident=resident)
