"""CUDA-graph replay of the lowered decode graphs: one capture per decode bucket, static buffers.

A step is: the host writes the rows' slots, positions and sampling parameters into pinned staging
(numpy, no torch call), then `graph.replay()`: the graph itself copies that staging in (one H2D
memcpy node), so the step makes one CUDA call. The captured graph gathers the input tokens
from the executor's `last_tok` (the ids sampled by the previous step, never through the host) and
scatters the new ids back. The state tensors are the executor's own (fixed addresses), so prefill
graphs (run uncaptured) and every captured bucket share one state.

Capture needs (docs/design.md, "CUDA-graph capture"): the package loaded with
`run_single_threaded=True`, captured on a side stream, and that stream handed to
`loader.run(inputs, stream)` as a PyCapsule of the cudaStream_t. Warm-up and capture point every
row at the scratch slot, so no request's state is touched.
"""
from __future__ import annotations

import ctypes
import time

import torch

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)


def stream_capsule(stream: torch.cuda.Stream):
    return _capsule_new(ctypes.c_void_p(stream.cuda_stream), None, None)


ALIGN = 16          # bytes: AOTInductor copies an input whose address is not a multiple of 16 before using it


def _row_bytes(B: int, itemsize: int) -> int:
    return -(-B * itemsize // ALIGN) * ALIGN


def staging_bytes(B: int) -> int:
    return 4 * _row_bytes(B, 8) + 2 * _row_bytes(B, 4)


def split(buf: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A staging byte buffer -> views (int64 [4, B]: slots, positions, top_k, seed; fp32 [2, B]:
    temperature, top_p). Each row starts ALIGN bytes apart, so on the device each row is a graph input as it
    is (a view the captured graph reads in place: no copy into separate input buffers)."""
    ri, rf = _row_bytes(B, 8), _row_bytes(B, 4)
    return (buf[:4 * ri].view(torch.int64).view(4, ri // 8)[:, :B],
            buf[4 * ri:4 * ri + 2 * rf].view(torch.float32).view(2, rf // 4)[:, :B])


class Staging:
    """One step's per-row inputs of a bucket of B rows, in one (pinned) host byte buffer that a single
    H2D copy moves; written through numpy views, so filling it costs no torch call."""

    def __init__(self, B: int, scratch: int, pin: bool):
        self.B, self.scratch = B, scratch
        buf = torch.zeros(staging_bytes(B), dtype=torch.uint8)
        self.bytes = buf.pin_memory() if pin else buf
        self.ints, self.floats = split(self.bytes, B)
        self._i, self._f = self.ints.numpy(), self.floats.numpy()
        self.fill([], [], [])

    def fill(self, slots: list[int], positions: list[int], sampling) -> None:
        """n <= B rows; rows n..B-1 are padding: the scratch slot, position 0, greedy (top_p 1)."""
        n, i, f = len(slots), self._i, self._f
        i[0, :n] = slots
        i[1, :n] = positions
        i[2, :n] = [s.top_k for s in sampling]
        i[3, :n] = [s.seed for s in sampling]
        f[0, :n] = [s.temperature for s in sampling]
        f[1, :n] = [s.top_p for s in sampling]
        if n < self.B:
            i[0, n:] = self.scratch
            i[1:, n:] = 0
            f[0, n:], f[1, n:] = 0.0, 1.0


class CapturedDecode:
    """One decode bucket captured as a CUDA graph around the AOTInductor call, with the per-step glue
    inside it, so that a step costs the host one replay:

      host (numpy into pinned staging): slots, positions, top_k, seed (int64) | temperature, top_p (fp32)
      -> replay: H2D copy of the staging bytes (in the graph, unless `copy_in` is False: tensor
         parallel replays bytes the leader broadcast to a device buffer, copied in by replay()), whose
         rows are the graph's static inputs as they lie, tokens = last_tok[slots] (the ids sampled by the
         previous step stay on the device), the lowered decode, last_tok[slots] = ids, ids -> pinned
         host buffer and an event recorded after it (the engine reads both one step late).

    spec=True captures a speculative round (`spec_b{B}`, graphs/spec_graphs.py) the same way: no positions
    input (the round keeps them on the device), last_tok[slots] = its next_ids, and the host copy is each
    row's [n_accepted, targets...] [B, 1+K+1], the form the engine reads a round in.

    Padding rows point at the scratch slot with zero inputs (greedy, top_p 1; last_tok[scratch] is
    zeroed after each step). Two pinned stagings alternate with two captured graphs, each of which also
    copies its ids to its own pinned host buffer: the engine has read (synchronised) step t-2 before it
    fills the staging of step t, so neither buffer being rewritten is still in use."""

    def __init__(self, run_with_stream, B: int, state: list[torch.Tensor], last_tok: torch.Tensor, scratch: int,
                 device: torch.device, copy_in: bool = True, spec: bool = False):
        self.B, self.copy_in, d = B, copy_in, device
        # two stagings alternate: the engine has read (synchronised) step t-2 before it fills step t's
        self.host = [Staging(B, scratch, pin=True) for _ in range(2)]
        self.flip = 0
        self.dev = self.host[0].bytes.to(d)                # device copy of the staging; its rows are the inputs
        (self.slots, self.positions, self.top_k, self.seed), (self.temperature, self.top_p) = split(self.dev, B)
        self.tokens = torch.zeros(B, dtype=torch.int64, device=d)
        # a speculative round (spec=True) keeps its positions on the device (spec.pos): no positions input
        positions = [] if spec else [self.positions]
        inputs = [self.tokens, self.slots, *positions, self.temperature, self.top_k, self.top_p, self.seed] + state

        def body(stream):
            """-> (what the host reads: decode ids [B] | a round's [n_accepted, targets] [B, 1+K+1],
            the step's two outputs: (ids, logits) | (n_accepted [B], targets [B, K+1]))"""
            torch.index_select(last_tok, 0, self.slots, out=self.tokens)
            out = run_with_stream(inputs, stream_capsule(stream))
            last_tok.index_copy_(0, self.slots, out[0])     # decode ids | the round's next_ids
            last_tok[scratch].zero_()                 # padding rows keep feeding token 0, as uncaptured
            if spec:
                return torch.cat([out[1][:, None], out[2]], 1), (out[1], out[2])
            return out[0], (out[0], out[1])

        side = torch.cuda.Stream(device=d)
        side.wait_stream(torch.cuda.current_stream(d))
        with torch.cuda.stream(side):
            for _ in range(2):                        # warm-up (lazy init, autotune caches) on scratch rows
                host_shape = body(side)[0].shape
        side.synchronize()
        # two graphs, one per staging: each copies its own staging in, its sampled ids out into its own
        # pinned host buffer and records its own event (read by the engine one step late, while the
        # other graph runs), so a step launches no copy or event of its own. An external event is a
        # node of the graph: every replay records it. The graphs share one memory pool: they never
        # run at the same time.
        self.host_ids = [torch.zeros(host_shape, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.graphs, self.outs, pool = [], [], None
        self.events = [torch.cuda.Event(external=True) for _ in range(2)]
        for k in range(2):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side, pool=pool):
                if copy_in:
                    self.dev.copy_(self.host[k].bytes, non_blocking=True)
                host_out, outs = body(side)
                self.host_ids[k].copy_(host_out, non_blocking=True)
                self.events[k].record(side)
            pool = g.pool()
            self.graphs.append(g)
            self.outs.append(outs)
        torch.cuda.current_stream(d).wait_stream(side)

    def step(self, slots: list[int], positions: list[int], sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """n <= B rows: their slots, positions (host ints) and Sampling rows -> (ids [n], logits [n, V]) views
        of the graph's static outputs (rewritten by the next step); last_tok[slots] already holds the ids."""
        return self.replay(self.stage(slots, positions, sampling), len(slots))

    def stage(self, slots: list[int], positions: list[int], sampling) -> torch.Tensor:
        """Fill the next pinned staging -> its bytes (what replay() copies in; TP broadcasts them)."""
        self.flip ^= 1
        self.host[self.flip].fill(slots, positions, sampling)
        return self.host[self.flip].bytes

    def replay(self, staged: torch.Tensor, n: int, graph: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of the last stage() -> outputs of n rows. `staged`: its bytes (the graph
        copies them in itself), or, without copy_in, a device buffer of them that is copied in here.
        graph: a tensor-parallel follower replays the graph the leader replays (it never stage()s), so
        that each rank's captured NCCL collectives meet the peer's capture of the same graph (replaying
        another graph would pair collectives of different captures)."""
        if graph is not None:
            self.flip = graph
        if not self.copy_in:
            self.dev.copy_(staged, non_blocking=True)
        self.copied_at = time.perf_counter()      # copy-in ends here (Engine's per-phase timings)
        self.graphs[self.flip].replay()
        ids, logits = self.outs[self.flip]
        return (ids, logits) if n == self.B else (ids[:n], logits[:n])   # a full bucket: no slicing

    def last_host_ids(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The pinned host copy of the last replay's ids [n] and the event its graph records after
        copying them: valid once that event has completed, until the replay after next."""
        h = self.host_ids[self.flip]
        return (h if n == self.B else h[:n]), self.events[self.flip]
