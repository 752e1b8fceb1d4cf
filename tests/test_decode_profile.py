"""examples/decode_profile.py: a verify step's parts from a profile of one decode.

- op names come from the HLO text: an instruction's own, else the common prefix of what it calls;
- the innermost part scope names the part (the walk inside the drafter is the walk's), the prefill
  is apart, and an op of no part is the rest of the step;
- nested host events count their self time only;
- a profile of a real jitted loop on this device attributes time to the scoped parts and to them alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from examples import decode_profile as dp

HLO = """HloModule jit_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b), metadata={op_name="reduce_sum"}
}

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %sine.1 = f32[4]{0} sine(%param_0), metadata={op_name="jit(step)/while/body/drafter/walk/sin"}
  ROOT %cosine.1 = f32[4]{0} cosine(%sine.1), metadata={op_name="jit(step)/while/body/drafter/walk/cos"}
}

ENTRY %main.9 (Arg_0.1: f32[4]) -> f32[4] {
  %Arg_0.1 = f32[4]{0} parameter(0)
  %walk_fusion = f32[4]{0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation
  %reduce.2 = f32[] reduce(%walk_fusion, %c), to_apply=%region_0.1, metadata={op_name="j/rejection_sampler/sum"}
  ROOT %tanh.3 = f32[4]{0} tanh(%walk_fusion), metadata={op_name="jit(step)/prefill/tanh"}
}
"""


def test_op_names_are_an_instructions_own_or_the_common_prefix_of_what_it_calls():
    module, names = dp.hlo_op_names(HLO)
    assert module == "jit_step"
    assert names["walk_fusion"] == "jit(step)/while/body/drafter/walk"  # no metadata of its own
    assert names["reduce.2"] == "j/rejection_sampler/sum"  # its own, not its reducer's
    assert names["sine.1"] == "jit(step)/while/body/drafter/walk/sin"
    assert names["Arg_0.1"] == ""


def test_the_innermost_part_scope_names_the_part():
    assert dp.part_of("jit(f)/while/body/drafter/walk/jit(walk)/dot_general") == "walk"
    assert dp.part_of("jit(f)/while/body/drafter/dot_general") == "drafter"
    assert dp.part_of("jit(f)/while/body/drafter_context/dot_general") == "drafter"
    assert dp.part_of("jit(f)/while/body/target_forward/dot_general") == "target forward"
    assert dp.part_of("jit(f)/prefill/target_forward/dot_general") == "prefill"
    assert dp.part_of("jit(f)/while/body/add") is None and dp.part_of("") is None
    times, ops = dp.attribute([("m", "a", 5.0), ("m", "b", 3.0), ("m", "c", 2.0), ("m", "a", 1.0),
                               ("other", "a", 100.0)], "m",
                              {"a": "x/target_forward/y", "b": "x/while/body", "c": "x/prefill/z"})
    assert times == {"target forward": 6.0, "drafter": 0.0, "walk": 0.0, "rejection sampler": 0.0, dp.REST: 3.0,
                     "prefill": 2.0}
    assert ops == {("target forward", "a"): 6.0, (dp.REST, "b"): 3.0, ("prefill", "c"): 2.0}


def test_result_types_and_families_come_from_the_hlo_text():
    assert dp.hlo_result_types(HLO)["walk_fusion"] == "f32[4]{0}" and dp.hlo_result_types(HLO)["reduce.2"] == "f32[]"
    tuple_line = "  %t.1 = (f32[4]{0}, s32[]) tuple(%a, %b)"
    assert dp.hlo_result_types(tuple_line) == {"t.1": "(f32[4]{0}, s32[])"}
    assert dp.op_family("wrapped_concatenate.52") == "wrapped_concatenate" and dp.op_family("ffi_call") == "ffi_call"


def test_nested_events_count_their_self_time():
    # a loop's event (0-100) holding two ops (10-30, 40-45), and one op after it
    out = dp.self_times([(0, 100, "m", "while"), (10, 30, "m", "a"), (40, 45, "m", "b"), (100, 110, "m", "c")])
    assert {op: ns for _, op, ns in out} == {"while": 75, "a": 20, "b": 5, "c": 10}


def test_kernels_that_overlap_in_part_share_the_busy_time():
    # b starts (launched early) while a's tail runs; c holds d; e comes after a gap
    events = [(0, 10, "m", "a"), (8, 20, "m", "b"), (20, 50, "m", "c"), (30, 35, "m", "d"), (60, 61, "m", "e")]
    out = dp.self_times(events)
    assert {op: ns for _, op, ns in out} == {"a": 8, "b": 12, "c": 25, "d": 5, "e": 1}
    assert sum(ns for *_, ns in out) == 51  # the line's busy time, nothing counted twice


@jax.jit
def _loop(x, w):
    with jax.named_scope("prefill"):
        x = jnp.tanh(x @ w)

    def body(i, x):
        with jax.named_scope("target_forward"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("drafter"):
            with jax.named_scope("walk"):
                y = jnp.sin(y @ w.T)
        return y

    return jax.lax.fori_loop(0, 8, body, x)


def test_a_profile_of_a_jitted_loop_attributes_its_time_to_the_scoped_parts():
    x, w = jnp.ones((64, 512)), jnp.full((512, 512), 1e-3)

    def run(lower=False):
        return _loop.lower(x, w) if lower else _loop(x, w)

    jax.block_until_ready(run())
    split = dp.step_split(run, iterations=8)
    ms = split["ms"]
    assert set(ms) == {*dp.PARTS.values(), dp.REST}
    assert ms["target forward"] > 0 and ms["walk"] > 0
    assert ms["drafter"] == ms["rejection sampler"] == 0
    assert sum(ms.values()) == pytest.approx(ms["target forward"] + ms["walk"] + ms[dp.REST])
    assert "time" in split["method"]
    # the heaviest ops, longest first, each in its part and none of the prefill's
    top = split["top_ops"]
    assert 0 < len(top) <= 12 and [t[2] for t in top] == sorted((t[2] for t in top), reverse=True)
    assert {t[0] for t in top} <= set(ms) and top[0][2] <= max(ms.values())
    assert {t[0] for t in top} >= {"target forward", "walk"}
    # each op's result type, from the HLO text: the scoped parts' ops make [64, 512] floats
    assert all(t[3] for t in top) and all(t[3].startswith("f32[64,512]") for t in top if t[0] != dp.REST)
    # the same time by kinds of op: every family's ops under one name without its number
    families = split["op_families"]
    assert [f[2] for f in families] == sorted((f[2] for f in families), reverse=True)
    assert all(f[3] >= 1 and dp.op_family(f[4]) == f[1] for f in families)
    assert sum(f[2] for f in families) <= sum(ms.values()) + 1e-9 and families[0][2] >= top[0][2]
