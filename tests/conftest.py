import sys
from pathlib import Path

# tests import their helpers as plain modules (hf_models, ...)
sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU the Triton kernel tests run in Triton's interpreter (tests/triton_env.py). The variable must be
# set before anything imports triton.language: its own @jit functions (tl.sum, tl.max, ...) are made when it
# is imported, and an interpreted kernel cannot call compiled ones ("Cannot call @triton.jit'd outside of the
# scope of a kernel"). Importing onegraph.export pulls in torch._inductor, which imports triton, while pytest
# collects the modules before the first test_triton_* one: so it is set here, before collection.
import os  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

# One AOTInductor export of `tiny` shared by every test that needs an artifact (compiles take
# tens of seconds each on 2 cores): decode buckets 1, 2, 4; prefill chunk 16; 256 tokens.
TINY_EXPORT = dict(batch_sizes=(1, 2, 4), prefill_chunks=(16,), max_seq_len=256)


@pytest.fixture(scope="session")
def aoti_cache(tmp_path_factory):
    """The session's compiled-graph cache (export/cache.py): a later export of tiny_artifact's graphs (the same
    model, weights and options, e.g. with --weights reference) reuses them instead of compiling again."""
    return tmp_path_factory.mktemp("aoti-cache")


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, aoti_cache):
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("art") / "tiny"
    export("tiny", out, ExportOptions(**TINY_EXPORT), progress=False, cache_dir=aoti_cache)
    return out


@pytest.fixture()
def artifact_copy(tiny_artifact, tmp_path):
    """A copy of tiny_artifact that a test may damage."""
    import shutil
    dst = tmp_path / "copy"
    shutil.copytree(tiny_artifact, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_bf16_artifact(tmp_path_factory):
    """bf16 `tiny` with fp32_reduce at TP-1 (decode bucket 1, prefill chunk 16, 128 tokens): the bf16 artifact
    test (test_export_aoti) and the TP-4 artifact test's reference (test_tp, which exports TP-4 with these
    options, read back from the manifest) share its two compiles."""
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("art") / "tiny_bf16"
    export("tiny", out, ExportOptions(dtype="bfloat16", batch_sizes=(1,), prefill_chunks=(16,), max_seq_len=128,
                                      fp32_reduce=True), progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_eager():
    from onegraph.checkpoint.load import load_model
    return load_model("tiny")[1]


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """A transformers-made tiny checkpoint (test-only oracle) saved with save_pretrained."""
    pytest.importorskip("transformers")
    import hf_models
    out = tmp_path_factory.mktemp("hf") / "moe"
    hf_models.build("moe_i2_top1_gqa4_oddvocab").save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_artifact(hf_checkpoint, tmp_path_factory):
    from onegraph.export.pipeline import ExportOptions, export
    out = tmp_path_factory.mktemp("art") / "hf"
    # one stream at a time in its tests: decode bucket 1 and prefill chunk 16, the 2 graphs lowered side by side
    export(str(hf_checkpoint), out, ExportOptions(batch_sizes=(1,), prefill_chunks=(16,), max_seq_len=128),
           progress=False)
    return out


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes gain nothing from intra-op threads, and on a shared 2-core machine the thread
    handoffs of thousands of small ops cost 10x; restored for the modules that follow."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
