"""Accuracy of the quantized schemes against the bf16 model, eager on CPU (benchmarks/quant_accuracy.json).

    python -m onegraph.tools.quant_accuracy --out benchmarks/quant_accuracy.json [--model tiny] [--model DIR ...]

Per model (a float checkpoint: the trained builtin `tiny`, or transformers-made ones) and per variant, all
computed in bf16: none (the reference), fp8 (block, `--quant fp8`), fp8-channel (a compressed-tensors checkpoint
written by tools/quant_checkpoint.py and loaded as it is: W8A8 e4m3), int8 (`--quant int8`, amax / 127) and
int8-ct (a compressed-tensors int8 checkpoint, llm-compressor's amax / 127.5); plus fp32 none.
- bits_per_byte on the text (default tiny's bundled held-out text; tools/eval.py's windows: ctx 256 sharing one
  token, each from an empty slot, every token after the first scored once; tools/eval.py's own loop, with
  the logits kept);
- logits vs bf16 at the same teacher-forced positions: max and mean |diff|, relative RMS (||diff|| / ||bf16||),
  and how often the argmax is the same;
- greedy agreement: GREEDY_PROMPTS prompts (16 tokens from the text) x 256 generated tokens: positions equal to
  bf16's ids, and the first step that differs (after it the contexts differ, so a later mismatch is not an
  error of its own).
A transformers-made checkpoint has random weights (no language model: ~8 bits/byte); its rows show how far
each scheme moves logits and greedy ids of a model of that shape, its bits/byte only that they stay put.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GREEDY_PROMPTS, GREEDY_TOKENS, PROMPT_LEN = 4, 256, 16
VARIANTS = ("bf16", "fp8", "fp8-channel", "int8", "int8-ct", "fp32")


def load_variant(model: str, variant: str, tmp: Path):
    from onegraph.graphs.load import load_model
    from onegraph.tools import quant_checkpoint
    if variant in ("fp8-channel", "int8-ct"):
        scheme = "fp8-channel" if variant == "fp8-channel" else "int8"
        d = tmp / f"{Path(str(model)).name}-{variant}"
        if not d.exists():
            quant_checkpoint.write(model, d, scheme)
        return load_model(d, "bfloat16")[1]
    dtype = "float32" if variant == "fp32" else "bfloat16"
    return load_model(model, dtype, quant={"bf16": "none", "fp32": "none"}.get(variant, variant))[1]


@torch.no_grad()
def scored_logits(model, windows: list[list[int]], ctx: int, rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """tools/eval.py's teacher-forced loop -> (logits [n, V] fp32 at every scored position, targets [n])."""
    from onegraph.runtime.executor import GraphExecutor, Sampling
    ex = GraphExecutor.from_model(model, {"decode": [rows], "prefill": [1]}, max_slots=rows, max_seq_len=ctx)
    greedy, out, tgt = Sampling(), [], []
    for g in range(0, len(windows), rows):
        group = windows[g:g + rows]
        for s, w in enumerate(group):
            out.append(ex.prefill(w[:1], s, greedy)[1][:1].float())
            tgt.append(w[1])
        for j in range(1, max(map(len, group)) - 1):
            live = [s for s, w in enumerate(group) if j + 1 < len(w)]
            lg = ex.decode([group[s][j] for s in live], live, [j] * len(live), [greedy] * len(live))[1]
            out.append(lg[:len(live)].float())
            tgt += [group[s][j + 1] for s in live]
    return torch.cat(out), torch.tensor(tgt)


def measure(model_spec: str, text: Path, max_tokens: int | None, ctx: int, tmp: Path) -> dict:
    from tokenizers import Tokenizer

    from onegraph.graphs.eager import generate_eager
    from onegraph.graphs.load import model_dir
    from onegraph.tools.eval import encode, token_windows
    tok_dir = model_dir(model_spec) if (model_dir(model_spec) / "tokenizer.json").is_file() else model_dir("tiny")
    ids, n_bytes = encode(Tokenizer.from_file(str(tok_dir / "tokenizer.json")), text.read_text(encoding="utf-8"),
                          max_tokens)
    windows = token_windows(ids, ctx)
    step = (len(ids) - PROMPT_LEN) // GREEDY_PROMPTS
    prompts = [ids[i * step: i * step + PROMPT_LEN] for i in range(GREEDY_PROMPTS)]
    res, ref_logits, ref_ids = {}, None, None
    for variant in VARIANTS:
        t0 = time.perf_counter()
        model = load_variant(model_spec, variant, tmp)
        logits, target = scored_logits(model, windows, ctx)
        nll = float(-torch.log_softmax(logits, -1).gather(1, target[:, None]).sum())
        greedy = [generate_eager(model, p, GREEDY_TOKENS, max_seq_len=PROMPT_LEN + GREEDY_TOKENS + 1).token_ids
                  for p in prompts]
        r = {"bits_per_byte": round(nll / math.log(2) / n_bytes, 5), "perplexity": round(math.exp(nll / len(target)), 5)}
        if variant == "bf16":
            ref_logits, ref_ids = logits, greedy
        else:
            d = logits - ref_logits
            first = [next((i for i, (a, b) in enumerate(zip(g, h)) if a != b), None) for g, h in zip(greedy, ref_ids)]
            r.update({"bits_per_byte_minus_bf16": round(r["bits_per_byte"] - res["bf16"]["bits_per_byte"], 5),
                      "logit_max_abs_diff": round(d.abs().max().item(), 4),
                      "logit_mean_abs_diff": round(d.abs().mean().item(), 5),
                      "logit_rel_rms": round((d.norm() / ref_logits.norm()).item(), 5),
                      "top1_agreement": round((logits.argmax(1) == ref_logits.argmax(1)).float().mean().item(), 5),
                      "greedy_same_tokens": f"{sum(a == b for g, h in zip(greedy, ref_ids) for a, b in zip(g, h))}"
                                            f"/{GREEDY_PROMPTS * GREEDY_TOKENS}",
                      "greedy_first_diff_step": first})
        r["seconds"] = round(time.perf_counter() - t0, 1)
        res[variant] = r
        print(model_spec, variant, r, flush=True)
    return {"model": str(model_spec), "tokens_scored": len(target), "bytes": n_bytes, "results": res}


def main(argv=None) -> int:
    from onegraph.tools.eval import DEFAULT_CTX, HELDOUT_TEXT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", action="append", default=None, help="float checkpoint dir or tiny (repeatable)")
    p.add_argument("--hf-case", action="append", default=[],
                   help="also a transformers-made random checkpoint: a tests/hf_models.py CASES name (repeatable)")
    p.add_argument("--hf-max-tokens", type=int, default=2048, help="--max-tokens for the --hf-case models")
    p.add_argument("--text", default=str(HELDOUT_TEXT))
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = {"what": __doc__, "command": "python -m onegraph.tools.quant_accuracy " + " ".join(argv or sys.argv[1:]),
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip(),
           "torch": torch.__version__, "threads": a.threads, "models": []}
    with tempfile.TemporaryDirectory(prefix="onegraph-qacc-") as tmp:
        for m in a.model or ["tiny"]:
            out["models"].append(measure(m, Path(a.text), a.max_tokens, a.ctx, Path(tmp)))
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        for case in a.hf_case:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            import hf_models
            d = Path(tmp) / f"hf-{case}"
            hf_models.build(case).save_pretrained(d)
            r = measure(str(d), Path(a.text), a.hf_max_tokens, a.ctx, Path(tmp))
            out["models"].append(dict(r, model=f"transformers {case} (tests/hf_models.py, seed 0, random weights)"))
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
