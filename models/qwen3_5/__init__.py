"""Qwen3.5 / Qwen3.6 (MoE and dense): Gated DeltaNet + gated full attention, explicit state, MTP head."""
from onegraph.models import Family
from onegraph.models.qwen3_5.config import DENSE_TYPES, MOE_TYPES, ModelConfig
from onegraph.models.qwen3_5.fuse import fuse_projections, projection_groups
from onegraph.models.qwen3_5.model import Qwen35Model
from onegraph.models.qwen3_5.mtp import attach_mtp
from onegraph.models.qwen3_5.tp import check_divisible, shard_state_dict

FAMILY = Family("qwen3_5", MOE_TYPES + DENSE_TYPES, ModelConfig, Qwen35Model, shard_state_dict, check_divisible,
                fuse_projections, attach_mtp, projection_groups)
