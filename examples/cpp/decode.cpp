// A toy decode engine on mfa::attention_with_kvcache: a 2-layer GQA transformer with random
// weights prefills an 11-token prompt, then decodes greedily for 8 steps, its K/V in paged q8_0
// caches appended in place (one call per layer per step). It prints the 9 tokens it chose and a
// checksum of every logit; examples/cpp/decode_twin.py is the same engine in numpy.
//   python -m mfa_native bundle -o decode.mfab --spec examples/cpp/decode_spec.json
//   usage: decode BUNDLE   (with MFA_NATIVE_DEVICE=cpu it prints the twin's line, bit for bit)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "mfa/mfa.hpp"

namespace {

constexpr int VOCAB = 64, DIM = 64, HIDDEN = 128, LAYERS = 2;  // the model
constexpr int HQ = 4, HKV = 2, D = 32;                          // attention heads (GQA 2), head dim
constexpr int PAGE = 16, PROMPT = 11, STEPS = 8;                // cache page, prompt length, decode steps
constexpr int PAGES = (PROMPT + STEPS + PAGE - 1) / PAGE;       // pages of one layer's cache
constexpr int Q8_0_BYTES = D / 32 * 34;  // a q8_0 row: per 32 values, a float16 scale + 32 int8

using Tensor = std::vector<float>;  // row-major (rows, cols); the row count is size() / cols

// splitmix64; uniform() takes 24 random bits to [-1, 1), exact in float32.
struct Rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = state += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // (rows, cols), uniform / sqrt(rows) (rows = fan-in), drawn row by row.
  Tensor weights(int rows, int cols) {
    Tensor w(std::size_t(rows) * cols);
    for (float& x : w) x = float((double(next() >> 40) / 8388608.0 - 1.0) / std::sqrt(double(rows)));
    return w;
  }
};

// x (rows, n) @ w (n, m), summed in float64 in order, rounded to float32 (as the twin does).
// A float product is exact in float64, so a fused multiply-add rounds the same.
Tensor linear(const Tensor& x, const Tensor& w, int n, int m) {
  const std::size_t rows = x.size() / n;
  Tensor y(rows * m);
  for (std::size_t r = 0; r < rows; ++r)
    for (int j = 0; j < m; ++j) {
      double acc = 0;
      for (int i = 0; i < n; ++i) acc += double(x[r * n + i]) * w[std::size_t(i) * m + j];
      y[r * m + j] = float(acc);
    }
  return y;
}

Tensor rms_norm(const Tensor& x) {
  Tensor y(x.size());
  for (std::size_t r = 0; r < x.size() / DIM; ++r) {
    double squares = 0;
    for (int i = 0; i < DIM; ++i) squares += double(x[r * DIM + i]) * x[r * DIM + i];
    const double inverse = 1.0 / std::sqrt(squares / DIM + 1e-5);
    for (int i = 0; i < DIM; ++i) y[r * DIM + i] = float(x[r * DIM + i] * inverse);
  }
  return y;
}

void add(Tensor& x, const Tensor& y) {
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
}

struct Layer {
  Tensor wq, wk, wv, wo, w1, w2;
};

mfa::TensorView view(void* data, mfa::DType dtype, std::vector<std::int64_t> shape) {
  return mfa::TensorView{data, dtype, std::move(shape), {}};
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
    Rng rng{2024};
    const Tensor embedding = rng.weights(VOCAB, DIM);
    std::vector<Layer> layers;
    for (int l = 0; l < LAYERS; ++l)
      layers.push_back({rng.weights(DIM, HQ * D), rng.weights(DIM, HKV * D), rng.weights(DIM, HKV * D),
                        rng.weights(HQ * D, DIM), rng.weights(DIM, HIDDEN), rng.weights(HIDDEN, DIM)});
    const Tensor head = rng.weights(DIM, VOCAB);

    // One pool of q8_0 pages for K and one for V, shared by the layers; zero bytes are a
    // valid q8_0 block (zeros). Layer l's logical page p is pool page p * LAYERS + l.
    std::vector<std::uint8_t> k_pool(std::size_t(LAYERS) * PAGES * PAGE * HKV * Q8_0_BYTES);
    std::vector<std::uint8_t> v_pool(k_pool.size());
    const std::vector<std::int64_t> pool_shape{LAYERS * PAGES, PAGE, HKV, Q8_0_BYTES};
    const mfa::QuantizedTensor k_cache{"q8_0", view(k_pool.data(), mfa::DType::uint8, pool_shape)};
    const mfa::QuantizedTensor v_cache{"q8_0", view(v_pool.data(), mfa::DType::uint8, pool_shape)};
    std::vector<std::vector<std::int32_t>> tables(LAYERS);
    for (int l = 0; l < LAYERS; ++l)
      for (int p = 0; p < PAGES; ++p) tables[l].push_back(p * LAYERS + l);

    std::vector<int> tokens, generated;
    for (int i = 0; i < PROMPT; ++i) tokens.push_back((7 * i + 3) % VOCAB);
    double checksum = 0;
    std::int32_t length = 0;          // tokens in the cache
    for (int step = 0; step <= STEPS; ++step) {  // the prefill, then one token a step
      const std::int64_t rows = std::int64_t(tokens.size());
      Tensor x;
      for (int t : tokens)
        x.insert(x.end(), embedding.begin() + std::size_t(t) * DIM, embedding.begin() + std::size_t(t + 1) * DIM);
      for (int l = 0; l < LAYERS; ++l) {
        const Layer& w = layers[l];
        const Tensor h = rms_norm(x);
        Tensor q = linear(h, w.wq, DIM, HQ * D), k = linear(h, w.wk, DIM, HKV * D), v = linear(h, w.wv, DIM, HKV * D);
        Tensor o(q.size());
        const mfa::TensorView seqlens = view(&length, mfa::DType::int32, {1});
        const mfa::TensorView k_new = view(k.data(), mfa::DType::float32, {1, rows, HKV, D});
        const mfa::TensorView v_new = view(v.data(), mfa::DType::float32, {1, rows, HKV, D});
        const mfa::TensorView table = view(tables[l].data(), mfa::DType::int32, {1, PAGES});
        mfa::KVCacheOptions options;
        options.cache_seqlens = &seqlens, options.k = &k_new, options.v = &v_new, options.block_table = &table;
        options.causal = mfa::Causal::lower_right;
        mfa::attention_with_kvcache(device, bundle, view(q.data(), mfa::DType::float32, {1, rows, HQ, D}), k_cache,
                                    v_cache, view(o.data(), mfa::DType::float32, {1, rows, HQ, D}), options);
        add(x, linear(o, w.wo, HQ * D, DIM));
        Tensor hidden = linear(rms_norm(x), w.w1, DIM, HIDDEN);
        for (float& e : hidden) e = std::fmax(e, 0.0f);
        add(x, linear(hidden, w.w2, HIDDEN, DIM));
      }
      length += std::int32_t(rows);
      const Tensor logits = linear(rms_norm(x), head, DIM, VOCAB);
      for (float e : logits) checksum += e;
      int next = 0;  // greedy: the last row's first largest logit
      for (int i = 1; i < VOCAB; ++i)
        if (logits[std::size_t(rows - 1) * VOCAB + i] > logits[std::size_t(rows - 1) * VOCAB + next]) next = i;
      tokens = {next};
      generated.push_back(next);
    }
    std::printf("logits checksum %.6f, tokens", checksum);
    for (int t : generated) std::printf(" %d", t);
    std::printf("\n");
    return 0;
  } catch (const mfa::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
