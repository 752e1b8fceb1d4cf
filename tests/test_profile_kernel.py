"""benchmarks/profile_kernel.py's config parsing (CPU): the modes it runs and the ones it refuses."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_kernel  # noqa: E402


def test_configs_parse_with_the_int8_head_by_default():
    assert profile_kernel.parse("151936,7,64,greedy-logits") == (151936, 7, 64, "greedy-logits", "int8")
    assert profile_kernel.parse("5003,3,3,probabilistic,bf16") == (5003, 3, 3, "probabilistic", "bf16")


def test_an_unknown_mode_is_refused_not_run_as_greedy():
    with pytest.raises(ValueError, match="mode 'sampled' of '5003,3,3,sampled' is not one of"):
        profile_kernel.parse("5003,3,3,sampled")


def test_the_f32_modes_write_float32_logits_and_the_others_bf16():
    assert profile_kernel.walk_options("greedy", 4) == {}
    assert profile_kernel.walk_options("greedy-logits", 4)["logits_dtype"] == profile_kernel.jnp.bfloat16
    assert profile_kernel.walk_options("greedy-logits-f32", 4)["logits_dtype"] == profile_kernel.jnp.float32
    sampled = profile_kernel.walk_options("probabilistic-f32", 4)
    assert sampled["logits_dtype"] == profile_kernel.jnp.float32 and sampled["temperature"].shape == (4,)
    assert "temperature" not in profile_kernel.walk_options("greedy-logits-f32", 4)
