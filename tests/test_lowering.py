"""The `markov_walk` primitive's lowerings, on any machine: for CUDA (lowered here for a GPU that the
launch plan assumes when none can be asked: an H100/H200) and for CPU, with impl="auto", "ffi" and
"reference"; and the CUDA envelope and kernel choice as `jax_markov.native` asks the plan for them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov
from jax_markov import native
from jax_markov.head import MarkovHead

B, K, V, R = 3, 3, 24, 8
CUSTOM_CALL = "custom_call @jax_markov_walk"
needs_cuda_module = pytest.mark.skipif(not native.cuda_available(), reason="the CUDA module is not built")
needs_plan = pytest.mark.skipif(not native.plan_available(), reason="the plan module is not built")


def _rank() -> int:
    return native.cuda_envelope()["rank"]


def _lowered_text(platform, impl, rank=None, quantized=True, w2_dtype=jnp.bfloat16, batch=B):
    rank = _rank() if rank is None else rank
    rng = np.random.default_rng(1)
    head = MarkovHead(jnp.asarray(rng.normal(size=(V, rank)), jnp.bfloat16), jnp.asarray(rng.normal(size=(V, rank)), w2_dtype))
    head = jax_markov.quantize(head) if quantized else head
    args = (jnp.asarray(rng.normal(size=(batch, K, V)), jnp.bfloat16), jnp.arange(batch, dtype=jnp.int32), head,
            jnp.ones((batch,), jnp.float32), jax.random.split(jax.random.key(0), batch),
            jnp.zeros((batch,), jnp.int32))
    f = jax.jit(lambda base, anchor, head, t, key, pos: jax_markov.walk(
        base, anchor, head, temperature=t, key=key, position=pos, return_logits=True, impl=impl))
    return f.trace(*args).lower(lowering_platforms=(platform,)).as_text()


@needs_plan
def test_lowering_for_cuda_on_cpu_machine():
    text = _lowered_text("cuda", "auto")
    reason = native.cuda_unsupported_reason(B, K, V, _rank(), jnp.bfloat16, jnp.int8)
    fits = reason is None
    if native.cuda_available():
        assert fits, reason
        assert CUSTOM_CALL in text
    else:
        assert not fits and CUSTOM_CALL not in text and "stablehlo.while" in text
    # impl="reference" never emits the custom call, on either platform
    for platform in ("cuda", "cpu"):
        ref_text = _lowered_text(platform, "reference")
        assert CUSTOM_CALL not in ref_text and "stablehlo.while" in ref_text
    # outside the kernel's envelope (rank != 256), "auto" falls back to the reference loop
    small = _lowered_text("cuda", "auto", rank=R)
    assert CUSTOM_CALL not in small and "stablehlo.while" in small


@needs_cuda_module
@needs_plan
def test_cuda_refuses_launches_past_32_bit_base_offsets():
    """One launch's base logits are addressed in 32 bits: a float head of a vocabulary that large
    falls back (the int8 head's L2 limit comes first), as does one whose CTA's shared memory would
    not hold its fixed part."""
    vocab = 2**32 // (64 * 16)
    assert native.cuda_unsupported_reason(64, 16, vocab - 1, _rank(), jnp.bfloat16, jnp.bfloat16) is None
    reason = native.cuda_unsupported_reason(64, 16, vocab, _rank(), jnp.bfloat16, jnp.bfloat16)
    assert reason is not None and "2^32" in reason
    # 8 requests of that vocabulary are well inside it; fp32 W1 takes two columns a request
    assert native.cuda_unsupported_reason(8, 16, vocab, _rank(), jnp.bfloat16, jnp.bfloat16) is None
    assert "2^32" in native.cuda_unsupported_reason(64, 16, 2 * vocab, _rank(), jnp.float32, jnp.float16)
    # Below 2^32 there, a CTA's W2 scales alone (8.4M rows over 132 SMs) outgrow its shared memory.
    reason = native.cuda_unsupported_reason(64, 16, 2 * vocab - 1, _rank(), jnp.float32, jnp.float16)
    assert reason is not None and "shared memory" in reason


@needs_cuda_module
@needs_plan
def test_lowering_float_heads_for_cuda():
    """fp16 and bf16 heads walk in the kernel unquantized; an fp32 W2 falls back to the reference
    (impl="ffi" names the formats the kernel walks)."""
    for w2_dtype in (jnp.bfloat16, jnp.float16):
        assert CUSTOM_CALL in _lowered_text("cuda", "auto", quantized=False, w2_dtype=w2_dtype)
    f32 = _lowered_text("cuda", "auto", quantized=False, w2_dtype=jnp.float32)
    assert CUSTOM_CALL not in f32 and "stablehlo.while" in f32
    with pytest.raises(ValueError, match="float16 or bfloat16 W2, got float32"):
        _lowered_text("cuda", "ffi", quantized=False, w2_dtype=jnp.float32)
    # above CUDA_FLOAT_W2_AUTO_MAX_BATCH requests "auto" walks an unquantized head on the reference,
    # "ffi" still on the kernel; an int8 head stays on the kernel
    wide = native.CUDA_FLOAT_W2_AUTO_MAX_BATCH + 1
    auto_wide = _lowered_text("cuda", "auto", quantized=False, batch=wide)
    assert CUSTOM_CALL not in auto_wide and "stablehlo.while" in auto_wide
    assert CUSTOM_CALL in _lowered_text("cuda", "ffi", quantized=False, batch=wide)
    assert CUSTOM_CALL in _lowered_text("cuda", "auto", quantized=True, batch=wide)


@needs_plan
def test_columns_per_request():
    assert native.cuda_columns_per_request(jnp.float16, jnp.bfloat16) == 2
    assert native.cuda_columns_per_request(jnp.float16, jnp.int8) == 1
    assert native.cuda_columns_per_request(jnp.float32, jnp.float16) == 2
    assert native.cuda_columns_per_request(jnp.bfloat16, jnp.bfloat16) == 1


@needs_plan
def test_which_launches_take_the_transposed_kernel():
    """Launches of 17-64 requests over int8 W2 with V % 8 == 0 take the transposed kernel, greedy or
    sampled, with logits out only for a bf16 W1 (the precision of its logits); fp32 W1 walks 32
    requests a launch; a head with tiles walks 9-16 greedy requests with no logits out there too;
    everything else takes MarkovWalkKernel.
    (The GPU tests assert this of their cases, so that a case meant for one kernel cannot drift to
    the other unseen.)"""
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    assert native.cuda_transposed_launches(17, 151936, bf16) == [True]
    assert native.cuda_transposed_launches(64, 151936, bf16) == [True]
    assert native.cuda_transposed_launches(16, 151936, bf16) == [False]
    assert native.cuda_transposed_launches(100, 20008, bf16) == [True, True]  # 64 + 36
    assert native.cuda_transposed_launches(65, 151936, bf16) == [True, False]  # 64 + 1
    assert native.cuda_transposed_launches(64, 151936, f32) == [True, True]  # 32 + 32
    assert native.cuda_transposed_launches(40, 151936, f32) == [True, False]  # 32 + 8
    for vocab in (20010, 20011, 20004):  # V % 8 != 0
        assert native.cuda_transposed_launches(24, vocab, bf16) == [False]
    assert native.cuda_transposed_launches(24, 151936, bf16, logits_out=True) == [True]
    assert native.cuda_transposed_launches(64, 151936, bf16, logits_out=True) == [True]
    assert native.cuda_transposed_launches(16, 151936, bf16, logits_out=True) == [False]
    assert native.cuda_transposed_launches(84, 20008, bf16, logits_out=True) == [True, True]  # 64 + 20
    assert native.cuda_transposed_launches(24, 20010, bf16, logits_out=True) == [False]  # V % 8 != 0
    assert native.cuda_transposed_launches(24, 151936, f16) == [True]
    assert native.cuda_transposed_launches(24, 151936, f16, logits_out=True) == [False]
    assert native.cuda_transposed_launches(64, 151936, f32, logits_out=True) == [False, False]
    for batch in (9, 12, 16):  # EREGS's and the fp16 columns' launches, but for a head with tiles
        assert native.cuda_transposed_launches(batch, 151936, bf16, w2_tiles=True) == [True]
        assert native.cuda_transposed_launches(batch, 151936, f32, w2_tiles=True) == [True]
        assert native.cuda_transposed_launches(batch, 151936, bf16, logits_out=True, w2_tiles=True) == [True]
        assert native.cuda_transposed_launches(batch, 20010, bf16, w2_tiles=True) == [False]  # V % 8 != 0
    assert native.cuda_transposed_launches(8, 151936, bf16, w2_tiles=True) == [False]  # the digit pairs
    assert native.cuda_transposed_launches(65, 151936, bf16, w2_tiles=True) == [True, False]  # 64 + 1
    assert native.cuda_transposed_launches(73, 151936, bf16, w2_tiles=True) == [True, True]  # 64 + 9
    # A GPU whose shared memory cannot hold the transposed kernel's fixed part but MarkovWalkKernel's
    # (4 SMs: 594 tiles of 64 rows a CTA; an L2 large enough that the int8 W2 it streams stays there).
    four_sms = dict(native.ASSUMED_GPU, sm_count=4, l2_bytes=2**30)
    assert native.cuda_transposed_launches(24, 151936, bf16, props=four_sms) == [False]
    assert native.cuda_transposed_launches(24, 151936, bf16, props=dict(four_sms, sm_count=8)) == [True]
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16, got float64"):
        native.cuda_transposed_launches(24, 151936, jnp.float64)


def _custom_call_operands(text: str) -> int:
    (line,) = [line for line in text.splitlines() if CUSTOM_CALL in line]
    return len(line.split(CUSTOM_CALL + "(")[1].split(")")[0].split(","))


def test_lowering_ffi_for_cuda():
    if native.cuda_available():
        text = _lowered_text("cuda", "ffi")
        # The CUDA handler binds the walk's ten operands (ffi/README.md); a CertifiedMarkovHead's two
        # more come only with that head (tests/test_certified.py).
        assert _custom_call_operands(text) == 10
        assert _custom_call_operands(_lowered_text("cuda", "ffi", quantized=False)) == 10
        with pytest.raises(ValueError, match=r"impl='ffi' on cuda: the CUDA kernel needs rank r = 256"):
            _lowered_text("cuda", "ffi", rank=R)
    else:
        with pytest.raises(ValueError, match=r"impl='ffi' on cuda: the jax_markov CUDA module is not built"):
            _lowered_text("cuda", "ffi", rank=R)


def test_lowering_for_cpu():
    text = _lowered_text("cpu", "auto", rank=R, quantized=False)
    assert (CUSTOM_CALL in text) == native.cpu_available()
    if not native.cpu_available():
        assert "stablehlo.while" in text
