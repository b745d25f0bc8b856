"""The vLLM names cg_extract depends on, as each tested vLLM has them
(``compat/vllm_surface.py``; one ``compat/vllm-<version>.txt`` per release
``cg_extract.plugin.TESTED_VLLM`` names). Reads sources with ``ast``: no
vLLM import, so it runs where vLLM is absent too."""

from __future__ import annotations

from pathlib import Path

import pytest

from compat import vllm_release, vllm_surface
from compat.vllm_surface import MISSING

TESTED_VLLM = vllm_surface.tested_releases()

COMPAT = Path(vllm_surface.__file__).parent
# Entries that differ between 0.32.0 and 0.33.0, each reviewed: the names
# the plugin uses on some releases only (vllm_surface.RELEASE_ONLY), and
# the defer_finalize 0.33's KVConnector.post_forward gains (its runner passes
# it on the last stage), which pipeline_parallel.HiddenStatesOnLastStage, a
# KVConnector of the stages before it, takes too.
REVIEWED_DIFFERENCE_0_32_TO_0_33 = {
    "vllm.v1.worker.gpu.kv_connector:KVConnector.post_forward\tfunction\t"
    "(self, finished_req_ids: set[str])",
    "vllm.v1.worker.gpu.kv_connector:KVConnector.post_forward\tfunction\t"
    "(self, finished_req_ids: set[str], defer_finalize: bool=False)",
    "vllm.v1.core.kv_cache_planning:get_global_kv_cache_groups\tMISSING\t"
    "no module vllm.v1.core.kv_cache_planning",
    "vllm.v1.core.kv_cache_planning:get_global_kv_cache_groups\tfunction\t"
    "(vllm_config: VllmConfig, kv_cache_specs: list[dict[str, KVCacheSpec]])",
    "vllm.v1.core.kv_cache_planning:get_kv_cache_configs\tMISSING\t"
    "no module vllm.v1.core.kv_cache_planning",
    "vllm.v1.core.kv_cache_planning:get_kv_cache_configs\tfunction\t"
    "(vllm_config: VllmConfig, kv_cache_specs: list[dict[str, KVCacheSpec]], "
    "available_memory: list[int], global_kv_cache_groups: list[KVCacheGroupSpec])",
    "vllm.v1.core.kv_cache_utils:get_kv_cache_configs\tfunction\t"
    "(vllm_config: VllmConfig, kv_cache_specs: list[dict[str, KVCacheSpec]], "
    "available_memory: list[int])",
    "vllm.v1.core.kv_cache_utils:get_kv_cache_configs\tMISSING\t"
    "vllm.v1.core.kv_cache_utils has no get_kv_cache_configs",
    # split_kv_cache_groups: the grouping it wraps moved with the planning,
    # 0.33's builders, and the engine core's call that takes the groups.
    "vllm.v1.core:kv_cache_planning\tMISSING\tvllm.v1.core has no kv_cache_planning",
    "vllm.v1.core:kv_cache_planning\tmodule\t",
    "vllm.v1.core.kv_cache_config_builder:get_kv_cache_config_builder\tMISSING\t"
    "no module vllm.v1.core.kv_cache_config_builder",
    "vllm.v1.core.kv_cache_config_builder:get_kv_cache_config_builder\tfunction\t"
    "(vllm_config: 'VllmConfig')",
    "vllm.v1.core.kv_cache_planning:DefaultKVCacheConfigBuilder\tMISSING\t"
    "no module vllm.v1.core.kv_cache_planning",
    "vllm.v1.core.kv_cache_planning:DefaultKVCacheConfigBuilder\tclass\t"
    "(KVCacheConfigBuilder)",
    "vllm.v1.core.kv_cache_planning:DefaultKVCacheConfigBuilder.get_kv_cache_groups"
    "\tMISSING\tno module vllm.v1.core.kv_cache_planning",
    "vllm.v1.core.kv_cache_planning:DefaultKVCacheConfigBuilder.get_kv_cache_groups"
    "\tfunction\t(self, vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec])",
    "vllm.v1.core.kv_cache_planning:get_kv_cache_groups\tMISSING\t"
    "no module vllm.v1.core.kv_cache_planning",
    "vllm.v1.core.kv_cache_planning:get_kv_cache_groups\tfunction\t"
    "(vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec])",
    "vllm.v1.core.kv_cache_utils:get_kv_cache_groups\tfunction\t"
    "(vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec])",
    "vllm.v1.core.kv_cache_utils:get_kv_cache_groups\tMISSING\t"
    "vllm.v1.core.kv_cache_utils has no get_kv_cache_groups",
    "vllm.v1.engine.core:get_kv_cache_configs\tfunction\t"
    "(vllm_config: VllmConfig, kv_cache_specs: list[dict[str, KVCacheSpec]], "
    "available_memory: list[int])",
    "vllm.v1.engine.core:get_kv_cache_configs\tfunction\t"
    "(vllm_config: VllmConfig, kv_cache_specs: list[dict[str, KVCacheSpec]], "
    "available_memory: list[int], global_kv_cache_groups: list[KVCacheGroupSpec])",
}


def committed(version: str) -> list[str]:
    lines = (COMPAT / f"vllm-{version}.txt").read_text().splitlines()
    assert lines[0] == f"# vLLM {version}: python compat/vllm_surface.py"
    return lines[1:]


def names(lines: list[str]) -> list[tuple[str, str]]:
    return [tuple(line.split("\t")[0].split(":")) for line in lines]


def test_one_file_per_tested_release():
    recorded = {p.name for p in COMPAT.glob("vllm-*.txt")}
    assert recorded == {f"vllm-{version}.txt" for _, version in TESTED_VLLM}


@pytest.mark.parametrize("version", sorted({v for _, v in TESTED_VLLM}))
def test_each_file_lists_every_name_the_plugin_uses_now(version):
    """A vLLM name newly imported, subclassed, overridden or patched by the
    plugin fails this until both releases are recorded again."""
    assert names(committed(version)) == vllm_surface.plugin_surface()


@pytest.mark.parametrize("version", sorted({v for _, v in TESTED_VLLM}))
def test_every_name_exists_in_each_tested_release(version):
    for line in committed(version):
        name, kind, _ = line.split("\t")
        only = vllm_surface.RELEASE_ONLY.get(tuple(name.split(":")), (version,))
        assert (kind == vllm_surface.MISSING) == (version not in only), line
        if tuple(name.split(":")) in vllm_surface.PATCHED and version in only:
            assert kind in ("function", "class", "attribute"), line


def test_the_difference_between_0_32_and_0_33_is_the_reviewed_one():
    old, new = set(committed("0.32.0")), set(committed("0.33.0"))
    assert old ^ new == REVIEWED_DIFFERENCE_0_32_TO_0_33


def test_the_installed_vllm_reads_as_committed():
    vllm = pytest.importorskip("vllm")
    version = vllm.__version__.split("+")[0]
    if not (COMPAT / f"vllm-{version}.txt").is_file():
        pytest.skip(f"vLLM {version} is not a tested release")
    recorded = list(vllm_surface.record(vllm_surface.installed_vllm()))
    assert recorded == committed(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_the_newer_releases_read_as_committed(version):
    """From the release's source distribution (its vllm/ is the wheel's
    Python)."""
    source = vllm_release.sdist(version)
    assert vllm_surface.Source(source).version() == version
    assert list(vllm_surface.record(source)) == committed(version)


def test_a_changed_signature_shows(monkeypatch):
    """The recorder on the installed vLLM with one wrapped method's
    signature changed, as a new release might."""
    pytest.importorskip("vllm")
    read = vllm_surface.Source._read_file

    def changed(self, name):
        text = read(self, name)
        if name.endswith("v1/worker/gpu/cudagraph_utils.py"):
            text = text.replace(
                "def capture(\n        self,\n        model",
                "def capture(\n        self,\n        new_first,\n        model",
                1,
            )
        return text

    monkeypatch.setattr(vllm_surface.Source, "_read_file", changed)
    recorded = list(vllm_surface.record(vllm_surface.installed_vllm()))
    (line,) = set(recorded) - set(committed("0.32.0"))
    assert line.startswith(
        "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager.capture\tfunction\t(self, new_first, model"
    )


def test_the_tested_releases_are_the_plugins():
    plugin = pytest.importorskip("cg_extract.plugin")  # imports vLLM
    assert TESTED_VLLM == plugin.TESTED_VLLM


# What ``python compat/vllm_surface.py --diff 0.33.0 0.34.0`` finds: the port
# to 0.34 starts from these (issue 61). Names the port makes the plugin read
# change them; each is reviewed here.
GONE_IN_0_34 = {
    # Model Runner V1 is gone (plugin.py, pipeline_parallel.py read these).
    "vllm:envs.VLLM_USE_V2_MODEL_RUNNER",
    "vllm.config:VllmConfig.use_v2_model_runner",
    "vllm.config:VllmConfig._get_v2_model_runner_unsupported_features",
    # speculator.py reads it.
    "vllm.config:SpeculativeConfig.disable_padded_drafter_batch",
}
CHANGED_IN_0_34 = {
    # decode_query_len: int became decode_query_lens: Mapping[int, int]
    # (vllm_graphs.SpeculatorGraphs passes it); the classes show __init__.
    "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager",
    "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.__init__",
    "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager",
    # Gained stream (SpeculatorGraphs overrides capture).
    "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.capture",
    "vllm.distributed.parallel_state:graph_capture",  # gained stream
    "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager.capture",  # has_lora
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.initialize_kv_cache",  # extensible
}
BYPASSED_IN_0_34 = {
    # 0.34's extensible KV cache imports get_kv_connector itself: the
    # plugin's rebinding in model_runner does not reach it, so the plugin
    # rebinds it there too.
    "vllm.v1.worker.gpu.model_runner:get_kv_connector"
    "\timported by vllm.v1.worker.extensible_kv_cache (rebound there too)",
}


def test_the_difference_between_0_33_and_0_34_is_the_reviewed_one():
    try:
        old, new = vllm_release.wheel("0.33.0"), vllm_release.wheel("0.34.0")
    except OSError as e:  # offline, no cached wheel
        pytest.skip(f"the 0.33.0 and 0.34.0 wheels cannot be fetched: {e}")
    found = vllm_surface.diff(old, new)
    assert {line.split("\t")[0] for line in found["gone"]} == GONE_IN_0_34
    changed = {line.split("\t")[0]: line for line in found["changed signature"]}
    assert set(changed) == CHANGED_IN_0_34
    init = changed["vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.__init__"]
    assert "decode_query_len: int" in init.split(" -> ")[0]
    assert "decode_query_lens: Mapping[int, int]" in init.split(" -> ")[1]
    assert set(found["bypassed"]) == BYPASSED_IN_0_34
    assert not set(found["new"]) & set(found["gone"])


def test_what_a_source_reads(tmp_path):
    """Class fields, names a module ``__getattr__`` serves from a literal,
    instance attributes through the annotation, and the other modules that
    import a function by name: on a made-up ``vllm``."""
    for name, text in {
        "__init__.py": "",
        "envs.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    OLD: bool = False\n"
        "variables = {'NEW': lambda: 1}\n"
        "def __getattr__(name):\n"
        "    if name in variables:\n        return variables[name]()\n"
        "    raise AttributeError(name)\n",
        "config.py": "class Spec:\n    flag: bool = False\n"
        "class Platform:\n    def pool(self): ...\n"
        "platform: Platform\n",
        "runner.py": "from vllm.connector import get\n",
        "connector.py": "def get(config): ...\n",
        "other.py": "from .runner import get\n",
        "lazy.py": "def f():\n    from vllm.connector import get\n",
    }.items():
        (tmp_path / "vllm").mkdir(exist_ok=True)
        (tmp_path / "vllm" / name).write_text(text)
    source = vllm_surface.Source(tmp_path)
    assert source.describe("vllm", "envs.OLD") == ("value", "False")
    assert source.describe("vllm", "envs.NEW") == ("dynamic", "vllm.envs.__getattr__")
    assert source.describe("vllm.envs", "GONE")[0] == MISSING
    assert source.describe("vllm.config", "Spec.flag") == ("value", "False")
    assert source.describe("vllm.config", "platform.pool") == ("function", "(self)")
    assert source.importers("vllm.runner", "get") == {"vllm.other"}
