"""compressed-tensors checkpoints (the format llm-compressor writes): which configs load, as which scheme.

config.json `quantization_config` (field names as compressed-tensors 0.20 `QuantizationConfig` /
`QuantizationScheme` / `QuantizationArgs`, transformers' `CompressedTensorsConfig`, vLLM's
`CompressedTensorsW8A8Fp8` / `CompressedTensorsW8A8Int8`):
  {"quant_method": "compressed-tensors", "format": "float-quantized" | "int-quantized",
   "quantization_status": "compressed",
   "config_groups": {"group_0": {"targets": ["Linear"],
        "weights":           {"num_bits": 8, "type": "float" | "int", "strategy": "channel", "symmetric": true,
                              "dynamic": false, "group_size": null, "block_structure": null, ...},
        "input_activations": {"num_bits": 8, "type": <same>, "strategy": "token", "symmetric": true,
                              "dynamic": true, ...},
        "output_activations": null}},
   "ignore": ["lm_head", "re:.*mlp.gate$", ...], "kv_cache_scheme": null, "sparsity_config": null}
Tensors (naive/int/float-quantized compressor): `X.weight` int8 | float8_e4m3fn [N, K] and `X.weight_scale`
[N, 1] (the model dtype or fp32); `X.weight_zero_point` only for asymmetric weights, which are refused.
Two schemes load (checkpoint/quant.py SCHEMES): float 8-bit -> "fp8-channel", int 8-bit -> "int8". Which modules
are quantized is read from the tensors' dtypes, not from `targets` / `ignore`: a module the config ignores
has a float weight, and any other quantized weight the model does not run quantized is dequantized at load.
Everything else (static or per-tensor activation scales, group / block / tensor strategies, asymmetric
weights or activations, other bit widths and packed formats, weight-only schemes, kv-cache schemes,
sparsity or transforms) is refused with the field and value named.
"""
from __future__ import annotations

from onegraph.checkpoint.quant import FP8_CHANNEL, INT8, QuantError

METHOD = "compressed-tensors"
FORMATS = {"float-quantized": FP8_CHANNEL, "int-quantized": INT8}
# field -> required value, for weights and input_activations (type is checked against the format)
WEIGHTS = {"num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False, "group_size": None,
           "block_structure": None, "actorder": None}
ACTIVATIONS = {"num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True, "group_size": None,
               "block_structure": None}
TYPES = {FP8_CHANNEL: "float", INT8: "int"}
ABSENT = ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config")


def _args(group: dict, key: str, want: dict, scheme: str, where: str) -> None:
    args = group.get(key)
    if not isinstance(args, dict):
        raise QuantError(f"{where}.{key}={args!r}: supported a dict with {want} (weight-only and "
                         f"activation-only schemes are not supported)")
    for field, value in dict(want, type=TYPES[scheme]).items():
        got = args.get(field, value if field in ("group_size", "block_structure", "actorder") else None)
        if got != value:
            raise QuantError(f"{where}.{key}.{field}={got!r}: supported {value!r}")


def check_config(q: dict, where: str) -> str:
    """A compressed-tensors quantization_config -> its scheme ("fp8-channel" | "int8"), or QuantError naming
    the first field this loader does not read exactly."""
    where = f"{where} quantization_config"
    fmt = q.get("format")
    if fmt not in FORMATS:
        raise QuantError(f"{where} format={fmt!r}: supported {sorted(FORMATS)} (8-bit weights stored unpacked)")
    scheme = FORMATS[fmt]
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantError(f"{where} quantization_status={status!r}: supported 'compressed'")
    for field in ABSENT:
        if q.get(field) not in (None, {}):
            raise QuantError(f"{where} {field}={q.get(field)!r}: supported null")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantError(f"{where} config_groups={groups!r}: supported one or more groups")
    for name, group in groups.items():
        at = f"{where} config_groups.{name}"
        if not isinstance(group, dict):
            raise QuantError(f"{at}={group!r}: supported a scheme dict")
        if group.get("format") not in (None, fmt):
            raise QuantError(f"{at}.format={group.get('format')!r}: supported {fmt!r} (the config's format)")
        _args(group, "weights", WEIGHTS, scheme, at)
        _args(group, "input_activations", ACTIVATIONS, scheme, at)
        if group.get("output_activations") is not None:
            raise QuantError(f"{at}.output_activations={group['output_activations']!r}: supported null")
    return scheme
