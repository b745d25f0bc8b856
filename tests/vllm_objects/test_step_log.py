"""The step-log check (``vllm_on_cpu.step_log.zero_copy_violations``) on
step lines written by hand: each rule on its own. The e2e tests
(``tests/vllm_engine/test_e2e_target_graphs.py``) and the CI gate's engine run
(``zero_copy_where_due``) apply it to the real engine's log."""

import pytest

pytest.importorskip("vllm")  # the check reads vLLM's CUDAGraphMode

from vllm_on_cpu.step_log import zero_copy_violations

FULL_SIZES = [2, 4, 8, 16]  # the runner's FULL decode graphs, max_num_seqs 8


def step(target: str, path: str, tokens: int, prefill: bool = False, requests=2):
    """A step line as the worker writes it (the fields the check reads); a
    uniform decode where every request has 2 tokens (the decode query
    length with one speculative token)."""
    return {
        "scheduled": {f"r{i}": tokens // requests for i in range(requests)},
        "target": target,
        "tokens": tokens,
        "padded": tokens,
        "prefill": prefill,
        "uniform_decode": not prefill and tokens == 2 * requests,
        "paths": [path],
    }


# Under FULL_AND_PIECEWISE, what a healthy engine does: a prefill above the
# capture sizes eagerly, a small mixed step as PIECEWISE graphs (ours copy-in),
# uniform decodes of one and of several requests FULL (ours zero-copy), one
# above the FULL graphs PIECEWISE, and a decode where one request decodes its
# last token alone (no draft: not uniform) PIECEWISE.
HEALTHY = [
    step("NONE", "copy_in", 64, prefill=True, requests=4),
    step("PIECEWISE", "copy_in", 12, prefill=True, requests=3),
    step("FULL", "zero_copy", 2, requests=1),
    step("FULL", "zero_copy", 16, requests=8),
    step("PIECEWISE", "copy_in", 24, requests=12),
    step("PIECEWISE", "copy_in", 15, requests=8),
]


def test_a_healthy_engine_passes():
    assert zero_copy_violations(HEALTHY, FULL_SIZES, "FULL_AND_PIECEWISE") == []


@pytest.mark.parametrize(
    "bad, message",
    [
        # Zero-copy lost for several requests decoding together (the bug
        # issue 38 asks to catch).
        (step("FULL", "copy_in", 8, requests=4), "must replay zero-copy"),
        # The target lost its FULL decode graphs.
        (step("PIECEWISE", "copy_in", 8, requests=4), "must replay zero-copy"),
        # A prefill step read as if the target had replayed FULL.
        (
            step("PIECEWISE", "zero_copy", 12, prefill=True),
            "a step with a prefill must not",
        ),
        # Zero-copy where the target's buffers do not hold the step.
        (
            step("PIECEWISE", "zero_copy", 15, requests=8),
            "zero-copy only after a FULL replay",
        ),
        # Our speculator ran twice in a step, or not at all.
        ({**step("FULL", "zero_copy", 4), "paths": []}, "not one path"),
    ],
)
def test_each_wrong_step_is_named(bad, message):
    steps = [*HEALTHY, bad]
    (wrong,) = zero_copy_violations(steps, FULL_SIZES, "FULL_AND_PIECEWISE")
    assert wrong.startswith(f"step {len(HEALTHY)}") and message in wrong


def test_under_full_a_prefill_step_replayed_full_is_zero_copy():
    """FULL runs mixed batches as FULL graphs too: the target's buffers
    hold a prefill step's states, and zero-copy is due there."""
    prefill = step("FULL", "zero_copy", 12, prefill=True)
    assert zero_copy_violations([prefill], FULL_SIZES, "FULL") == []
    (wrong,) = zero_copy_violations(
        [{**prefill, "paths": ["copy_in"]}], FULL_SIZES, "FULL"
    )
    assert "after a FULL replay of the target, zero-copy" in wrong


def test_a_log_without_the_runners_record_is_refused():
    unrecorded = {**step("FULL", "zero_copy", 4), "target": None}
    with pytest.raises(ValueError, match="cudagraph_metrics=True"):
        zero_copy_violations([unrecorded], FULL_SIZES, "FULL_AND_PIECEWISE")
