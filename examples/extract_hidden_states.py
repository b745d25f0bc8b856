"""Save the hidden states of layers 1-4 for two prompts, with cg_extract's
CUDA-graph write, and read them back.

    python examples/extract_hidden_states.py [MODEL] [OUT_DIR]

For a CUDA GPU with vllm==0.34.0 or 0.33.0 (README, "Status": not yet run
on one). On a CPU it cannot work: vLLM 0.32/0.33 run their V1 runner there,
without cg_extract, 0.34 refuses an x86 CPU without triton-cpu, and
ExampleHiddenStatesConnector needs CUDA (README, "Limits", "On a CPU").
"""

import sys

from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    load_hidden_states,
)


def main(model: str = "Qwen/Qwen3-8B", out_dir: str = "/tmp/hidden_states") -> None:
    llm = LLM(
        model=model,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}
            },
            "cudagraph": True,
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": out_dir},
        },
    )
    prompts = ["The capital of France is", "def fibonacci(n):"]
    for output in llm.generate(prompts, SamplingParams(max_tokens=1)):
        path = output.kv_transfer_params["hidden_states_path"]
        # Waits on the file's .lock until the connector has written it.
        saved = load_hidden_states(path)
        print(path, {name: tuple(t.shape) for name, t in saved.items()})


# vLLM starts its engine in a new process, which imports this file again.
if __name__ == "__main__":
    main(*sys.argv[1:])
