"""What programmatic dependent launch (PDL) saves between small dependent Triton kernels in a CUDA graph.

    python3 benchmarks/pdl_chain.py [--kernels 24] [--grids 1,32,1024] [--replays 200]

A reusing decode step is a chain of small dependent launches (the trigger's follow, blocks, row stage and
decide; the token's append and unit append; the attention's split and combine): each pays the gap between one kernel's end and the next one's start.
With PDL (Triton's ``launch_pdl=True``; ``griddepcontrol`` on sm_90) the next kernel is scheduled while the
one before it finishes and waits in ``gdc_wait`` for its results. This chains ``--kernels`` kernels, each
reading what the one before wrote (a read-modify-write of every element: a missed wait would lose adds, and
the check at the end says so), captures the chain in a CUDA graph, and times a replay with and without PDL,
at each grid size. Prints us a kernel for both and their difference.

Then it checks the places where a PDL launch follows something that is not a kernel in a captured graph:
a device-to-device copy (a memcpy node) and a conditional node (``graph_branch.run_if_any``, taken and
skipped), and PDL launches inside a conditional node's body. Each must capture, replay and keep every add.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # a hint: the next kernel may be scheduled once every program got here
        gdc_wait()  # the kernel before has finished and its writes are visible
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = at < n
    tl.store(x_ptr + at, tl.load(x_ptr + at, mask=ok) + 1, mask=ok)


def _chain(x: torch.Tensor, kernels: int, grid: int, block: int, pdl: bool) -> None:
    for _ in range(kernels):
        _add_one[(grid,)](x, x.numel(), BLOCK=block, PDL=pdl, launch_pdl=pdl)


def time_chain(kernels: int, grid: int, pdl: bool, replays: int, block: int = 128) -> tuple[float, bool]:
    """us a kernel of a replayed chain, and whether every add landed."""
    x = torch.zeros(grid * block, dtype=torch.int32, device="cuda")
    _chain(x, kernels, grid, block, pdl)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _chain(x, kernels, grid, block, pdl)
    x.zero_()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    exact = bool((x == kernels * (replays + 10)).all())
    return start.elapsed_time(end) * 1000.0 / replays / kernels, exact


def after_other_nodes(replays: int = 20) -> list[tuple[str, str]]:
    """(case, outcome) for PDL launches right after a memcpy node and after a conditional node."""
    from kvpolicy import graph_branch

    results = []
    for case in ("memcpy", "conditional taken", "conditional skipped", "conditional taken, PDL inside"):
        x = torch.zeros(4096, dtype=torch.int32, device="cuda")
        source = torch.zeros_like(x)
        flag = torch.tensor([case.startswith("conditional taken")], device="cuda")

        def step():
            _chain(x, 2, 32, 128, True)
            if case == "memcpy":
                x.copy_(source + x)  # a kernel (the add), then a memcpy node
            else:
                inside = case.endswith("PDL inside")  # two PDL links in the body (pdl.py keeps bodies plain)
                graph_branch.run_if_any(flag, lambda: _chain(x, 2 if inside else 1, 32, 128, inside))
            _chain(x, 2, 32, 128, True)

        try:
            step()
            torch.cuda.synchronize()
            nodes = graph_branch.ConditionalNodes(x.device)
            graph = torch.cuda.CUDAGraph()
            with nodes.capturing(), torch.cuda.graph(graph):
                step()
            x.zero_()
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
            per_step = {"conditional taken": 5, "conditional taken, PDL inside": 6}.get(case, 4)
            ok = bool((x == per_step * replays).all())
            results.append((case, "kept every add" if ok else f"LOST ADDS: {x[:4].tolist()}"))
        except Exception as error:  # the outcome to report, whatever the driver says
            results.append((case, f"FAILED: {type(error).__name__}: {error}"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=24)
    parser.add_argument("--grids", default="1,32,1024")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pdl_chain.py: needs a CUDA device (PDL is an sm_90 launch attribute)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.kernels} dependent kernels a replay")
    print(f"{'programs':>9} {'plain us/kernel':>16} {'PDL us/kernel':>14} {'saved us':>9}  all adds landed")
    for grid in (int(g) for g in args.grids.split(",")):
        plain, plain_exact = time_chain(args.kernels, grid, False, args.replays)
        pdl, pdl_exact = time_chain(args.kernels, grid, True, args.replays)
        print(f"{grid:>9} {plain:>16.2f} {pdl:>14.2f} {plain - pdl:>9.2f}  {plain_exact and pdl_exact}")
    for case, outcome in after_other_nodes():
        print(f"a PDL launch after a {case}: {outcome}")


if __name__ == "__main__":
    main()
