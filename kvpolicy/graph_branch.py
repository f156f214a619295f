"""Work a captured decode step runs only when the device says so: CUDA graph conditional nodes.

A step where no sequence of a layer re-selects has no scoring, ranking or fetching to do, but a
captured graph replays every kernel it holds: each exits at once and still costs its launch
(about 2 us, some ten of them per layer). ``run_if_any(flags, body)`` instead captures ``body``
into the body graph of an IF conditional node; a one-thread kernel captured before it sets the
node's condition from ``flags.any()`` at each replay, so a reusing step skips the whole body.

Outside a capture that ``ConditionalNodes.capturing`` opened (eager decode, the CPU, an emulated graph,
a graph captured by someone else), ``run_if_any`` calls ``body()`` inline: its kernels skip the
rows that keep their selection, which is the same result.

The CUDA driver is reached through ctypes (conditional nodes need a 12.4+ driver; PyTorch 2.11
has no Python API for them). The bodies are captured on a stream of their own, whose
allocations are routed to a memory pool held as long as the graph.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Callable

import torch

from .errors import KVPolicyError

BRANCH_KINDS = ("auto", "node", "inline")

_CU_GRAPH_NODE_TYPE_CONDITIONAL = 13
_CU_GRAPH_COND_TYPE_IF = 0
_CU_GRAPH_COND_ASSIGN_DEFAULT = 1
_CU_STREAM_SET_CAPTURE_DEPENDENCIES = 1
_CU_STREAM_CAPTURE_MODE_RELAXED = 2
_CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
_CU_STREAM_NON_BLOCKING = 1

# One thread ORs the (count,) bool flags and sets the node's condition. The driver resolves
# cudaGraphSetConditional when it loads the PTX (as it does vprintf), so no toolkit is needed.
_SET_IF_ANY_PTX = rb"""
.version 8.0
.target sm_70
.address_size 64

.extern .func cudaGraphSetConditional(.param .b64 handle, .param .b32 value);

