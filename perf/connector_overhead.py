"""Host time a graph step spends on KV-connector hooks, with and without a
connector.

After each replay the speculator runs the cache-only layer's hooks on the host
(a forward context and vLLM's ``dummy_attention``) when a KV transfer group
exists, and nothing when none does. This prints the median host time of:

* ``hooks``: that post-replay part alone, as a graph step on a GPU adds it;
* ``step``: a whole copy-in graph step (``propose``), on the chosen backend.

each with no connector and with ``ExampleHiddenStatesConnector`` (its hooks
are no-ops) created the worker's way, metadata bound as during a step.

    python perf/connector_overhead.py [--backend emulated|cuda] [--tokens 8]

On the ``emulated`` backend a replay re-runs the step under inspection, so
``step`` figures there are not a GPU's; ``hooks`` figures are host Python
either way.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import tempfile

import torch

from perf.measure import time_steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="emulated", choices=["emulated", "cuda"])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args(argv)

    from vllm.config.compilation import CUDAGraphMode

    from cg_extract.speculator import ExtractHiddenStatesSpeculator
    from vllm_on_cpu.harness import (
        attach_target_graph_outputs,
        build_vllm_config,
        load_speculator,
        make_step_inputs,
        single_process_group,
        worker_connector,
        write_model_dir,
    )
    from vllm_on_cpu.hidden_states_connector import (
        ExampleHiddenStatesConnector,
        kv_transfer_config,
    )

    device = torch.device("cuda" if args.backend == "cuda" else "cpu")
    tmp = Path(tempfile.mkdtemp())
    model_dir = write_model_dir(tmp / "model")
    kv = kv_transfer_config(tmp / "states", ExampleHiddenStatesConnector)
    keys = dict(
        cudagraph=True,
        cudagraph_backend=args.backend,
        cudagraph_capture_sizes=[args.tokens],
    )
    cfg = build_vllm_config(model_dir, engine_args={"kv_transfer_config": kv}, **keys)
    loaded = load_speculator(ExtractHiddenStatesSpeculator, cfg, device, num_blocks=16)
    spec = loaded.speculator
    # Kept alive: the plugin holds the target's buffers by weak reference only.
    _target = attach_target_graph_outputs(loaded, [args.tokens])
    spec.init_cudagraph_manager(CUDAGraphMode.FULL)
    spec.capture()
    inputs = make_step_inputs(loaded, args.tokens, torch.Generator().manual_seed(0))
    kw = inputs.kwargs
    slots = kw["slot_mappings"][loaded.layer_name][: args.tokens]
    is_padding = kw["input_batch"].is_padding[: args.tokens]

    def hooks() -> None:  # what propose runs after graphs.run
        from vllm.distributed.kv_transfer import has_kv_transfer_group

        if has_kv_transfer_group():
            with spec._step_context(kw["attn_metadata"], slots, is_padding, None):
                spec._run_connector_hooks()

    def step() -> None:
        spec.propose(**kw)

    def measure(label: str) -> None:
        for name, fn in (("hooks", hooks), ("step", step)):
            for _ in range(50):
                fn()
            median = time_steps(fn, args.iters, device).host_median_us
            print(f"{name:6s} {label:34s} {median:9.2f} us (median of {args.iters})")

    measure("no KV transfer group")
    with single_process_group(cfg), worker_connector(loaded) as connectors:
        connectors.bind()
        assert connectors.worker.kv_connector.has_connector_metadata()
        measure("ExampleHiddenStatesConnector")
    stats = spec.cudagraph_stats()
    print(
        f"backend {args.backend}, {args.tokens} tokens; steps replayed: "
        f"{stats['replays']}, eager: {stats['eager_steps']}"
    )


if __name__ == "__main__":
    main()
