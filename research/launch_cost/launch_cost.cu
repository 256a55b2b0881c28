// Host cost of one backward call, and of its parts: the C ABI call itself (moe_routing_backward,
// GLM-4.5's shape in PyTorch's dtypes, checked device; the forward's too), and beside it what
// the driver alone charges for a launch of the same kind (an empty kernel with the fused
// backward's block, shared memory and parameter size, with and without its launch attributes)
// and for one TMA descriptor. Each figure: host µs per call over loops of calls queued behind a
// GPU spin, so that no call waits on the GPU; the median of 5 loops.
//
//   launch_cost [T]        (default 2048)
//
// Build: research/launch_cost/build.sh (no GPU needed); run on a Hopper GPU.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "moe_routing/moe_routing.h"
#include "research/cuda_check.h"

namespace {

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

struct Params768 {
  unsigned char bytes[768];
};

__global__ void __launch_bounds__(384, 1) empty_kernel(const __grid_constant__ Params768 p) {
  if (p.bytes[threadIdx.x % 768] == 255 && threadIdx.x == 1023) printf("never\n");
}

// Host µs per call: loops of n calls behind a spin long enough that the GPU never catches up.
double host_us(const std::function<void()>& call, cudaStream_t s, int n = 400) {
  std::vector<double> loops;
  for (int r = 0; r < 5; ++r) {
    spin<<<1, 1, 0, s>>>(400000LL * n);  // ~200 µs a call at 2 GHz
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) call();
    const auto t1 = std::chrono::steady_clock::now();
    CK(cudaStreamSynchronize(s));
    loops.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / n);
  }
  std::sort(loops.begin(), loops.end());
  return loops[loops.size() / 2];
}

