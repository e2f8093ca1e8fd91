// The generic binder on the declarations a bundle carries (tests/cpp/declarations.json, the
// writer's data): sizes bound in the layout's order, derived sizes, broadcasts, outputs written
// in place, the declaration's messages. (tests/python/test_bundle_cpp_messages.py compares the
// messages with Python's for the same calls.)
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/binder.hpp"
#include "core/json.hpp"

namespace {

mfa::Declaration declaration(const std::string& op) {
  std::ifstream file(MFA_DECLARATIONS_JSON);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return mfa::Declaration::from_json(mfa::json::parse(text).at(op));
}

std::string message_of(mfa::Binder& binder) {
  try {
    binder.bind_sizes();
    binder.check_others();
  } catch (const mfa::Error& e) {
    return e.what();
  }
  return "";
}

struct Views {
  std::vector<float> data = std::vector<float>(4096);
  mfa::TensorView view(std::vector<std::int64_t> shape, mfa::DType dtype = mfa::DType::float32) {
    return {data.data(), dtype, std::move(shape), {}};
  }
};

}  // namespace

TEST(Binder, BindsSizesInTheLayoutsOrderAndDerivesTheRest) {
  const mfa::Declaration d = declaration("attention");
  Views m;
  const mfa::TensorView q = m.view({2, 5, 4, 16}), k = m.view({2, 7, 2, 16}), v = m.view({2, 7, 2, 8});
  const mfa::TensorView out = m.view({2, 5, 4, 8}), slopes = m.view({2, 4});
  mfa::Binder binder(d, "bshd", {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"alibi_slopes", &slopes}});
  EXPECT_EQ(message_of(binder), "");
  const mfa::SizeEnv expected = {{"B", 2}, {"Hq", 4}, {"R", 5}, {"D", 16}, {"Hkv", 2}, {"C", 7}, {"Dv", 8}};
  for (const auto& [name, value] : expected) EXPECT_EQ(binder.size(name), value) << name;
  EXPECT_EQ(binder.size("slope_rows"), 2);
  EXPECT_EQ(binder.shape_index("alibi_slopes"), 1u);
  EXPECT_EQ(binder.expected("out"), (std::vector<std::int64_t>{2, 5, 4, 8}));
}

TEST(Binder, BroadcastsAMaskAndRefusesWithTheDeclarationsMessages) {
  const mfa::Declaration d = declaration("attention");
  Views m;
  const mfa::TensorView q = m.view({1, 2, 4, 16}), k = m.view({1, 1, 6, 16}), out = m.view({1, 2, 4, 16});
  const mfa::TensorView mask = m.view({4, 1}, mfa::DType::bool8), wide = m.view({3, 6}, mfa::DType::bool8);
  mfa::Binder broadcast(d, "bhsd", {{"q", &q}, {"k", &k}, {"v", &k}, {"out", &out}, {"mask", &mask}});
  EXPECT_EQ(message_of(broadcast), "");
  mfa::Binder refused(d, "bhsd", {{"q", &q}, {"k", &k}, {"v", &k}, {"out", &out}, {"mask", &wide}});
  EXPECT_EQ(message_of(refused), "mask of shape (3, 6) does not broadcast to (B, Hq, R, C) = (1, 2, 4, 6)");
  const mfa::TensorView half = m.view({1, 1, 6, 16}, mfa::DType::float16);
  mfa::Binder dtype(d, "bhsd", {{"q", &q}, {"k", &k}, {"v", &half}, {"out", &out}});
  EXPECT_EQ(message_of(dtype), "v has dtype float16 but q has float32; q, k and v must share one dtype");
}

TEST(Binder, OutputsAreWrittenInPlaceAndNeedTheirArgument) {
  const mfa::Declaration d = declaration("attention_backward");
  Views m;
  const mfa::TensorView q = m.view({1, 2, 4, 16}), k = m.view({1, 1, 6, 16}), lse = m.view({1, 2, 4});
  const mfa::TensorView dsinks = m.view({2});
  mfa::TensorView strided = m.view({1, 2, 4, 16});
  strided.strides = {256, 128, 32, 2};
  mfa::Binder needs(d, "bhsd", {{"q", &q}, {"k", &k}, {"v", &k}, {"o", &q}, {"lse", &lse}, {"do", &q},
                                {"dq", &q}, {"dk", &k}, {"dv", &k}, {"dsinks", &dsinks}, {"sinks", nullptr}});
  EXPECT_EQ(message_of(needs), "dsinks is given but options.sinks is not: there is no sink gradient");
  mfa::Binder contiguous(d, "bhsd", {{"q", &q}, {"k", &k}, {"v", &k}, {"o", &q}, {"lse", &lse}, {"do", &q},
                                     {"dq", &strided}, {"dk", &k}, {"dv", &k}});
  EXPECT_EQ(message_of(contiguous), "dq must be contiguous (it is written in place), got strides (256, 128, 32, 2)");
}
