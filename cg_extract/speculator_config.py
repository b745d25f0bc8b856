"""Our speculator's config class for vLLM 0.34's speculator lookup.

vLLM 0.34's ``init_speculator`` builds the class named by
``speculative_config.speculator_config.speculator_class``. This is vLLM's
config of ``extract_hidden_states`` with that one name changed; the draft
model declares it (:mod:`cg_extract.draft_model`), so setup and behaviour stay
vLLM's. Imported in every process that builds a config: it must not import
the speculator.
"""

from vllm.v1.worker.gpu.spec_decode.extract_hidden_states_config import (
    ExtractHiddenStatesSpeculatorConfig as VllmExtractHiddenStatesSpeculatorConfig,
)


class ExtractHiddenStatesSpeculatorConfig(VllmExtractHiddenStatesSpeculatorConfig):
    speculator_class = "cg_extract.speculator.ExtractHiddenStatesSpeculator"
