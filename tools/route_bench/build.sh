#!/usr/bin/env bash
# Builds tools/route_bench/route_bench (no GPU needed) with the nvcc and CUTLASS headers that
# the crate's build installed (run `cargo build --release` first), or NVCC / CUTLASS_INCLUDE.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cache=${MOE_ROUTING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moe-routing}
nvcc=${NVCC:-$(ls -d "$cache"/cuda-toolchain-*/nvidia/cu13/bin/nvcc | head -1)}
cutlass=${CUTLASS_INCLUDE:-$(ls -d "$cache"/cutlass-*/cutlass_library/source/include | head -1)}
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG --expt-relaxed-constexpr \
  ${EXTRA_FLAGS:-} -I "$root/cpp/include" -I "$root/cpp" -I "$cutlass" \
  "$root/tools/route_bench/route_bench.cu" -o "$root/tools/route_bench/route_bench" \
  -cudart static -L "$(dirname "$nvcc")/../lib" -ldl -lpthread -lrt
