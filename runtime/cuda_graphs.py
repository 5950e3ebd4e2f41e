"""CUDA-graph replay of the lowered decode graphs: one capture per decode bucket, static buffers.

A step is: copy this step's inputs into the bucket's static input tensors (tokens/slots device to
device, positions and sampling from a pinned host staging tensor) -> `graph.replay()`. The state
tensors are the executor's own (fixed addresses), so prefill graphs (run uncaptured) and every
captured bucket share one state.

Capture follows what was measured on the H200 image (FACTS.md): the package is loaded with
`run_single_threaded=True`, captured on a side stream, and that stream is handed to
`loader.run(inputs, stream)` as a PyCapsule of the cudaStream_t. Warm-up and capture point every
row at the scratch slot, so no request's state is touched.
"""
from __future__ import annotations

import ctypes

import torch

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)


def stream_capsule(stream: torch.cuda.Stream):
    return _capsule_new(ctypes.c_void_p(stream.cuda_stream), None, None)


def stage_rows(B: int, positions, sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step scalars of n <= B rows, padded to B, built with one tensor per dtype (not 5·B element
    writes on the hot path): -> (int64 [3, B]: position, top_k, seed; fp32 [2, B]: temperature, top_p).
    Padding rows: zeros, top_p 1 (greedy on the scratch slot)."""
    pad = B - len(positions)
    ints = torch.tensor([list(positions) + [0] * pad, [s.top_k for s in sampling] + [0] * pad,
                         [s.seed for s in sampling] + [0] * pad], dtype=torch.int64)
    floats = torch.tensor([[s.temperature for s in sampling] + [0.0] * pad,
                           [s.top_p for s in sampling] + [1.0] * pad], dtype=torch.float32)
    return ints, floats


class CapturedDecode:
    """One decode bucket captured as a CUDA graph around the AOTInductor call."""

    def __init__(self, run_with_stream, B: int, state: list[torch.Tensor], scratch: int, device: torch.device):
        self.B = B
        d = device
        z64 = lambda fill=0: torch.full((B,), fill, dtype=torch.int64, device=d)  # noqa: E731
        self.tokens, self.slots, self.positions = z64(), z64(scratch), z64()
        self.temperature = torch.zeros(B, dtype=torch.float32, device=d)
        self.top_k, self.seed = z64(), z64()
        self.top_p = torch.ones(B, dtype=torch.float32, device=d)
        # pinned host staging for the per-step scalars: positions, top_k, seed (int64) / temperature, top_p
        # (fp32). Two of each, alternated: the engine has read (synchronised) step t-2 before it fills the
        # staging of step t, so the buffer being overwritten is never still in flight.
        self.host_i = [torch.zeros(3, B, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.host_f = [torch.zeros(2, B, dtype=torch.float32).pin_memory() for _ in range(2)]
        self.flip = 0
        inputs = [self.tokens, self.slots, self.positions, self.temperature, self.top_k, self.top_p, self.seed] + state
        side = torch.cuda.Stream(device=d)
        side.wait_stream(torch.cuda.current_stream(d))
        with torch.cuda.stream(side):
            for _ in range(2):                        # warm-up (lazy init, autotune caches) on scratch rows
                run_with_stream(inputs, stream_capsule(side))
        side.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):
            out = run_with_stream(inputs, stream_capsule(side))
        self.ids, self.logits = out[0], out[1]
        torch.cuda.current_stream(d).wait_stream(side)

    def step(self, tokens: torch.Tensor, slots: torch.Tensor, positions, sampling, scratch: int):
        """tokens/slots: device [n <= B]; positions: host ints; sampling: Sampling rows."""
        n = tokens.shape[0]
        self.tokens[:n].copy_(tokens)
        self.slots[:n].copy_(slots)
        if n < self.B:                                 # padding rows: scratch slot, zero inputs
            self.tokens[n:].zero_()
            self.slots[n:].fill_(scratch)
        self.flip ^= 1
        hi, hf = self.host_i[self.flip], self.host_f[self.flip]
        ints, floats = stage_rows(self.B, positions, sampling)
        hi.copy_(ints)
        hf.copy_(floats)
        dev_i = hi.to(self.tokens.device, non_blocking=True)
        dev_f = hf.to(self.tokens.device, non_blocking=True)
        self.positions.copy_(dev_i[0])
        self.top_k.copy_(dev_i[1])
        self.seed.copy_(dev_i[2])
        self.temperature.copy_(dev_f[0])
        self.top_p.copy_(dev_f[1])
        self.graph.replay()
        return self.ids[:n], self.logits[:n]
