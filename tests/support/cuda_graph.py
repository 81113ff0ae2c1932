"""CUDA-graph capture for the GPU tests: one warm-up run on a side stream (Triton compiles, lazy buffers are
allocated, outside the capture), then the capture on torch.cuda.graph's own stream."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """(the graph of fn(), what the captured call returned: the tensors each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def assert_replays_track_inputs(fn: Callable[[], torch.Tensor], change: Callable[[], None]) -> None:
    """fn() captured: three replays give the eager call's bits; after change() rewrites its inputs in place, a replay
    gives the bits of an eager call on the new inputs."""
    eager = fn()
    graph, out = capture(fn)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    change()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn())
