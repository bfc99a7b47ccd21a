"""Tiny random models of the popular decoder families, built from the installed transformers' configs.

Each uses SmolLM2's vocabulary (so the real tokenizer and templates apply) and sets the family's
distinguishing features to values that matter at this size: a sliding window shorter than the test
samples, soft-caps small enough for tanh to bend, logit scales far from 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

WINDOW = 5
"""Sliding window of the windowed families: shorter than every test sample."""

DELTA_NET: dict[str, Any] = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"],
}
"""Gated delta-net linear attention in the first layer, full attention in the second."""

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "phi3": ("Phi3Config", {"sliding_window": WINDOW, "pad_token_id": 0}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "final_logit_softcapping": 0.5,
            "attn_logit_softcapping": 1.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "final_logit_softcapping": 0.5,
            "sliding_window_pattern": 2,
        },
    ),
    "cohere": ("CohereConfig", {"logit_scale": 0.25}),
    "cohere2": ("Cohere2Config", {"logit_scale": 0.25, "sliding_window": WINDOW}),
    "granite": ("GraniteConfig", {"logits_scaling": 8.0}),
    "phi": ("PhiConfig", {}),
    "falcon_h1": (
        "FalconH1Config",
        {
            "lm_head_multiplier": 3.0,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_chunk_size": 8,
        },
    ),
    "gpt2": (  # Conv1D layers; dropout off so that train-mode passes are comparable
        "GPT2Config",
        {
            "n_inner": 96,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    ),
    "llama4": (  # MoE with a shared expert and a router that is not a plain linear layer
        "Llama4TextConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 96,
            "head_dim": 16,
            "attention_chunk_size": WINDOW,
        },
    ),
    "phimoe": (  # its sliding window is applied through the attention mask only; router not linear
        "PhimoeConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "router_jitter_noise": 0.0,
        },
    ),
    "seed_oss": (  # residual dropout off: train-mode passes comparable (with it, the fused MLP falls back)
        "SeedOssConfig",
        {"head_dim": 16, "residual_dropout": 0.0, "attention_dropout": 0.0},
    ),
    "mixtral": (
        "MixtralConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
        },
    ),
    "deepseek_v3": (  # dense first layer and shared experts named like the experts peft rewrites
        "DeepseekV3Config",
        {
            "n_routed_experts": 4,
            "num_key_value_heads": 4,  # MLA: as many key heads as query heads
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            **DELTA_NET,
        },
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": (  # dense first layer and shared experts, as DeepSeek
        "Glm4MoeConfig",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "head_dim": 16,
        },
    ),
    "smollm3": ("SmolLM3Config", {"pad_token_id": 0}),  # every fourth layer without rotary embeddings
    "starcoder2": (
        "Starcoder2Config",
        {"sliding_window": WINDOW, "residual_dropout": 0.0, "embedding_dropout": 0.0},
    ),
    "gpt_oss": (  # attention sinks, alternating sliding window, clamped SwiGLU experts
        "GptOssConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "qwen3_5": (  # gated delta-net linear attention and full attention
        "Qwen3_5TextConfig",
        DELTA_NET,
    ),
    "granitemoehybrid": (  # Granite 4: Mamba-2 layers and attention, MoE with a shared MLP
        "GraniteMoeHybridConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 96,
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_chunk_size": 8,
            "logits_scaling": 8.0,
        },
    ),
    "lfm2": (  # short gated convolutions and attention
        "Lfm2Config",
        {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    ),
    "jamba": (  # Mamba layers, attention, MoE
        "JambaConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "use_mamba_kernels": False,
            "mamba_d_state": 8,
        },
    ),
    "gemma3n": (  # AltUp, Laurel, per-layer embeddings, KV sharing
        "Gemma3nTextConfig",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 0.5,
            "vocab_size_per_layer_input": 128,
            "hidden_size_per_layer_input": 8,
            "laurel_rank": 8,
            "num_kv_shared_layers": 0,
            "activation_sparsity_pattern": [0.0, 0.0],
        },
    ),
    "gemma4": (
        "Gemma4TextConfig",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 0.5,
            "num_kv_shared_layers": 0,
        },
    ),
    "falcon": (  # Falcon-7B's layout: every layer a FalconLinear (an nn.Linear subclass with its own forward)
        "FalconConfig",
        {"ffn_hidden_size": 96, "multi_query": True, "parallel_attn": True},
    ),
}


def tiny_config(name: str, vocab_size: int) -> Any:
    """The config of family ``name`` (of :data:`FAMILIES`) at the tiny size."""
    import transformers

    config_class, extra = FAMILIES[name]
    config = getattr(transformers, config_class)(vocab_size=vocab_size, **{**COMMON, **extra})
    config.tie_word_embeddings = False
    return config


def meta_model(name: str, vocab_size: int) -> torch.nn.Module:
    """The skeleton of a tiny model of family ``name`` on the meta device: names and shapes, no weights
    (what a config-time check sees)."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(tiny_config(name, vocab_size))