.visible .entry kvpolicy_set_if_any(.param .u64 flags, .param .u32 count, .param .u64 handle)
{
    .reg .pred %p<3>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [flags];
    ld.param.u32 %r1, [count];
    ld.param.u64 %rd2, [handle];
    cvta.to.global.u64 %rd3, %rd1;
    mov.u32 %r2, 0;
    mov.u32 %r3, 0;
$L_next:
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra $L_done;
    cvt.u64.u32 %rd4, %r2;
    add.u64 %rd5, %rd3, %rd4;
    ld.global.u8 %r4, [%rd5];
    or.b32 %r3, %r3, %r4;
    add.u32 %r2, %r2, 1;
    bra $L_next;
$L_done:
    setp.ne.u32 %p2, %r3, 0;
    selp.u32 %r5, 1, 0, %p2;
    {
        .param .b64 param0;
        .param .b32 param1;
        st.param.b64 [param0], %rd2;
        st.param.b32 [param1], %r5;
        call.uni cudaGraphSetConditional, (param0, param1);
    }
    ret;
}
"""


class _ConditionalParams(ctypes.Structure):  # CUDA_CONDITIONAL_NODE_PARAMS
    _fields_ = [("handle", ctypes.c_uint64), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("graphs_out", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _NodeParams(ctypes.Structure):  # CUgraphNodeParams: a type, then a 232-byte union
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("conditional", _ConditionalParams),
                ("union_rest", ctypes.c_byte * (232 - ctypes.sizeof(_ConditionalParams))),
                ("reserved2", ctypes.c_longlong)]


class _Driver:
    """The few driver entry points a conditional node needs, and the set-condition kernel."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise KVPolicyError(f"conditional graph nodes need the CUDA driver (libcuda.so.1): {error}") from None
        version = ctypes.c_int()
        self._check(self.lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        if version.value < 12040:
            raise KVPolicyError(f"conditional graph nodes need a CUDA 12.4+ driver; this one is {version.value}")
        self.capture_info_has_edges = hasattr(self.lib, "cuStreamGetCaptureInfo_v3")
        self._modules: dict[int, tuple] = {}
        self._streams: dict[int, torch.cuda.ExternalStream] = {}

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(name))
            message = name.value.decode() if name.value else "unknown error"
            raise KVPolicyError(f"{what} failed: CUDA error {result} ({message})")

    def kernel(self) -> ctypes.c_void_p:
        """The set-condition kernel, loaded once per CUDA context."""
        context = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        if context.value not in self._modules:
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_SET_IF_ANY_PTX)),
                        "loading the set-condition kernel (cuModuleLoadData)")
            self._check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, b"kvpolicy_set_if_any"),
                        "cuModuleGetFunction")
            self._modules[context.value] = (context, module, function)
        return self._modules[context.value]

    def capture_info(self, stream: int) -> tuple:
        """``(graph, dependencies, edges, count)`` of an active capture on ``stream``."""
        status, capture_id, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
        deps, edges, count = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        if self.capture_info_has_edges:
            self._check(self.lib.cuStreamGetCaptureInfo_v3(
                ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(capture_id), ctypes.byref(graph),
                ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(count)), "cuStreamGetCaptureInfo")
        else:
            self._check(self.lib.cuStreamGetCaptureInfo_v2(
                ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(capture_id), ctypes.byref(graph),
                ctypes.byref(deps), ctypes.byref(count)), "cuStreamGetCaptureInfo")
        if status.value != _CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise KVPolicyError("a conditional node was asked for on a stream that is not capturing")
        return graph, deps, edges, count

    def add_if_node(self, stream: int, flags: torch.Tensor) -> ctypes.c_void_p:
        """Capture the set-condition kernel and an IF node after it on ``stream``; returns the
        node's (empty) body graph. The stream's later work depends on the node."""
        context, _, function = self.kernel()
        graph, _, _, _ = self.capture_info(stream)
        handle = ctypes.c_uint64()
        self._check(self.lib.cuGraphConditionalHandleCreate(
            ctypes.byref(handle), graph, context, ctypes.c_uint(0), ctypes.c_uint(_CU_GRAPH_COND_ASSIGN_DEFAULT)),
            "cuGraphConditionalHandleCreate")
        args = (ctypes.c_uint64(flags.data_ptr()), ctypes.c_uint32(flags.numel()), handle)
        pointers = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self._check(self.lib.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(stream), pointers, None),
                    "launching the set-condition kernel")
        graph, deps, edges, count = self.capture_info(stream)
        params = _NodeParams()
        params.type = _CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle.value
        params.conditional.type = _CU_GRAPH_COND_TYPE_IF
        params.conditional.size = 1
        params.conditional.ctx = context.value
        node = ctypes.c_void_p()
        if hasattr(self.lib, "cuGraphAddNode_v2"):
            result = self.lib.cuGraphAddNode_v2(ctypes.byref(node), graph, deps, edges, count, ctypes.byref(params))
        else:
            result = self.lib.cuGraphAddNode(ctypes.byref(node), graph, deps, count, ctypes.byref(params))
        self._check(result, "adding the conditional node (cuGraphAddNode)")
        body = ctypes.cast(params.conditional.graphs_out, ctypes.POINTER(ctypes.c_void_p))[0]
        if hasattr(self.lib, "cuStreamUpdateCaptureDependencies_v2"):
            result = self.lib.cuStreamUpdateCaptureDependencies_v2(
                ctypes.c_void_p(stream), ctypes.byref(node), None, ctypes.c_size_t(1),
                ctypes.c_uint(_CU_STREAM_SET_CAPTURE_DEPENDENCIES))
        else:
            result = self.lib.cuStreamUpdateCaptureDependencies(
                ctypes.c_void_p(stream), ctypes.byref(node), ctypes.c_size_t(1),
                ctypes.c_uint(_CU_STREAM_SET_CAPTURE_DEPENDENCIES))
        self._check(result, "cuStreamUpdateCaptureDependencies")
        return ctypes.c_void_p(body)

    def body_stream(self, device_index: int, device: torch.device) -> torch.cuda.ExternalStream:
        """A stream of the driver's own, one per device, that bodies are captured on. (Not one of
        ``torch.cuda.Stream``'s: those come from a pool of 32 shared round robin, so one may be
        the stream ``torch.cuda.graph`` is capturing on.)"""
        if device_index not in self._streams:
            stream = ctypes.c_void_p()
            self._check(self.lib.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(_CU_STREAM_NON_BLOCKING)),
                        "cuStreamCreate")
            self._streams[device_index] = torch.cuda.ExternalStream(stream.value, device=device)
        return self._streams[device_index]

    def begin_capture_to(self, stream: int, graph: ctypes.c_void_p) -> None:
        self._check(self.lib.cuStreamBeginCaptureToGraph(
            ctypes.c_void_p(stream), graph, None, None, ctypes.c_size_t(0), ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)),
            "cuStreamBeginCaptureToGraph")

    def end_capture(self, stream: int) -> None:
        graph = ctypes.c_void_p()
        self._check(self.lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph)), "cuStreamEndCapture")


