"""The decode step captured as CUDA graphs, one per padded input shape (``compile_scope="layer"`` on CUDA).

A decode step on a GPU is bound by the host: hundreds of kernel launches, each a few microseconds of Python and
driver time, around kernels that take less. Captured, a step is one launch whatever its depth. The step captured is
the engine's own (its layers each run the compiled layer graph, the embedding and head eager between them), so the
graph is the model's forward, not a copy of it. What a capture needs, the step already keeps: its inputs are
buffers of their own per padded shape (``StaticInputs``), the KV pools and weights are written in place, and nothing
in the step reads the device on the host (CUDA refuses a sync while capturing, so a step that syncs fails here, not
silently).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepGraphs:
    """``step(*inputs)`` run as one CUDA graph per set of input buffers: the first call with a set runs the step
    once (the layer graph compiles for the shape; it writes what the replay writes again), captures it, and replays
    it; later calls replay. The outputs are the graph's own tensors, overwritten by the next replay: read them first.
    """

    def __init__(self, step: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]):
        self.step = step
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None  # one memory pool for every shape's graph: only one runs at a time
        self.captures = 0  # graphs captured so far (a test's count)

    def __call__(self, *inputs: torch.Tensor | None) -> tuple:
        key = tuple(None if t is None else (t.data_ptr(), tuple(t.shape)) for t in inputs)
        held = self.graphs.get(key)
        if held is None:
            self.step(*inputs)  # compiles where it must: a compilation cannot run inside a capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.step(*inputs)
            self.pool = graph.pool()
            held = self.graphs[key] = (graph, out)
            self.captures += 1
        graph, out = held
        graph.replay()
        return out

    def reset(self) -> None:
        """Forget every captured graph: each shape is captured again at its next call."""
        self.graphs.clear()
