"""jax_markov.sharding on 8 CPU host devices: every layout against the single-device walk.

The tests need 8 devices, which XLA only creates when --xla_force_host_platform_device_count=8 is
in XLA_FLAGS before the backend starts. In a plain `pytest` run other test files have started it
with one device already, so `test_sharding_suite_on_8_host_devices` runs this file again in a fresh
`python -P -m pytest` with the flag (and JAX_PLATFORMS=cpu, and the same jax_markov), and the
8-device tests are not collected here. With the flag in XLA_FLAGS (as in the child) they run in
this process and the launcher skips:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_sharding.py

The data make the comparisons exact: dyadic head weights (every bias is exact in float32, in any
summation order) and continuous base logits, so the sharded walks must give the single-device
tokens, logits and embeddings bit for bit; the tie/NaN/padding test builds its expectations by hand.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import site
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_markov
from jax_markov import sharding

N_DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={N_DEVICES}"
# The 8-device tests exist only where XLA was asked for 8 host devices (the child run); elsewhere
# they are dropped from the module at the end of this file instead of being reported as skipped.
EIGHT_DEVICE_RUN = FLAG in os.environ.get("XLA_FLAGS", "")
_EIGHT_DEVICE_TESTS = []


def needs_8(fn):
    _EIGHT_DEVICE_TESTS.append(fn.__name__)
    return fn


B, K, V, V_TARGET, R = 16, 3, 64, 128, 16
VOCAB_SIZE = 60  # the last 4 columns are padding
AXES = ("batch", "vocab")
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter|"
                        r"collective-broadcast|ragged-all-to-all)(-start)?\(")


# ----------------------------------------------------------------------------- the launcher


def test_sharding_suite_on_8_host_devices():
    package = os.path.dirname(os.path.abspath(jax_markov.__file__))
    if EIGHT_DEVICE_RUN:
        assert jax.device_count() >= N_DEVICES, f"XLA_FLAGS has {FLAG} but jax sees {jax.devices()}"
        parent = os.environ.get("JAX_MARKOV_SHARDING_PARENT_PACKAGE")
        assert parent is None or os.path.samefile(parent, package), (parent, package)
        pytest.skip("8 host devices in this process: the tests below run here")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG).strip()
    env["JAX_PLATFORMS"] = "cpu"
    # The child imports the jax_markov this process imported (installed, or the source tree):
    # -P keeps the working directory off sys.path, PYTHONPATH puts the package's parent first.
    if os.path.dirname(package) not in site.getsitepackages() + [site.getusersitepackages()]:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(package), env.get("PYTHONPATH")) if p)
    env["JAX_MARKOV_SHARDING_PARENT_PACKAGE"] = package
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.abspath(__file__)], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"the 8-device run failed:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    skipped = re.search(r"(\d+) skipped", summary)
    assert passed >= 20 and (skipped is None or int(skipped.group(1)) == 1), f"unexpected child summary: {summary}"


# ----------------------------------------------------------------------------- data


def _dyadic(rng, shape, dtype):
    """Weights k/4, |k| <= 8: every product and every sum of r = 16 of them is exact in float32,
    so the Markov bias is the same bits in any summation order, on any device split."""
    return jnp.asarray(rng.integers(-8, 9, shape) / 4.0, dtype)


@functools.cache
def _case(name):
    """(kwargs of the walk, head): the three walks every layout is checked with."""
    rng = np.random.default_rng({"float_mixed": 1, "int8_greedy": 2, "int8_sampled": 3}[name])
    base = rng.normal(0.0, 2.0, (B, K, V)).astype(np.float32)
    anchor = rng.integers(0, V_TARGET, B)
    anchor[:2] = (-5, V_TARGET + 7)  # clamped into range
    sampled = dict(key=jax.random.split(jax.random.key(int(rng.integers(1 << 30))), B),
                   position=jnp.asarray(rng.integers(0, 10_000, B), jnp.int32))
    temps = rng.uniform(0.5, 1.5, B).astype(np.float32)
    if name == "float_mixed":  # bf16 head, greedy and sampled rows, bf16 logits, d2t, padding
        head = jax_markov.MarkovHead(_dyadic(rng, (V_TARGET, R), jnp.bfloat16), _dyadic(rng, (V, R), jnp.bfloat16))
        temps[::3] = 0.0
        kw = dict(base_logits=jnp.asarray(base), temperature=jnp.asarray(temps), **sampled,
                  vocab_size=VOCAB_SIZE, d2t=jnp.asarray(rng.integers(0, V_TARGET - V, V), jnp.int32),
                  return_logits=True, logits_dtype=jnp.bfloat16, return_embeds=True, impl="reference")
    elif name == "int8_greedy":  # int8 head, every row greedy, float32 logits, the primitive per device
        head = jax_markov.quantize(jax_markov.MarkovHead(_dyadic(rng, (V_TARGET, R), jnp.bfloat16),
                                                         _dyadic(rng, (V, R), jnp.float32)))
        kw = dict(base_logits=jnp.asarray(base, jnp.bfloat16), logit_scale=0.75, return_logits=True,
                  return_embeds=True, impl="auto")
    else:  # int8 head, every row sampled, float16 base logits
        head = jax_markov.quantize(jax_markov.MarkovHead(_dyadic(rng, (V_TARGET, R), jnp.float32),
                                                         _dyadic(rng, (V, R), jnp.float32)))
        kw = dict(base_logits=jnp.asarray(base, jnp.float16), temperature=jnp.asarray(temps), **sampled,
                  vocab_size=VOCAB_SIZE, impl="reference")
    kw["anchor"] = jnp.asarray(anchor, jnp.int32)
    return kw, head


@functools.cache
def _single_device(name, impl=None):
    """The walk of case `name` on one device (with its own impl, or `impl`)."""
    kw, head = _case(name)
    out = jax_markov.walk(head=head, **dict(kw, impl=impl or kw["impl"]))
    return jax.tree.map(np.asarray, out)


STATIC = ("vocab_size", "logit_scale", "return_logits", "logits_dtype", "return_embeds", "impl")


def _split(kw):
    """(array arguments, static arguments) of a walk."""
    return ({k: v for k, v in kw.items() if k not in STATIC}, {k: v for k, v in kw.items() if k in STATIC})


def _mesh(shape, axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, AXES, axis_types=(axis_type,) * 2)


def _layout_kwargs(layout, name):
    if layout == "batch":
        return dict(layout="batch")  # rows over both mesh axes
    if layout == "replicated":
        return dict(layout="replicated", batch_axis="batch")
    return dict(layout="vocab", batch_axis="batch", vocab_axis="vocab", w1_sharded=name == "int8_greedy")


def _place(mesh, layout, kw, head, *, w1_sharded=False, rows=None):
    """The inputs as a caller of each layout holds them: requests split like the rows (`rows`, or
    the layout's); in the vocab layout W2, its scales, d2t and the base logits split along the
    vocabulary; the replicated layout receives vocabulary-sharded base logits (as from a
    tensor-parallel LM head)."""
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    rows = rows or (("batch", "vocab") if layout == "batch" else "batch")
    cols = None if layout == "batch" else "vocab"
    kw = dict(kw)
    for f in ("anchor", "temperature", "key", "position"):
        if f in kw:
            kw[f] = put(kw[f], rows)
    kw["base_logits"] = put(kw["base_logits"], rows, None, cols)
    along = "vocab" if layout == "vocab" else None
    if "d2t" in kw:
        kw["d2t"] = put(kw["d2t"], along)
    fields = {f.name: getattr(head, f.name) for f in dataclasses.fields(head)}
    fields = {f: put(x, along if f != "w1" or w1_sharded else None) for f, x in fields.items()}
    return kw, type(head)(**fields)


def _assert_same(out, ref, what):
    np.testing.assert_array_equal(np.asarray(out.tokens), ref.tokens, err_msg=f"{what}: tokens")
    for field in ("logits", "embeds"):
        got, want = getattr(out, field), getattr(ref, field)
        assert (got is None) == (want is None), f"{what}: {field}"
        if want is not None:
            assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {field} {got.dtype}{got.shape}"
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                          err_msg=f"{what}: {field}")


# ----------------------------------------------------------------------------- parity and compiled programs

MESHES = [((1, 8), AxisType.Auto), ((2, 4), AxisType.Explicit), ((8, 1), AxisType.Explicit)]
NAMES = ("float_mixed", "int8_greedy", "int8_sampled")


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and line.strip():
            comps[name].append(line)
    return comps


def _collectives(hlo):
    """[(op, result type, the while body it is in or None, known trip count of that loop)]."""
    comps = _computations(hlo)
    bodies = {}
    for lines in comps.values():
        for line in lines:
            if " while(" in line:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                bodies[re.search(r"body=%?([\w.\-]+)", line).group(1)] = int(trip.group(1)) if trip else None
    assert bodies, "no K-step loop found"
    found = []
    for comp, lines in comps.items():
        for line in lines:
            m = COLLECTIVE.search(line)
            if m:
                result = re.match(r"\s*%?[\w.\-]+ = (\(.*?\)|\w+\[[\d,]*\])", line).group(1)
                result = re.sub(r"\{[\d,]*\}", "", result)  # drop layouts
                found.append((m.group(1), result, comp if comp in bodies else None, bodies.get(comp)))
    return sorted(found, key=str)


def _per_loop(found):
    """The collectives of each K-step loop (sorted), and those outside every loop."""
    loops = {}
    for op, result, body, trip in found:
        if body is not None:
            loops.setdefault(body, []).append((op, result, trip))
    return sorted(sorted(v) for v in loops.values()), [(op, result) for op, result, body, _ in found if body is None]


@functools.cache
def _compiled(shape, axis_type, layout):
    """The three walks of NAMES in one jitted program on this mesh and layout, inputs placed as
    the layout expects; checks them against the single-device walk bit for bit and returns
    ({name: result}, collectives of the compiled HLO)."""
    mesh = _mesh(shape, axis_type)
    layout_kws = [_layout_kwargs(layout, n) for n in NAMES]
    args = [_place(mesh, layout, *_case(n), w1_sharded=lk.get("w1_sharded", False)) for n, lk in zip(NAMES, layout_kws)]
    statics = [_split(kw)[1] for kw, _ in args]
    args = [(_split(kw)[0], head) for kw, head in args]

    def walks(args):
        return [sharding.walk(head=head, mesh=mesh, **kw, **static, **lk)
                for (kw, head), static, lk in zip(args, statics, layout_kws)]

    compiled = jax.jit(walks).lower(args).compile()
    outs = dict(zip(NAMES, compiled(args)))
    for name, out in outs.items():
        _assert_same(out, _single_device(name), f"{name} {layout} {shape} {axis_type.name}")
    return outs, _collectives(compiled.as_text())


@needs_8
@pytest.mark.parametrize("layout", sharding.LAYOUTS)
@pytest.mark.parametrize("shape,axis_type", MESHES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else x.name)
def test_layout_matches_single_device(shape, axis_type, layout):
    """bf16 head with greedy and sampled rows, int8 head greedy, int8 head sampled: the same tokens,
    logits and embeddings as the single-device walk, bit for bit, sharded as promised."""
    mesh = _mesh(shape, axis_type)
    rows = ("batch", "vocab") if layout == "batch" else "batch"
    for name, out in _compiled(shape, axis_type, layout)[0].items():
        assert out.tokens.sharding.is_equivalent_to(NamedSharding(mesh, P(rows)), 2), out.tokens.sharding
        logits_spec = P(rows, None, "vocab" if layout == "vocab" else None)
        if out.logits is not None:
            assert out.logits.sharding.is_equivalent_to(NamedSharding(mesh, logits_spec), 3), out.logits.sharding
        if out.embeds is not None:
            assert out.embeds.sharding.is_equivalent_to(NamedSharding(mesh, P(rows)), 3), out.embeds.sharding


@needs_8
@pytest.mark.parametrize("shape,axis_type", MESHES, ids=["1x8", "2x4", "8x1"])
def test_batch_layout_compiles_without_collectives(shape, axis_type):
    """Each device walks its own rows: no all-gather of the head or the logits, nothing at all."""
    assert _compiled(shape, axis_type, "batch")[1] == []


@needs_8
@pytest.mark.parametrize("shape,axis_type", MESHES[:2], ids=["1x8", "2x4"])
def test_vocab_layout_one_small_all_gather_per_step(shape, axis_type):
    """In the body of each K-step loop exactly one all-gather of [n_vocab, B_local, 2] uint32 (the
    walk with a sharded W1 adds its [B_local, r] embedding psum); nothing outside the loops: the
    base logits and W2 are never gathered."""
    n_batch, n_vocab = shape
    loops, outside = _per_loop(_compiled(shape, axis_type, "vocab")[1])
    gather = ("all-gather", f"u32[{n_vocab},{B // n_batch},2]", K)
    w1_psum = ("all-reduce", f"u16[{B // n_batch},{R}]", K)  # int8_greedy: w1_sharded=True, bf16 W1
    assert outside == [] and loops == sorted([[gather], [gather], sorted([gather, w1_psum])]), (loops, outside)


@needs_8
@pytest.mark.parametrize("shape,axis_type", MESHES[:2], ids=["1x8", "2x4"])
def test_replicated_layout_gathers_the_base_logits_once(shape, axis_type):
    """Vocabulary-sharded base logits are gathered once, before the walk; nothing in the loops."""
    n_batch, _ = shape
    loops, outside = _per_loop(_compiled(shape, axis_type, "replicated")[1])
    assert loops == [] or all(not ops for ops in loops), loops
    # (XLA on the CPU may widen a bf16/f16 gather to f32, so only the shapes are checked.)
    gathered = re.findall(r"\w+(\[[\d,]*\])", " ".join(result for op, result in outside if op == "all-gather"))
    assert {op for op, _ in outside} == {"all-gather"}, outside
    assert gathered == [f"[{B // n_batch},{K},{V}]"] * 3, outside


@needs_8
def test_context_mesh_and_eager_call():
    """mesh=None takes the mesh of jax.set_mesh; outside jit the walk runs too."""
    mesh = _mesh((2, 4))
    kw, head = _case("int8_greedy")
    with jax.set_mesh(mesh):
        out = sharding.walk(head=head, **kw, layout="vocab", batch_axis="batch")
    _assert_same(out, _single_device("int8_greedy"), "context mesh")
    with pytest.raises(ValueError, match="mesh is required"):
        sharding.walk(head=head, **kw, layout="vocab")


@needs_8
def test_plain_jit_with_batch_sharded_inputs_partitions_without_collectives():
    """jax_markov.walk itself under jax.jit with batch-sharded inputs on an Auto mesh: XLA
    partitions the pure-JAX lowering along the batch, no collective."""
    mesh = _mesh((8, 1), AxisType.Auto)
    kw, head = _place(mesh, "batch", *_case("float_mixed"))
    kw, static = _split(kw)
    compiled = jax.jit(lambda kw, head: jax_markov.walk(head=head, **kw, **static)).lower(kw, head).compile()
    out = compiled(kw, head)
    _assert_same(out, _single_device("float_mixed"), "plain jit")
    assert _collectives(compiled.as_text()) == []
    assert out.tokens.sharding.is_equivalent_to(NamedSharding(mesh, P(("batch", "vocab"))), 2)


@needs_8
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_walk_inside_shard_map_with_an_invariant_anchor(impl):
    """jax_markov.walk called directly inside shard_map with an anchor built on every device (not
    varying) while the base logits vary over the mesh: the primitive gives its operands one varying
    type, so the walk traces, and it matches the single-device walk."""
    mesh = _mesh((8, 1), AxisType.Auto)
    kw, head = _case("int8_greedy")
    base = kw["base_logits"]

    def body(base):
        return jax_markov.walk(base, jnp.full((base.shape[0],), 5, jnp.int32), head, impl=impl).tokens

    tokens = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("batch", "vocab")),
                                   out_specs=P(("batch", "vocab"))))(base)
    expected = jax_markov.walk(base, jnp.full((base.shape[0],), 5, jnp.int32), head, impl="reference").tokens
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))


@needs_8
def test_plain_jit_on_an_explicit_mesh_walks_each_devices_rows():
    """jax_markov.walk itself under jax.jit with base logits split over Explicit mesh axes: it
    takes the batch layout (no collective) and matches the single-device walk."""
    mesh = _mesh((2, 4), AxisType.Explicit)
    kw, head = _place(mesh, "batch", *_case("int8_greedy"))
    kw, static = _split(kw)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda kw, head: jax_markov.walk(head=head, **kw, **static)).lower(kw, head).compile()
        out = compiled(kw, head)
    _assert_same(out, _single_device("int8_greedy"), "plain jit, explicit mesh")
    hlo = compiled.as_text()
    assert not any(op in hlo for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute")), hlo


# ----------------------------------------------------------------------------- plain jit: the custom call partitioned

# The result types of each jax_markov_walk custom call in a compiled program: its tokens come first.
FFI_TOKENS = re.compile(r"= \((\w+\[[\d,]*\])\{[\d,]*\}, .*custom_call_target=\"jax_markov_walk\"")


def _plain_jit_ffi(mesh, placed):
    """jax_markov.walk itself with impl="ffi" for each (name, (kwargs, head)) of `placed`, in one
    jitted program; checks each against the single-device custom call bit for bit and returns
    ({name: result}, compiled HLO text)."""
    statics = {name: dict(_split(kw)[1], impl="ffi") for name, (kw, _) in placed.items()}
    args = {name: (_split(kw)[0], head) for name, (kw, head) in placed.items()}

    def walks(args):
        return {name: jax_markov.walk(head=head, **kw, **statics[name]) for name, (kw, head) in args.items()}

    compiled = jax.jit(walks).lower(args).compile()
    outs = compiled(args)
    for name, out in outs.items():
        _assert_same(out, _single_device(name, "ffi"), f"{name} plain jit on {mesh.axis_names}")
    return outs, compiled.as_text()


@needs_8
@pytest.mark.parametrize("rows,partitioner", [("batch", "shardy"), (("batch", "vocab"), "shardy"),
                                              (("batch", "vocab"), "gspmd")],
                         ids=["rows-over-1-axis", "rows-over-2-axes", "rows-over-2-axes-gspmd"])
def test_plain_jit_on_an_auto_mesh_walks_each_devices_rows_in_the_custom_call(rows, partitioner):
    """jax_markov.walk itself under jax.jit, requests split over Auto mesh axes, head replicated:
    the custom call is partitioned (custom_partitioning), each device walks its own rows, nothing
    is gathered. Greedy, sampled and mixed rows, int8 and bf16 heads, logits and embeds on and off."""
    mesh = _mesh((2, 4), AxisType.Auto)
    n_rows = 2 if rows == "batch" else 8
    placed = {name: _place(mesh, "batch", *_case(name), rows=rows) for name in NAMES}
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
    try:
        outs, hlo = _plain_jit_ffi(mesh, placed)
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)
    assert COLLECTIVE.search(hlo) is None, COLLECTIVE.search(hlo)
    assert FFI_TOKENS.findall(hlo) == [f"s32[{B // n_rows},{K}]"] * len(NAMES), hlo
    for name, out in outs.items():
        assert out.tokens.sharding.is_equivalent_to(NamedSharding(mesh, P(rows)), 2), (name, out.tokens.sharding)


@needs_8
def test_plain_jit_with_a_vocab_sharded_head_on_an_auto_mesh():
    """Requests over "batch", base logits, W2, its scales, d2t (and W1 for the int8 greedy walk)
    split along the vocabulary over "vocab": the vocabulary is gathered, the custom call still walks
    each request group's own rows, and the results are those of the single-device call."""
    mesh = _mesh((2, 4), AxisType.Auto)
    placed = {name: _place(mesh, "vocab", *_case(name), w1_sharded=name == "int8_greedy") for name in NAMES}
    outs, hlo = _plain_jit_ffi(mesh, placed)
    for name, out in outs.items():
        assert out.tokens.sharding.is_equivalent_to(NamedSharding(mesh, P("batch")), 2), (name, out.tokens.sharding)
    assert FFI_TOKENS.findall(hlo) == [f"s32[{B // 2},{K}]"] * len(NAMES), hlo


@needs_8
def test_vmap_under_jit_with_a_sharded_batch():
    """jax.vmap of jax_markov.walk under jax.jit, the mapped axis over "batch" and the requests over
    "vocab": the vmap rule folds both into one request batch, which the custom call walks per
    device without a collective; the results are those of the single-device call."""
    mesh = _mesh((2, 4), AxisType.Auto)
    kw, head = _case("int8_sampled")
    arrays, static = _split(dict(kw, impl="ffi"))
    arrays = {f: x.reshape(2, B // 2, *x.shape[1:]) for f, x in arrays.items()}
    arrays = {f: jax.device_put(x, NamedSharding(mesh, P("batch", "vocab"))) for f, x in arrays.items()}
    compiled = jax.jit(jax.vmap(lambda a: jax_markov.walk(head=head, **a, **static).tokens)).lower(arrays).compile()
    tokens = compiled(arrays)
    expected = _single_device("int8_sampled", "ffi").tokens
    np.testing.assert_array_equal(np.asarray(tokens), expected.reshape(2, B // 2, K))
    hlo = compiled.as_text()
    assert COLLECTIVE.search(hlo) is None, COLLECTIVE.search(hlo)
    assert FFI_TOKENS.findall(hlo) == [f"s32[{B // 8},{K}]"], hlo


# ----------------------------------------------------------------------------- the choice across shards


@needs_8
@pytest.mark.parametrize("shape,batch_axis", [((1, 8), "batch"), ((2, 4), "batch"), ((2, 4), None)],
                         ids=["1x8", "2x4", "2x4-vocab-over-both-axes"])
def test_vocab_layout_ties_nans_signed_zeros_and_padding(shape, batch_axis):
    """The lowest global index wins ties across shards, the first NaN wins (even over +inf in an
    earlier shard), -0 ties with +0, padding columns are never chosen even when huge or NaN."""
    inf, nan = np.inf, np.nan
    n_rows = 8
    base = np.full((n_rows, 1, V), -100.0, np.float32)  # 8 columns per shard on a 1x8 mesh
    expected = np.zeros(n_rows, np.int32)
    base[0, 0, [9, 33, 41]] = 5.0; expected[0] = 9                       # tie over three shards
    base[1, 0, [1, 20, 50]] = (inf, nan, nan); expected[1] = 20           # first NaN, not +inf
    base[2, 0, [3, 40]] = (-0.0, 0.0); base[2, 0, :3] = -1; expected[2] = 3  # -0 == +0
    base[3, 0, [3, 40]] = (0.0, -0.0); expected[3] = 3
    base[3, 0, :3] = -1
    base[4, 0, 50:] = 1e30; base[4, 0, 49] = 7.0; expected[4] = 49        # 50.. are padding (vocab_size=50)
    base[5, 0, 55] = nan; base[5, 0, 56:] = inf; base[5, 0, 10] = 1.0; expected[5] = 10  # NaN/inf padding
    base[6, 0, 48:50] = 2.0; base[6, 0, 63] = 3.0; expected[6] = 48      # tie inside one shard
    base[7] = -inf; expected[7] = 0                                        # all -inf: column 0
    # W2 = 0 and logit_scale = -1: the bias is exactly -0, so l == base bit for bit (-0 stays -0).
    head = jax_markov.MarkovHead(jnp.ones((V, R), jnp.float32), jnp.zeros((V, R), jnp.float32))
    kw = dict(base_logits=jnp.asarray(base), anchor=jnp.zeros(n_rows, jnp.int32), head=head)
    static = dict(vocab_size=50, logit_scale=-1.0, return_logits=True, impl="reference")
    single = jax_markov.walk(**kw, **static)
    np.testing.assert_array_equal(np.asarray(single.tokens)[:, 0], expected)
    mesh = _mesh(shape)
    out = jax.jit(lambda kw: sharding.walk(mesh=mesh, layout="vocab", batch_axis=batch_axis, **kw, **static))(kw)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 0], expected)
    np.testing.assert_array_equal(np.signbit(np.asarray(out.logits)), np.signbit(np.asarray(single.logits)))
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(single.logits))


@needs_8
@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
def test_vocab_layout_noise_on_shards_that_start_inside_a_philox_block(shape, impl):
    """V = 40 over 8 or 4 shards: shards of 5 or 10 columns, most of which start at a global column
    that is not a multiple of 4, i.e. inside a Philox block (docs/spec.md version 2: column v is word
    v mod 4 of block v // 4). Flat base logits and a zero head: the noise alone decides, so every
    token is the argmax of `philox.gumbel_noise` (pinned to the Python-int oracle in
    test_reference.py) over the columns that are neither masked (-inf) nor padding, at T = 1 and at
    T = +inf, as in the single-device walk."""
    from jax_markov import philox

    n_rows, steps, v, vocab_size = 8, 3, 40, 37
    rng = np.random.default_rng(6)
    base = np.full((n_rows, steps, v), 0.25, np.float32)
    base[rng.random(base.shape) < 0.3] = -np.inf
    head = jax_markov.MarkovHead(jnp.ones((v, R), jnp.float32), jnp.zeros((v, R), jnp.float32))
    temperature = jnp.asarray([1.0, np.inf] * (n_rows // 2), jnp.float32)
    key = jax.random.split(jax.random.key(17), n_rows)
    position = jnp.asarray(rng.integers(0, 2**31 - steps, n_rows), jnp.int32)
    kw = dict(base_logits=jnp.asarray(base), anchor=jnp.zeros(n_rows, jnp.int32), head=head,
              temperature=temperature, key=key, position=position)
    static = dict(vocab_size=vocab_size, impl=impl)
    mesh = _mesh(shape)
    out = jax.jit(lambda kw: sharding.walk(mesh=mesh, layout="vocab", batch_axis="batch", vocab_axis="vocab", **kw,
                                           **static))(kw)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens, np.asarray(jax_markov.walk(**kw, **static).tokens))
    words = jax.random.key_data(key)
    noise = np.asarray(philox.gumbel_noise((words[:, 0, None, None], words[:, 1, None, None]),
                                           jnp.arange(v)[None, None, :],
                                           (position[:, None] + jnp.arange(steps))[:, :, None]))
    allowed = (base != -np.inf) & (np.arange(v) < vocab_size)
    np.testing.assert_array_equal(tokens, np.argmax(np.where(allowed, noise, -np.inf), axis=-1))


def test_ordered_score_is_the_float_order():
    values = np.array([-np.inf, -3e38, -1.0, -1e-37, -0.0, 0.0, 1e-37, 1.0, 3e38, np.inf, np.nan, -np.nan],
                      np.float32)
    keys = np.asarray(sharding.ordered_score(jnp.asarray(values)))
    assert list(keys[:4]) == sorted(keys[:4]) and len(set(keys[:4])) == 4
    assert keys[4] == keys[5]  # -0 == +0
    assert list(keys[5:10]) == sorted(keys[5:10]) and len(set(keys[5:10])) == 5
    assert keys[3] < keys[4] < keys[6]
    assert keys[10] == keys[11] == 0xFFFFFFFF > keys[9]


# ----------------------------------------------------------------------------- errors


@needs_8
def test_errors_name_the_argument():
    kw, head = _case("float_mixed")
    mesh = _mesh((2, 4))
    call = lambda **extra: sharding.walk(head=head, mesh=mesh, **{**kw, **extra})
    with pytest.raises(ValueError, match="layout must be one of"):
        call(layout="tensor")
    with pytest.raises(ValueError, match="'model' is not an axis of the mesh"):
        call(layout="batch", batch_axis="model")
    with pytest.raises(ValueError, match="must not share mesh axes"):
        call(layout="vocab", batch_axis="batch", vocab_axis=("vocab", "batch"))
    with pytest.raises(ValueError, match="vocab_axis is only used with layout='vocab'"):
        call(layout="batch", vocab_axis="vocab")
    with pytest.raises(ValueError, match="w1_sharded is only used with layout='vocab'"):
        call(layout="replicated", w1_sharded=True)
    with pytest.raises(ValueError, match=r"B = 6 must be a multiple of the size 8"):
        call(layout="batch", base_logits=kw["base_logits"][:6], anchor=kw["anchor"][:6],
             temperature=kw["temperature"][:6], key=kw["key"][:6], position=kw["position"][:6])
    with pytest.raises(ValueError, match=r"V = 60 must be a multiple of the size 8.*vocab_size"):
        sharding.walk(kw["base_logits"][:, :, :60], kw["anchor"],
                      jax_markov.MarkovHead(head.w1, head.w2[:60]), mesh=mesh, layout="vocab")
    with pytest.raises(ValueError, match="V_target = 126 must be a multiple of the size 4"):
        sharding.walk(kw["base_logits"], kw["anchor"], jax_markov.MarkovHead(head.w1[:126], head.w2), mesh=mesh,
                      layout="vocab", batch_axis="batch", w1_sharded=True)
    with pytest.raises(ValueError, match="at least one mesh axis"):
        call(layout="vocab", batch_axis=("batch", "vocab"))
    with pytest.raises(ValueError, match="key is required"):  # the walk's own checks run first
        sharding.walk(kw["base_logits"], kw["anchor"], head, mesh=mesh, temperature=1.0)


if not EIGHT_DEVICE_RUN:
    for _name in _EIGHT_DEVICE_TESTS:
        del globals()[_name]
