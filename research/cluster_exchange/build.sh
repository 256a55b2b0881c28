#!/usr/bin/env bash
# Builds research/cluster_exchange/cluster_exchange (no GPU needed); toolchain as in research/toolchain.sh.
set -euo pipefail
source "$(dirname "$0")/../toolchain.sh"
"$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG --expt-relaxed-constexpr \
  -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED ${EXTRA_FLAGS:-} -I "$root/cpp/include" -I "$root/cpp" -I "$cutlass" \
  "$root/research/cluster_exchange/cluster_exchange.cu" -o "$root/research/cluster_exchange/cluster_exchange" "${cuda_link[@]}"
