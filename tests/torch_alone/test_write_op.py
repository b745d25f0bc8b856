"""torch.ops.cg_extract.write_hidden_states: its torch body against vLLM's
``basic_cache``, bad arguments, what a dispatch mode sees of it, the emulated
graph contract through it, and its Triton kernel under Triton's interpreter
(in a process of its own; on a GPU: ``tests/cuda/test_write_kernel_cuda.py``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cg_extract import cache_write, write_op
from cg_extract.cache_write import write_per_layer, write_stacked
from cg_extract.cudagraph_manager import CudaGraphManager
from cg_extract.emulated_graph import StaticMemoryViolation
from cg_extract.write_op import write_hidden_states
from perf.measure import count_step
from tests.write_cases import (
    DTYPES,
    LAYOUTS,
    WriteCase,
    any_write_case,
    run_op,
    same_bytes,
    write_case,
)

REPO = Path(__file__).resolve().parents[2]
OP_NAME = "cg_extract.write_hidden_states.default"


# --------------------------------------------------------------------------
# Semantics (CPU body)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden_size", [64, 100, 1030])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_owned_slots_match_vllms_basic_cache(dtype, hidden_size, layout):
    """On real slots, the bytes of vLLM's cache-only layer; padding nowhere."""
    basic_cache = pytest.importorskip(
        "vllm.model_executor.models.extract_hidden_states"
    ).basic_cache
    case = write_case(
        torch.Generator().manual_seed(hidden_size),
        num_tokens=40,
        num_layers=3,
        hidden_size=hidden_size,
        dtype=dtype,
        layout=layout,
        padding=[0, 17, 37, 38, 39],
        null_block=True,
    )
    got = run_op(case)
    owned = case.owned_rows()
    vllm = case.fresh_cache()
    basic_cache(torch.stack(case.aux, dim=1)[owned], vllm, case.slots[owned])
    assert same_bytes(got, vllm)
    # vLLM's layer, given the padded rows too, writes them into block 0.
    padded = case.fresh_cache()
    basic_cache(torch.stack(case.aux, dim=1), padded, case.slots)
    assert not same_bytes(padded[0], case.initial[0])
    assert same_bytes(got[0], case.initial[0])


@settings(max_examples=60, deadline=None)
@given(case=any_write_case(max_tokens=40, max_layers=8, max_hidden=80))
def test_writes_exactly_the_owned_rows(case):
    """Any shape, any padding pattern: the cache equals the element-by-element
    reference, every byte not owned by a real token as it was."""
    assert same_bytes(run_op(case), case.expected())


@settings(max_examples=60, deadline=None)
@given(case=any_write_case(max_tokens=40, max_layers=8, max_hidden=80))
def test_each_cpu_body_writes_exactly_the_owned_rows(case):
    """The CPU body's two ways, whatever token count picks each: the copy per
    token takes padding as it comes, the per-layer scatter the owned rows
    only."""
    got = run_body(case, cache_write.copy_rows, case.slots.tolist())
    assert same_bytes(got, case.expected())
    owned = case.owned_rows()
    real = WriteCase([a[owned] for a in case.aux], case.slots[owned], case.initial)
    got = run_body(real, cache_write.scatter_layers, real.slots)
    assert same_bytes(got, case.expected())


def run_body(case: WriteCase, body, slots) -> torch.Tensor:
    cache = case.fresh_cache()
    body(case.aux, cache, slots)
    return cache


@pytest.mark.parametrize("num_tokens", [1, 4, 5, 40])
def test_a_cache_with_gaps_between_its_blocks(num_tokens):
    """Both ways write through the cache's strides: blocks of a larger
    buffer, nothing written between them."""
    case = write_case(
        torch.Generator().manual_seed(num_tokens), num_tokens, 3, 32,
        torch.bfloat16, "separate", [0], null_block=True,
    )  # fmt: skip
    wide = torch.zeros(len(case.initial), 3, 2 * 16, 32, dtype=torch.bfloat16)
    cache = wide[:, :, :16]
    cache.copy_(case.initial)
    write_hidden_states(case.aux, cache, case.slots)
    assert same_bytes(cache, case.expected())
    assert not wide[:, :, 16:].any()


