// Example consumer of the moe_routing package (C++ API, moe_routing/router.h): routes a small
// GLM-4.5-shaped batch on the GPU (with the optional full scores and expert counts), runs the
// backward on the forward's outputs, and checks both against an f64 CPU reference written
// here (the semantics of the crate's src/reference.rs).
//
// Exit status 0 when the results agree, or when there is no CUDA device (nothing to run).
#include <moe_routing/router.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "c_abi_check.h"

namespace {

namespace mr = moe_routing;

#define CUDA_CHECK(expr)                                                              \
  do {                                                                                \
    cudaError_t err_ = (expr);                                                        \
    if (err_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(err_));              \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

#define ROUTER_CHECK(expr)                                                            \
  do {                                                                                \
    mr::Status st_ = (expr);                                                          \
    if (st_ != mr::Status::kSuccess) {                                                \
      std::fprintf(stderr, "%s: %s\n", #expr, mr::status_string(st_));                \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// splitmix64.
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) / double(1ull << 53); }  // [0, 1)
  double sym(double scale) { return (2.0 * uniform() - 1.0) * scale; }   // [-scale, scale)
};

uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

double from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ‖a − b‖ / ‖b‖.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
}

constexpr double kTieRel = 1e-5;  // adjacent ranked values closer than this are a near tie
constexpr double kNormEps = 1e-20;

bool near(double a, double b) {
  return a == b || std::fabs(a - b) < kTieRel * std::max({std::fabs(a), std::fabs(b), 1e-30});
}

struct Routed {
  std::vector<int32_t> idx;
  std::vector<double> scores, weights;
  bool near_tie = false;
};

// One token of the forward, from its logits: sigmoid, + bias, the best topk_group groups by
// the sum of their two best values, the best K of their experts (ties to the lower index).
Routed route(const mr::RouterConfig& c, const std::vector<double>& logits,
             const std::vector<double>& bias) {
  const int64_t E = c.n_routed_experts, K = c.num_experts_per_tok;
  std::vector<double> s(E), choice(E);
  for (int64_t e = 0; e < E; ++e) {
    s[e] = 1.0 / (1.0 + std::exp(-logits[e]));
    choice[e] = s[e] + bias[e];
  }
  auto better = [&](int64_t a, int64_t b) {
    return choice[a] != choice[b] ? choice[a] > choice[b] : a < b;
  };
  Routed r;
  std::vector<int64_t> cands;
  if (c.n_group > 1) {
    const int64_t gs = E / c.n_group;
    std::vector<double> gscore(c.n_group);
    for (int64_t g = 0; g < c.n_group; ++g) {
      std::vector<int64_t> m(gs);
      std::iota(m.begin(), m.end(), g * gs);
      std::sort(m.begin(), m.end(), better);
      gscore[g] = choice[m[0]] + choice[m[1]];
    }
    std::vector<int64_t> groups(c.n_group);
    std::iota(groups.begin(), groups.end(), 0);
    std::sort(groups.begin(), groups.end(), [&](int64_t a, int64_t b) {
      return gscore[a] != gscore[b] ? gscore[a] > gscore[b] : a < b;
    });
    for (int64_t i = 0; i < c.topk_group && c.topk_group < c.n_group; ++i)
      r.near_tie |= near(gscore[groups[i]], gscore[groups[i + 1]]);
    for (int64_t i = 0; i < c.topk_group; ++i)
      for (int64_t e = groups[i] * gs; e < (groups[i] + 1) * gs; ++e) cands.push_back(e);
  } else {
    cands.resize(E);
    std::iota(cands.begin(), cands.end(), 0);
  }
  std::sort(cands.begin(), cands.end(), better);
  const int64_t m = std::min<int64_t>(K + 1, int64_t(cands.size()));
  for (int64_t i = 0; i + 1 < m; ++i) r.near_tie |= near(choice[cands[i]], choice[cands[i + 1]]);
  double sum = kNormEps;
  for (int64_t k = 0; k < K; ++k) {
    r.idx.push_back(int32_t(cands[k]));
    r.scores.push_back(s[cands[k]]);
    sum += s[cands[k]];
  }
  for (int64_t k = 0; k < K; ++k)
    r.weights.push_back(r.scores[k] * (c.norm_topk_prob ? 1.0 / sum : 1.0) *
                        double(c.routed_scaling_factor));
  return r;
}

// Gradient of the logits at the K chosen experts from the gradient of the routing weights.
std::vector<double> routing_grad(const mr::RouterConfig& c, const float* s, const float* g) {
  const int64_t K = c.num_experts_per_tok;
  const double scale = c.routed_scaling_factor;
  double sum = kNormEps, dot = 0;
  for (int64_t k = 0; k < K; ++k) {
    sum += s[k];
    dot += double(g[k]) * s[k];
  }
  std::vector<double> out(K);
  for (int64_t k = 0; k < K; ++k) {
    const double gs = c.norm_topk_prob ? scale * (g[k] / sum - dot / (sum * sum)) : scale * g[k];
    out[k] = gs * s[k] * (1.0 - s[k]);
  }
  return out;
}

template <class T>
T* device_alloc(size_t n) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
  return static_cast<T*>(p);
}

