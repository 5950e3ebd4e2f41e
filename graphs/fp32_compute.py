"""Eager in fp32 over a bf16 / fp16 model's own weights, without an fp32 copy of the model.

The parity fixture's tolerance (export/pipeline.py fixture(), runtime/fixture.py) needs how far the model's
low-precision eager run is from the same computation in fp32. An fp32 copy of the model would answer it but
does not fit beside the model at scale (35B: 138 GB in fp32 beside its 69 GB in bf16), so instead every op
is upcast as it runs: `Fp32Compute`, a TorchDispatchMode, sees every aten op and every onegraph op (they
are torch.library custom ops, which reach dispatch modes) and hands the op fp32 copies of its arguments of
the model dtype. Each weight is upcast per op call as a temporary and freed after it; the computation is
the one an fp32 copy of the model would run on the same values, bit for bit on the CPU (tests/test_fp32_compute.py).

What is not cast: tensors of any other dtype (int8 / float8 weights and their fp32 scales, int64 ids and
positions, fp32 tensors), so a quantized model keeps its quantized weights and only its float ones go to fp32.
A `dtype=` argument of the model dtype (a factory, a `.to()`) becomes fp32 too, so no op rounds back to it.
An op that writes into a tensor of the model dtype (in place, out=) is refused: it would write into the
temporary copy and lose the write, so the state the run carries must already be fp32 (generate_eager_fp32).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

LOW = (torch.bfloat16, torch.float16)


class Fp32Compute(TorchDispatchMode):
    """While active, every op whose tensor arguments are of `dtype` (bfloat16 or float16) runs on fp32
    copies of them and returns what the op returns for those (fp32 where the op computes in its inputs'
    dtype)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        if dtype not in LOW:
            raise ValueError(f"Fp32Compute upcasts bfloat16 or float16 tensors, not {dtype}")
        self.dtype = dtype

    def _up(self, x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype == self.dtype else x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            written = args[i] if i < len(args) else kwargs.get(a.name)
            if any(isinstance(t, torch.Tensor) and t.dtype == self.dtype for t in tree_flatten(written)[0]):
                raise RuntimeError(f"Fp32Compute: {func} writes into a {self.dtype} tensor ({a.name}): the write "
                                   "would land in an fp32 temporary and be lost; make that tensor fp32")
        args, kwargs = tree_map(self._up, args), tree_map(self._up, kwargs)
        if kwargs.get("dtype") == self.dtype:
            kwargs["dtype"] = torch.float32
        return func(*args, **kwargs)


def generate_eager_fp32(model, prompt_ids: list[int], max_new_tokens: int, *args, **kw):
    """graphs/eager.py generate_eager in fp32 over `model`'s bf16 / fp16 weights (its state fp32): the same
    EagerResult, logits fp32. An fp32 model runs as it is."""
    from onegraph.graphs.eager import generate_eager
    dtype = model.embed_tokens.weight.dtype
    if dtype not in LOW:
        return generate_eager(model, prompt_ids, max_new_tokens, *args, **kw)
    with Fp32Compute(dtype):
        return generate_eager(model, prompt_ids, max_new_tokens, *args, state_dtype=torch.float32, **kw)
