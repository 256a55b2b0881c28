#!/usr/bin/env bash
# Builds tools/dram_pattern/dram_pattern (no GPU needed); toolchain as in tools/toolchain.sh.
set -euo pipefail
source "$(dirname "$0")/../toolchain.sh"
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a "$root/tools/dram_pattern/dram_pattern.cu" \
  -o "$root/tools/dram_pattern/dram_pattern" "${cuda_link[@]}"
