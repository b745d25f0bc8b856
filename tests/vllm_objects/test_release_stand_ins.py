"""What ``vllm_on_cpu/site/sitecustomize.py`` does for the runs on vLLM 0.33.0
and 0.34.0 (``make test``'s later sessions, compat/release_on_cpu.py): a process that
imports another vLLM than ``CG_EXTRACT_EXPECT_VLLM`` names fails; and the JIT
warm-up stand-in, with the interpreter bug that makes it needed."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from vllm_on_cpu.engine import SITE, target_graphs_kwargs
from vllm_on_cpu.harness import vllm_release

EXPECT = "CG_EXTRACT_EXPECT_VLLM"


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python whose start-up runs the rig's sitecustomize."""
    base = {
        k: v for k, v in os.environ.items() if k not in (EXPECT, "TRITON_INTERPRET")
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, "PYTHONPATH": str(SITE), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_process_that_imports_another_vllm_fails():
    other = "0.32.0" if vllm_release() != "0.32.0" else "0.33.0"
    wrong = run("import vllm", **{EXPECT: other})
    assert wrong.returncode != 0
    assert f"{EXPECT}={other} but this process imported vllm {vllm_release()}" in (
        wrong.stderr
    )
    right = run("import vllm; print(vllm.__version__)", **{EXPECT: vllm_release()})
    assert right.returncode == 0, right.stderr[-2000:]
    assert right.stdout.split() == [vllm_release()]


CONFIG = """
    import json
    from vllm.engine.arg_utils import EngineArgs
    cfg = EngineArgs(model={model!r}, load_format="dummy", skip_tokenizer_init=True,
                     dtype="float32", **{graphs!r}).create_engine_config()
    print(json.dumps(cfg.kernel_config.enable_jit_warmup))
"""


def test_the_jit_warmup_is_off_only_where_triton_is_interpreted(model_dir):
    """An engine with graphs (not enforce_eager) keeps vLLM's JIT warm-up
    (0.33's CPU worker runs it), except in the rig's CPU engines. vLLM 0.34
    starts on an x86 CPU only with a Triton ``cpu`` backend: without the
    stand-in, vLLM refuses the config."""
    code = CONFIG.format(model=str(model_dir), graphs=target_graphs_kwargs("FULL"))
    outcomes = {}
    for interpret in ("0", "1"):
        proc = run(code, TRITON_INTERPRET=interpret, VLLM_PLUGINS="")
        if "vLLM on x86 CPUs requires Triton (triton-cpu)." in proc.stderr:
            outcomes[interpret] = "refused"
            continue
        assert proc.returncode == 0, proc.stderr[-3000:]
        outcomes[interpret] = proc.stdout.split()[-1]
    without = "refused" if vllm_release() == "0.34.0" else "true"
    assert outcomes == {"0": without, "1": "false"}


INTERPRETER_BUG = """
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton, triton.language as tl

    @triton.jit
    def store_where(out_ptr, n, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
        active = tl.program_id(0) < LIMIT  # a scalar comparison, as in vLLM's
        offsets = tl.arange(0, BLOCK)      # _apply_grammar_bitmask_kernel
        tl.store(out_ptr + offsets, 1.0, mask=active & (offsets < n))

    out = torch.zeros(8)
    try:
        store_where[(1,)](out, 5, LIMIT=1, BLOCK=8)
    except Exception as error:
        print("raised", error)
    else:
        print("stored", int(out.sum()))
"""


def test_the_interpreter_bug_the_stand_in_avoids():
    """Triton's interpreter turns a scalar comparison splatted into a store
    mask into an int32 mask and refuses it; compiled Triton stores the five
    values. When this test fails, Triton's interpreter is fixed: drop the
    JIT warm-up stand-in from sitecustomize.py."""
    proc = run(INTERPRETER_BUG)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "raised" in proc.stdout and "mask has unsupported dtype" in proc.stdout
