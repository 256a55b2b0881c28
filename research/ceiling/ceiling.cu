// The suite's ceiling: how close to its speed of light any kernel can come on this GPU. Per
// case, the bytes of the suite's SOL model are moved with no compute at all, timed as the
// benchmarks time the kernels (CUDA graph of back-to-back calls over rotated buffer sets that
// together exceed twice the L2, median of 7 rounds):
//   backward  reads R = 2·T·H + 2·E·H + 12·T·K bytes and writes W = 2·T·H + 4·E·H (each
//             written vector depends on a read one, as grad_x depends on x)
//             - `copy`: a kernel of 16-byte loads and stores, 4 vectors in flight per thread,
//               the best of: one pass (a thread per 4 vectors) or grid-stride on 2, 4 or 8
//               CTAs of 256 threads per SM; streaming (.cs) or default loads and stores
//               or bulk copies through a ring in shared memory (one thread per SM, 5 loads
//               of 32 KB in flight)
//             - `memcpy`: cudaMemcpyAsync device to device of (R + W) / 2 bytes (rounded down
//               to 64 KB)
//   forward   reads 2·T·H + 2·E·H and writes 12·T·K bytes
//             - `read`: the same kernel shapes, loads folded into one word per thread, written
//               where it would be read as nonzero (never, for finite data: keeps the loads)
// Any implementation moves at least these bytes, so its time is at least the best of these,
// and at least the FLOPs at the tensor peak; `ceiling %` is SOL time / the larger of the two
// (100% where the FLOPs bound the SOL and the bytes move faster).
//
//   ceiling T H E K [T H E K ...]
//
// Prints one line per case and direction. Build: research/ceiling/build.sh (no GPU needed); run on
// a Hopper GPU.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#include "../cuda_check.h"

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr double kHbm = 4.8e12, kTensor = 989e12;

// Cache hints of the loads and stores: kStreaming `.cs` (evict first), else the default.
template <bool kStreaming>
__device__ __forceinline__ uint4 load(const uint4* p) { return kStreaming ? __ldcs(p) : *p; }
template <bool kStreaming>
__device__ __forceinline__ void store(uint4* p, uint4 v) {
  if (kStreaming) __stcs(p, v); else *p = v;
}

// Vectors base + u·kThreads (u < kUnroll) of `in`, all loads in flight; `fill(i)` where i >= reads.
template <bool kLoadCs, class Fill>
__device__ __forceinline__ void load_vectors(const uint4* in, int64_t base, int64_t reads,
                                             uint4 (&v)[kUnroll], Fill fill) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + int64_t(u) * kThreads;
    v[u] = i < reads ? load<kLoadCs>(in + i) : fill(i);
  }
}

// The first vector of each thread's groups of kUnroll: grid-stride, a grid that covers every
// vector at once runs each thread's loop once.
#define FOR_EACH_GROUP(base, n)                                                       \
  for (int64_t base = int64_t(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < (n); \
       base += int64_t(gridDim.x) * kThreads * kUnroll)

// Vectors [0, max(reads, writes)): vector i read from `in` where i < reads, written to `out`
// where i < writes (the read value, or i where there is none).
template <bool kLoadCs, bool kStoreCs>
__global__ void __launch_bounds__(kThreads) copy_vectors(const uint4* __restrict__ in,
                                                         uint4* __restrict__ out, int64_t reads,
                                                         int64_t writes) {
  FOR_EACH_GROUP(base, reads > writes ? reads : writes) {
    uint4 v[kUnroll];
    load_vectors<kLoadCs>(in, base, reads, v,
                          [](int64_t i) { return make_uint4(uint32_t(i), 0, 0, 0); });
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * kThreads;
      if (i < writes) store<kStoreCs>(out + i, v[u]);
    }
  }
}

// Vectors [0, reads) of `in` read and folded; a thread writes its word only where it is
// nonzero (never for finite data, all of whose words here are below the sign bit pattern).
template <bool kLoadCs>
__global__ void __launch_bounds__(kThreads) read_vectors(const uint4* __restrict__ in,
                                                         uint32_t* __restrict__ out, int64_t reads) {
  uint32_t acc = 0;
  FOR_EACH_GROUP(base, reads) {
    uint4 v[kUnroll];
    load_vectors<kLoadCs>(in, base, reads, v, [](int64_t) { return make_uint4(0, 0, 0, 0); });
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc |= (v[u].x & v[u].y & v[u].z & v[u].w) & 0x80808080u;
  }
  if (acc == 0x80808080u) out[int64_t(blockIdx.x) * kThreads + threadIdx.x] = acc;
}