template <class T>
T* device_random(size_t n, unsigned seed) {
  std::vector<T> h(n);
  unsigned v = seed;
  for (auto& e : h) {
    v = v * 1664525u + 1013904223u;
    e = T(v >> 9);
  }
  T* d = nullptr;
  CK(cudaMalloc(&d, n * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? atoll(argv[1]) : 2048, H = 5120, E = 160, K = 8;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int device = 0;
  CK(cudaGetDevice(&device));

  // The backward's inputs in PyTorch's dtypes: bf16 x, w, scores [T, E] and gradients; int64
  // indices (K distinct experts a token); grad_x and grad_w bf16.
  uint16_t* x = device_random<uint16_t>(size_t(T * H), 1);
  uint16_t* w = device_random<uint16_t>(size_t(E * H), 2);
  std::vector<int64_t> hidx(size_t(T * K));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) hidx[size_t(t * K + k)] = (t * 7 + k * 19) % E;
  int64_t* idx = nullptr;
  CK(cudaMalloc(&idx, hidx.size() * 8));
  CK(cudaMemcpy(idx, hidx.data(), hidx.size() * 8, cudaMemcpyHostToDevice));
  std::vector<uint16_t> hs(size_t(T * E), 0x3f00), hg(size_t(T * K), 0x3c00);  // 0.5, 0.0078
  uint16_t *scores = nullptr, *grad = nullptr, *gx = nullptr, *gw = nullptr;
  CK(cudaMalloc(&scores, hs.size() * 2));
  CK(cudaMemcpy(scores, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&grad, hg.size() * 2));
  CK(cudaMemcpy(grad, hg.data(), hg.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&gx, size_t(T * H) * 2));
  CK(cudaMalloc(&gw, size_t(E * H) * 2));

  moe_routing_config cfg{};
  cfg.struct_size = sizeof(cfg);
  cfg.hidden_size = H;
  cfg.n_routed_experts = E;
  cfg.num_experts_per_tok = K;
  cfg.n_group = 1;
  cfg.topk_group = 1;
  cfg.routed_scaling_factor = 2.5f;
  cfg.norm_topk_prob = 1;
  const size_t ws_bytes = moe_routing_backward_workspace_bytes(&cfg, T);
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  CK(cudaMemset(ws, 0, ws_bytes));

  moe_routing_backward_args a{};
  a.struct_size = sizeof(a);
  a.tokens = T;
  a.x = x, a.x_len = T * H;
  a.w = w, a.w_len = E * H;
  a.topk_idx = reinterpret_cast<const int32_t*>(idx), a.topk_idx_len = T * K;
  a.topk_idx_dtype = MOE_ROUTING_DTYPE_I64;
  a.scores = scores, a.scores_len = T * E, a.scores_dtype = MOE_ROUTING_DTYPE_BF16;
  a.grad_topk_weights = reinterpret_cast<const float*>(grad), a.grad_topk_weights_len = T * K;
  a.grad_topk_weights_dtype = MOE_ROUTING_DTYPE_BF16;
  a.grad_x = gx, a.grad_x_len = T * H;
  a.grad_w = reinterpret_cast<float*>(gw), a.grad_w_len = E * H;
  a.grad_w_dtype = MOE_ROUTING_DTYPE_BF16;
  a.workspace = ws, a.workspace_bytes = int64_t(ws_bytes);
  a.flags = MOE_ROUTING_FLAG_CHECKED_DEVICE;
  a.device = device;
  int status = moe_routing_backward(&cfg, &a, s);
  if (status != MOE_ROUTING_SUCCESS) {
    printf("moe_routing_backward: %s\n", moe_routing_status_string(status));
    return 1;
  }
  CK(cudaStreamSynchronize(s));

  printf("T %lld, GLM-4.5 shape, PyTorch dtypes; host us per call (median of 5 loops of 400)\n",
         (long long)T);
  printf("  moe_routing_backward (checked device)        %6.2f\n",
         host_us([&] { moe_routing_backward(&cfg, &a, s); }, s));
  moe_routing_backward_args b = a;
  b.flags = 0;
  printf("  moe_routing_backward (device asked)          %6.2f\n",
         host_us([&] { moe_routing_backward(&cfg, &b, s); }, s));
  // The forward on the same x and w (GLM-4.5's groups: 8, top 4), its three outputs.
  moe_routing_config fcfg = cfg;
  fcfg.n_group = 8;
  fcfg.topk_group = 4;
  float *bias = nullptr, *weights = nullptr, *topk_scores = nullptr;
  int32_t* fidx = nullptr;
  CK(cudaMalloc(&bias, size_t(E) * 4));
  CK(cudaMemset(bias, 0, size_t(E) * 4));
  CK(cudaMalloc(&weights, size_t(T * K) * 4));
  CK(cudaMalloc(&topk_scores, size_t(T * K) * 4));
  CK(cudaMalloc(&fidx, size_t(T * K) * 4));
  moe_routing_forward_args f{};
  f.struct_size = sizeof(f);
  f.tokens = T;
  f.x = x, f.x_len = T * H;
  f.w = w, f.w_len = E * H;
  f.bias = bias, f.bias_len = E;
  f.topk_idx = fidx, f.topk_idx_len = T * K;
  f.topk_weights = weights, f.topk_weights_len = T * K;
  f.topk_scores = topk_scores, f.topk_scores_len = T * K;
  f.flags = MOE_ROUTING_FLAG_CHECKED_DEVICE;
  f.device = device;
  if ((status = moe_routing_forward(&fcfg, &f, s)) != MOE_ROUTING_SUCCESS) {
    printf("moe_routing_forward: %s\n", moe_routing_status_string(status));
    return 1;
  }
  printf("  moe_routing_forward (checked device)         %6.2f\n",
         host_us([&] { moe_routing_forward(&fcfg, &f, s); }, s));
  printf("  moe_routing_backward_workspace_bytes         %6.2f\n",
         host_us([&] { (void)moe_routing_backward_workspace_bytes(&cfg, T); }, s, 4000));

  // The driver alone: an empty kernel shaped as the fused backward (132 CTAs of 384 threads,
  // 200 KB of shared memory, 768 bytes of parameters).
  const int smem = 200 * 1024;
  CK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  Params768 p{};
  auto launch = [&](bool cluster, bool pdl) {
    cudaLaunchAttribute attrs[2];
    int n = 0;
    if (cluster) {
      attrs[n] = {};
      attrs[n].id = cudaLaunchAttributeClusterDimension;
      attrs[n].val.clusterDim.x = 1, attrs[n].val.clusterDim.y = 1, attrs[n].val.clusterDim.z = 1;
      ++n;
    }
    if (pdl) {
      attrs[n] = {};
      attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attrs[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    cudaLaunchConfig_t c{};
    c.gridDim = dim3(132), c.blockDim = dim3(384), c.dynamicSmemBytes = smem, c.stream = s;
    c.attrs = attrs, c.numAttrs = unsigned(n);
    (void)cudaLaunchKernelEx(&c, empty_kernel, p);
  };
  printf("  empty kernel <<<>>>                          %6.2f\n",
         host_us([&] { empty_kernel<<<132, 384, smem, s>>>(p); }, s));
  printf("  empty kernel, cudaLaunchKernelEx, no attrs   %6.2f\n",
         host_us([&] { launch(false, false); }, s));
  printf("  ... cluster dimension 1                      %6.2f\n",
         host_us([&] { launch(true, false); }, s));
  printf("  ... programmatic serialization (PDL)         %6.2f\n",
         host_us([&] { launch(false, true); }, s));
  printf("  ... both (the library's launch)              %6.2f\n",
         host_us([&] { launch(true, true); }, s));

  // One TMA descriptor, as the backward encodes two per call.
  void* pfn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pfn, 12000, cudaEnableDefault,
                                      &found));
  auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(pfn);
  CUtensorMap map;
  cuuint64_t dims[2] = {cuuint64_t(H), cuuint64_t(T)}, strides[1] = {cuuint64_t(H * 2)};
  cuuint32_t box[2] = {64, 128}, estr[2] = {1, 1};
  printf("  cuTensorMapEncodeTiled                       %6.2f\n",
         host_us([&] {
           (void)encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x, dims, strides, box, estr,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
         }, s, 4000));
  cudaStreamCaptureStatus cap;
  int dev;
  printf("  cudaStreamIsCapturing + cudaStreamGetDevice  %6.2f\n",
         host_us([&] {
           (void)cudaStreamIsCapturing(s, &cap);
           (void)cudaStreamGetDevice(s, &dev);
         }, s, 4000));
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  return 0;
}
