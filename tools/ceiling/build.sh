#!/usr/bin/env bash
# Builds tools/ceiling/ceiling (no GPU needed); toolchain as in tools/toolchain.sh.
set -euo pipefail
source "$(dirname "$0")/../toolchain.sh"
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a "$root/tools/ceiling/ceiling.cu" \
  -o "$root/tools/ceiling/ceiling" "${cuda_link[@]}"
