// Helpers shared by the host launchers.
#pragma once

#include <atomic>
#include <cstdint>

#include "cuda_error.h"
#include "moe_routing/router.h"

namespace moe_routing::detail {

inline Status last_launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::kSuccess : cuda_error(err);
}

inline Status cuda_status(cudaError_t err) {
  if (err == cudaSuccess) return Status::kSuccess;
  (void)cudaGetLastError();
  return cuda_error(err);
}

// Puts the calling thread in relaxed stream-capture mode for its scope. The host-side queries
// before a launch (stream device, pointer attributes, kernel attributes) are not stream work,
// but under a global-mode capture (what PyTorch's CUDA graphs use) the runtime refuses them
// as "potentially unsafe" and invalidates the capture. In relaxed mode they are allowed; the
// launches themselves are captured as usual.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCaptureScope() {
    if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Launch attribute of the fused kernels: they may start while the stream's previous kernel is
// still running, and wait for it on the device before touching global memory
// (kernels/dependent_launch.cuh).
inline cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// The helpers below take a kernel description K: K::kernel (the __global__ function), K::Cfg
// (with kThreads and kSmemBytes) and K::kLargeClusters (clusters above 8 CTAs wanted).

// Opts K::kernel into its dynamic shared memory on `device` (and, with K::kLargeClusters, into
// clusters above 8 CTAs where the device has them). The setting is per device and sticks: set
// once per device.
template <class K>
Status prepare_kernel(int device) {
  static std::atomic<uint64_t> prepared{0};  // one bit per device done
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (prepared.load(std::memory_order_acquire) & bit) return Status::kSuccess;
  RelaxedCaptureScope relaxed;
  if (Status s = cuda_status(cudaFuncSetAttribute(
          K::kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::Cfg::kSmemBytes));
      s != Status::kSuccess)
    return s;
  if (K::kLargeClusters) {  // allowed where the device has them (the occupancy query says)
    (void)cudaFuncSetAttribute(K::kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    (void)cudaGetLastError();
  }
  prepared.fetch_or(bit, std::memory_order_release);
  return Status::kSuccess;
}

// Launch configuration of K as a 1-D grid in clusters of `cluster` CTAs: the cluster attribute
// goes into attrs[0], which the caller keeps alive until the launch.
template <class K>
cudaLaunchConfig_t launch_config(unsigned grid, int cluster, cudaStream_t stream,
                                 cudaLaunchAttribute* attrs) {
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(grid);
  c.blockDim = dim3(unsigned(K::Cfg::kThreads));
  c.dynamicSmemBytes = size_t(K::Cfg::kSmemBytes);
  c.stream = stream;
  attrs[0] = {};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = unsigned(cluster);
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  c.attrs = attrs;
  c.numAttrs = 1;
  return c;
}

// Launches K::kernel(p) as a 1-D grid in clusters of `cluster` CTAs, with programmatic
// dependent launch (dependent_launch_attribute).
template <class K, class P>
Status launch_dependent(unsigned grid, int cluster, cudaStream_t stream, const P& p) {
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t c = launch_config<K>(grid, cluster, stream, attrs);
  attrs[1] = dependent_launch_attribute();
  c.numAttrs = 2;
  return cuda_status(cudaLaunchKernelEx(&c, K::kernel, p));
}

// Clusters of `cluster` CTAs of K that fit on `device` at once; 0 where none do or on error.
template <class K>
int max_active_clusters(int cluster, int device) {
  RelaxedCaptureScope relaxed;  // a query, not stream work: allowed under graph capture
  if (prepare_kernel<K>(device) != Status::kSuccess) return 0;
  cudaLaunchAttribute attrs[1];
  const cudaLaunchConfig_t c = launch_config<K>(unsigned(cluster), cluster, nullptr, attrs);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, K::kernel, &c) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace moe_routing::detail
