"""One verify step of a decode loop split into its parts, from a profile of one real decode.

The loops of `jax_markov.speculative` run their parts under named scopes (`STEP_SCOPES`), which
become the op names of their HLO ops. A decode run under the profiler gives every op's time: on a
GPU each kernel and copy of the device's streams (CUPTI), elsewhere each of XLA's thunks on the
host (self time: a loop's thunk without the ops inside it). Each event names its HLO op; the
compiled program's HLO text gives that op's name, and the innermost part scope in it the part.
Ops of no part (the text and cache updates, the loop's control, ops that XLA fused across parts)
are the rest of the step; the prefill's are left out. So the parts are the time the loop itself
spent in them and add up, with the rest, to the loop's whole profiled time.
"""
from __future__ import annotations

import glob
import re
import tempfile
from collections import defaultdict

import jax

from jax_markov import speculative as sp

# scope -> part; the drafter's context update counts as the drafter's
PARTS = {"target_forward": "target forward", "drafter": "drafter", "drafter_context": "drafter", "walk": "walk",
         "rejection_sampler": "rejection sampler"}
REST = "rest of the step"
assert set(PARTS) == set(sp.STEP_SCOPES)

_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_RESULT_TYPE = re.compile(r"=\s*(\([^)]*\)|\S+)\s")
_NUMBERED = re.compile(r"\.\d+$")


def common_prefix(names) -> str:
    """The longest common '/'-separated prefix of op names."""
    names = [n.split("/") for n in names if n]
    if not names:
        return ""
    prefix = names[0]
    for parts in names[1:]:
        i = 0
        while i < min(len(prefix), len(parts)) and prefix[i] == parts[i]:
            i += 1
        prefix = prefix[:i]
    return "/".join(prefix)


def hlo_op_names(hlo_text: str) -> tuple[str, dict[str, str]]:
    """(module name, {instruction: op name}) of an HLO module's text. An instruction's op name is its
    own (a fusion's: that of the op it computes, whatever producers it fused), or where it has none,
    the longest common prefix of those of the computations it calls."""
    module, computation = "", None
    own, calls, members = {}, {}, defaultdict(list)
    for line in hlo_text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
        elif line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY ") else 0].lstrip("%")
        elif (m := _INSTRUCTION.match(line)) and computation is not None:
            name = m.group(1)
            members[computation].append(name)
            op_name = _OP_NAME.search(line)
            own[name] = op_name.group(1) if op_name else ""
            calls[name] = [c.strip(" %{}") for group in _CALLS.findall(line) for c in group.split(",")]
    names_in: dict[str, list[str]] = {}

    def computation_names(comp: str, seen=()) -> list[str]:
        if comp not in names_in:
            names_in[comp] = [n for inst in members.get(comp, ()) for n in instruction_names(inst, (*seen, comp))]
        return names_in[comp]

    def instruction_names(inst: str, seen) -> list[str]:
        if own[inst]:
            return [own[inst]]
        return [n for c in calls[inst] if c not in seen for n in computation_names(c, seen)]

    return module, {inst: common_prefix(instruction_names(inst, ())) for inst in own}


def hlo_result_types(hlo_text: str) -> dict[str, str]:
    """{instruction: its result type} of an HLO module's text (e.g. "bf16[16,8,562,128]{3,2,1,0}")."""
    out = {}
    for line in hlo_text.splitlines():
        if (m := _INSTRUCTION.match(line)) and (t := _RESULT_TYPE.search(line, m.end() - 2)):
            out[m.group(1)] = t.group(1)
    return out


def op_family(op: str) -> str:
    """An HLO op's name without its number: the ops one kind of kernel runs under (one a layer)."""
    return _NUMBERED.sub("", op)


def part_of(op_name: str) -> str | None:
    """The part of the innermost part scope in an op name; "prefill" in the prefill; None elsewhere."""
    scopes = op_name.split("/")
    if sp.PREFILL_SCOPE in scopes:
        return sp.PREFILL_SCOPE
    return next((PARTS[s] for s in reversed(scopes) if s in PARTS), None)


