"""A Llama whose residual stream between decoder layers is kept in another
dtype than the engine's, so the aux hidden states vLLM's own model code
captures (``hidden_states + residual`` after a layer) arrive in that dtype.

Models that keep the residual stream, or some layers, in another precision
hand ``propose`` such states; vLLM's speculator stacks them and copies the
stack into its buffer of the model's dtype. The families suite runs two
(:data:`tests.model_families.FAMILIES`): bfloat16 states in a float32 engine
and float32 states in a bfloat16 one.

Each layer computes in the engine's dtype (its weights') and emits its
hidden states and residual in its entry of the config's
``residual_dtypes``; the layers past the list (the last) emit the engine's
dtype, so the final norm and the LM head are vLLM's as they are. Registered with vLLM's ``ModelRegistry`` by
:func:`register` in the process that builds the engine (the families
suite's engine core and worker run in it).
"""

from __future__ import annotations

import torch
from vllm import ModelRegistry
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

ARCHITECTURE = "ResidualDtypeLlamaForCausalLM"


class ResidualDtypeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        emits = vllm_config.model_config.hf_config.residual_dtypes
        index = extract_layer_index(prefix)
        self.compute_dtype = vllm_config.model_config.dtype
        self.emit_dtype = (
            getattr(torch, emits[index]) if index < len(emits) else self.compute_dtype
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.to(self.compute_dtype)
        if residual is not None:
            residual = residual.to(self.compute_dtype)
        hidden_states, residual = super().forward(positions, hidden_states, residual)
        return hidden_states.to(self.emit_dtype), residual.to(self.emit_dtype)


class ResidualDtypeLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(
            vllm_config=vllm_config,
            prefix=prefix,
            layer_type=ResidualDtypeDecoderLayer,
        )


def register() -> None:
    ModelRegistry.register_model(ARCHITECTURE, ResidualDtypeLlamaForCausalLM)
