"""examples/speculative_decoding_gpu.py on its tiny configuration (any device; on the CPU its kernel
arms run the CPU custom call), and the head fit it shares with examples/speculative_decoding.py:

- the factored fit is the truncated SVD of the dense bias matrix that the toy example used to form;
- drafters of two block sizes fitted from one computation of the target's factors get the heads that
  fitting each alone gives;
- the target alone is timed once per batch and mode (its program does not depend on K);
- the heads' fit, on a thread of its own, reads a clone of the target (nnx.jit writes state back into
  the modules it is given), not the target that the programs are lowered from meanwhile;
- a run compiles every program it runs before the first run, and none of them again during the runs;
- a run writes a report whose every arm ran, whose greedy arms reproduce the target's greedy text
  (each arm's own program with every draft set aside, and the separately compiled reference: the
  target on the verify step's K + 1 query rows), whose verify-step parts (from a
  profile of one decode) and memory are measured; the greedy check finds a planted difference;
- the summary counts the settings where the int8 kernel beats the eager walk and the published gain;
- --merge joins runs over different settings and refuses runs that do not belong together.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples import speculative_decoding as toy
from examples import speculative_decoding_gpu as gpu_example
from examples import speculative_gpu_report as gpu_report
from jax_markov import flax as jmf
from jax_markov import speculative as sp

SETTINGS = ["3,1,greedy", "3,2,sampled"]


def test_factored_fit_is_the_truncated_svd_of_the_dense_bias():
    cfg = dict(gpu_example.TINY, dtype="float32", markov_rank=8)  # rank 8 < bigram rank 16: a real truncation
    target = toy.build_target(cfg)
    drafter, _, error = toy.build_drafters(cfg, target, 4)
    v = cfg["vocab"]

    # the dense bias as the toy example formed it: the bigram table minus the mask rows' mean logits,
    # rows centred, from plain forwards
    table = target(jnp.arange(v)[:, None], jnp.zeros(v, jnp.int32), target.init_cache(v, 1)).logits[:, 0]
    sample = jax.random.randint(jax.random.key(cfg["seed"] + 2), (16, 16), 0, v - 1)
    out = target(sample, jnp.zeros(16, jnp.int32), target.init_cache(16, 16), feature_layers=drafter.target_layer_ids)
    ctx = drafter.extend_context(out.features, jnp.zeros(16, jnp.int32), drafter.init_context(16, 17))
    hidden = drafter.hidden(sample[:, -1], jnp.full(16, 15), ctx, embed=target.embed)
    bias = table - jnp.mean(drafter.base_logits(hidden, unembed=target.unembed)[:, 1:], axis=(0, 1))[None, :]
    bias = bias - bias.mean(axis=1, keepdims=True)
    dense = jmf.MarkovHead(v, cfg["markov_rank"], param_dtype=jnp.float32)
    dense_error = dense.fit(bias)

    def product(head):
        return np.asarray(head.markov_w1[...] @ head.markov_w2[...].T)

    np.testing.assert_allclose(product(drafter.markov_head), product(dense), atol=2e-3 * float(jnp.max(jnp.abs(bias))))
    assert 0.01 < error < 1 and error == pytest.approx(dense_error, rel=1e-3)


def test_drafters_of_every_block_size_share_the_targets_factors_and_fit_as_alone():
    cfg = dict(gpu_example.TINY)
    target = toy.build_target(cfg)
    factors = toy.target_factors(target, cfg)
    for block_size in (3, 7):
        _, alone, error = toy.build_drafters(cfg, target, block_size)
        _, shared, shared_error = toy.build_drafters(cfg, target, block_size, factors=factors)
        assert shared_error == error  # the mask rows' mean hidden state differs with K: the fit too
        for name in alone:
            for a, b in zip(jax.tree.leaves(nnx.state(alone[name])), jax.tree.leaves(nnx.state(shared[name]))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_target_alone_is_timed_once_per_batch_and_mode():
    """Its program does not depend on K: the first block size of a batch and mode times it beside the
    drafter arms, a later one times only the drafter arms and repeats that timing."""
    calls = {}

    def run(name):
        def fn():
            calls[name] = calls.get(name, 0) + 1
            return f"{name} result"
        return fn

    timings = {}
    first, first_seconds = gpu_example.time_arms({"target": run("target"), "eager": run("eager")}, 2,
                                                 lambda text: None, timings, (1, "greedy"))
    assert calls == {"target": 3, "eager": 3}  # one untimed first run, then 2 timed
    later, later_seconds = gpu_example.time_arms({"target": run("target"), "eager": run("eager")}, 2,
                                                 lambda text: None, timings, (1, "greedy"))
    assert calls == {"target": 3, "eager": 6}
    assert list(later) == ["target", "eager"] and later["target"] == "target result"
    assert later_seconds["target"] is first_seconds["target"] and len(later_seconds["eager"]) == 2
    gpu_example.time_arms({"target": run("target"), "eager": run("eager")}, 2, lambda text: None, timings,
                          (2, "greedy"))
    assert calls == {"target": 6, "eager": 9}  # another batch: the target alone is timed again


def test_the_fit_reads_a_clone_of_the_target_that_the_programs_are_lowered_from(monkeypatch):
    """The fit's thread calls nnx.jit functions, which write their state back into the modules they are
    given: it gets module objects of its own (sharing the target's arrays), never those that the main
    thread lowers the programs from at the same time."""
    cfg = dict(gpu_example.TINY)
    target = toy.build_target(cfg)
    seen = []
    fit_heads = gpu_example.fit_heads

    def recording_fit(fit_target, *args):
        shared = [a is b for a, b in zip(jax.tree.leaves(nnx.state(fit_target)), jax.tree.leaves(nnx.state(target)),
                                         strict=True)]
        seen.append((fit_target, shared))
        return fit_heads(fit_target, *args)

    monkeypatch.setattr(gpu_example, "fit_heads", recording_fit)
    gpu_example.build_and_compile(target, cfg, [(3, 1, "greedy")], ["eager"], 2, lambda text: None)
    [(fit_target, shared)] = seen
    assert fit_target is not target
    assert fit_target.model.layers[0] is not target.model.layers[0]
    assert all(shared)  # when the fit starts, the same arrays: no copy of the weights


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_example") / "tiny"
    status = gpu_example.main(["--tiny", "--settings", *SETTINGS, "--repeats", "2", "--out", str(out)])
    return status, out, json.loads(out.with_suffix(".json").read_text())


def test_a_tiny_run_measures_every_arm_and_keeps_the_targets_greedy_text(tiny_run):
    status, out, report = tiny_run
    assert status == 0
    cfg = gpu_example.TINY
    assert {gpu_report.row_key(r) for r in report["rows"]} == {
        (3, b, mode, arm) for b, mode in ((1, "greedy"), (2, "sampled")) for arm in ("target", *gpu_report.WALK_ARMS)}
    v, r = cfg["vocab"], cfg["markov_rank"]
    int8 = v * r * 2 + v * r + v * 4  # W1 bf16, W2 int8, scales
    head_bytes = {"eager": 2 * v * r * 2, "kernel-bf16": 2 * v * r * 2, "kernel-int8": int8,
                  "kernel-certified": int8 + v * r * 2 + v * 4}  # and the certificate: W2 bf16, a norm a row
    for row in report["rows"]:
        assert len(row["seconds"]) == 2 and row["tokens_per_s"] > 0
        assert row["tokens_per_s_range"][0] <= row["tokens_per_s"] <= row["tokens_per_s_range"][1]
        # a setting at B = 1 decodes several requests one after another in each run
        rounds = cfg["b1_rounds"] if row["batch"] == 1 else 1
        assert row["rounds"] == rounds and cfg["b1_rounds"] > 1
        tokens = rounds * row["batch"] * cfg["new_tokens"]
        assert row["tokens_per_s"] == pytest.approx(tokens / np.median(row["seconds"]))
        if row["arm"] == "target":
            assert row["iterations"] == rounds * (cfg["new_tokens"] - 1)  # one forward per token after the first
            # the plain decode beside the reference (K + 1 query rows): compared, never a failure
            assert isinstance(row["divergences"], list) if row["mode"] == "greedy" else "divergences" not in row
            continue
        assert 1.0 <= row["acceptance_length"] <= 4.0  # K = 3: at most 3 drafts + 1 per verify step
        assert row["iterations"] < rounds * (cfg["new_tokens"] - 1)
        if row["mode"] == "greedy":
            assert row["divergences"] == [] and row["reference_divergences"] == []
        else:
            assert 0 < row["accepted"] <= row["drafted"]
        # the verify step from a profile of one decode: every part and the rest, each op counted once
        parts = row["parts_ms"]
        assert set(parts) == set(gpu_report.PARTS) and min(parts.values()) >= 0
        assert min(parts[p] for p in ("target forward", "drafter", "walk")) > 0
        assert row["top_ops"] and all(part in parts for part, *_ in row["top_ops"])
        assert row["op_families"] and all(part in parts for part, *_ in row["op_families"])
        assert row["head_bytes"] == head_bytes[row["arm"]]
        assert row["walk_scratch_bytes"] >= 0 and row["drafter_bytes"] > 0 and row["context_bytes"] > 0
    text = out.with_suffix(".md").read_text()
    assert "token for token: 4 of 4 greedy drafter arms" in text
    assert "equal to the separately compiled reference's text: 4 of 4" in text
    assert text.count("identical to the target's greedy text") == 4
    assert "the certified int8 head's greedy drafts accepted as the bf16 head's (kernel), draft for draft: 1 of 1" in text
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_run_compiles_its_programs_before_the_runs_and_none_of_them_during_the_runs(tiny_run):
    _, _, report = tiny_run
    run = report["runs"][0]
    # the fit's (the target's hidden states, the mask rows at K = 3), per setting the target alone, the
    # 4 drafter arms and their 4 walks, the greedy setting's reference and the check's forward
    assert run["compile"]["programs"] == 2 + 2 * (1 + 4 + 4) + 2
    assert run["compile"]["wall_s"] >= run["compile"]["longest_s"] > 0
    programs = {"jit(_speculative)", "jit(_autoregressive)", "jit(logits_at)", "jit(<lambda>)", "jit(final_hidden)",
                "jit(mask_hidden)"}
    assert not programs & set(run["compiled_during_runs"])  # eager ops' small programs only
    assert "compiled 22 programs in" in gpu_report.markdown(report)


def test_the_greedy_check_finds_a_difference_and_the_targets_margin_there():
    cfg = dict(gpu_example.TINY)
    target = toy.build_target(cfg)
    prompt, lengths = gpu_example.prompts(cfg, 2)
    reference = sp.target_decode(target, prompt, lengths, max_new_tokens=cfg["new_tokens"])
    assert gpu_example.divergences(target, reference, reference) == []
    tokens = np.array(reference.tokens)
    position = cfg["prompt_len"] + 5
    tokens[1, position] = (tokens[1, position] + 1) % cfg["vocab"]  # request 1 differs from its 6th new token on
    found = gpu_example.divergences(target, reference._replace(tokens=jnp.asarray(tokens)), reference)
    assert [(d["request"], d["new_token"]) for d in found] == [(1, 5)]
    assert found[0]["logit_gap"] > 0  # the target prefers its own greedy token


def row(k, b, mode, arm, tokens_per_s, ms_per_iteration):
    return dict(block_size=k, batch=b, mode=mode, arm=arm, tokens_per_s=tokens_per_s,
                ms_per_iteration=ms_per_iteration, divergences=[])


def test_the_summary_counts_the_settings_above_the_eager_walk_and_the_published_gain():
    rows = []
    # (7, 1, greedy) published +4.3%: +5% is above; (16, 1, greedy) published +9.3%: +5% is below;
    # (16, 16, sampled) has no published gain; (7, 16, greedy): the kernel is slower
    for setting, gain in (((7, 1, "greedy"), 1.05), ((16, 1, "greedy"), 1.05), ((16, 16, "sampled"), 1.2),
                          ((7, 16, "greedy"), 0.9)):
        rows += [row(*setting, "eager", 100.0, 10.0), row(*setting, "kernel-int8", 100.0 * gain, 8.0)]
    rows[-1]["divergences"] = [dict(request=0, new_token=3, logit_gap=0.0)]
    lines = gpu_report.summary(rows)
    assert "beat the eager walk's at 3 of 4 settings" in lines[0]
    assert "more than the published gain at 1 of the 3 settings that have one" in lines[0]
    assert "iterations were faster than the eager walk's at 4 of 4" in lines[0]
    assert "5 of 6 greedy drafter arms" in lines[1]  # the eager and int8 arms of 3 greedy settings
    gains = gpu_report.gains(rows)
    assert gains[(7, 1, "greedy", "kernel-int8")]["gain"] == pytest.approx(5.0)
    assert gains[(7, 1, "greedy", "kernel-int8")]["iteration_gain"] == pytest.approx(25.0)  # 10 ms -> 8 ms
    assert gains[(7, 1, "greedy", "eager")] == dict(gain=0.0, iteration_gain=0.0, speedup=None)


def test_merge_joins_settings_and_refuses_other_commits(tiny_run):
    _, _, report = tiny_run
    greedy = dict(report, rows=[r for r in report["rows"] if r["mode"] == "greedy"])
    sampled = dict(report, rows=[r for r in report["rows"] if r["mode"] == "sampled"])
    merged = gpu_report.merge_reports([greedy, sampled], "merge")
    assert sorted(map(gpu_report.row_key, merged["rows"])) == sorted(map(gpu_report.row_key, report["rows"]))
    assert len(merged["runs"]) == 2 and merged["merge_command"] == "merge"
    assert "merged into one report by `merge`" in gpu_report.markdown(merged)
    with pytest.raises(ValueError, match="commit"):
        gpu_report.merge_reports([greedy, dict(sampled, commit="other")], "merge")


def test_off_a_gpu_the_report_needs_a_name():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("on a GPU the report is named after it")
    with pytest.raises(SystemExit):
        gpu_example.main(["--tiny"])


def test_prompts_are_fixed_and_shared_across_batch_sizes():
    one, _ = gpu_example.prompts(gpu_example.TINY, 1)
    many, lengths = gpu_example.prompts(gpu_example.TINY, 16)
    np.testing.assert_array_equal(one[0], many[0])
    assert int(jnp.max(many)) < toy.mask_token(gpu_example.TINY) and lengths.shape == (16,)


def test_xla_flags_are_added_before_the_backend_starts_and_never_twice(monkeypatch, tmp_path):
    from jax._src import xla_bridge

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_exclude_nondeterministic_ops=false --xla_dump_to=/tmp/x")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
    jax.devices()
    assert gpu_example.set_xla_flags(False).endswith("(set before this run)")  # this process's backend runs
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    flags = gpu_example.set_xla_flags(True).split()
    assert flags == ["--xla_gpu_exclude_nondeterministic_ops=false", "--xla_dump_to=/tmp/x",
                     "--xla_gpu_enable_command_buffer=",
                     f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path / 'xla_autotune'}",
                     "--xla_gpu_deterministic_ops=true"]  # the caller's own setting kept
    monkeypatch.setenv("XLA_FLAGS", "")
    assert gpu_example.set_xla_flags(False).split() == [
        "--xla_gpu_enable_command_buffer=", f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path / 'xla_autotune'}"]
    monkeypatch.setenv("XLA_FLAGS", "")  # command buffers on: XLA's default left alone
    assert gpu_example.set_xla_flags(False, command_buffers=True).split() == [
        f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path / 'xla_autotune'}"]
    assert (tmp_path / "xla_autotune").is_dir()


def test_the_certified_arm_runs_where_the_plan_takes_its_batch_and_must_accept_as_the_bf16_head(monkeypatch):
    from jax_markov import native

    if not native.plan_available():
        pytest.skip("the launch plan module is not built")
    monkeypatch.setattr(native, "_markov_cuda", native._markov_cuda or object())  # the plan needs no GPU
    cfg, lines = gpu_example.QWEN3_4B, []
    arms = gpu_report.WALK_ARMS
    assert gpu_example.setting_arms(arms, cfg, (7, 1, "greedy"), lines.append) == arms and not lines
    assert gpu_example.setting_arms(arms, cfg, (7, 16, "sampled"), lines.append) == tuple(
        arm for arm in arms if arm != "kernel-certified")
    assert len(lines) == 1 and lines[0].startswith("  K=7 B=16 sampled: no kernel-certified arm (")

    def row(arm, accepted, mode="greedy", batch=1):
        return dict(block_size=7, batch=batch, mode=mode, arm=arm, accepted=accepted, drafted=700)

    rows = [row("kernel-bf16", 400), row("kernel-certified", 400), row("kernel-int8", 380),
            row("kernel-bf16", 401, batch=2), row("kernel-certified", 399, batch=2),
            row("kernel-bf16", 300, "sampled"), row("kernel-certified", 250, "sampled")]  # sampled: int8 semantics
    assert gpu_report.certified_acceptance(rows) == {(7, 1): True, (7, 2): False}
