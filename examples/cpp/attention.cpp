// A C++ program that runs attention with no Python: it loads a bundle written by
//   python -m mfa_native bundle -o attention.mfab --spec examples/cpp/attention_spec.json
// runs attention forward and backward on the default device (causal and not,
// grouped-query heads), and checks both against a naive float64 reference.
//   usage: attention BUNDLE
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "mfa/mfa.hpp"

namespace {

struct Sizes {
  int B, Hq, Hkv, R, C, D;
};

// Naive attention in float64: o, lse and the gradients for dO = `dout` (bhsd, contiguous).
struct Reference {
  std::vector<double> o, lse, dq, dk, dv;
};

Reference reference(const Sizes& s, bool causal, const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, const std::vector<float>& dout) {
  const double scale = 1.0 / std::sqrt(double(s.D));
  Reference r{std::vector<double>(q.size()), std::vector<double>(std::size_t(s.B) * s.Hq * s.R),
              std::vector<double>(q.size()), std::vector<double>(k.size()), std::vector<double>(v.size())};
  auto at = [&](int b, int h, int heads, int len, int i) { return ((std::size_t(b) * heads + h) * len + i) * s.D; };
  std::vector<double> p(std::size_t(s.C)), dp(std::size_t(s.C));
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.Hq; ++h) {
      const int hk = h / (s.Hq / s.Hkv);
      for (int i = 0; i < s.R; ++i) {
        const float* qi = &q[at(b, h, s.Hq, s.R, i)];
        double top = -INFINITY;
        for (int j = 0; j < s.C; ++j) {
          const bool allowed = !causal || j <= i + s.C - s.R;
          double dot = 0;
          for (int d = 0; d < s.D; ++d) dot += double(qi[d]) * k[at(b, hk, s.Hkv, s.C, j) + d];
          p[j] = allowed ? scale * dot : -INFINITY;
          top = std::fmax(top, p[j]);
        }
        double sum = 0;
        for (int j = 0; j < s.C; ++j) sum += p[j] = std::isinf(p[j]) ? 0 : std::exp(p[j] - top);
        r.lse[(std::size_t(b) * s.Hq + h) * s.R + i] = top + std::log(sum);
        double* oi = &r.o[at(b, h, s.Hq, s.R, i)];
        for (int j = 0; j < s.C; ++j) {
          p[j] /= sum;
          for (int d = 0; d < s.D; ++d) oi[d] += p[j] * v[at(b, hk, s.Hkv, s.C, j) + d];
        }
        // Backward: dP = dO V^T, dS = P (dP - rowsum(dO * O)), dQ = scale dS K, dK += scale dS^T Q, dV += P^T dO.
        const float* gi = &dout[at(b, h, s.Hq, s.R, i)];
        double delta = 0;
        for (int d = 0; d < s.D; ++d) delta += gi[d] * oi[d];
        for (int j = 0; j < s.C; ++j) {
          dp[j] = 0;
          for (int d = 0; d < s.D; ++d) dp[j] += gi[d] * double(v[at(b, hk, s.Hkv, s.C, j) + d]);
          const double ds = p[j] * (dp[j] - delta);
          for (int d = 0; d < s.D; ++d) {
            r.dq[at(b, h, s.Hq, s.R, i) + d] += scale * ds * k[at(b, hk, s.Hkv, s.C, j) + d];
            r.dk[at(b, hk, s.Hkv, s.C, j) + d] += scale * ds * qi[d];
            r.dv[at(b, hk, s.Hkv, s.C, j) + d] += p[j] * gi[d];
          }
        }
      }
    }
  return r;
}

double worst(const std::vector<float>& got, const std::vector<double>& want) {
  double error = 0, scale = 1;
  for (double w : want) scale = std::fmax(scale, std::fabs(w));
  for (std::size_t i = 0; i < got.size(); ++i) error = std::fmax(error, std::fabs(got[i] - want[i]));
  return std::isnan(error) ? INFINITY : error / scale;
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
    const Sizes s{2, 4, 2, 37, 53, 32};
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    auto random = [&](std::size_t n) {
      std::vector<float> x(n);
      for (float& e : x) e = normal(rng);
      return x;
    };
    const std::size_t nq = std::size_t(s.B) * s.Hq * s.R * s.D, nk = std::size_t(s.B) * s.Hkv * s.C * s.D;
    const std::vector<float> q = random(nq), k = random(nk), v = random(nk), dout = random(nq);
    auto view = [](const std::vector<float>& x, std::vector<std::int64_t> shape) {
      return mfa::TensorView{const_cast<float*>(x.data()), mfa::DType::float32, std::move(shape), {}};
    };
    const std::vector<std::int64_t> q_shape{s.B, s.Hq, s.R, s.D}, k_shape{s.B, s.Hkv, s.C, s.D};

    double error = 0;
    for (bool causal : {false, true}) {
      mfa::AttentionOptions options;
      options.causal = causal ? mfa::Causal::lower_right : mfa::Causal::none;
      std::vector<float> o(nq), lse(std::size_t(s.B) * s.Hq * s.R), dq(nq), dk(nk), dv(nk);
      const mfa::TensorView lse_view = view(lse, {s.B, s.Hq, s.R});
      mfa::attention(device, bundle, view(q, q_shape), view(k, k_shape), view(v, k_shape), view(o, q_shape), options,
                     &lse_view);
      mfa::attention_backward(device, bundle, view(q, q_shape), view(k, k_shape), view(v, k_shape), view(o, q_shape),
                              lse_view, view(dout, q_shape), view(dq, q_shape), view(dk, k_shape), view(dv, k_shape),
                              options);
      const Reference r = reference(s, causal, q, k, v, dout);
      const double errors[] = {worst(o, r.o), worst(lse, r.lse), worst(dq, r.dq), worst(dk, r.dk), worst(dv, r.dv)};
      std::printf("attention on %s, causal %-3s: max relative error o %.2g, lse %.2g, dq %.2g, dk %.2g, dv %.2g\n",
                  device.name().c_str(), causal ? "yes" : "no", errors[0], errors[1], errors[2], errors[3],
                  errors[4]);
      for (double e : errors) error = std::fmax(error, e);
    }
    return error <= 1e-4 ? 0 : 1;
  } catch (const mfa::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
