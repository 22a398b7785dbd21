"""Replaying a kernel call from a CUDA graph: the same launches for one host call instead of several.

An eager counted decode step launches the same kernels with the same arguments every step (its buffers keep their
addresses and its counts live on the device), and the host's launch code for those kernels costs more than the GPU
spends on them. `GraphReplay` captures such a call in a CUDA graph the second time it sees the call's key, and
replays the graph from then on: the input is copied into the graph's own, the output copied out.

The key must name everything the launches bake in: every tensor's address, shape, strides and dtype (`layout`), and
every scalar. Two calls with equal keys then launch the same kernels with the same arguments, so replaying the graph
is the call, whichever tensor lives at an address now. Memory a call writes that its key does not name (a backend's
scratch) must stay allocated while a graph that writes it lives: `keep` gives it to the graph, and the owner calls
`clear` when it replaces that memory, so that no graph holds it longer.

Off CUDA, while `torch.compile` traces, and while the stream is being captured already (a compiled step's CUDA
graph, or the caller's own), the call runs directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


def layout(t: torch.Tensor | None) -> tuple | None:
    """What a kernel launch bakes in of a tensor: its address, shape, strides and dtype (None for None)."""
    if t is None:
        return None
    return t.data_ptr(), t.shape, t.stride(), t.dtype


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_input: torch.Tensor
    output: torch.Tensor
    keep: object  # memory the graph writes that its key does not name (see the module docstring)


class GraphReplay:
    """CUDA graphs of calls `body(x) -> tensor`, one per key (module docstring). A key's first call runs directly
    (the kernels compile and size their scratch then, outside any capture), its second is captured, and later ones
    replay. `max_graphs` bounds the graphs kept (the oldest go first); a call whose capture failed runs directly
    from then on."""

    def __init__(self, max_graphs: int = 1024):
        self.max_graphs = max_graphs
        self.captures = 0  # graphs captured so far (tests read it: one per layer, not one per demotion cycle)
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._failed: set[Hashable] = set()
        self._pools: dict[int, tuple] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (a graph still running completes first: CUDA frees it then). Later captures use a
        fresh memory pool: the allocator may already have released the old one with its last graph, and capturing
        into a released pool fails inside PyTorch's allocator."""
        self._graphs.clear()
        self._seen.clear()
        self._pools.clear()

    @staticmethod
    def replays(x: torch.Tensor) -> bool:
        """Whether a call on `x` may be captured and replayed here (module docstring)."""
        return x.is_cuda and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()

    def __call__(self, key: Hashable, x: torch.Tensor, body: Callable[[torch.Tensor], torch.Tensor],
                 keep: Callable[[], object] = lambda: None) -> torch.Tensor:
        """`body(x)`, from the key's graph where there is one; `keep()` is read after a capture (module docstring)."""
        if not self.replays(x):
            return body(x)
        key = (key, x.shape, x.stride(), x.dtype, x.device)  # `x` is copied in: its address is not baked in
        entry = self._graphs.get(key)
        if entry is None:
            if key in self._failed:
                return body(x)
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > self.max_graphs:
                    self._seen.popitem(last=False)
                return body(x)
            entry = self._capture(key, x, body, keep)
            if entry is None:
                return body(x)
        entry.static_input.copy_(x)
        entry.graph.replay()
        return entry.output.clone()

    def _capture(self, key, x, body, keep) -> _Graph | None:
        device = x.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        static_input = torch.empty_like(x)  # the graph reads its layout; `x`'s is in the key
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = self._streams.get(index)
        if side is None:
            side = self._streams[index] = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                if index not in self._pools:
                    self._pools[index] = torch.cuda.graph_pool_handle()
                # thread-local: another thread's CUDA calls (a streamer's) do not break the capture
                graph.capture_begin(pool=self._pools[index], capture_error_mode="thread_local")
                try:
                    output = body(static_input)
                finally:
                    graph.capture_end()
        except Exception as error:  # the call runs directly from now on; its result is the same
            self._failed.add(key)
            logger.warning("could not capture a decode step's kernels in a CUDA graph (%s: %s); that call runs "
                           "its launches directly from now on", type(error).__name__, error)
            return None
        finally:
            current.wait_stream(side)
        entry = _Graph(graph, static_input, output, keep())
        self._graphs[key] = entry
        self.captures += 1
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry
