#!/usr/bin/env bash
# Builds research/wgmma_rate/wgmma_rate (no GPU needed); toolchain as in research/toolchain.sh.
set -euo pipefail
source "$(dirname "$0")/../toolchain.sh"
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG --expt-relaxed-constexpr \
  -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED ${EXTRA_FLAGS:-} -I "$cutlass" \
  "$root/research/wgmma_rate/wgmma_rate.cu" -o "$root/research/wgmma_rate/wgmma_rate" "${cuda_link[@]}"
