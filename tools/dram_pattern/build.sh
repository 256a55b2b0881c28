#!/usr/bin/env bash
# Builds tools/dram_pattern/dram_pattern (no GPU needed) with the nvcc the crate's build
# installed (run `cargo build --release` first), or NVCC.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cache=${MOE_ROUTING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moe-routing}
nvcc=${NVCC:-$(ls -d "$cache"/cuda-toolchain-*/nvidia/cu13/bin/nvcc | head -1)}
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a "$root/tools/dram_pattern/dram_pattern.cu" \
  -o "$root/tools/dram_pattern/dram_pattern" -cudart static -L "$(dirname "$nvcc")/../lib" -ldl -lpthread -lrt
