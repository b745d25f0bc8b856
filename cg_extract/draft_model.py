"""The draft model of ``extract_hidden_states``, as the plugin registers it.

vLLM builds the draft of ``extract_hidden_states`` from the architecture
``ExtractHiddenStatesModel``, which it looks up in its model registry. The
plugin registers this class under that name (``ModelRegistry.register_model``,
the documented way for a plugin to give vLLM a model class), and the class
declares two things vLLM reads from the registry:

* **which speculator runs it** (vLLM 0.34 on). vLLM builds the speculator
  that ``speculative_config.speculator_config.speculator_class`` names, and
  takes that config class from the draft model's declared
  ``speculator_config_class`` when it subclasses the method's own. Ours
  names :class:`cg_extract.speculator.ExtractHiddenStatesSpeculator`, for
  every ``extract_hidden_states`` config, with or without our keys.
* **that it runs under pipeline parallelism.** The speculative config gives
  this draft the target's parallel config and checks its architecture for
  ``SupportsPP``. The draft has no layers to split: it lives on the last
  stage, as every draft model does, and never receives intermediate tensors
  (:mod:`cg_extract.pipeline_parallel`).

The model itself is vLLM's, unchanged.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.extract_hidden_states import (
    ExtractHiddenStatesModel as VllmExtractHiddenStatesModel,
)
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.sequence import IntermediateTensors

try:  # vLLM 0.34: the speculator is chosen through the draft's config class
    from cg_extract.speculator_config import ExtractHiddenStatesSpeculatorConfig
except ImportError:  # vLLM 0.32, 0.33: cg_extract.plugin chooses it
    ExtractHiddenStatesSpeculatorConfig = None  # type: ignore[assignment,misc]


class ExtractHiddenStatesModel(VllmExtractHiddenStatesModel, SupportsPP):
    if ExtractHiddenStatesSpeculatorConfig is not None:
        speculator_config_class = ExtractHiddenStatesSpeculatorConfig

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> None:
        # Only the last stage has a draft; nothing reaches it between stages.
        assert intermediate_tensors is None
        super().forward(hidden_states)

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        return IntermediateTensors({})
