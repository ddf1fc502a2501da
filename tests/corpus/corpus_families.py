"""The corpus's model families: a tiny config per family and where its projections live.

Every entry builds a transformers model from a config with random weights (no model hub). The projection
specs say where the MLP's up / gate / down weights and the attention's query / output weights are, by a
regular expression on the parameter name, so the zero variants (tests/corpus/variants.py) can be derived
from one export per exporter.

Family list: the dense decoder families people export (Llama-like, GPT-2, GPT-NeoX, GPT-J, Phi-3, ...),
one encoder (BERT), and every MoE family named in issue 8 plus the remaining causal-LM MoE families of
transformers 5.24 with a plain decoder stack. Multimodal, hybrid (Mamba / linear attention) and
encoder-decoder families are not in it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

__all__ = ["FAMILIES", "Family", "Proj", "family_hash"]


@dataclasses.dataclass(frozen=True)
class Proj:
    """A projection weight: ``pattern`` matches its parameter name without ``.weight`` / ``.bias``.

    ``conv1d``: GPT-2's ``Conv1D`` stores ``[in, out]`` (a Linear stores ``[out, in]``). ``offset`` /
    ``size``: a block of a fused weight (Phi-3's ``gate_up_proj``, a fused qkv) along the output axis.
    """

    pattern: str
    conv1d: bool = False
    offset: int = 0
    size: int | None = None

    @property
    def out_axis(self) -> int:
        return 1 if self.conv1d else 0

    @property
    def in_axis(self) -> int:
        return 0 if self.conv1d else 1


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config: str  # the transformers config class
    kwargs: dict[str, Any]
    moe: bool = False
    rotary: bool = True
    encoder: bool = False  # built with AutoModel (no LM head); its output is the last hidden state
    up: Proj | None = None
    gate: Proj | None = None
    down: Proj | None = None
    query: Proj | None = None
    out: Proj | None = None
    bias: bool = False  # the MLP projections have biases
    head_dim: int = 16
    intermediate: int = 128
    rotary_table: str | None = None  # a precomputed [positions, sin | cos] buffer instead of inv_freq (GPT-J)
    # transformers' experts implementation the MoE export uses; "dense_scatter_einsum" (corpus_export) computes
    # every expert on every token and combines them with a scattered routing matrix and an Einsum.
    experts: str = "batched_mm"


HIDDEN = 64
INTER = 128
HEADS = 4
HEAD_DIM = 16
VOCAB = 256

_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_BASE: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "use_cache": False,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_MOE: dict[str, Any] = {
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
}

_LLAMA_MLP = {
    "up": Proj(r"mlp\.up_proj"),
    "gate": Proj(r"mlp\.gate_proj"),
    "down": Proj(r"mlp\.down_proj"),
}
_LLAMA_ATTN = {"query": Proj(r"self_attn\.q_proj"), "out": Proj(r"self_attn\.o_proj")}


def _llama_like(name: str, config: str, **kwargs: Any) -> Family:
    return Family(name, config, {**_BASE, **kwargs}, **_LLAMA_MLP, **_LLAMA_ATTN)


def _moe(name: str, config: str, **kwargs: Any) -> Family:
    return Family(name, config, {**_BASE, **_MOE, **kwargs}, moe=True, **_LLAMA_ATTN)


_DENSE = [
    _llama_like("llama", "LlamaConfig"),
    _llama_like("mistral", "MistralConfig", sliding_window=None),
    _llama_like("qwen2", "Qwen2Config"),
    _llama_like("qwen3", "Qwen3Config"),
    _llama_like("gemma", "GemmaConfig"),
    _llama_like("gemma2", "Gemma2Config", sliding_window=64, query_pre_attn_scalar=16),
    _llama_like("olmo2", "Olmo2Config"),
    _llama_like("granite", "GraniteConfig"),
    _llama_like("stablelm", "StableLmConfig", partial_rotary_factor=0.5),
    Family(
        "phi3",
        "Phi3Config",
        {**_BASE},
        up=Proj(r"mlp\.gate_up_proj", offset=INTER, size=INTER),
        gate=Proj(r"mlp\.gate_up_proj", offset=0, size=INTER),
        down=Proj(r"mlp\.down_proj"),
        query=Proj(r"self_attn\.qkv_proj", size=HEADS * HEAD_DIM),
        out=Proj(r"self_attn\.o_proj"),
    ),
    Family(
        "gpt_neox",
        "GPTNeoXConfig",
        {**_BASE, "rotary_pct": 0.5},
        up=Proj(r"mlp\.dense_h_to_4h"),
        down=Proj(r"mlp\.dense_4h_to_h"),
        # query_key_value is laid out [heads, 3, head_dim]: head 0's query is the first head_dim rows.
        query=Proj(r"attention\.query_key_value", size=3 * HEADS * HEAD_DIM),
        out=Proj(r"attention\.dense"),
        bias=True,
    ),
    Family(
        "gptj",
        "GPTJConfig",
        {"n_embd": HIDDEN, "n_inner": INTER, "n_layer": 2, "n_head": HEADS, "rotary_dim": 8, "vocab_size": VOCAB,
         "n_positions": 128, "use_cache": False, "tie_word_embeddings": False, **_TOKENS},
        up=Proj(r"mlp\.fc_in"),
        down=Proj(r"mlp\.fc_out"),
        query=Proj(r"attn\.q_proj"),
        out=Proj(r"attn\.out_proj"),
        bias=True,
        rotary_table="embed_positions",
    ),
    Family(
        "gpt2",
        "GPT2Config",
        {"n_embd": HIDDEN, "n_inner": INTER, "n_layer": 2, "n_head": HEADS, "vocab_size": VOCAB, "n_positions": 128,
         "use_cache": False, "tie_word_embeddings": False, **_TOKENS},
        rotary=False,
        up=Proj(r"mlp\.c_fc", conv1d=True),
        down=Proj(r"mlp\.c_proj", conv1d=True),
        query=Proj(r"attn\.c_attn", conv1d=True, size=3 * HIDDEN),
        out=Proj(r"attn\.c_proj", conv1d=True),
        bias=True,
    ),
    Family(
        "bert",
        "BertConfig",
        {**_BASE, "type_vocab_size": 2},
        rotary=False,
        encoder=True,
        up=Proj(r"intermediate\.dense"),
        down=Proj(r"layer\.\d+\.output\.dense"),
        query=Proj(r"attention\.self\.query"),
        out=Proj(r"attention\.output\.dense"),
        bias=True,
    ),
]

_MOES = [
    _moe("mixtral", "MixtralConfig", sliding_window=None),
    _moe("qwen2_moe", "Qwen2MoeConfig"),
    _moe("qwen3_moe", "Qwen3MoeConfig"),
    _moe("olmoe", "OlmoeConfig"),
    _moe("minimax", "MiniMaxConfig", layer_types=["full_attention", "full_attention"], block_size=16),
    _moe("hunyuan_v1_moe", "HunYuanMoEV1Config", moe_topk=2, num_shared_expert=1),
    _moe("flex_olmo", "FlexOlmoConfig"),
    _moe("granitemoe", "GraniteMoeConfig"),
    _moe("granitemoeshared", "GraniteMoeSharedConfig"),
    _moe("jetmoe", "JetMoeConfig", kv_channels=16, num_key_value_heads=4),
    _moe("gpt_oss", "GptOssConfig", sliding_window=64, layer_types=["sliding_attention", "full_attention"]),
    _moe("deepseek_v2", "DeepseekV2Config", kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
         qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, topk_method="greedy"),
    _moe("deepseek_v3", "DeepseekV3Config", kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
         qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=8),
    _moe("glm4_moe", "Glm4MoeConfig"),
    _moe("dots1", "Dots1Config"),
    _moe("ernie4_5_moe", "Ernie4_5_MoeConfig", moe_num_experts=4, moe_k=2, moe_layer_start_index=0,
         moe_num_shared_experts=1),
    _moe("phimoe", "PhimoeConfig", sliding_window=None),
    _moe("llama4", "Llama4TextConfig", intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
         interleave_moe_layer_step=1, no_rope_layers=[1, 1], attention_chunk_size=64),
]

# Issue 20's MoE shapes, each a corpus family of its own:
# - qwen3_moe_dense: Qwen3-MoE's experts on every token, combined through a [T, E] routing matrix scattered from
#   the top-k weights (corpus_export's "dense_scatter_einsum" experts; TorchScript builds the matrix's zeros from
#   Shape(x)[0]);
# - llama4_nope: Llama 4's router (top-k of the logits, then a sigmoid of the k values) and its experts reading
#   their tokens scaled by the routing weight; without RoPE layers (the llama4 family above has them: its complex
#   rotary is exported as real arithmetic, layerzero.hf_rotary);
# - jetmoe_wide: JetMoE with one expert's gate/up weight past the constant folding limit (1 << 20 elements), so
#   each sorted expert's `self.weight[i]` stays a `select` (Gather) of the stacked parameter.
_ISSUE20 = [
    dataclasses.replace(next(f for f in _MOES if f.name == "qwen3_moe"), name="qwen3_moe_dense",
                        experts="dense_scatter_einsum"),
    dataclasses.replace(next(f for f in _MOES if f.name == "llama4"), name="llama4_nope", rotary=False,
                        kwargs={**next(f for f in _MOES if f.name == "llama4").kwargs, "no_rope_layers": [0, 0]}),
    dataclasses.replace(next(f for f in _MOES if f.name == "jetmoe"), name="jetmoe_wide",
                        kwargs={**next(f for f in _MOES if f.name == "jetmoe").kwargs, "intermediate_size": 8256}),
]  # fmt: skip

FAMILIES: dict[str, Family] = {f.name: f for f in _DENSE + _MOES + _ISSUE20}


def family_hash(family: Family) -> str:
    """A short hash of what builds the family's export: a changed config makes a new cache entry."""
    what: dict[str, Any] = {"config": family.config, "kwargs": family.kwargs, "encoder": family.encoder}
    if family.experts != "batched_mm":  # the default stays out of the hash: cached exports keep their keys
        what["experts"] = family.experts
    text = json.dumps(what, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]
