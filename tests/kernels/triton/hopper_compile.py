"""Compile the score-gap ops' Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's interpreter, which runs the kernels in CI, executes them as Python: it accepts code that the
compiler refuses (a variable that changes shape inside an ``if``, a compile-time constant reassigned
inside one; both reached the GPU in session 30). Here each op runs its Python code against a stand-in
driver that names an sm_90 target, and every kernel launch compiles (to a cubin, through the ptxas that
Triton ships) instead of running, so nothing is computed. Run by ``test_compiles_for_hopper.py`` in a
process of its own: the kernels must be made without ``TRITON_INTERPRET``.

Usage: ``python3 tests/kernels/triton/hopper_compile.py`` prints each case's kernels; exit status 1
on the first that does not compile.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("hopper_compile.py: run it without TRITON_INTERPRET=1 (the interpreter compiles nothing)")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


class _StandInDriver:
    """What ``JITFunction.run`` asks of the driver before it compiles: a device, a stream, the target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET


def compiling_launches() -> list[str]:
    """Make every launch compile for ``TARGET`` without running; returns the list the compiled kernels'
    names are appended to."""
    driver.set_active(_StandInDriver())
    launched: list[str] = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        launched.append(self.__name__)
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only
    return launched


def score_gap_cases():
    """(label, op name, trigger, state maker, the outlier op's module constants): the outlier op with
    challengers at its compile-time choices (group, leaving, admit) and once at the steps between's other
    settings, once without, and the mean-estimate op once."""
    from kvpolicy.bench.trigger_states import decode_trigger_state
    from kvpolicy.triggers.score_gap import ScoreGap

    def state(admit="room"):
        made = decode_trigger_state(torch.Generator().manual_seed(0), 2, 2, 300, 16, 256, 24, 3)
        made.layer.policy.admit = admit
        return made

    # the challengers' kernels at their compile-time choices; one case each of the settings the GPU ran
    # before them (a compile is 1-2 s a kernel)
    outlier_cases = [(group, leaving, admit, 3, 4) for group in ("each", "mean")
                     for leaving, admit in (("ignored", "room"), ("unheld", "evict"))] + [("each", "ignored", "room", 1, 0)]
    for group, leaving, admit, every, challengers in outlier_cases:
        trigger = ScoreGap(margin=1.0, measure="mass", leaving=leaving, estimate="outlier", outliers=3,
                           group=group, every=every, challengers=challengers, follow=1.5, cap=5)
        yield (f"outlier group={group} leaving={leaving} every={every} challengers={challengers}",
               "score_gap_outlier_fire", trigger, lambda admit=admit: state(admit), {})
    # the steps between measured ones' other settings: in the blocks launch, the keys as one tile
    trigger = ScoreGap(margin=1.0, measure="mass", leaving="ignored", estimate="outlier", outliers=3, every=3,
                       challengers=4)
    yield ("outlier challengers=4 between in the blocks launch, keys as a tile", "score_gap_outlier_fire", trigger,
           state, {"_BETWEEN_LAUNCH": "blocks", "_BETWEEN_KEYS": "tile"})
    yield "mean measure=rank", "score_gap_fire", ScoreGap(margin=1.0, measure="rank", every=2), state, {}
    # the query in fixed point (int8 products; a block with decode units takes their float16 means), with
    # challengers' steps between too
    for every, challengers in ((1, 0), (3, 4)):
        trigger = ScoreGap(margin=1.0, measure="mass", leaving="ignored", estimate="outlier", outliers=3,
                           group="each", every=every, challengers=challengers, fixed_query=True)
        yield (f"outlier fixed_query every={every} challengers={challengers}", "score_gap_outlier_fire", trigger,
               state, {})


def main() -> int:
    launched = compiling_launches()
    from kvpolicy.kernels.triton import pdl, score_gap, score_gap_outlier

    # the tensors are on the CPU; the target is sm_90, where the reusing step's kernels (pdl.REUSING_STEP) launch
    # with PDL: they compile with it here (at any grid: an H100's 132 SMs), the others plain
    pdl.supported = lambda device: True
    pdl.WAVES = None

    shipped = {name: getattr(score_gap_outlier, name) for name in ("_BETWEEN_LAUNCH", "_BETWEEN_KEYS")}
    ops = {"score_gap_outlier_fire": score_gap_outlier.score_gap_outlier_fire,
           "score_gap_fire": score_gap.score_gap_fire}
    for label, op, trigger, make_state, settings in score_gap_cases():
        for name, value in settings.items():  # the outlier op's module constants, for this case alone
            setattr(score_gap_outlier, name, value)
        trigger.validate()
        state = make_state()
        query = torch.randn(2, 6, 24).bfloat16()
        launched.clear()
        try:
            if op == "score_gap_fire":
                scores = torch.randn(*state.held.shape[:2], state.layer.units.capacity)
                ops[op](trigger, state, scores, 0.2)
            else:
                ops[op](trigger, state, query, 0.2)
        except Exception as error:  # the compiler's error names the kernel line
            print(f"FAILED {label}: {type(error).__name__}: {error}")
            while error.__cause__ is not None or error.__context__ is not None:  # the compiler nests its reasons
                error = error.__cause__ or error.__context__
                print(f"  from {type(error).__name__}: {error}")
            return 1
        print(f"compiled for sm_{TARGET.arch}: {label}: {', '.join(launched)}", flush=True)
        for name in settings:
            setattr(score_gap_outlier, name, shipped[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
