"""CUDA-graph-enabled extract_hidden_states speculator for vLLM Model Runner V2."""

__version__ = "0.1.0"
