"""CI run of the decoder fuzzer (``decoders.py``): two seeded random configs exported with a KV cache, compiled
float, int4 native and int4 native + activation sparsity, generated with and without the cache buffers; the float
ids equal transformers' own. The long run is ``python -m tests.fuzz.decoders --cases 24``."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.fuzz.decoders import FAMILIES, MOE_FAMILIES, VARIANTS, check, config_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("seed", [2, 14])  # Llama (dynamo, 2 heads over 1, hidden 32) and Qwen2 (TorchScript)
def test_random_decoders_export_compile_and_generate(seed: int) -> None:
    variants = (VARIANTS[0], VARIANTS[2], VARIANTS[5])
    failures = check(seed, variants)
    assert not failures, "\n".join(failures)


def test_configs_are_seeded_and_span_the_families() -> None:
    assert config_for(5) == config_for(5)
    drawn = {config_for(seed)[0] for seed in range(40)}
    assert drawn == set(FAMILIES)
    assert {config_for(seed)[2] for seed in range(40)} == {"dynamo", "torchscript"}
    for seed in range(40):
        _, kwargs, _ = config_for(seed)
        assert kwargs["num_attention_heads"] % kwargs["num_key_value_heads"] == 0


def test_moe_configs_draw_the_moe_families_and_build() -> None:
    import transformers

    drawn = {config_for(seed, moe=True)[0] for seed in range(40)}
    assert drawn == set(MOE_FAMILIES)
    for seed in range(8):
        family, kwargs, _ = config_for(seed, moe=True)
        config = getattr(transformers, family)(**kwargs)
        assert config.num_experts_per_tok in (1, 2, 3)
