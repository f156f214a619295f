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

    args = argparse.Namespace(gather_ops="gather,copy", eager=False, backend="triton")
    with pytest.raises(KVPolicyError, match="accepted: a comma-separated list of gather, refresh"):
        bench.gather(args, torch.device("cpu"), [])
    args = argparse.Namespace(gather_ops="refresh", eager=False, backend="reference")
    with pytest.raises(KVPolicyError, match="pass --eager"):
        bench.gather(args, torch.device("cuda"), [])  # refused before anything touches the device
