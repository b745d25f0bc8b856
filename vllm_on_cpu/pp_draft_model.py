"""STAND-IN for vLLM's own speculator across pipeline stages, which vLLM
refuses: the plugin's draft model (vLLM's, declaring ``SupportsPP``) naming
no speculator of ours, so that vLLM 0.34 builds its own class with it
(:func:`vllm_on_cpu.engine.install_pp_stand_ins`)."""

from cg_extract import draft_model


class ExtractHiddenStatesModel(draft_model.ExtractHiddenStatesModel):
    speculator_config_class = None  # vLLM's own speculator config's class
