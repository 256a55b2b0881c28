#!/usr/bin/env bash
# Builds research/dram_pattern/dram_pattern (no GPU needed); toolchain as in research/toolchain.sh.
set -euo pipefail
source "$(dirname "$0")/../toolchain.sh"
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a "$root/research/dram_pattern/dram_pattern.cu" \
  -o "$root/research/dram_pattern/dram_pattern" "${cuda_link[@]}"
