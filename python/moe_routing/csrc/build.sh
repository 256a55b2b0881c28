#!/usr/bin/env bash
# Builds the native PyTorch ops (torch_ops.cpp) by hand, against one torch installation:
#
#   build.sh SITE_PACKAGES LIBMOE_ROUTING OUTPUT
#
#   SITE_PACKAGES   the folder holding torch/ (torch's include/ and lib/ are used; nothing is
#                   imported, so a torch that cannot import here, e.g. an unpacked wheel, works)
#   LIBMOE_ROUTING  libmoe_routing.so (or .so.1) to link against
#   OUTPUT          the op library to write, e.g. python/moe_routing/lib/libmoe_routing_torch.so
#
# The result works with that torch build only (C++ ABI, CUDA major). It needs, by soname, what
# `import torch` has loaded (libtorch*, libc10*, torch's libcudart) and libmoe_routing.so.1,
# which moe_routing.ops loads first (RPATH $ORIGIN finds a libmoe_routing.so.1 beside it
# otherwise). No libtorch_python: one build serves every Python version.
#
# CUDA: libcudart of torch's CUDA major (the capture query and CUDAGuard call it directly) and
# its headers, from $CUDA_HOME if set, then torch's own CUDA wheels (SITE_PACKAGES/nvidia/cu<N>,
# or nvidia/cuda_runtime for CUDA 12). Environment: CXX (default c++), MOE_ROUTING_INCLUDE
# (default: cpp/include of this repository), EXTRA_CXXFLAGS.
set -euo pipefail

if [ $# -ne 3 ]; then
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
site=$(cd "$1" && pwd)
moe_lib=$(readlink -f "$2")
output=$3
here=$(cd "$(dirname "$0")" && pwd)
torch_dir=$site/torch
include=${MOE_ROUTING_INCLUDE:-$here/../../../cpp/include}
cxx=${CXX:-c++}

die() { echo "build.sh: $*" >&2; exit 1; }
[ -f "$torch_dir/include/torch/library.h" ] || die "no torch headers in $torch_dir/include"
[ -f "$torch_dir/lib/libc10_cuda.so" ] || die "$torch_dir/lib has no libc10_cuda.so (a CUDA build of torch is needed)"
[ -f "$moe_lib" ] || die "no library at $2"
[ -f "$include/moe_routing/moe_routing.h" ] || die "no moe_routing/moe_routing.h under $include (set MOE_ROUTING_INCLUDE)"

# The CUDA runtime torch was built with: the soname its libc10_cuda needs. Then a runtime of
# that soname to link (only the soname is recorded) and headers of that major with crt/ (a
# toolkit's or nvidia-cuda-crt's: the runtime wheel's include/ alone lacks crt/).
cudart_soname=$(readelf -d "$torch_dir/lib/libc10_cuda.so" | sed -n 's/.*NEEDED.*\[\(libcudart\.so\.[0-9]*\)\].*/\1/p')
[ -n "$cudart_soname" ] || die "cannot tell which libcudart $torch_dir/lib/libc10_cuda.so needs"
major=${cudart_soname##*.}
roots=("$site/nvidia/cu$major" "$site/nvidia/cuda_runtime")
[ -n "${CUDA_HOME:-}" ] && roots=("$CUDA_HOME" "${roots[@]}")
cudart=
for root in "${roots[@]}"; do
  for dir in "$root/lib" "$root/lib64" "$root/targets/x86_64-linux/lib"; do
    if [ -z "$cudart" ] && [ -f "$dir/$cudart_soname" ]; then cudart=$dir/$cudart_soname; fi
  done
done
cuda_inc=
for root in "${roots[@]}"; do
  h=$root/include/cuda_runtime_api.h
  if [ -z "$cuda_inc" ] && [ -f "$root/include/crt/host_defines.h" ] && [ -f "$h" ] &&
     grep -Eq "^#define CUDART_VERSION +$major[0-9]{3}\b" "$h"; then
    cuda_inc=$root/include
  fi
done
[ -n "$cudart" ] || die "no $cudart_soname beside torch (nvidia/) nor under \$CUDA_HOME"
[ -n "$cuda_inc" ] || die "no CUDA $major runtime headers with crt/ (set CUDA_HOME to a CUDA $major toolkit)"

mkdir -p "$(dirname "$output")"
set -x
# (torch's libraries stay needed where the compiler links as-needed: libtorch_cuda registers the
# CUDA kernels of at::empty and friends for a program that loads only this library. The macro
# prefix map keeps the build's paths out of the dispatcher's "registered at" notes.)
"$cxx" -std=c++17 -O2 -fPIC -shared -D_GLIBCXX_USE_CXX11_ABI=1 -Wall -Wextra \
  -fmacro-prefix-map="$here/=" \
  -I "$include" -isystem "$torch_dir/include" -isystem "$cuda_inc" \
  ${EXTRA_CXXFLAGS:-} \
  "$here/torch_ops.cpp" -o "$output" \
  -L "$torch_dir/lib" \
  -Wl,--no-as-needed -ltorch -ltorch_cpu -ltorch_cuda -lc10_cuda -lc10 -Wl,--as-needed \
  "$moe_lib" "$cudart" \
  -Wl,--no-undefined -Wl,-rpath,'$ORIGIN'