_DRIVER: _Driver | None = None
_ACTIVE = threading.local()  # .capture: the ConditionalNodes of the capture in progress


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def unavailable_reason(device: torch.device) -> str | None:
    """Why conditional nodes cannot run on ``device`` (None: they can)."""
    if device.type != "cuda":
        return f"conditional graph nodes need a CUDA device, not {device.type}"
    if not hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool"):
        return f"this PyTorch ({torch.__version__}) cannot route a body's allocations to the graph's pool"
    try:
        _driver()
    except KVPolicyError as error:
        return str(error)
    return None


def resolve(kind: str, device: torch.device, *, emulate: bool = False) -> str:
    """``kind`` ("auto", "node", "inline") -> what a capture on ``device`` will use ("node" or
    "inline"). "auto" takes nodes where the driver has them; "node" where it has not is an error."""
    if kind not in BRANCH_KINDS:
        raise KVPolicyError(f"unknown branch kind {kind!r}; accepted: {', '.join(BRANCH_KINDS)}")
    if kind == "inline":
        return "inline"
    reason = "an emulated graph runs its steps as Python" if emulate else unavailable_reason(device)
    if reason is None:
        return "node"
    if kind == "node":
        raise KVPolicyError(f"branches='node': {reason}; use branches='inline' (or 'auto')")
    return "inline"


class ConditionalNodes:
    """What one captured graph's conditional nodes share: the stream their bodies are captured
    on and the memory pool their temporaries come from.

    The bodies get a pool of their own (PyTorch will not route a second stream into the pool of
    a capture in progress). The pool is held while this object lives, since the body graphs
    point into it: keep it as long as the graph.
    """

    def __init__(self, device: torch.device):
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(device):
            driver = _driver()
            driver.kernel()  # loaded before the capture: a module load is no captured work
            self.stream = driver.body_stream(self.device_index, device)
        self.pool = torch.cuda.graph_pool_handle()
        # created with one use, the hold; each body's routing adds and drops one more
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device_index, self.pool)
        torch._C._cuda_endAllocateToPool(self.device_index, self.pool)
        self._held = True

    @contextlib.contextmanager
    def capturing(self):
        """Entered around ``torch.cuda.graph(...)``: ``run_if_any`` in it makes conditional nodes."""
        previous = getattr(_ACTIVE, "capture", None)
        _ACTIVE.capture = self
        try:
            yield
        finally:
            _ACTIVE.capture = previous

    def release(self) -> None:
        if self._held:
            self._held = False
            torch._C._cuda_releasePool(self.device_index, self.pool)

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass  # never raise under GC


def in_conditional_body() -> bool:
    """Whether work launched now is being captured into a conditional node's body: it will run
    only on steps where some row re-selects, so kernels need not skip cheaply for the others."""
    return getattr(_ACTIVE, "in_body", False)


def run_if_any(flags: torch.Tensor, body: Callable[[], None]) -> None:
    """Run ``body`` (device work only, results left in persistent buffers) where any of ``flags``
    (a bool device tensor) is True: a conditional node inside ``ConditionalNodes.capturing``,
    inline otherwise (``body``'s kernels then skip the rows themselves)."""
    nodes = getattr(_ACTIVE, "capture", None)
    if nodes is None or not torch.cuda.is_current_stream_capturing():
        body()
        return
    if flags.dtype != torch.bool or not flags.is_contiguous():
        raise KVPolicyError(f"run_if_any needs contiguous bool flags, got {flags.dtype}")
    driver = _driver()
    body_graph = driver.add_if_node(torch.cuda.current_stream().cuda_stream, flags)
    driver.begin_capture_to(nodes.stream.cuda_stream, body_graph)
    try:
        torch._C._cuda_beginAllocateCurrentThreadToPool(nodes.device_index, nodes.pool)
        _ACTIVE.in_body = True
        try:
            with torch.cuda.stream(nodes.stream):
                body()
        finally:
            _ACTIVE.in_body = False
            torch._C._cuda_endAllocateToPool(nodes.device_index, nodes.pool)
            torch._C._cuda_releasePool(nodes.device_index, nodes.pool)
    finally:
        driver.end_capture(nodes.stream.cuda_stream)
