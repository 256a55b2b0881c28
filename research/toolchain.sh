# Sourced by the tools' build scripts: sets `root` (the repository), `nvcc` and `cutlass` (its
# headers) from NVCC / CUTLASS_INCLUDE, else from what the crate's build installed (run
# `cargo build --release` first).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${MOE_ROUTING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moe-routing}
nvcc=${NVCC:-$(ls -d "$cache"/cuda-toolchain-*/nvidia/cu13/bin/nvcc | head -1)}
cutlass=${CUTLASS_INCLUDE:-$(ls -d "$cache"/cutlass-*/cutlass_library/source/include | head -1)}
# Static cudart and the host libraries it needs, for every tool.
cuda_link=(-cudart static -L "$(dirname "$nvcc")/../lib" -ldl -lpthread -lrt)
