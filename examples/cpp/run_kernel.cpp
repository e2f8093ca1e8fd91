// A C++ program that embeds mfa through include/mfa/ only: it compiles an MSL
// kernel, runs it on the default device, and checks the result.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "mfa/mfa.hpp"

namespace {

const char* kSource = R"(
#include <metal_stdlib>
using namespace metal;

kernel void saxpy(device const float* x [[buffer(0)]],
                  device float* y [[buffer(1)]],
                  constant float& alpha [[buffer(2)]],
                  constant uint& count [[buffer(3)]],
                  uint i [[thread_position_in_grid]]) {
  if (i < count) y[i] = fma(alpha, x[i], y[i]);
}
)";

}  // namespace

int main() {
  try {
    mfa::Device device = mfa::Device::default_device();
    auto pipeline = device.pipeline(kSource, "saxpy");

    const std::uint32_t count = 1000;  // not a multiple of the threadgroup size
    const float alpha = 0.75f;
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal;
    std::vector<float> x(count), y(count), expected(count);
    for (std::uint32_t i = 0; i < count; ++i) {
      x[i] = normal(rng);
      y[i] = normal(rng);
      expected[i] = std::fma(alpha, x[i], y[i]);
    }

    mfa::CommandBatch batch(device);
    batch.dispatch(pipeline, {(count + 255) / 256}, {256})
        .host(0, x.data(), x.size() * sizeof(float), /*writable=*/false)
        .host(1, y.data(), y.size() * sizeof(float), /*writable=*/true)
        .bytes(2, &alpha, sizeof alpha)
        .bytes(3, &count, sizeof count);
    std::vector<mfa::DispatchStats> stats = batch.run();

    double worst = 0;
    for (std::uint32_t i = 0; i < count; ++i) worst = std::fmax(worst, std::fabs(y[i] - expected[i]));
    std::printf("saxpy on %s: %llu threadgroups, max error %.3g\n", device.name().c_str(),
                static_cast<unsigned long long>(stats.at(0).threadgroups), worst);
    return worst <= 1e-6 ? 0 : 1;
  } catch (const mfa::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
