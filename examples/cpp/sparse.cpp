// DeepSeek sparse attention from C++: the lightning indexer (mfa::sparse_topk) picks each query's
// top keys, then mfa::sparse_attention reads only those. Checks the lists (each a causal
// candidate, none twice, no unlisted candidate scoring above a listed one) and the attention
// (against a naive float64 reference over the same lists), and prints the error.
//   python -m mfa_native bundle -o sparse.mfab --spec examples/cpp/sparse_spec.json
//   usage: sparse BUNDLE
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "mfa/mfa.hpp"

namespace {

constexpr std::int64_t B = 1, HQ = 4, HKV = 1, R = 16, C = 128, D = 32;  // attention (MQA)
constexpr std::int64_t HI = 2, DI = 32, TOPK = 16;                         // the indexer

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::vector<float> x(n);
  for (float& e : x) {  // xorshift32: values in [-1, 1), the same on every machine
    seed ^= seed << 13, seed ^= seed >> 17, seed ^= seed << 5;
    e = float(seed >> 8) / 8388608.0f - 1.0f;
  }
  return x;
}

double dot(const float* a, const float* b, std::int64_t n) {
  double sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += double(a[i]) * b[i];
  return sum;
}

// The indexer's score of key c for query row r: sum over its heads of weight * relu(q . k).
double index_score(const std::vector<float>& iq, const std::vector<float>& ik, const std::vector<float>& w,
                   std::int64_t r, std::int64_t c) {
  double score = 0;
  for (std::int64_t h = 0; h < HI; ++h)
    score += w[h * R + r] * std::max(0.0, dot(&iq[(h * R + r) * DI], &ik[c * DI], DI));
  return score;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s BUNDLE\n", argv[0]);
    return 2;
  }
  try {
    const mfa::Bundle bundle = mfa::Bundle::load(argv[1]);
    const mfa::Device device = mfa::Device::default_device();
    std::vector<float> index_q = random_floats(HI * R * DI, 1), index_k = random_floats(C * DI, 2);
    std::vector<float> weights = random_floats(HI * R, 3), q = random_floats(HQ * R * D, 4);
    std::vector<float> k = random_floats(C * D, 5), v = random_floats(C * D, 6);
    std::vector<float> out(q.size(), NAN);                    // poisoned: an element not written shows
    std::vector<std::int32_t> indices(R * TOPK, INT32_MIN);  // as no key a list may name (padding is -1)
    const auto f32 = mfa::DType::float32;
    const mfa::TensorView lists{indices.data(), mfa::DType::int32, {B, 1, R, TOPK}, {}};
    mfa::sparse_topk(device, bundle, {index_q.data(), f32, {B, HI, R, DI}, {}}, {index_k.data(), f32, {B, 1, C, DI}, {}},
                     {weights.data(), f32, {B, HI, R}, {}}, TOPK, lists);
    mfa::sparse_attention(device, bundle, {q.data(), f32, {B, HQ, R, D}, {}}, {k.data(), f32, {B, HKV, C, D}, {}},
                          {v.data(), f32, {B, HKV, C, D}, {}}, lists, {out.data(), f32, {B, HQ, R, D}, {}});

    bool lists_ok = true;
    double error = 0, norm = 0;
    for (std::int64_t r = 0; r < R; ++r) {
      const std::int32_t* list = &indices[r * TOPK];
      const std::int64_t candidates = r + C - R + 1;  // causal, lower right
      std::vector<bool> listed(C, false);
      double lowest = INFINITY;
      for (std::int64_t j = 0; j < TOPK; ++j) {
        lists_ok &= list[j] >= 0 || (list[j] == -1 && j >= candidates);  // padding past the row's candidates
        if (list[j] < 0) continue;
        lists_ok &= list[j] < candidates && !listed[list[j]];
        listed[list[j]] = true;
        lowest = std::min(lowest, index_score(index_q, index_k, weights, r, list[j]));
      }
      for (std::int64_t c = 0; c < candidates; ++c)
        lists_ok &= listed[c] || index_score(index_q, index_k, weights, r, c) <= lowest + 1e-5;
      for (std::int64_t h = 0; h < HQ; ++h) {  // softmax over the listed keys, in float64
        std::vector<double> p;
        double top = -INFINITY, sum = 0;
        for (std::int64_t j = 0; j < TOPK; ++j)
          p.push_back(list[j] < 0 ? -INFINITY : dot(&q[(h * R + r) * D], &k[list[j] * D], D) / std::sqrt(double(D)));
        for (double s : p) top = std::max(top, s);
        for (double& s : p) sum += s = std::exp(s - top);
        for (std::int64_t d = 0; d < D; ++d) {
          double expected = 0;
          for (std::int64_t j = 0; j < TOPK; ++j)
            if (list[j] >= 0) expected += p[j] / sum * v[list[j] * D + d];
          error += std::pow(out[(h * R + r) * D + d] - expected, 2), norm += expected * expected;
        }
      }
    }
    std::printf("sparse attention over the indexer's %s lists: relative L2 %.2e on %s\n",
                lists_ok ? "valid" : "INVALID", std::sqrt(error / norm), device.name().c_str());
    return lists_ok && std::sqrt(error / norm) < 1e-5 ? 0 : 1;
  } catch (const mfa::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
