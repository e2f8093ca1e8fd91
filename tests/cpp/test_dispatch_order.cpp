// barriers_before: a barrier exactly before the dispatches that touch memory
// an earlier dispatch since the last barrier wrote, or write memory it read.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dispatch_order.hpp"
#include "fake_backend.hpp"
#include "mfa/pipeline.hpp"

namespace {

using mfa::Binding;
using mfa::Buffer;
using mfa::Dispatch;

// in: read-only; out: written; both: a non-const pointer the kernel may read too.
const char* kSource = R"(
kernel void step(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                 constant float& scale [[buffer(2)]]) {}
)";

// A window into another storage's memory, as a framework's tensor view is.
class ViewStorage final : public mfa::BufferStorage {
 public:
  ViewStorage(mfa::BufferStorage& base, std::size_t offset, std::size_t bytes)
      : base_(base), offset_(offset), bytes_(bytes) {}
  void* contents() override { return static_cast<unsigned char*>(base_.contents()) + offset_; }
  std::size_t size() const override { return bytes_; }

 private:
  mfa::BufferStorage& base_;
  std::size_t offset_, bytes_;
};

class DispatchOrderTest : public ::testing::Test {
 protected:
  DispatchOrderTest() : random_(std::random_device{}()) {
    const mfa::FunctionInfo function = mfa::reflect_msl(kSource).at(0);
    auto library = std::make_shared<mfa::Library>("library", kSource, std::vector<mfa::FunctionInfo>{function},
                                                  std::make_shared<mfa::BackendLibrary>());
    pipeline_ = std::make_shared<mfa::Pipeline>("pipeline", library, function, std::map<int, mfa::ConstantValue>{},
                                                std::make_shared<mfa::testing::FakePipeline>());
  }

  Buffer buffer() {
    const std::size_t bytes = std::uniform_int_distribution<std::size_t>(64, 4096)(random_);
    return Buffer(std::make_shared<mfa::testing::FakeStorage>(bytes), bytes);
  }

  // step(in, out): reads `in`, writes `out`; `scale` as inline bytes.
  Dispatch step(const Buffer& in, const Buffer& out, std::size_t out_offset = 0) const {
    Dispatch dispatch;
    dispatch.pipeline = pipeline_;
    dispatch.bindings.push_back(Binding{0, in, 0, {}, false});
    dispatch.bindings.push_back(Binding{1, out, out_offset, {}, false});
    dispatch.bindings.push_back(Binding{2, {}, 0, {0, 0, 128, 63}, false});
    return dispatch;
  }

  std::shared_ptr<const mfa::Pipeline> pipeline_;
  std::mt19937 random_;
};

TEST_F(DispatchOrderTest, IndependentDispatchesNeedNoBarrier) {
  const Buffer a = buffer(), b = buffer(), c = buffer(), d = buffer();
  EXPECT_EQ(mfa::barriers_before({step(a, b), step(c, d), step(a, buffer())}),
            (std::vector<bool>{false, false, false}));  // a is only read
}

TEST_F(DispatchOrderTest, ReadingWhatAnEarlierDispatchWroteNeedsABarrier) {
  const Buffer a = buffer(), b = buffer(), c = buffer();
  EXPECT_EQ(mfa::barriers_before({step(a, b), step(b, c)}), (std::vector<bool>{false, true}));
}

TEST_F(DispatchOrderTest, WritingWhatAnEarlierDispatchReadOrWroteNeedsABarrier) {
  const Buffer a = buffer(), b = buffer(), c = buffer();
  EXPECT_EQ(mfa::barriers_before({step(a, b), step(c, a)}), (std::vector<bool>{false, true}));
  EXPECT_EQ(mfa::barriers_before({step(a, b), step(c, b)}), (std::vector<bool>{false, true}));
}

TEST_F(DispatchOrderTest, ABarrierOrdersEverythingBeforeIt) {
  const Buffer a = buffer(), b = buffer(), c = buffer(), d = buffer();
  // d1 waits for b; d2 reads b again, already ordered; d3 writes c, which d1 wrote;
  // d4 writes a, which d3 read.
  EXPECT_EQ(mfa::barriers_before({step(a, b), step(b, c), step(b, d), step(a, c), step(d, a)}),
            (std::vector<bool>{false, true, false, true, true}));
}

TEST_F(DispatchOrderTest, BindingsOfOneStorageAtOffsetsStillOverlap) {
  const Buffer a = buffer(), b = buffer();
  // A binding reaches from its offset to the end of its buffer, so the two `out` ranges overlap.
  EXPECT_EQ(mfa::barriers_before({step(a, b, 0), step(a, b, 32)}), (std::vector<bool>{false, true}));
}

TEST_F(DispatchOrderTest, ViewsOfOneAllocationConflictOnlyWhereTheyOverlap) {
  const Buffer whole = buffer(), in = buffer();
  const std::size_t half = whole.size() / 2;
  auto view = [&](std::size_t offset, std::size_t bytes) {
    return Buffer(std::make_shared<ViewStorage>(*whole.storage(), offset, bytes), bytes);
  };
  const Buffer low = view(0, half), high = view(half, whole.size() - half), middle = view(half - 4, 8);
  EXPECT_EQ(mfa::barriers_before({step(in, low), step(in, high)}), (std::vector<bool>{false, false}));
  EXPECT_EQ(mfa::barriers_before({step(in, low), step(middle, high)}), (std::vector<bool>{false, true}));
  EXPECT_EQ(mfa::barriers_before({step(in, whole), step(in, high)}), (std::vector<bool>{false, true}));
}

}  // namespace