// Bulk copies through shared memory (the tensor memory accelerator's 1-D copies, as TMA moves
// tiles in the fused kernels): one thread per CTA, one CTA per SM, a ring of kBulkStages
// chunks of kBulkBytes with kBulkStages - 1 loads in flight. The CTA's k-th chunk is
// blockIdx.x + k·gridDim.x; it is loaded where below read_chunks and stored where below
// write_chunks (a stored chunk that was not loaded holds the ring's old bytes).
constexpr int kBulkStages = 6, kBulkBytes = 32 * 1024;
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
__global__ void __launch_bounds__(32) bulk_copy(const char* __restrict__ in, char* __restrict__ out,
                                                int64_t read_chunks, int64_t write_chunks) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kBulkStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kBulkStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int64_t n = read_chunks > write_chunks ? read_chunks : write_chunks;
  auto chunk = [&](int k) { return int64_t(blockIdx.x) + int64_t(k) * gridDim.x; };
  auto load = [&](int k) {  // chunk k into stage k % kBulkStages
    const int64_t i = chunk(k);
    if (i >= read_chunks) return;
    const uint32_t bar = smem_addr(&full[k % kBulkStages]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                 "r"(kBulkBytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_addr(ring + (k % kBulkStages) * kBulkBytes)), "l"(in + i * kBulkBytes),
        "r"(kBulkBytes), "r"(bar) : "memory");
  };
  for (int k = 0; k < kBulkStages - 1; ++k) load(k);
  for (int k = 0; chunk(k) < n; ++k) {
    const int64_t i = chunk(k);
    const int s = k % kBulkStages;
    if (i < read_chunks) {
      const uint32_t bar = smem_addr(&full[s]), parity = (k / kBulkStages) & 1;
      uint32_t done = 0;
      while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
    if (i < write_chunks)
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                       out + i * kBulkBytes), "r"(smem_addr(ring + s * kBulkBytes)),
                   "r"(kBulkBytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // Chunk k + kBulkStages - 1 goes to the stage of chunk k - 1, once that chunk's store (the
    // group before this one) has read it.
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    load(k + kBulkStages - 1);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void fill(uint4* p, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    const uint32_t bf = 0x3F003F00u | (h & 0x007F007Fu);  // two bf16 in [0.5, 1): finite, nonzero
    p[i] = make_uint4(bf, bf ^ 0x00010001u, bf ^ 0x00020002u, bf ^ 0x00030003u);
  }
}

// Median µs per call of `launch(set)` over rotated sets: rounds of n calls (n such that a round
// lasts >= 2 ms) captured into a graph and replayed.
template <class F>
double time_calls(cudaStream_t st, int sets, F launch) {
  for (int s = 0; s < sets; ++s) launch(s);  // warm-up
  CK(cudaStreamSynchronize(st));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto capture = [&](int n) {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; ++i) launch(i % sets);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&exec, g, 0));
    CK(cudaGraphDestroy(g));
    CK(cudaGraphLaunch(exec, st));  // upload
    CK(cudaStreamSynchronize(st));
    return exec;
  };
  auto replay = [&](cudaGraphExec_t exec) {
    CK(cudaEventRecord(a, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return double(ms) * 1e3;
  };
  cudaGraphExec_t probe = capture(sets * 4);
  const double probe_us = replay(probe) / (sets * 4);
  CK(cudaGraphExecDestroy(probe));
  const int n = std::max(sets * 4, int(2000.0 / std::max(probe_us, 0.5)) / sets * sets + sets);
  cudaGraphExec_t exec = capture(n);
  std::vector<double> us;
  for (int r = 0; r < 7; ++r) us.push_back(replay(exec) / n);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[3];
}

int main(int argc, char** argv) {
  if (argc < 5 || (argc - 1) % 4 != 0) {
    printf("usage: ceiling T H E K [T H E K ...]\n");
    return 2;
  }
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("device: %s, %d SMs\n", prop.name, sms);
  printf("%-5s %7s %9s %9s %9s %9s %9s %9s %9s  %s\n", "dir", "T", "MB", "SOL us", "copy us",
         "bulk us", "memcpy us", "best TB/s", "ceiling%", "copy kernel");
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int c = 1; c + 3 < argc; c += 4) {
    const int64_t T = atoll(argv[c]), H = atoll(argv[c + 1]), E = atoll(argv[c + 2]),
                  K = atoll(argv[c + 3]);
    for (int fwd = 0; fwd < 2; ++fwd) {
      const int64_t reads = fwd ? 2 * T * H + 2 * E * H : 2 * T * H + 2 * E * H + 12 * T * K;
      const int64_t writes = fwd ? 12 * T * K : 2 * T * H + 4 * E * H;
      const double bytes = double(reads + writes);
      const double flops = double(fwd ? 2 : 4) * double(T) * double(E) * double(H);
      const double sol_us = std::max(bytes / kHbm, flops / kTensor) * 1e6;
      const int64_t rv = (reads + 15) / 16, wv = (writes + 15) / 16;
      // Vectors of the memcpy, each way: (R + W) / 2 bytes, rounded down to 64 KB (sizes of
      // odd multiples of 16 bytes took a path 1.5-1.6x slower on an H200; the few bytes less
      // only make the ceiling more generous).
      const int64_t half = (reads + writes) / 2 / 65536 * 65536 / 16;
      // CTAs of a one-pass grid (the largest of the kernels' grids).
      const int64_t need = (std::max(rv, fwd ? int64_t(0) : wv) + kThreads * kUnroll - 1) /
                           (kThreads * kUnroll);
      // Vectors per buffer: the copies' bytes, whole bulk chunks, and read_vectors' output
      // words (one per thread of its grid).
      const int64_t cap = std::max({rv, wv, half, need * kThreads / 4 + 1,
                                   (std::max(reads, writes) / kBulkBytes + 1) * kBulkBytes / 16});
      const int sets = int(std::min<double>(7, std::max<double>(2, 100e6 / bytes + 1)));
      std::vector<uint4*> in(sets), out(sets);
      for (int s = 0; s < sets; ++s) {
        CK(cudaMalloc(&in[s], cap * 16));
        CK(cudaMalloc(&out[s], cap * 16));
        fill<<<1024, 256, 0, st>>>(in[s], cap, 0x1234u + s);
        CK(cudaGetLastError());
      }
      // Variants: CTAs per SM (0: one pass, a thread per kUnroll vectors), load and store hints.
      double best_copy = 1e30;
      char best_how[32] = "";
      for (int per : {0, 2, 4, 8}) {
        const int grid = int(per == 0 ? need : std::min<int64_t>(int64_t(sms) * per, need));
        for (int hint = 0; hint < 3; ++hint) {  // .cs both, default loads, default both
          if (fwd && hint == 2) continue;
          const double us = time_calls(st, sets, [&](int s) {
            if (fwd) {
              uint32_t* o = reinterpret_cast<uint32_t*>(out[s]);
              if (hint == 0) read_vectors<true><<<grid, kThreads, 0, st>>>(in[s], o, rv);
              else read_vectors<false><<<grid, kThreads, 0, st>>>(in[s], o, rv);
            } else if (hint == 0) {
              copy_vectors<true, true><<<grid, kThreads, 0, st>>>(in[s], out[s], rv, wv);
            } else if (hint == 1) {
              copy_vectors<false, true><<<grid, kThreads, 0, st>>>(in[s], out[s], rv, wv);
            } else {
              copy_vectors<false, false><<<grid, kThreads, 0, st>>>(in[s], out[s], rv, wv);
            }
          });
          if (us < best_copy) {
            best_copy = us;
            snprintf(best_how, sizeof(best_how), "%s,%s", per ? (per == 2 ? "2/SM" : per == 4 ? "4/SM" : "8/SM") : "pass",
                     hint == 0 ? "cs" : hint == 1 ? "ld" : "ld+st");
          }
        }
      }
      double bulk_us = 0;
      {  // bulk copies: whole chunks (the last rounded up: a few KB more, never fewer)
        const int64_t rc = (reads + kBulkBytes - 1) / kBulkBytes;
        const int64_t wc = (writes + kBulkBytes - 1) / kBulkBytes;
        const int smem = kBulkStages * kBulkBytes;
        CK(cudaFuncSetAttribute(bulk_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const double us = time_calls(st, sets, [&](int s) {
          bulk_copy<<<sms, 32, smem, st>>>(reinterpret_cast<const char*>(in[s]),
                                           reinterpret_cast<char*>(out[s]), rc, fwd ? 0 : wc);
        });
        bulk_us = us;
        if (bulk_us < best_copy) best_copy = bulk_us, snprintf(best_how, sizeof(best_how), "bulk");
      }
      double memcpy_us = 0;
      if (!fwd) {
        memcpy_us = time_calls(st, sets, [&](int s) {  // (R + W) / 2 bytes each way
          CK(cudaMemcpyAsync(out[s], in[s], size_t(half) * 16, cudaMemcpyDeviceToDevice, st));
        });
      }
      const double best = fwd ? best_copy : std::min(best_copy, memcpy_us);
      printf("%-5s %7lld %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %8.1f%%  %s\n", fwd ? "fwd" : "bwd",
             (long long)T, bytes / 1e6, sol_us, best_copy, bulk_us, memcpy_us, bytes / best / 1e6,
             100.0 * sol_us / std::max(best, flops / kTensor * 1e6), best_how);
      for (int s = 0; s < sets; ++s) {
        CK(cudaFree(in[s]));
        CK(cudaFree(out[s]));
      }
    }
  }
  return 0;
}
