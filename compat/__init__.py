"""What cg_extract depends on in vLLM, recorded per release (vllm_surface.py)."""
