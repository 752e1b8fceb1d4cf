"""benchmarks/profile_kernel.py's config parsing (CPU): the modes it runs and the ones it refuses."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import profile_kernel
from jax_markov import native


def test_configs_parse_with_the_int8_head_by_default():
    assert profile_kernel.parse("151936,7,64,greedy-logits") == (151936, 7, 64, "greedy-logits", "int8")
    assert profile_kernel.parse("5003,3,3,probabilistic,bf16") == (5003, 3, 3, "probabilistic", "bf16")


def test_an_unknown_mode_or_head_is_refused_not_run_as_greedy():
    with pytest.raises(ValueError, match="mode 'sampled' of '5003,3,3,sampled' is not one of"):
        profile_kernel.parse("5003,3,3,sampled")
    with pytest.raises(ValueError, match="head 'int4' of '5003,3,3,greedy,int4' is not one of"):
        profile_kernel.parse("5003,3,3,greedy,int4")
    assert profile_kernel.parse("5000,3,12,greedy,untiled")[4] == "untiled"


@pytest.mark.skipif(not native.plan_available(), reason="the jax_markov plan module is not built")
def test_the_launch_plan_is_the_heads():
    """The int8 head has its tiles, so 12 greedy requests walk on the transposed kernel; without them
    on EREGS; the certified head on its certified EREGS walk."""
    names = {head: [p["name"] for p in profile_kernel.launch_plan(f"151936,3,12,greedy,{head}")]
             for head in ("int8", "untiled", "certified")}
    assert names["int8"] == ["transposed<base=bfloat16,packed,plain>"]
    assert names["untiled"] == ["walk<nt=2,eregs,w2=int8,threads=256,form=plain>"]
    assert names["certified"] == ["walk<nt=2,eregs,certified,w2=int8,threads=256,form=plain>"]


@pytest.mark.skipif(not native.plan_available(), reason="the jax_markov plan module is not built")
def test_the_certified_head_lands_its_tiles_by_bulk_copies_above_16_requests():
    """24 greedy requests of a certified head walk on the transposed kernel's certified walk, from its
    tiles unless the config names the head without them."""
    for head, tiled in (("certified", True), ("certified-untiled", False)):
        (plan,) = profile_kernel.launch_plan(f"151936,7,24,greedy,{head}")
        assert plan["name"] == "transposed<base=bfloat16,packed,certified>" and plan["w2_tiled"] is tiled, plan


def test_the_f32_modes_write_float32_logits_and_the_others_bf16():
    assert profile_kernel.walk_options("greedy", 4) == {}
    assert profile_kernel.walk_options("greedy-logits", 4)["logits_dtype"] == profile_kernel.jnp.bfloat16
    assert profile_kernel.walk_options("greedy-logits-f32", 4)["logits_dtype"] == profile_kernel.jnp.float32
    sampled = profile_kernel.walk_options("probabilistic-f32", 4)
    assert sampled["logits_dtype"] == profile_kernel.jnp.float32 and sampled["temperature"].shape == (4,)
    assert "temperature" not in profile_kernel.walk_options("greedy-logits-f32", 4)


class _Event:
    def __init__(self, name, start_ns, duration_ns):
        self.name, self.start_ns, self.duration_ns = name, start_ns, duration_ns


class _Line:
    def __init__(self, name, events):
        self.name, self.events = name, events


class _Plane:
    def __init__(self, name, lines):
        self.name, self.lines = name, lines


def test_walk_kernel_events_from_the_gpu_streams_in_start_order():
    planes = [
        _Plane("/host:CPU", [_Line("python3", [_Event("MarkovWalkKernel host-side call", 0, 10)])]),
        _Plane("/device:GPU:0", [
            _Line("Stream #14(compute)", [
                _Event("void jax_markov::walk::MarkovWalkTransposedKernel<1, false>(jax_markov::walk::WalkArgs)",
                       3000, 180_500),
                _Event("loop_convert_fusion", 2000, 900),
                _Event("void jax_markov::walk::MarkovWalkNoise<4>(jax_markov::walk::WalkArgs, float*)", 1000, 280_000),
            ]),
            _Line("XLA Ops", [_Event("MarkovWalkKernel op", 0, 5)]),
        ]),
        _Plane("/device:GPU:1", [_Line("Stream #7", [
            _Event("_ZN10jax_markov4walk15MarkovWalkNoiseILi4EEEvNS0_8WalkArgsEPf", 4000, 1000),
            _Event("_ZN10jax_markov4walk16MarkovWalkKernelILi2ELb0ELb0ELi0ELi512ELb1EEEvNS0_8WalkArgsE", 5000, 2000)])]),
    ]
    assert profile_kernel.walk_kernel_events(planes) == [("MarkovWalkNoise", 280.0),
                                                         ("MarkovWalkTransposedKernel", 180.5),
                                                         ("MarkovWalkNoise", 1.0), ("MarkovWalkKernel", 2.0)]


def test_a_fingerprint_tells_walks_apart_by_tokens_and_logits():
    from jax_markov.result import WalkResult

    fields = {f: None for f in WalkResult._fields}
    tokens = np.array([[3, 1, 4], [1, 5, 9]], np.int32)
    logits = np.random.default_rng(0).standard_normal((2, 3, 7)).astype(np.float32)
    plain = profile_kernel.fingerprint(WalkResult(**{**fields, "tokens": tokens}))
    assert plain.startswith("tokens=") and plain.endswith(" logits=-")
    assert profile_kernel.fingerprint(WalkResult(**{**fields, "tokens": tokens[:, ::-1].copy()})) != plain
    with_logits = profile_kernel.fingerprint(WalkResult(**{**fields, "tokens": tokens, "logits": logits}))
    assert with_logits.split()[0] == plain.split()[0] and with_logits.split()[1] != "logits=-"
    logits[1, 2, 6] += 1.0
    assert profile_kernel.fingerprint(WalkResult(**{**fields, "tokens": tokens, "logits": logits})) != with_logits


def test_a_guarded_pair_times_as_one_launch():
    """A sampled call of two runs of requests, each a guarded pair (walk_config.h's RunWhen), chained
    twice: each pair's durations add up under the name of the launch that walked; a certified head's
    run of three guarded launches folds alike, and unguarded runs stay apart."""
    plan = [{"first": 0, "run_when": "no_row_samples"}, {"first": 0, "run_when": "some_row_samples"},
            {"first": 64, "run_when": "no_row_samples"}, {"first": 64, "run_when": "some_row_samples"}]
    events = [("MarkovWalkKernel", 1.5), ("MarkovWalkKernel", 190.0), ("MarkovWalkTransposedKernel", 180.0),
              ("MarkovWalkKernel", 1.4)] * 2
    assert profile_kernel.fold_guarded_pairs(events, plan) == [("MarkovWalkKernel", 191.5),
                                                               ("MarkovWalkTransposedKernel", 181.4)] * 2
    plain = [("MarkovWalkKernel", 52.0)] * 3
    assert profile_kernel.fold_guarded_pairs(plain, [{"first": 0, "run_when": "always"}]) == plain
    two_runs = [{"first": 0, "run_when": "always"}, {"first": 64, "run_when": "always"}]
    assert profile_kernel.fold_guarded_pairs(plain[:2], two_runs) == plain[:2]
    certified = [{"first": 0, "run_when": "no_row_samples"}, {"first": 0, "run_when": "mixed_rows"},
                 {"first": 0, "run_when": "all_rows_sample"}]
    events = [("MarkovWalkKernel", 1.5), ("MarkovWalkKernel", 1.6), ("MarkovWalkKernel", 60.0)]
    assert profile_kernel.fold_guarded_pairs(events * 2, certified) == [("MarkovWalkKernel", 63.1)] * 2
    with pytest.raises(ValueError, match="not whole calls of 2 launches"):
        profile_kernel.fold_guarded_pairs(events[:3], plan[:2])