def tiny_model(name: str, vocab_size: int) -> torch.nn.Module:
    """A tiny random model of family ``name`` (of :data:`FAMILIES`)."""
    import transformers

    config = tiny_config(name, vocab_size)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # spread the head's weights so the logit transforms bend
        model.get_output_embeddings().weight.normal_(0.0, 0.2)
        for p in model.parameters():  # a scale that starts at zero (Gemma 3n's AltUp) cuts a path
            if p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.1)
    return model


def build_family(name: str, vocab_size: int, path: Path) -> Path:
    """Save a tiny random model of family ``name`` to ``path`` and return it."""
    tiny_model(name, vocab_size).save_pretrained(path)
    return path


LABELS = {
    "llama": "Llama",
    "qwen2": "Qwen2 (sliding window)",
    "mistral": "Mistral",
    "phi3": "Phi-3 (fused `qkv_proj`, `gate_up_proj`)",
    "gemma": "Gemma",
    "gemma2": "Gemma 2",
    "gemma3": "Gemma 3 text",
    "cohere": "Cohere",
    "cohere2": "Cohere 2",
    "granite": "Granite",
    "phi": "Phi-2 (lm_head bias)",
    "falcon_h1": "Falcon-H1 (attention + Mamba-2)",
    "gpt2": "GPT-2 (`Conv1D`)",
    "llama4": "Llama 4 text (MoE, shared expert, chunked attention)",
    "phimoe": "PhiMoE",
    "seed_oss": "Seed-OSS",
    "mixtral": "Mixtral (MoE, router loss)",
    "deepseek_v3": "DeepSeek-V3 (MLA, MoE, dense first layer, shared experts)",
    "qwen3_next": "Qwen3-Next (gated delta-net + attention, MoE, shared expert)",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "olmoe": "OLMoE",
    "glm4_moe": "GLM-4.5 MoE (dense first layer, shared experts)",
    "smollm3": "SmolLM3 (NoPE layers)",
    "starcoder2": "StarCoder2",
    "gpt_oss": "GPT-OSS (attention sinks, MoE)",
    "qwen3_5": "Qwen3.5 text (gated delta-net + attention)",
    "granitemoehybrid": "Granite 4 (Mamba-2 + attention, MoE, shared MLP)",
    "lfm2": "LFM2 (short convolutions + attention)",
    "jamba": "Jamba (Mamba + attention, MoE)",
    "gemma3n": "Gemma 3n text (AltUp, Laurel, per-layer inputs)",
    "gemma4": "Gemma 4 text",
    "falcon": "Falcon (`FalconLinear`, multi-query, parallel attention)",
}
"""How the support matrix of docs/models.md names each family."""

NO_PACKING = {  # refused by the build check: a packed row is not its samples run alone
    "falcon_h1": "Mamba state",
    "granitemoehybrid": "Mamba state",
    "jamba": "Mamba state",
    "llama4": "chunks applied through the mask",
    "phimoe": "window applied through the mask",
    "qwen3_next": "delta-net state",
    "qwen3_5": "delta-net state",
    "lfm2": "convolution state",
}
MOE = {
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "granitemoehybrid",
    "jamba",
    "llama4",
    "mixtral",
    "olmoe",
    "phimoe",
    "qwen3_moe",
    "qwen3_next",
}
BY_WEIGHT = {"deepseek_v3", "glm4_moe", "qwen3_next"}
"""Dense MLPs or shared experts named like the experts peft rewrites: adapted through their weight."""
LEFT_OUT = {  # by the build-time rules of lit_instruct.models.lora_targets
    "falcon_h1": ("mamba.out_proj",),  # the fused Mamba kernels read the weight
    "granitemoehybrid": ("mamba.out_proj",),
    "gemma3n": ("altup.correction_coefs",),  # read by its parent in training
    "jamba": ("mamba.dt_proj",),  # read by its parent
    "llama4": (".router",),  # not a plain linear layer
    "phimoe": (".router",),
}
LINEAR_SUBCLASSES = {"falcon": "FalconLinear"}
"""Families whose linear layers are an ``nn.Linear`` subclass with a forward of its own (a plain
linear map, so adapted)."""
SHARP = {  # fp32 rounding of reordered sums passes 1e-5 relative in some LoRA gradients, packed vs
    # padded; in float64 they agree to 1e-14, so packing is tested there, and the loss at 1e-4
    "gemma4",  # 2.8e-5: attention logits of RMS-normed q and k, unscaled
    "starcoder2",  # 1.4e-5
}
