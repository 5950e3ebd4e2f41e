"""onegraph custom ops: one file per op (schema, validation, pure-torch reference, fake, lowerings).

Importing this package registers every op under `torch.ops.onegraph`.
"""
from ._registry import PYTHON_CALLS, REGISTRY, decompositions, schema_versions  # noqa: F401
from .add_rms_norm import add_rms_norm  # noqa: F401
from .add_rms_norm_linear import add_rms_norm_linear  # noqa: F401
from .add_rms_norm_linear_fp8 import add_rms_norm_linear_fp8  # noqa: F401
from .attention_decode import attention_decode  # noqa: F401
from .attention_prefill import attention_prefill  # noqa: F401
from .causal_conv_prefill import causal_conv_prefill  # noqa: F401
from .causal_conv_update import causal_conv_update  # noqa: F401
from .fused_moe import fused_moe  # noqa: F401
from .fused_moe_fp8 import fused_moe_fp8  # noqa: F401
from .gated_rms_norm import gated_rms_norm  # noqa: F401
from .gdn_decode_step import gdn_decode_step  # noqa: F401
from .gdn_decode_step_norm import gdn_decode_step_norm  # noqa: F401
from .gdn_decode_steps import gdn_decode_steps  # noqa: F401
from .gdn_prefill import gdn_prefill  # noqa: F401
from .linear import linear  # noqa: F401
from .linear_f32 import linear_f32  # noqa: F401
from .linear_fp8 import linear_fp8  # noqa: F401
from .linear_w8a8_fp8 import linear_w8a8_fp8  # noqa: F401
from .linear_w8a8_int8 import linear_w8a8_int8  # noqa: F401
from .rms_norm import rms_norm  # noqa: F401
from .qk_norm_rope import qk_norm_rope  # noqa: F401
from .rope import rope  # noqa: F401
from .sample import sample  # noqa: F401