# The words a row may move as, widest first: 16, 8 and 4 bytes.
WIDEST_FIRST = (torch.complex128, torch.int64, torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden_size", [1, 7, 8, 16, 1024])
def test_rows_move_as_the_widest_words_that_tile_them(dtype, hidden_size):
    """Viewed as complex128 where every row is 16-byte aligned and a multiple
    of 16 bytes, narrower words where only those tile it, as they are else."""
    cache = torch.zeros(3, 2, 4, hidden_size, dtype=dtype)
    aux = [torch.zeros(5, hidden_size, dtype=dtype) for _ in range(2)]
    itemsize = cache.element_size()
    tiling = [
        word
        for word in WIDEST_FIRST
        if word.itemsize > itemsize and hidden_size * itemsize % word.itemsize == 0
    ]
    want = tiling[0] if tiling else dtype
    if dtype is torch.bfloat16 and hidden_size == 1024:  # a 2 KiB row
        assert want is torch.complex128
    words, (hidden, _) = cache_write._as_words(cache, aux)
    assert words.dtype == hidden.dtype == want
    assert words.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    strided = torch.zeros(5, 2 * hidden_size, dtype=dtype)[:, ::2]
    assert cache_write._as_words(cache, [strided, aux[1]])[0].dtype == dtype


@pytest.mark.parametrize(
    "num_tokens, body",
    [(1, "copy"), (4, "copy"), (5, "scatter"), (40, "scatter")],
)
def test_up_to_4_tokens_copy_rows_above_that_scatter(num_tokens, body):
    """The CPU body's choice, seen in the ops it dispatches (the bytes are
    the same either way): one row copy per owned token up to 4 tokens, the
    crossover perf/write_op_cost.py measured; one scatter per layer above."""
    case = write_case(
        torch.Generator().manual_seed(num_tokens), num_tokens, 3, 64,
        torch.bfloat16, "separate", [0],
    )  # fmt: skip
    cache = case.fresh_cache()
    count = count_step(
        lambda: cache_write.write_owned_slots(case.aux, cache, case.slots)
    )
    ops = [op.name.split(".")[1] for op in count.dispatched]
    if body == "copy":
        assert "index_put_" not in ops and ops.count("copy_") == num_tokens - 1, ops
    else:
        assert ops.count("index_put_") == 3 and "copy_" not in ops, ops
    assert same_bytes(cache, case.expected())


@pytest.mark.parametrize("stacked", [True, False], ids=["write_stacked", "per_layer"])
def test_the_reference_writes_are_vllms_padding_included(stacked):
    """write_stacked and write_per_layer (the sweep's references and its
    per_layer mode) store what vLLM's basic_cache stores, padding rows in the
    null block 0 included. One padding row: which of several landing on the
    same slot wins is up to the scatter."""
    basic_cache = pytest.importorskip(
        "vllm.model_executor.models.extract_hidden_states"
    ).basic_cache
    case = write_case(
        torch.Generator().manual_seed(3), 20, 3, 64, torch.bfloat16, "separate",
        [19], null_block=True,
    )  # fmt: skip
    vllm = case.fresh_cache()
    basic_cache(torch.stack(case.aux, dim=1), vllm, case.slots)
    ours = case.fresh_cache()
    if stacked:
        write_stacked(torch.stack(case.aux, dim=1), ours, case.slots)
    else:
        write_per_layer(case.aux, ours, case.slots)
    assert same_bytes(ours, vllm)
    assert not same_bytes(vllm[0], case.initial[0]), "padding went to block 0"


def test_same_bytes_as_the_per_layer_write_on_real_slots():
    case = write_case(
        torch.Generator().manual_seed(1), 33, 4, 256, torch.bfloat16, "stacked", []
    )
    old = case.fresh_cache()
    write_per_layer(case.aux, old, case.slots)
    assert same_bytes(run_op(case), old)


def small_case(device="cpu", **overrides):
    case = write_case(
        torch.Generator().manual_seed(0), 4, 3, 8, torch.float32, "separate", [3]
    ).to(device)
    args = dict(aux=case.aux, kv_cache=case.fresh_cache(), slot_mapping=case.slots)
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, message",
    [
        (lambda a: {"aux": a["aux"][:2]}, r"2 aux hidden states for a cache of 3"),
        (
            lambda a: {"aux": [a["aux"][0][:, :7], *a["aux"][1:]]},
            r"aux hidden state 0 is torch.float32 \[4, 7\].*expected torch.float32 \[4, 8\]",
        ),
        (
            lambda a: {"aux": [*a["aux"][:2], a["aux"][2].double()]},
            r"aux hidden state 2 is torch.float64",
        ),
        (
            lambda a: {"aux": [x[:3] for x in a["aux"]]},
            r"expected torch.float32 \[4, 8\] .*one row per slot",
        ),
        (
            lambda a: {"slot_mapping": a["slot_mapping"].float()},
            r"slot_mapping is torch.float32 .*int32 or int64",
        ),
        (
            lambda a: {"kv_cache": a["kv_cache"][0]},
            r"kv_cache has shape \[3, 16, 8\]",
        ),
        (  # meta stands for another device (a CPU slot row for a CUDA cache)
            lambda a: {"slot_mapping": a["slot_mapping"].to("meta")},
            r"slot_mapping is on meta, kv_cache on cpu",
        ),
    ],
)
def test_bad_arguments_name_what_is_wrong(overrides, message):
    args = small_case()
    args.update(overrides(args))
    with pytest.raises(ValueError, match=message):
        write_hidden_states(args["aux"], args["kv_cache"], args["slot_mapping"])


def test_meta_tensors_check_shapes_only():
    args = small_case()
    meta = {
        "aux": [a.to("meta") for a in args["aux"]],
        "kv_cache": args["kv_cache"].to("meta"),
        "slot_mapping": args["slot_mapping"].to("meta"),
    }
    write_hidden_states(meta["aux"], meta["kv_cache"], meta["slot_mapping"])
    with pytest.raises(ValueError, match="2 aux hidden states"):
        write_hidden_states(meta["aux"][:2], meta["kv_cache"], meta["slot_mapping"])


@settings(max_examples=60, deadline=None)
@given(case=any_write_case(20, 4, 40), data=st.data())
def test_aux_of_another_dtype_is_refused_before_anything_is_written(case, data):
    """The op's contract for aux hidden states of mixed dtypes (write_op,
    "Dtypes"): the first whose dtype is not the cache's is named and nothing
    is written, called directly or through the dispatcher; the speculator
    converts them first, as vLLM's does. All of the cache's dtype: written."""
    dtypes = data.draw(
        st.lists(
            st.sampled_from(DTYPES), min_size=len(case.aux), max_size=len(case.aux)
        )
    )
    aux = [a.to(dtype) for a, dtype in zip(case.aux, dtypes, strict=True)]
    cache = case.fresh_cache()
    other = [i for i, dtype in enumerate(dtypes) if dtype != cache.dtype]
    if not other:
        write_hidden_states(aux, cache, case.slots)
        assert same_bytes(cache, case.expected())
        return
    first = other[0]
    message = rf"aux hidden state {first} is {dtypes[first]} .*expected {cache.dtype}"
    for write in (write_hidden_states, write_op.op):
        with pytest.raises(ValueError, match=message):
            write(aux, cache, case.slots)
        assert same_bytes(cache, case.fresh_cache())


# --------------------------------------------------------------------------
# What a dispatch mode sees: one op, every tensor argument


def test_a_dispatch_mode_sees_one_op_with_the_owned_bytes():
    case = write_case(
        torch.Generator().manual_seed(2),
        10,
        3,
        64,
        torch.bfloat16,
        "separate",
        [7, 8, 9],
    )
    cache = case.fresh_cache()
    count = count_step(lambda: write_hidden_states(case.aux, cache, case.slots))
    assert [op.name for op in count.dispatched] == [OP_NAME]
    row = 3 * 64 * 2
    assert count.bytes == 10 * 8 + 2 * 7 * row  # slots, then 7 owned rows in and out
    assert same_bytes(cache, case.expected())


