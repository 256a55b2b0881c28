#!/usr/bin/env bash
# Runs the GPU checks and benchmarks on a machine with a Hopper GPU, from executables built
# elsewhere (no Rust toolchain needed there). From the repository root:
#
#   scripts/gpu-check.sh BIN_DIR OUT_DIR [SECTION...]
#
# BIN_DIR holds test-gpu-test (target/release/deps/gpu-<hash>), bench-backward[-bench]
# (target/release/deps/backward-<hash>), bench-forward[-bench] (target/release/deps/forward-<hash>)
# and, optionally, router_example (examples/cpp build)
# and moe_routing/ (the C/C++ package, for the PyTorch tests), and a wheel moe_routing-*.whl (the
# `wheel` section: built with `pip wheel --no-build-isolation .` against the GPU machine's torch
# version, so that it holds the native ops). OUT_DIR receives the logs and
# results. Sections, in order (default: all): tests bench ncu sanitize example python trace; and
# wide (the wide fused backward on every wide shape), wheel (the package as pip installs it) and
# crossing (the 64/128-column plan's crossing on this GPU, scripts/plan_crossing.sh).
# Each step has a time limit, so a hang costs minutes, not the run; all sections together take
# longer than one sitting may allow, so name the sections you need. SANITIZE_TOOLS picks
# compute-sanitizer's tools (default: memcheck racecheck synccheck initcheck).
set -uo pipefail
bin=${1:?BIN_DIR}; out=${2:?OUT_DIR}; shift 2
sections=${*:-tests bench ncu sanitize example python}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # (absolute: some steps run elsewhere)
bench=$(ls "$bin"/bench-backward* 2>/dev/null | head -1)
bench_fwd=$(ls "$bin"/bench-forward* 2>/dev/null | head -1)
# The unfused baseline loads cuBLAS at run time; PyTorch's wheels carry one.
cublas=$(find / -name 'libcublas.so.1[0-9]*' -path '*nvidia*' 2>/dev/null | head -1)
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
status=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$out/$name.log"
  [ $rc -eq 0 ] || { echo "!! $name: exit $rc"; status=1; }
  return $rc
}
benches() {  # both suites, then the forward, into h200.json
  step bench 300 "$bench" --bench --json "$out/h200.json"
  # The forward's results go into the same file, as its `forward` section.
  [ -n "$bench_fwd" ] && step bench-forward 300 "$bench_fwd" --bench \
    --json "$out/forward.json" --into "$out/h200.json"
}
for section in $sections; do
  case $section in
    tests)
      # A short deadlock check first: the rest is not worth running if it hangs.
      step determinism 60 "$bin/test-gpu-test" deterministic &&
      step gpu-tests 600 "$bin/test-gpu-test" ;;
    bench) benches ;;
    ncu)
      step ncu 240 ncu --clock-control none -k regex:fused_backward --launch-skip 5 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section ComputeWorkloadAnalysis \
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
        "$bench" --bench --filter t32768 --json "$out/ncu-bench.json" ;;
    sanitize)
      # Small shapes, every grad_w sum mode, the wide backward, zero tokens, validation, and four suite cases with the tails T=3001 and
      # T=10007, under each tool. One process per (tool, test, suite case), SANITIZE_JOBS at
      # a time (racecheck of the larger backward cases takes minutes).
      # The PyTorch dtypes on both suites: four cases, among them the public range's ends.
      cases="t512_g1x1 t1536_g4x2 t3001_g8x4 t10007_g1x1"
      dtype_cases="s1264 s7680 t512_g1x1 t3001_g8x4"
      jobs=()
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
        for t in backward_small_shapes backward_grad_w_sums zero_tokens invalid_arguments \
          forward_fused_shapes backward_dtypes_small backward_wide_small; do
          jobs+=("$tool $t -")
        done
        for t in ${SANITIZE_SUITE_TESTS-suite_backward suite_forward}; do
          for c in $cases; do jobs+=("$tool $t $c"); done
        done
        for c in $dtype_cases; do jobs+=("$tool suites_in_pytorch_dtypes $c"); done
      done
      printf '%s\n' "${jobs[@]}" | xargs -P "${SANITIZE_JOBS:-16}" -L 1 sh -c '
        # $0 = OUT_DIR, $1 = BIN_DIR, then tool, test, suite case (- for none)
        log="$0/sanitize-$2-$3-$4.log"
        [ "$4" = - ] || export MOE_ROUTING_SUITE_CASES="$4"
        timeout "${SANITIZE_LIMIT:-480}" compute-sanitizer --tool "$2" --error-exitcode 9 \
          "$1/test-gpu-test" "$3" > "$log" 2>&1
        echo "$2 $3 $4: exit $? | $(grep -E "^gpu:" "$log" | tail -1) | $(grep -E "SUMMARY" "$log" | tail -1)"
      ' "$out" "$bin" | sort | tee "$out/sanitize-summary.txt"
      grep -qv ": exit 0 |" "$out/sanitize-summary.txt" && status=1 ;;
    wide)
      # The wide fused backward (more than 256 experts by default; MOE_ROUTING_WIDE_BACKWARD=1
      # also takes more than 8 experts a token at up to 256, and the GPU tests set it): its
      # tests, every expert count, then the models bench with it on every wide shape.
      step wide-tests 600 "$bin/test-gpu-test" wide &&
      step wide-every-expert-count 600 "$bin/test-gpu-test" every_expert_count
      if [ -f "$bin/moe_routing/lib/libmoe_routing.so" ]; then
        MOE_ROUTING_WIDE_BACKWARD=1 MOE_ROUTING_LIB="$bin/moe_routing/lib/libmoe_routing.so" \
          step wide-models 900 python3 python/benches/models.py --json "$out/models-wide.json"
      fi ;;
    example)
      [ -x "$bin/router_example" ] && step cpp-example 120 "$bin/router_example" ;;
    python)
      if [ -f "$bin/moe_routing/lib/libmoe_routing.so" ]; then
        MOE_ROUTING_LIB="$bin/moe_routing/lib/libmoe_routing.so" PYTHONPATH="$PWD/python" \
          step python-tests 600 python3 -m pytest -q python/tests
      fi ;;
    wheel)
      # The package from its wheel, installed into a folder of its own (no dependencies: torch is
      # the machine's): its tests from a copy outside the repository, so that `import
      # moe_routing` is the installed package, through its native ops; then the host cost of its
      # ops (h200-pytorch.json: host µs per call and GPU operations per call).
      whl=$(ls "$bin"/moe_routing-*.whl 2>/dev/null | head -1)
      if [ -n "$whl" ]; then
        site="$out/wheel-site" tests="$out/wheel-tests"
        rm -rf "$site" "$tests" && mkdir -p "$tests"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$whl" &&
          cp python/tests/*.py "$tests"/ && : > "$tests/pytest.ini" &&
          (cd "$tests" && PYTHONPATH="$site" MOE_ROUTING_TORCH_OP=1 \
            step wheel-tests 600 python3 -m pytest -q -p no:cacheprovider .) || status=1
        lib="$site/moe_routing/lib"
        MOE_ROUTING_LIB="$lib/libmoe_routing.so" MOE_ROUTING_TORCH_LIB="$lib/libmoe_routing_torch.so" \
          MOE_ROUTING_TORCH_OP=1 step host-cost 300 python3 python/benches/host_cost.py --engine \
          --json "$out/h200-pytorch.json"
        rm -rf "$site" "$tests"
      fi ;;
    crossing)
      # The PyTorch-dtype plan's 64/128-column crossing on this GPU (scripts/plan_crossing.sh:
      # the sweep, the anchor, the public range A/B), then the benches with that anchor set.
      [ -f "$bin/moe_routing/lib/libmoe_routing.so" ] &&
        step crossing 1200 scripts/plan_crossing.sh "$bin/moe_routing/lib/libmoe_routing.so" \
          "$out/crossing" &&
        MOE_ROUTING_BACKWARD_UNIT64=$(cat "$out/crossing/unit64.txt") benches ;;
    trace)
      # One backward call through the C ABI under PyTorch's profiler: its GPU operations.
      if [ -f "$bin/moe_routing/lib/libmoe_routing.so" ]; then
        MOE_ROUTING_LIB="$bin/moe_routing/lib/libmoe_routing.so" \
          step trace 300 python3 scripts/trace_backward_call.py --json "$out/trace.json"
      fi ;;
    *) echo "unknown section $section"; status=1 ;;
  esac
done
exit $status
