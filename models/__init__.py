"""Builders of example models (zero-flagged transformer, MoE blocks, ...) used by the demo, tests and benchmarks."""

from __future__ import annotations

from layerzero.models.gated import build_gated_model, gated_feeds
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds, moe_layer_weights, moe_parameter_count
from layerzero.models.routed_groups import build_routed_example, routed_feeds
from layerzero.models.transformer import (
    TransformerConfig,
    build_transformer,
    example_feeds,
    parameter_count,
    reference_forward,
)

__all__ = [
    "MoEConfig",
    "TransformerConfig",
    "build_gated_model",
    "build_moe",
    "build_routed_example",
    "build_transformer",
    "example_feeds",
    "gated_feeds",
    "moe_feeds",
    "moe_layer_weights",
    "moe_parameter_count",
    "parameter_count",
    "reference_forward",
    "routed_feeds",
]
