// A Metal-only embedder: attention from a bundle written with `--metallib`
// (the kernels' compiled libraries, so nothing is compiled from source at run
// time), encoded into the app's own command buffer with mfa::metal::attention,
// and checked against a naive float64 reference. Prints the relative L2 error;
// exits 1 above 1e-5. .github/workflows/macos.yml builds and runs it on a Mac
// with a Metal device (examples/metal/CMakeLists.txt, examples/metal/spec.json).
#import <Metal/Metal.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <future>
#include <vector>

#include "mfa/attention.hpp"
#include "mfa/metal.hpp"

namespace {

constexpr std::int64_t B = 1, H = 2, R = 9, C = 33, D = 32;

// softmax(q k^T / sqrt(D)) v per (batch, head), in float64; (B, H, R|C, D) row-major.
std::vector<double> reference(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v) {
  std::vector<double> out(q.size());
  const double scale = 1.0 / std::sqrt(double(D));
  for (std::int64_t h = 0; h < B * H; ++h)
    for (std::int64_t i = 0; i < R; ++i) {
      std::vector<double> p(C);
      double top = -INFINITY, sum = 0;
      for (std::int64_t j = 0; j < C; ++j) {
        double dot = 0;
        for (std::int64_t d = 0; d < D; ++d) dot += double(q[(h * R + i) * D + d]) * k[(h * C + j) * D + d];
        p[j] = dot * scale;
        top = std::max(top, p[j]);
      }
      for (double& x : p) sum += (x = std::exp(x - top));
      for (std::int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (std::int64_t j = 0; j < C; ++j) acc += p[j] * v[(h * C + j) * D + d];
        out[(h * R + i) * D + d] = acc / sum;
      }
    }
  return out;
}

double relative_l2(const std::vector<float>& got, const std::vector<double>& expected) {
  double error = 0, norm = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    error += (got[i] - expected[i]) * (got[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  return std::sqrt(error / norm);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s BUNDLE (written with python -m mfa_native bundle --metallib)\n", argv[0]);
    return 2;
  }
  try {
    const mfa::Bundle bundle = mfa::Bundle::load(argv[1]);
    const mfa::Device device = mfa::Device::get(mfa::DeviceKind::metal);
    std::vector<float> q(B * H * R * D), k(B * H * C * D), v(k.size()), out(q.size(), NAN);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.3f * i);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.1f * i), v[i] = std::cos(0.2f * i);

    id<MTLCommandQueue> queue = [MTLCreateSystemDefaultDevice() newCommandQueue];  // the app's own queue
    id<MTLCommandBuffer> command_buffer = [queue commandBuffer];
    const std::shared_future<void> done = mfa::metal::attention(
        device, bundle, {q.data(), mfa::DType::float32, {B, H, R, D}, {}},
        {k.data(), mfa::DType::float32, {B, H, C, D}, {}}, {v.data(), mfa::DType::float32, {B, H, C, D}, {}},
        {out.data(), mfa::DType::float32, {B, H, R, D}, {}}, {}, nullptr, command_buffer);
    [command_buffer commit];
    done.get();  // out is complete (staged outputs copied back)

    const double error = relative_l2(out, reference(q, k, v));
    std::printf("relative L2 error %.3g on %s, encoded into the app's command buffer\n", error, device.name().c_str());
    return error <= 1e-5 ? 0 : 1;
  } catch (const mfa::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
