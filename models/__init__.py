"""Builders of example models (zero-flagged transformer, ...) used by the demo, tests and benchmarks."""

from __future__ import annotations

from layerzero.models.transformer import (
    TransformerConfig,
    build_transformer,
    example_feeds,
    parameter_count,
    reference_forward,
)

__all__ = [
    "TransformerConfig",
    "build_transformer",
    "example_feeds",
    "parameter_count",
    "reference_forward",
]
