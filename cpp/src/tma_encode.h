// TMA descriptors are encoded by the driver's cuTensorMapEncodeTiled. CUTLASS looks its entry
// point up again for every descriptor (cudaGetDriverEntryPointByVersion), a cost paid on the
// host per call; included before any CUTLASS header, this header has CuTe call the function
// below instead, which looks the entry point up once per process. (Linking the driver library
// instead would make the library fail to load on a machine without a GPU driver.)
#pragma once

#ifdef CUTLASS_CUDA_DRIVER_WRAPPER_CALL
#error "tma_encode.h must be included before CUTLASS's headers"
#endif

#include <atomic>
#include <cstdint>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

// CUTLASS's wrapper then calls cuTensorMapEncodeTiled unqualified from namespace cutlass with
// CuTe's argument types, which the function below takes exactly (int rank, non-const arrays):
// overload resolution prefers it to the driver's declaration, which needs conversions. (Should
// CuTe's types change, the call becomes ambiguous and the build fails; it cannot silently
// bypass this.)
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1

namespace cutlass {

inline CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, int rank,
                                       void* address, uint64_t* dims, uint64_t* strides,
                                       uint32_t* box, uint32_t* element_strides,
                                       CUtensorMapInterleave interleave,
                                       CUtensorMapSwizzle swizzle,
                                       CUtensorMapL2promotion promotion,
                                       CUtensorMapFloatOOBfill fill) {
  using Fn = PFN_cuTensorMapEncodeTiled_v12000;
  static std::atomic<void*> entry{nullptr};  // kept once found; looked up again until then
  void* pfn = entry.load(std::memory_order_acquire);
  if (pfn == nullptr) {
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pfn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess || pfn == nullptr) {
      (void)cudaGetLastError();
      return CUDA_ERROR_UNKNOWN;
    }
    entry.store(pfn, std::memory_order_release);
  }
  return reinterpret_cast<Fn>(pfn)(map, type, cuuint32_t(rank), address, dims, strides, box,
                                   element_strides, interleave, swizzle, promotion, fill);
}

}  // namespace cutlass
