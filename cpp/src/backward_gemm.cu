// The simple backward's GEMMs on the tensor cores: CUTLASS sm90 warp-specialized kernels from
// its collective builders, four instantiations (grad_x bf16; grad_w f32 written, or added into
// its source; grad_w bf16). See backward_gemm.h.
#include "tma_encode.h"  // (before CUTLASS's headers)

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <atomic>

#include "backward_gemm.h"
#include "launch.h"

namespace moe_routing::detail {
namespace {

using namespace cute;
using Bf16 = cutlass::bfloat16_t;

// One GEMM D = A·B (+ beta·C), bf16 operands, fp32 accumulation: 128 × 128 × 64 tiles on one
// CTA each (no cluster), the cooperative schedule (two consumer warpgroups per tile).
template <class LayoutA, class LayoutB, class ElementC, class ElementD>
struct Gemm {
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC,
      cutlass::layout::RowMajor, 16 / int(sizeof(ElementD)), ElementD, cutlass::layout::RowMajor,
      16 / int(sizeof(ElementD)), cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA, 8, Bf16, LayoutB, 8,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Adapter::Arguments;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
};

// grad_x = G · w: A = G [T, E] (K-major), B = w [E, H] (N contiguous), D [T, H] bf16.
using GradXGemm = Gemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, void, Bf16>;
// grad_w = Gᵀ · x: A = Gᵀ, G [T, E] read with E (M) contiguous, B = x [T, H] (N contiguous),
// D [E, H] f32 written (no source: a source scaled by beta = 0 is not loaded, but its
// registers still enter the sum as 0 · whatever they hold), f32 added into (C = D, beta = 1),
// or bf16 written.
using GradWGemm = Gemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, void, float>;
using GradWAddGemm = Gemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float>;
using GradWBf16Gemm = Gemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, void, Bf16>;

// SMs per device, read once (the persistent tile scheduler's grid).
int sm_count(int device) {
  static std::atomic<int> cached[64] = {};
  if (device < 0 || device >= 64)
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  int n = cached[device].load(std::memory_order_relaxed);
  if (n == 0) {
    n = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
    cached[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// The problem (M, N, K) with its operands' strides: A (M, K), B (N, K), C and D (M, N) row-major.
template <class G>
typename G::Arguments arguments(int m, int n, int k, const Bf16* a, int64_t lda, const Bf16* b,
                                int64_t ldb, const void* c, void* d, int64_t ldd, float beta,
                                int device) {
  using namespace cute;
  typename G::StrideA sa{};
  typename G::StrideB sb{};
  typename G::StrideC sc{};
  typename G::StrideD sd{};
  // The unit strides are static, fixed by the layout tags; the others are set here (the batch
  // mode, of extent 1, as a whole operand's).
  constexpr bool kKMajorA = cute::is_static<decltype(get<1>(sa))>::value;  // (lda, 1) or (1, lda)
  if constexpr (kKMajorA) get<0>(sa) = lda;
  else get<1>(sa) = lda;
  get<2>(sa) = lda * (kKMajorA ? m : k);
  get<1>(sb) = ldb;  // (1, ldb): N contiguous
  get<2>(sb) = ldb * k;
  get<0>(sc) = ldd, get<2>(sc) = ldd * m;
  get<0>(sd) = ldd, get<2>(sd) = ldd * m;
  cutlass::KernelHardwareInfo hw{device, sm_count(device)};
  using ElementC = typename G::Kernel::ElementC;
  using ElementD = typename G::Kernel::ElementD;
  typename G::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                             {m, n, k, 1},
                             {a, sa, b, sb},
                             {{}, static_cast<const ElementC*>(c), sc,
                              static_cast<ElementD*>(d), sd},
                             hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = beta;
  return args;
}

template <class G>
bool implementable(const typename G::Arguments& args) {
  return G::Adapter::can_implement(args) == cutlass::Status::kSuccess &&
         G::Adapter::get_workspace_size(args) == 0;
}

template <class G>
Status run(const typename G::Arguments& args, cudaStream_t stream) {
  typename G::Adapter gemm;
  if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess)
    return Status::kUnsupported;
  const cutlass::Status s = gemm.run(stream);
  if (Status launched = last_launch_status(); launched != Status::kSuccess) return launched;
  return s == cutlass::Status::kSuccess ? Status::kSuccess : Status::kCudaError;
}

struct Problems {
  GradXGemm::Arguments grad_x;
  GradWGemm::Arguments grad_w;          // written
  GradWAddGemm::Arguments grad_w_add;   // added into grad_w
  GradWAddGemm::Arguments grad_w_lo;    // the residual's, added
  GradWBf16Gemm::Arguments grad_w_bf16;
};

Problems problems(const BackwardGemms& a, int device) {
  const int T = int(a.tokens), E = a.experts, H = a.hidden;
  auto g = reinterpret_cast<const Bf16*>(a.g);
  auto g_lo = reinterpret_cast<const Bf16*>(a.g_lo);
  auto x = reinterpret_cast<const Bf16*>(a.x);
  auto w = reinterpret_cast<const Bf16*>(a.w);
  Problems p;
  p.grad_x = arguments<GradXGemm>(T, H, E, g, E, w, H, nullptr, a.grad_x, H, 0.0f, device);
  p.grad_w = arguments<GradWGemm>(E, H, T, g, E, x, H, nullptr, a.grad_w, H, 0.0f, device);
  p.grad_w_add = arguments<GradWAddGemm>(E, H, T, g, E, x, H, a.grad_w, a.grad_w, H, 1.0f, device);
  p.grad_w_lo =
      arguments<GradWAddGemm>(E, H, T, g_lo, E, x, H, a.grad_w, a.grad_w, H, 1.0f, device);
  p.grad_w_bf16 =
      arguments<GradWBf16Gemm>(E, H, T, g, E, x, H, nullptr, a.grad_w, H, 0.0f, device);
  return p;
}

}  // namespace

bool backward_gemms_supported(const BackwardGemms& a, int device) {
  if (a.tokens < 1 || a.tokens > INT32_MAX || a.experts % 8 != 0 || a.hidden % 8 != 0)
    return false;
  if (!aligned16(a.g) || !aligned16(a.x) || !aligned16(a.w) || !aligned16(a.grad_x) ||
      !aligned16(a.grad_w) || (a.g_lo && !aligned16(a.g_lo)))
    return false;
  if (a.grad_w_bf16 && (a.accumulate || a.g_lo)) return false;
  const Problems p = problems(a, device);
  if (!implementable<GradXGemm>(p.grad_x)) return false;
  if (a.grad_w_bf16) return implementable<GradWBf16Gemm>(p.grad_w_bf16);
  return (a.accumulate ? implementable<GradWAddGemm>(p.grad_w_add)
                       : implementable<GradWGemm>(p.grad_w)) &&
         (!a.g_lo || implementable<GradWAddGemm>(p.grad_w_lo));
}

Status launch_backward_gemms(const BackwardGemms& a, int device, cudaStream_t stream) {
  const Problems p = problems(a, device);
  if (Status s = run<GradXGemm>(p.grad_x, stream); s != Status::kSuccess) return s;
  if (a.grad_w_bf16) return run<GradWBf16Gemm>(p.grad_w_bf16, stream);
  const Status s =
      a.accumulate ? run<GradWAddGemm>(p.grad_w_add, stream) : run<GradWGemm>(p.grad_w, stream);
  if (s != Status::kSuccess) return s;
  if (a.g_lo) return run<GradWAddGemm>(p.grad_w_lo, stream);
  return Status::kSuccess;
}

}  // namespace moe_routing::detail
