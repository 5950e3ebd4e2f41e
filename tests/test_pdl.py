"""Programmatic dependent launch (runtime/pdl.py): what the CPU can check beyond compile_check, which compiles
every kernel with PDL on for sm_90 and checks that the wait precedes every global access and that torch's
mutation analysis is unchanged by it (tests/test_triton_ops.py runs it). The replay itself (programmatic
edges, bit-identical steps) is measured on the H200: `python -m onegraph.tools.bench_big --batch 1 --pdl`."""
import torch

from onegraph.export.aoti import pdl_waits


def test_no_waits_recorded_off_hopper():
    """Only graphs compiled for a device with griddepcontrol, with the hand-written kernels, record waiting
    kernels; the runtime rewrites no edge of any other artifact."""
    assert pdl_waits(torch.device("cpu"), "auto") == []
    assert pdl_waits(torch.device("cuda"), "reference") == []


def test_cpu_artifact_records_no_waits(tiny_artifact):
    import json
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    assert manifest.get("lowering", {}).get("pdl_waits") == []