def self_times(events):
    """[(module, op, ns)] of one line's (start, end, module, op) events: each instant of the line's busy
    time goes to the latest-started event still running at it. An event that holds others (a loop's
    thunk) thus gets its duration less theirs; of two kernels of one stream that overlap in part (the
    next one launched while the last one's tail runs), the overlap goes to the later one, so no time
    is counted twice or subtracted from an event that did not hold the other."""
    out, running = [], []  # running: [end, index into out], latest-started last
    cursor = float("-inf")  # the instant up to which the busy time has been given out

    def run_until(t):
        nonlocal cursor
        while running and cursor < t:
            end, i = running[-1]
            upto = min(end, t)
            if upto > cursor:
                out[i][2] += upto - cursor
                cursor = upto
            if end <= t:
                running.pop()

    for start, end, module, op in sorted(events, key=lambda e: (e[0], -e[1])):
        run_until(start)
        cursor = max(cursor, start)
        out.append([module, op, 0])
        running.append([end, len(out) - 1])
    if running:
        run_until(max(end for end, _ in running))
    return out


def op_events(trace_dir: str):
    """([(module, HLO op, self ns)] of the trace's ops, "device" or "host"): the GPU streams' kernels
    and copies where the trace has them, else the host's XLA thunks."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    planes = list(ProfileData.from_file(files[0]).planes) if files else []
    gpu = [plane for plane in planes if plane.name.startswith("/device:GPU")]
    lines = [line_events(line) for plane in gpu for line in plane.lines if line.name.startswith("Stream")]
    source = "device"
    if not any(lines):  # no GPU activity: the host's lines (read only then, a GPU trace holds as many)
        lines = [line_events(line) for plane in planes if plane not in gpu for line in plane.lines]
        source = "host"
    return [t for events in lines for t in self_times(events)], source


def line_events(line) -> list:
    """[(start, end, module, op)] of a trace line's events that name an HLO op."""
    events = []
    for e in line.events:
        stats = dict(e.stats)
        if "hlo_op" in stats:
            events.append((e.start_ns, e.start_ns + e.duration_ns, str(stats.get("hlo_module", "")),
                           str(stats["hlo_op"])))
    return events


def profile_options():
    """What `step_split` needs of the profiler: the device's activity and the host's XLA thunks; no
    Python tracing and no HLO protos (the profiler would add those of every program the process
    compiled, each of a 36-layer decode loop several MB, to every trace)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    return options


def attribute(events, module: str, op_names: dict) -> tuple[dict, dict]:
    """({part, REST, "prefill": ns}, {(part, op): ns}) of the (module, op, ns) events of `module` (of
    every module where no event names it)."""
    mine = [e for e in events if e[0] == module] or events
    times = defaultdict(float, {part: 0.0 for part in (*PARTS.values(), REST)})
    ops = defaultdict(float)
    for _, op, ns in mine:
        part = part_of(op_names.get(op, "")) or REST
        times[part] += ns
        ops[part, op] += ns
    return dict(times), dict(ops)


def step_split(run, iterations: int, top: int = 12) -> dict:
    """The parts of one verify step from a profile of one call of `run` (a decode of
    `jax_markov.speculative` whose keywords take lower=True; run once before, so that nothing
    compiles here): dict(ms={part: ms per loop iteration, REST: ...}, method=what was timed,
    top_ops=the `top` ops of the loop that took longest, [part, HLO op, ms per loop iteration, result
    type], op_families=the `top` families of ops (`op_family`: a layer's ops of one kind together) that
    took longest, [part, family, ms per loop iteration, ops, its heaviest op, that op's result type])."""
    hlo = run(lower=True).compile().as_text()
    module, op_names = hlo_op_names(hlo)
    types = hlo_result_types(hlo)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, profiler_options=profile_options()):
            jax.block_until_ready(run())
        events, source = op_events(trace_dir)
    times, ops = attribute(events, module, op_names)
    times.pop(sp.PREFILL_SCOPE, None)
    method = ("GPU time of its kernels and copies, from CUPTI" if source == "device"
              else "host time of its XLA thunks, each less the thunks inside it")
    per_iteration = 1e-6 / max(iterations, 1)
    heaviest = sorted(((ns, part, op) for (part, op), ns in ops.items() if part != sp.PREFILL_SCOPE), reverse=True)
    families = defaultdict(list)  # (part, family) -> [(ns, op)], heaviest first
    for ns, part, op in heaviest:
        families[part, op_family(op)].append((ns, op))
    by_family = sorted(((sum(ns for ns, _ in members), part, family, members) for (part, family), members
                        in families.items()), key=lambda f: f[0], reverse=True)
    return dict(ms={part: ns * per_iteration for part, ns in times.items()}, method=method,
                top_ops=[[part, op, ns * per_iteration, types.get(op, "")] for ns, part, op in heaviest[:top]],
                op_families=[[part, family, ns * per_iteration, len(members), members[0][1],
                              types.get(members[0][1], "")] for ns, part, family, members in by_family[:top]])
