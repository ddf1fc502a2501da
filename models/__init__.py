"""Builders of example models (zero-flagged transformer, ...) used by the demo, tests and benchmarks."""

from __future__ import annotations

from layerzero.models.gated import build_gated_model, gated_feeds
from layerzero.models.routed_groups import build_routed_example, routed_feeds
from layerzero.models.transformer import (
    TransformerConfig,
    build_transformer,
    example_feeds,
    parameter_count,
    reference_forward,
)

__all__ = [
    "TransformerConfig",
    "build_gated_model",
    "build_routed_example",
    "build_transformer",
    "example_feeds",
    "gated_feeds",
    "parameter_count",
    "reference_forward",
    "routed_feeds",
]