template <class T>
void upload(T* dst, const std::vector<T>& src) {
  CUDA_CHECK(cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <class T>
std::vector<T> download(const T* src, size_t n) {
  std::vector<T> out(n);
  CUDA_CHECK(cudaMemcpy(out.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace

int main() {
  if (moe_routing_example_c_abi_check() != 0) return 1;
  if (mr::device_count() == 0) {
    std::printf("no CUDA device: skipped\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::printf("%s is sm_%d%d; this build runs on Hopper (sm_90a): skipped\n", prop.name,
                prop.major, prop.minor);
    return 0;
  }
  CUDA_CHECK(cudaSetDevice(0));

  // GLM-4.5 router: H 5120, 160 experts, top-8 of 8 groups keeping 4, scale 2.5, normalized.
  mr::RouterConfig cfg;
  cfg.hidden_size = 5120;
  cfg.n_routed_experts = 160;
  cfg.num_experts_per_tok = 8;
  cfg.n_group = 8;
  cfg.topk_group = 4;
  cfg.routed_scaling_factor = 2.5f;
  cfg.norm_topk_prob = true;
  ROUTER_CHECK(mr::validate_config(cfg));
  // Not a multiple of the forward's 128-token tile: the last tile is a tail.
  const int64_t T = 300, H = cfg.hidden_size, E = cfg.n_routed_experts,
                K = cfg.num_experts_per_tok;

  Rng rng{42};
  std::vector<uint16_t> x(T * H), w(E * H);
  std::vector<float> bias(E), grad_topk_weights(T * K);
  for (auto& v : x) v = to_bf16(float(rng.sym(1.0)));
  for (auto& v : w) v = to_bf16(float(rng.sym(3.0 / std::sqrt(double(H)))));
  for (auto& v : bias) v = float(rng.sym(0.1));
  for (auto& v : grad_topk_weights) v = float(rng.sym(1.0));

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  auto* d_x = device_alloc<uint16_t>(x.size());
  auto* d_w = device_alloc<uint16_t>(w.size());
  auto* d_bias = device_alloc<float>(E);
  auto* d_idx = device_alloc<int32_t>(T * K);
  auto* d_weights = device_alloc<float>(T * K);
  auto* d_scores = device_alloc<float>(T * K);
  auto* d_gtw = device_alloc<float>(T * K);
  auto* d_all_scores = device_alloc<float>(T * E);
  auto* d_counts = device_alloc<int32_t>(E);
  auto* d_grad_x = device_alloc<uint16_t>(T * H);
  auto* d_grad_w = device_alloc<float>(E * H);
  const size_t ws_bytes = mr::backward_workspace_bytes(cfg, T);
  auto* d_ws = device_alloc<uint8_t>(ws_bytes);
  CUDA_CHECK(cudaMemset(d_ws, 0, ws_bytes));  // once, when allocated
  upload(d_x, x);
  upload(d_w, w);
  upload(d_bias, bias);
  upload(d_gtw, grad_topk_weights);

  mr::ForwardArgs f;
  f.tokens = T;
  f.x = {d_x, T * H};
  f.w = {d_w, E * H};
  f.bias = {d_bias, E};
  f.topk_idx = {d_idx, T * K};
  f.topk_weights = {d_weights, T * K};
  f.topk_scores = {d_scores, T * K};
  f.scores = {d_all_scores, T * E};  // optional outputs
  f.expert_counts = {d_counts, E};
  ROUTER_CHECK(mr::router_forward(cfg, f, stream));

  mr::BackwardArgs b;
  b.tokens = T;
  b.x = {d_x, T * H};
  b.w = {d_w, E * H};
  b.topk_idx = {d_idx, T * K};
  b.topk_scores = {d_scores, T * K};
  b.grad_topk_weights = {d_gtw, T * K};
  b.grad_x = {d_grad_x, T * H};
  b.grad_w = {d_grad_w, E * H};
  b.workspace = {d_ws, int64_t(ws_bytes)};
  ROUTER_CHECK(mr::router_backward(cfg, b, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  const auto idx = download(d_idx, T * K);
  const auto weights = download(d_weights, T * K);
  const auto scores = download(d_scores, T * K);
  const auto grad_x = download(d_grad_x, T * H);
  const auto grad_w = download(d_grad_w, E * H);
  const auto all_scores = download(d_all_scores, T * E);
  const auto counts = download(d_counts, E);

  // Optional outputs: counts are the histogram of the chosen experts; the full scores hold
  // the saved scores at the chosen experts, bit for bit.
  std::vector<int32_t> want_counts(E, 0);
  bool extras_ok = true;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[t * K + k];
      if (e < 0 || e >= E) {
        extras_ok = false;
        continue;
      }
      ++want_counts[e];
      uint32_t a, b;
      std::memcpy(&a, &all_scores[t * E + e], 4);
      std::memcpy(&b, &scores[t * K + k], 4);
      extras_ok = extras_ok && a == b;
    }
  extras_ok = extras_ok && counts == want_counts;

  // The same through the C ABI (c_abi_check.c), into the same buffers after clearing them:
  // both paths run the same kernels, which are deterministic, so the results are identical.
  CUDA_CHECK(cudaMemset(d_idx, 0xff, T * K * sizeof(int32_t)));
  CUDA_CHECK(cudaMemset(d_grad_x, 0, T * H * sizeof(uint16_t)));
  CUDA_CHECK(cudaMemset(d_grad_w, 0, E * H * sizeof(float)));
  ROUTER_CHECK(mr::Status(
      moe_routing_example_c_forward(T, d_x, d_w, d_bias, d_idx, d_weights, d_scores, stream)));
  ROUTER_CHECK(mr::Status(moe_routing_example_c_backward(T, d_x, d_w, d_idx, d_scores, d_gtw,
                                                         d_grad_x, d_grad_w, d_ws, ws_bytes,
                                                         stream)));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const bool c_abi_same = download(d_idx, T * K) == idx && download(d_weights, T * K) == weights &&
                          download(d_scores, T * K) == scores &&
                          download(d_grad_x, T * H) == grad_x &&
                          download(d_grad_w, E * H) == grad_w;

  // Forward reference.
  std::vector<double> x64(T * H), w64(E * H), bias64(bias.begin(), bias.end());
  std::transform(x.begin(), x.end(), x64.begin(), from_bf16);
  std::transform(w.begin(), w.end(), w64.begin(), from_bf16);
  // Indices must match except on near-tie rows; weights and scores are compared on the rows
  // whose indices match.
  int64_t ties = 0, mismatched = 0, compared = 0;
  std::vector<double> got_v, ref_v;  // weights and scores of the compared rows
  std::vector<double> logits(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0;
      for (int64_t h = 0; h < H; ++h) acc += x64[t * H + h] * w64[e * H + h];
      logits[e] = acc;
    }
    const Routed r = route(cfg, logits, bias64);
    ties += r.near_tie;
    if (!std::equal(r.idx.begin(), r.idx.end(), idx.begin() + t * K)) {
      if (!r.near_tie && mismatched++ < 5)
        std::fprintf(stderr, "token %lld: experts differ from the reference\n", (long long)t);
      continue;
    }
    ++compared;
    for (int64_t k = 0; k < K; ++k) {
      got_v.push_back(weights[t * K + k]);
      ref_v.push_back(r.weights[k]);
      got_v.push_back(scores[t * K + k]);
      ref_v.push_back(r.scores[k]);
    }
  }
  const double value_err = rel_err(got_v, ref_v);

  // Backward reference from the GPU's own routing.
  std::vector<double> ref_gx(T * H, 0.0), ref_gw(E * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const auto gl = routing_grad(cfg, &scores[t * K], &grad_topk_weights[t * K]);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = idx[t * K + k];
      for (int64_t h = 0; h < H; ++h) {
        ref_gx[t * H + h] += gl[k] * w64[e * H + h];
        ref_gw[e * H + h] += gl[k] * x64[t * H + h];
      }
    }
  }
  std::vector<double> gx(T * H), gw(grad_w.begin(), grad_w.end());
  std::transform(grad_x.begin(), grad_x.end(), gx.begin(), from_bf16);
  const double err_x = rel_err(gx, ref_gx), err_w = rel_err(gw, ref_gw);

  const bool ok = mismatched == 0 && compared > 0 && value_err <= 1e-5 && err_x <= 1e-2 &&
                  err_w <= 5e-3 && c_abi_same && extras_ok;
  std::printf(
      "%s, T=%lld H=%lld E=%lld K=%lld\n"
      "forward:  %lld near-tie tokens, %lld tokens with other experts than the reference (0), "
      "weights/scores rel err %.2e (<= 1e-5) over %lld tokens\n"
      "backward: rel err grad_x %.2e (<= 1e-2), grad_w %.2e (<= 5e-3)\n"
      "optional: expert counts and full scores %s the top-k outputs\n"
      "C ABI:    forward and backward %s the C++ API's\n%s\n",
      prop.name, (long long)T, (long long)H, (long long)E, (long long)K, (long long)ties,
      (long long)mismatched, value_err, (long long)compared, err_x, err_w,
      extras_ok ? "agree with" : "DISAGREE with", c_abi_same ? "identical to" : "DIFFER from",
      ok ? "ok" : "FAILED");

  for (void* p : {static_cast<void*>(d_x), static_cast<void*>(d_w), static_cast<void*>(d_bias),
                  static_cast<void*>(d_idx), static_cast<void*>(d_weights),
                  static_cast<void*>(d_scores), static_cast<void*>(d_gtw),
                  static_cast<void*>(d_grad_x), static_cast<void*>(d_grad_w),
                  static_cast<void*>(d_ws), static_cast<void*>(d_all_scores),
                  static_cast<void*>(d_counts)})
    CUDA_CHECK(cudaFree(p));
  CUDA_CHECK(cudaStreamDestroy(stream));
  return ok ? 0 : 1;
}
