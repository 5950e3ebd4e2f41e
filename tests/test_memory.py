"""Memory sizing at load (runtime/memory.py): a slot count that does not fit is refused before anything is
allocated, with the memory needed and free in the message; one that fits loads; the per-slot bytes are the
state the executor allocates; `inspect` states them; a 131072-token artifact is sized from its shapes."""
import pytest

from onegraph.runtime import Engine, memory
from onegraph.runtime.artifact import Artifact


@pytest.fixture(scope="module")
def art(tiny_artifact):
    return Artifact.load(tiny_artifact)


def test_per_slot_bytes_are_the_allocated_state(art):
    eng = Engine.from_artifact(art, max_slots=2, check_parity=False)
    try:
        allocated = sum(t.numel() * t.element_size() for t in eng.ex.state)     # 2 slots + scratch
        assert allocated == 3 * memory.state_bytes_per_slot(art.manifest["state"])
    finally:
        eng.close()


def test_refusal_names_memory_needed_and_free(art):
    need = memory.needed_bytes(art.path, art.manifest, 4, "cpu")
    free = need["total"] - need["state_per_slot"] // 2            # half a slot short
    with pytest.raises(ValueError, match="needs .* on cpu .* but .* is free") as e:
        Engine.from_artifact(art, max_slots=4, check_parity=False, free_memory=free)
    msg = str(e.value)
    assert f"needs {memory.size(need['total'])}" in msg and f"{memory.size(free)} is free" in msg, msg
    assert "at most --max-slots 3 fits" in msg
    need = need["total"]
    eng = Engine.from_artifact(art, max_slots=4, check_parity=False, free_memory=need)    # exactly fits: loads
    try:
        assert eng.generate([1, 2, 3], 4).finish_reason == "length"
    finally:
        eng.close()


def test_largest_fitting_slot_count_is_the_boundary(art):
    for free in (10**9, 3 * 10**9 + 12345):
        n = memory.max_slots_fitting(art.path, art.manifest, free, "cpu")
        assert n > 0
        assert memory.needed_bytes(art.path, art.manifest, n, "cpu")["total"] <= free
        assert memory.needed_bytes(art.path, art.manifest, n + 1, "cpu")["total"] > free
    assert memory.max_slots_fitting(art.path, art.manifest, 1000, "cpu") == 0


def test_serve_refuses_slots_beyond_this_machines_memory(tiny_artifact, capsys):
    """No free_memory override: the real free RAM; 10^9 slots of ~0.3 MiB cannot fit anywhere."""
    from onegraph.cli import main
    assert main(["serve", str(tiny_artifact), "--max-slots", str(10**9), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-slots 1000000000" in err and "is free" in err, err


def test_inspect_states_bytes_per_slot_and_the_largest_slot_count(tiny_artifact, art, capsys):
    from onegraph.cli import main
    assert main(["inspect", str(tiny_artifact)]) == 0
    out = capsys.readouterr().out
    per = memory.state_bytes_per_slot(art.manifest["state"])
    assert f"memory: {per} bytes" in out and "at max_seq_len 256" in out
    n = int(out.split("the largest --max-slots that fits is ")[1].split()[0])
    assert n > 0
    ctx = dict(kv.split(": ") for kv in out.split("by --max-slots: ")[1].splitlines()[0].split(", "))
    assert list(ctx) == ["1", "4", "16", "64"] and int(ctx["1"]) >= int(ctx["64"]) > 0


def test_long_context_state_is_linear_in_max_seq_len(tiny_eager):
    """tiny at --max-seq-len 131072: accepted by export's options, and its per-slot state grows by the KV
    cache only (2 x KVH x D x dtype bytes per token per attention layer), nothing O(Tmax^2)."""
    import torch

    from onegraph.export.pipeline import ExportOptions
    from onegraph.graphs.signature import state_manifest
    cfg = tiny_eager.cfg
    ExportOptions(max_seq_len=131072).validate(cfg.max_position_embeddings)
    per = {t: memory.state_bytes_per_slot(state_manifest(tiny_eager, t, torch.float32)) for t in (256, 131072)}
    attn = sum(k == "full_attention" for k in cfg.layer_types)
    assert per[131072] - per[256] == (131072 - 256) * attn * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def test_largest_max_seq_len_for_a_slot_count_is_the_boundary(art):
    """inspect's longest context per slot count: a manifest exported at that max_seq_len fits the free bytes
    (by the refusal's own sizing), one token more does not; the GDN state does not grow with it."""
    import copy

    def at(T):                                       # the artifact's manifest as exported at max_seq_len T
        m = copy.deepcopy(art.manifest)
        for t in m["state"]:
            if t["kind"] == "kv":
                t["shape"][2] = T
        m["max_seq_len"] = T
        return m
    for slots, free in ((16, 10**9), (64, 10**9), (64, 2 * 10**9 + 777)):    # above the 256 MiB slack
        T = memory.max_seq_len_fitting(art.path, art.manifest, free, "cuda", slots)
        assert 256 < T < art.manifest["model"]["max_position_embeddings"]
        assert memory.needed_bytes(art.path, at(T), slots, "cuda")["total"] <= free
        assert memory.needed_bytes(art.path, at(T + 1), slots, "cuda")["total"] > free
    assert memory.max_seq_len_fitting(art.path, art.manifest, 1000, "cuda", 1) == 0
    cap = art.manifest["model"]["max_position_embeddings"]        # the model's own limit caps it
    assert memory.max_seq_len_fitting(art.path, art.manifest, 10**11, "cuda", 1) == cap
