#!/usr/bin/env bash
# Builds research/launch_cost/launch_cost (no GPU needed) against the library's static archive
# (cargo xtask package first); toolchain as in research/toolchain.sh.
set -euo pipefail
source "$(dirname "$0")/../toolchain.sh"
lib=${MOE_ROUTING_LIB_DIR:-$root/target/release/moe_routing/lib}
"$nvcc" -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I "$root/cpp/include" -I "$root" \
  "$root/research/launch_cost/launch_cost.cu" -o "$root/research/launch_cost/launch_cost" \
  "$lib/libmoe_routing.a" "${cuda_link[@]}"
