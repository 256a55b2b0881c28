#!/usr/bin/env bash
# Builds research/ceiling/ceiling (no GPU needed); toolchain as in research/toolchain.sh.
set -euo pipefail
source "$(dirname "$0")/../toolchain.sh"
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a "$root/research/ceiling/ceiling.cu" \
  -o "$root/research/ceiling/ceiling" "${cuda_link[@]}"
