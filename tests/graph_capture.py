"""What the kernels' CUDA-graph tests share: a step captured after a warm-up on the capture stream."""
from __future__ import annotations

from typing import Callable

import torch


def capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """step() run once (Triton compiles outside the capture), once more on a side stream (the allocator
    settles), then captured: the graph and the output tensor its replays write."""
    step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
