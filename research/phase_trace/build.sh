#!/usr/bin/env bash
# Builds research/phase_trace/phase_trace (no GPU needed); toolchain as in research/toolchain.sh.
set -euo pipefail
source "$(dirname "$0")/../toolchain.sh"
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG --expt-relaxed-constexpr \
  -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED ${EXTRA_FLAGS:-} -I "$root/cpp/include" -I "$root/cpp" -I "$root/cpp/src" \
  -I "$cutlass" "$root/research/phase_trace/phase_trace.cu" -o "${PT_OUT:-$root/research/phase_trace/phase_trace}" \
  "${cuda_link[@]}"