class NoDispatcher:
    """``write_op.op`` replaced by a call counter."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self.real = write_op.op
        monkeypatch.setattr(write_op, "op", self)

    def __call__(self, *args):
        self.calls += 1
        self.real(*args)


def test_without_a_dispatch_mode_the_op_is_called_directly(monkeypatch):
    """Same bytes, same checks, no trip through the dispatcher; a dispatch
    mode (the emulator, the sweep's counter), a tensor subclass or another
    device gets the op itself."""
    dispatched = NoDispatcher(monkeypatch)
    case = write_case(
        torch.Generator().manual_seed(6), 5, 3, 32, torch.bfloat16, "separate", [4]
    )
    assert same_bytes(run_op(case), case.expected())
    with pytest.raises(ValueError, match="2 aux hidden states for a cache of 3"):
        write_hidden_states(case.aux[:2], case.fresh_cache(), case.slots)
    assert dispatched.calls == 0
    cache = case.fresh_cache()
    count = count_step(lambda: write_hidden_states(case.aux, cache, case.slots))
    assert [op.name for op in count.dispatched] == [OP_NAME]
    assert dispatched.calls == 1 and same_bytes(cache, case.expected())

    class Subclass(torch.Tensor):
        pass

    for aux, slots in [
        ([case.aux[0].as_subclass(Subclass), *case.aux[1:]], case.slots),
        (case.aux, case.slots.as_subclass(Subclass)),
    ]:
        write_hidden_states(aux, case.fresh_cache(), slots)
    write_hidden_states(*small_case(device="meta").values())
    assert dispatched.calls == 4


class StaticWrite:
    """A graph of the op over static inputs, as the copy-in path captures it."""

    def __init__(self, case: WriteCase, sizes=(4, 8)):
        self.aux = [a.clone() for a in case.aux]
        self.slots = case.slots.clone()
        self.cache = case.fresh_cache()
        self.swap = {}  # aux layer -> a tensor the step passes instead
        self.manager = CudaGraphManager(sizes, "cpu", "emulated")
        self.manager.capture(self.step, progress=False)

    def step(self, n: int) -> None:
        aux = [self.swap.get(i, a[:n]) for i, a in enumerate(self.aux)]
        write_hidden_states(aux, self.cache, self.slots[:n])


def test_emulated_graph_replays_the_op_over_its_static_inputs():
    case = write_case(
        torch.Generator().manual_seed(3), 8, 3, 32, torch.float32, "stacked", [6, 7]
    )
    rig = StaticWrite(case)
    fresh = write_case(
        torch.Generator().manual_seed(4), 8, 3, 32, torch.float32, "stacked", [1, 7]
    )
    for static, new in zip(rig.aux, fresh.aux, strict=True):
        static.copy_(new)
    rig.slots.copy_(fresh.slots)
    rig.cache.copy_(fresh.initial)
    rig.manager.replay(8)
    assert same_bytes(rig.cache, fresh.expected())
    records = rig.manager._graphs[8].records
    assert {r.name for r in records} == {
        "aten::slice",
        "cg_extract::write_hidden_states",
    }
    (record,) = [r for r in records if r.name.startswith("cg_extract")]
    # every aux view, the cache and the slots, each by address, shape, stride
    assert sum(1 for a in record.args if hasattr(a, "stride")) == 3 + 2


@pytest.mark.parametrize("which", ["aux", "cache"])
def test_emulator_rejects_other_memory_through_the_op(which):
    case = write_case(
        torch.Generator().manual_seed(5), 8, 3, 32, torch.float32, "separate", []
    )
    rig = StaticWrite(case)
    if which == "aux":
        rig.swap[1] = rig.aux[1][:8].clone()  # same values, other memory
        argument = "argument 1"
    else:
        rig.cache = rig.cache.clone()
        argument = "argument 3"
    with pytest.raises(
        StaticMemoryViolation,
        match=f"cg_extract::write_hidden_states {argument}: captured external",
    ):
        rig.manager.replay(8)


# --------------------------------------------------------------------------
# The Triton kernel


def test_triton_kernel_under_the_interpreter():
    """``tests/torch_alone/write_kernel_interpreted.py`` in its own process: the kernel is
    defined after ``TRITON_INTERPRET=1`` is set, and only there."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/torch_alone/write_kernel_interpreted.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_the_cost_script_prints_both_tables(capsys):
    from perf import write_op_cost

    argv = ["--hidden-size", "64", "--layers", "2", "--sizes", "1", "3", "40"]
    write_op_cost.main([*argv, "--rounds", "1", "--number", "2"])
    out = capsys.readouterr().out
    for name in ("Library op", "custom_op", "mode check + call", "scatter_layers"):
        assert name in out
    assert len([line for line in out.splitlines() if line.startswith("    40 ")]) == 1
