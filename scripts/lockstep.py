"""Lockstep first-diff: an artifact's graphs vs eager over the artifact's own weights, step by step.

    python -m onegraph.scripts.lockstep ARTIFACT [--prompt-ids 1,2,3] [--steps 8] [--no-cuda-graphs] [--out F]
    torchrun --nproc-per-node N -m onegraph.scripts.lockstep TP_ARTIFACT ...     # every rank, its shard

The load-time fixture (runtime/fixture.py) says *whether* an artifact reproduces eager's tokens; this
says *where* it stops: both sides prefill the prompt into slot 0 from zero state, then decode
teacher-forced by eager's ids (the graph is fed eager's token, not its own), so a difference never
compounds and each row is one step of the graph vs eager on the same inputs: ids, the largest logit
difference, eager's smallest MoE router margin (a near-tie explains a flipped expert, see
runtime/fixture.py) and the largest difference of every state tensor (conv / recurrent GDN state,
K / V caches) of slot 0. The first row beyond the load-time fixture's tolerance (the dtype's, or
twice eager's recorded bf16-vs-fp32 gap where wider: runtime/fixture.py fixture_tolerance) is `first_diff`.

Tensor parallel: every rank compares its own graphs with an eager model of its own weight shard, both
running the same loop (no step broadcast: the collectives of the graphs, then those of eager, pair up
across ranks in the same order). Rank r writes OUT with `{rank}` replaced. Exit code 1 if a row
differs, so a script can stop at the first failing artifact.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

DEFAULT_PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 5, 200, 17]


def eager_twin(ex):
    """A GraphExecutor running the onegraph eager model over the weights the artifact's graphs were
    lowered with (this rank's shard under tensor parallel), with the same buckets and slots."""
    from onegraph.models.qwen3_5.config import ModelConfig
    from onegraph.models.qwen3_5.fuse import fuse_projections
    from onegraph.models.qwen3_5.model import Qwen35Model
    from onegraph.runtime.executor import GraphExecutor
    m = ex.artifact.manifest
    with torch.device("meta"):
        model = Qwen35Model(ModelConfig.from_dict(m["model"]), ex.artifact.tp,
                            fp32_reduce=m["options"].get("fp32_reduce", False))
    fuse_projections(model)                      # the artifact's weights are the concatenated projections
    weights = {k.removeprefix("model."): v for k, v in ex.artifact.load_weights(ex.device).items()}
    inv_freq = weights.pop("inv_freq")           # a buffer the graphs hold as a constant; not in state_dict()
    model.load_state_dict(weights, strict=True, assign=True)
    model.inv_freq = inv_freq
    kinds = {"decode": ex.decode_buckets, "prefill": ex.prefill_buckets}
    return model.eval(), GraphExecutor.from_model(model, kinds, max_slots=ex.max_slots, max_seq_len=ex.max_seq_len)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def lockstep(ex, prompt: list[int], steps: int) -> dict:
    """Graphs of `ex` (a GraphExecutor from an artifact, any slot count) vs their eager twin -> report."""
    from safetensors.torch import load_file

    from onegraph.graphs.eager import router_margins
    from onegraph.runtime.executor import Sampling
    from onegraph.runtime.fixture import fixture_tolerance
    m = ex.artifact.manifest
    # the load-time check's tolerance: the dtype's, or wider where eager's recorded fp32 gap says so
    tol, _, source, _ = fixture_tolerance(load_file(str(ex.artifact.fixture)), m["dtype"], m["options"].get("quant"))
    model, eager = eager_twin(ex)
    names = [t["name"] for t in m["state"]]
    ex.link = None                    # tensor parallel: every rank runs this same loop itself
    rows = []

    def compare(step, graph_out, eager_out, margins):
        state = {n: _max_diff(a[0], b[0]) for n, a, b in zip(names, ex.state, eager.state)}
        rows.append({"step": step, "ids": [int(graph_out[0][0]), int(eager_out[0][0])],
                     "logit_diff": _max_diff(graph_out[1][0], eager_out[1][0]),
                     "router_margin": min(margins, default=float("inf")), "state_diff": state})

    with torch.no_grad():
        with router_margins(model) as margins:
            e = eager.prefill(prompt, 0)
        compare(0, ex.prefill(prompt, 0), e, margins)
        pos = len(prompt)
        for step in range(1, steps + 1):
            ex.last_tok[0] = eager.last_tok[0]            # teacher-forced: both feed eager's last id
            with router_margins(model) as margins:
                e = eager.decode_step([0], [pos], [Sampling()])
            compare(step, ex.decode_step([0], [pos], [Sampling()]), e, margins)
            pos += 1
    bad = lambda r: (r["ids"][0] != r["ids"][1] or r["logit_diff"] > tol  # noqa: E731
                     or max(r["state_diff"].values()) > tol)
    first = next((r["step"] for r in rows if bad(r)), None)
    return {"path": ex.path, "dtype": m["dtype"], "tolerance": tol, "tolerance_source": source,
            "prompt": prompt, "first_diff": first, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m onegraph.scripts.lockstep", description=__doc__.split("\n")[0])
    p.add_argument("artifact")
    p.add_argument("--prompt-ids", default=",".join(map(str, DEFAULT_PROMPT)))
    p.add_argument("--steps", type=int, default=8, help="decode steps after the prefill")
    p.add_argument("--device", help="load the artifact on this device (default: the one it was exported for)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--out", help="write the JSON report here ({rank} is replaced by the rank)")
    args = p.parse_args(argv)
    from onegraph.runtime import ranks
    from onegraph.runtime.artifact import Artifact, ArtifactError
    from onegraph.runtime.executor import GraphExecutor
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
        art = Artifact.load(args.artifact, args.device, defer_sha256=True)
        rank, _ = ranks.init_from_torchrun(art.device.type)
        ex = GraphExecutor.from_artifact(art, max_slots=1, check_parity=False,
                                         cuda_graphs=args.cuda_graphs)
        if len(prompt) + args.steps > ex.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + steps ({args.steps}) exceed max_seq_len {ex.max_seq_len}")
        report = dict(lockstep(ex, prompt, args.steps), rank=rank)
    except (ArtifactError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        ranks.leave()
    if args.out:
        with open(args.out.format(rank=rank), "w") as f:
            json.dump(report, f, indent=1)
    for r in report["rows"]:
        worst = max(r["state_diff"], key=r["state_diff"].get)
        print(f"rank {rank} step {r['step']}: ids {r['ids'][0]} vs {r['ids'][1]}, logits {r['logit_diff']:.3g}, "
              f"router margin {r['router_margin']:.3g}, worst state {worst} {r['state_diff'][worst]:.3g}")
    print(f"rank {rank} {report['path']} {report['dtype']}: first step beyond {report['tolerance']}: "
          f"{report['first_diff']}")
    return 0 if report["first_diff"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
