"""The parity fixture check run at every artifact load (rung 3 of the ladder, in production).

At export, eager recorded greedy ids and logits for a few prompts; here the loaded graphs must
reproduce them: logits within the dtype's tolerance and identical ids wherever eager's top-2 margin
is wider than twice that tolerance (below it, a legitimate rounding difference may flip a near-tie).
"""
from __future__ import annotations

from pathlib import Path

from .artifact import ArtifactError

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.1}


def check_fixture(executor, manifest: dict) -> dict:
    from safetensors.torch import load_file
    fx = load_file(str(Path(manifest["_root"]) / manifest["fixture"]))
    tol = TOLERANCE[manifest["dtype"]]
    worst = 0.0
    i = 0
    while f"prompt{i}" in fx:
        prompt, ref_ids, ref_logits = fx[f"prompt{i}"].tolist(), fx[f"ids{i}"].tolist(), fx[f"logits{i}"]
        ids, logits = executor.generate(prompt, len(ref_ids), slot=0)
        for step, (a, b) in enumerate(zip(logits, ref_logits)):
            diff = (a.float().cpu() - b).abs().max().item()
            worst = max(worst, diff)
            top2 = b.topk(2).values
            if diff > tol:
                raise ArtifactError(f"parity fixture: prompt {i} step {step}: logits differ from eager by "
                                    f"{diff:.3g} > {tol}")
            if ids[step] != ref_ids[step] and (top2[0] - top2[1]).item() > 2 * tol:
                raise ArtifactError(f"parity fixture: prompt {i} first differing token at step {step}: "
                                    f"graph {ids[step]} vs eager {ref_ids[step]}")
            if ids[step] != ref_ids[step]:
                break  # a legitimate near-tie flip: the rest of the stream is not comparable
        i += 1
    return {"prompts": i, "max_logit_diff": worst, "tolerance": tol}
