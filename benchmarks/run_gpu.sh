#!/usr/bin/env bash
# The GPU evidence of one kernel version on an H100 or H200, in parts that each fit well under the
# device tool's 10 minutes a command (the build, about 2 minutes, included):
#
#     bash benchmarks/run_gpu.sh OUT_DIR [tests|sanitizers|memcheck|racecheck|table|timeline ...] [-- gpu_timing.py options]
#
# It builds the CUDA and CPU modules once, with the design-floor probes (-DJAX_MARKOV_PROBES=ON; the
# timeline part also builds the timeline variant), and names every output after the GPU (<gpu> is
# h100 or h200: benchmarks/gpu_timing.py's results_name of nvidia-smi's name). Into OUT_DIR:
#   tests       <gpu>_test_cuda.log: tests/test_cuda.py, test_cuda_transposed.py, test_cuda_certified.py,
#               test_design_floor.py and test_command_buffers.py, six shards side by side
#   sanitizers  <gpu>_memcheck.log, <gpu>_racecheck.log: compute-sanitizer on small and streamed shapes and on the
#               certified walk's exact-round GPU tests; memcheck, racecheck: one of the two
#   table       <gpu>.{md,json,png} and <gpu>_gpu_timing.log: benchmarks/gpu_timing.py --repeats 5 with the
#               options after --; the whole table takes longer than one command may, so give each call a
#               few rows (--rows V,K,B ...) and join the calls' <gpu>.json with gpu_timing.py --merge
#   timeline    <gpu>_timeline.{md,json}: benchmarks/timeline.py on the timeline build
# With no part named it runs all four. The commit recorded in the tables is $JAX_MARKOV_COMMIT or
# git's HEAD; set it on the device tool's machine, where git's HEAD has named an older commit than the
# tree that ran (the script refuses to run without it where the tracked files differ from HEAD's).
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: run_gpu.sh OUT_DIR [tests|sanitizers|memcheck|racecheck|table|timeline ...] [-- gpu_timing.py options]"
out=${1:?$usage}
shift
parts=() table_args=()
while (($#)); do
  if [[ $1 == -- ]]; then
    shift
    table_args=("$@")
    break
  fi
  parts+=("$1")
  shift
done
((${#parts[@]})) || parts=(tests timeline table sanitizers)
for part in "${parts[@]}"; do
  [[ $part =~ ^(tests|sanitizers|memcheck|racecheck|table|timeline)$ ]] || { echo "unknown part: $part; $usage" >&2; exit 2; }
done
# JAX_MARKOV_SANITIZER_PART=i/n: the sanitizer parts run every n-th of their jobs from the i-th alone,
# into <gpu>_<tool>_<i>of<n>.log (racecheck over every job takes longer than one device command may).
sanitizer_part=${JAX_MARKOV_SANITIZER_PART:-0/1}
[[ $sanitizer_part =~ ^([0-9]+)/([0-9]+)$ ]] && ((BASH_REMATCH[1] < BASH_REMATCH[2])) ||
  { echo "JAX_MARKOV_SANITIZER_PART must be i/n with 0 <= i < n, got $sanitizer_part" >&2; exit 2; }
first=${BASH_REMATCH[1]} every=${BASH_REMATCH[2]}
if [[ -z ${JAX_MARKOV_COMMIT:-} ]] && git rev-parse --is-inside-work-tree > /dev/null 2>&1 && ! git diff --quiet HEAD --; then
  echo "run_gpu.sh: the tracked files differ from git's HEAD ($(git rev-parse --short HEAD)); set JAX_MARKOV_COMMIT to the commit of this tree" >&2
  exit 2
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
py=$(command -v python3)
gpu_kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
[[ -n $gpu_kind ]] || { echo "run_gpu.sh: nvidia-smi names no GPU" >&2; exit 1; }
gpu=$(PYTHONPATH=$PWD python3 -c 'import sys; from benchmarks.gpu_timing import results_name; print(results_name(sys.argv[1]))' \
  "$gpu_kind") || exit 1

build() {  # build DIR [cmake options]: every module of the tree, from scratch (a warm machine may hold
  local dir=$1  # DIR from another tree, whose CMake cache would refuse this one)
  shift
  rm -rf "$dir"
  cmake -S . -B "$dir" -G Ninja -DPython_EXECUTABLE="$py" -DCMAKE_BUILD_TYPE=Release "$@" > "$dir.log" 2>&1 &&
    ninja -C "$dir" >> "$dir.log" 2>&1 || { tail -30 "$dir.log"; return 1; }
}
# JAX_MARKOV_PREBUILT=DIR takes the modules from DIR instead of building them: DIR/_markov_*.so built
# from this tree with the probes, and DIR/timeline/_markov_cuda*.so with the timeline (each built for
# this machine's Python; the device tool's calls carry them to save the build's two minutes).
prebuilt=${JAX_MARKOV_PREBUILT:-}
plain= timeline=
if [[ -n $prebuilt ]]; then
  rm -rf /tmp/jm_build /tmp/jm_timeline && mkdir -p /tmp/jm_build /tmp/jm_timeline
  cp "$prebuilt"/_markov_*.so /tmp/jm_build/ || exit 1
  cp "$prebuilt"/timeline/_markov_cuda*.so /tmp/jm_timeline/ 2> /dev/null
else
  build /tmp/jm_build -DJAX_MARKOV_PROBES=ON & plain=$!
  if [[ " ${parts[*]} " == *" timeline "* ]]; then
    build /tmp/jm_timeline -DJAX_MARKOV_TIMELINE=ON & timeline=$!
  fi
  wait $plain || exit 1
fi
# Each module goes in by rename, never rewritten in place: another run_gpu.sh beside this one (the
# tests and the sanitizers side by side) has them loaded, and a copy over a loaded module crashes it.
for module in /tmp/jm_build/_markov_*.so; do
  cmp -s "$module" "jax_markov/${module##*/}" && continue
  cp "$module" "jax_markov/.${module##*/}.new" && mv -f "jax_markov/.${module##*/}.new" "jax_markov/${module##*/}" || exit 1
done
export PYTHONPATH=$PWD
commit=${JAX_MARKOV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export JAX_MARKOV_COMMIT=$commit
# The first lines of every log: where it came from.
header() {
  echo "# bash benchmarks/run_gpu.sh OUT ${parts[*]} ${table_args[*]:+-- ${table_args[*]}} ($1)"
  echo "# commit $commit; $gpu_kind; jax $(python3 -c 'import jax; print(jax.__version__)')"
}

for part in "${parts[@]}"; do
  case $part in
    tests)
      # Six processes side by side, each every sixth test in collection order (tests/conftest.py's
      # JAX_MARKOV_TEST_SHARD), so that every GPU test runs exactly once (tests/test_run_gpu_shards.py).
      files="tests/test_cuda.py tests/test_cuda_transposed.py tests/test_cuda_certified.py tests/test_design_floor.py tests/test_command_buffers.py"
      shards=6
      pids=()
      for ((i = 0; i < shards; i++)); do
        # -v names each test as it ends; a test still running after 120 s has every thread's Python
        # stack written into the log (pytest's faulthandler_timeout), so a cut run says where it stood.
        JAX_MARKOV_TEST_SHARD=$i/$shards python3 -m pytest -v -p no:cacheprovider --durations=12 \
          -o faulthandler_timeout=120 $files > /tmp/jm_t$i.log 2>&1 &
        pids+=($!)
      done
      tests_log() { { header tests; for ((i = 0; i < shards; i++)); do cat /tmp/jm_t$i.log; done; } > "$out/${gpu}_test_cuda.log"; }
      # A run cut short (timeout's TERM) still leaves the log of what the shards ran.
      trap 'nvidia-smi > /tmp/jm_tsmi.log 2>&1; kill "${pids[@]}" 2> /dev/null; wait "${pids[@]}"; tests_log
        cat /tmp/jm_tsmi.log >> "$out/${gpu}_test_cuda.log"; echo "tests: cut short" >&2; exit 124' TERM
      wait "${pids[@]}"  # not the timeline build, which the timeline part waits for
      trap - TERM
      tests_log
      grep -E "passed|failed" "$out/${gpu}_test_cuda.log"
      ;;
    timeline)
      [[ -z $timeline ]] || wait $timeline || continue
      ls /tmp/jm_timeline/_markov_cuda*.so > /dev/null 2>&1 || { echo "timeline: no timeline build" >&2; continue; }
      rm -rf /tmp/jm_tlpkg && mkdir -p /tmp/jm_tlpkg && cp -r jax_markov /tmp/jm_tlpkg/ &&
        cp /tmp/jm_timeline/_markov_cuda*.so /tmp/jm_tlpkg/jax_markov/
      # The script's own folder and then /tmp/jm_tlpkg come first on sys.path: its jax_markov is the
      # timeline build's.
      PYTHONPATH=/tmp/jm_tlpkg python3 benchmarks/timeline.py --out "$out/${gpu}_timeline" \
        151936,7,1,greedy 151936,7,1,probabilistic 151936,7,16,greedy 151936,7,16,probabilistic 151936,7,64,greedy \
        151936,7,64,probabilistic \
        151936,7,1,greedy,bf16 151936,7,16,greedy,bf16 151936,7,1,greedy,certified 151936,7,2,greedy,certified \
        151936,7,24,greedy 151936,7,24,greedy,certified \
        > /tmp/jm_timeline_run.log 2>&1 ||
        tail -20 /tmp/jm_timeline_run.log
      ;;
    table)
      { header table; python3 benchmarks/gpu_timing.py --out "$out/$gpu" --repeats 5 "${table_args[@]}"; } \
        > "$out/${gpu}_gpu_timing.log" 2>&1 || tail -20 "$out/${gpu}_gpu_timing.log"
      grep -E "^- (greedy|probabilistic): " "$out/$gpu.md"
      ;;
    sanitizers | memcheck | racecheck)
      tools=(memcheck racecheck) && [[ $part == sanitizers ]] || tools=("$part")
      # 20011,2,40 probabilistic walks in MarkovWalkKernel (V % 8 != 0), which makes its noise a tile at a
      # time (noise tiles), as does 5000,3,12 probabilistic; 20008,2,40, 20008,2,56 and 40008,2,24
      # probabilistic walk in the transposed kernel, which makes the noise in its epilogue (not packed at
      # 40, in the rotated order, and 56; packed at 24), their bf16 logits stored 16 bytes at a time.
      # 5000,3,12's bf16 logits go out through MarkovWalkKernel's shared memory. The greedy ones take
      # the transposed kernel: packed (20: a warp of requests past the batch; 24) and not (40).
      # 5000,3,2 takes the epilogue of bf16 base logits and logits out with the noise ahead (the digit
      # kernel's instance for it, its base logits staged; 5003,3,2 not staged). 5000,3,4 and 5003,3,3
      # (this W1 is bf16) walk on e's digit pairs, logits out. 5000,3,12 greedy of the head without tiles
      # (untiled) holds e's digit pairs as the A operand (EREGS), its base logits staged, and 5000,3,12
      # greedy-logits its bf16-logits form; 151936,2,16 greedy untiled does not stage them and streams
      # tiles, and 151936,2,12 greedy-logits streams them in the bf16-logits form. With the head's tiles
      # 5000,3,12 and 151936,2,16 greedy take the transposed kernel (a last tile partly past V; streamed
      # tiles). 5003,3,2 greedy certified re-scores candidates from the unquantized
      # W2 (the certified digit kernel, its e in shared memory; 5003,3,2 probabilistic certified walks
      # the plain kernel, the certified launches returning at once), 5003,3,6,greedy-logits,certified in the
      # digit pairs', 5000,3,12 greedy certified in EREGS's; 151936,2,1 and 151936,2,16 greedy certified
      # stream tiles. 4096,3,24, 60008,4,40 and 20008,3,64 greedy certified walk on the transposed kernel's
      # certified instances (an exact round every step).
      small="5003,3,2,greedy,certified 5003,3,2,probabilistic,certified 5003,3,6,greedy-logits,certified 5000,3,12,greedy,certified 5000,3,12,greedy,untiled 5000,3,12,greedy 5000,3,12,greedy-logits 5000,3,2,probabilistic 5003,3,2,probabilistic 5000,3,4,probabilistic 5003,3,3,probabilistic 5003,3,3,probabilistic,bf16 5000,3,12,probabilistic 20011,2,40,probabilistic 20008,2,40,probabilistic 20008,2,56,probabilistic 40008,2,24,probabilistic 20008,2,20,greedy 20008,2,24,greedy 20008,2,40,greedy 4096,3,24,greedy,certified 60008,4,40,greedy,certified 20008,3,64,greedy,certified"
      # At V = 151936 most warps keep a streamed W2 tile in registers from step to step (odd steps
      # take them in reverse): 151936,2,1 greedy in the digit kernel's instance for tokens only,
      # 151936,3,2 probabilistic in its instance for logits out, 151936,2,4 greedy on the digit pairs,
      # 151936,2,1,greedy,bf16 in the bf16 head's kernel.
      streamed="151936,2,1,greedy 151936,3,2,probabilistic 151936,2,4,greedy 151936,2,16,greedy,untiled 151936,2,16,greedy 151936,2,12,greedy-logits 151936,2,1,greedy,bf16 151936,2,1,greedy,certified 151936,2,16,greedy,certified"
      # The certified walk's exact round (the grid's int8 keys do not single out a choice): rare on
      # profile_kernel.py's heads, taken by every decision of the GPU tests of ties and of a
      # disagreement at the last step (the digit kernel, the digit pairs, EREGS).
      exact_rounds="ties_make_lanes_rescore_all_their_rows or disagreement_at_the_last_step"
      nodes=$(python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_cuda_certified.py -k "$exact_rounds" |
        grep "::")
      # One process a shape and a test: compute-sanitizer's process crashed (a segmentation fault, no
      # error reported) after a few kernel instances in one process, at a different one each run, and
      # now and then in a single test's; a crashed one runs once more, both in the log. XLA's command
      # buffers are off, so that every launch goes straight to the stream rather than into a CUDA graph
      # (XLA puts our command-buffer-compatible custom call into its graphs). The tools side by side,
      # eight lanes of such processes in all; each tool's log in order.
      jobs=() && for shape in $small $streamed; do jobs+=("python3 benchmarks/profile_kernel.py $shape"); done
      for node in $nodes; do jobs+=("python3 -m pytest -q -p no:cacheprovider $node"); done
      # JAX_MARKOV_SANITIZER_PART (checked above): every n-th job from the i-th alone.
      picked=() && for ((j = first; j < ${#jobs[@]}; j += every)); do picked+=("${jobs[j]}"); done
      jobs=("${picked[@]}") log_suffix=
      ((every == 1)) || log_suffix=_${first}of$every
      lanes=$((8 / ${#tools[@]})) pids=()
      sanitizer_logs() {
        for tool in "${tools[@]}"; do
          { header $tool; for ((j = 0; j < ${#jobs[@]}; j++)); do cat /tmp/jm_${tool}_$j.log 2> /dev/null; done; } \
            > "$out/${gpu}_$tool$log_suffix.log"
        done
      }
      rm -f /tmp/jm_memcheck_*.log /tmp/jm_racecheck_*.log
      trap 'kill "${pids[@]}" 2> /dev/null; wait "${pids[@]}"; sanitizer_logs; echo "$part: cut short" >&2; exit 124' TERM
      for tool in "${tools[@]}"; do
        for ((lane = 0; lane < lanes; lane++)); do
          for ((j = lane; j < ${#jobs[@]}; j += lanes)); do
            for try in 1 2; do
              XLA_FLAGS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}" compute-sanitizer --tool $tool ${jobs[j]} \
                >> /tmp/jm_${tool}_$j.log 2>&1 && break
              status=$?
              echo "# compute-sanitizer exited with status $status on ${jobs[j]}" >> /tmp/jm_${tool}_$j.log
              ((status == 139)) || break
            done
          done &
          pids+=($!)
        done
      done
      wait "${pids[@]}"
      trap - TERM
      sanitizer_logs
      for tool in "${tools[@]}"; do grep -E "SUMMARY|exited with" "$out/${gpu}_$tool$log_suffix.log"; done
      ;;
  esac
done
