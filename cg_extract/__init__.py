"""CUDA-graph-enabled extract_hidden_states speculator for vLLM Model Runner V2."""

__version__ = "0.1.0"


def get_logger(module: str):
    """vLLM's logger for ``module``, named under vLLM's ``vllm`` logger tree
    so that vLLM's default logging config, which configures only that tree,
    prints our INFO lines as it prints its own."""
    from vllm.logger import init_logger

    return init_logger(f"vllm.{module}")
