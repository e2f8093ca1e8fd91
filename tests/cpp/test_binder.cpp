// The generic binder on the declarations a bundle carries (tests/cpp/declarations.json, the
// writer's data): sizes bound in the layout's order (a lower-rank array's too), derived sizes,
// broadcasts, leading axes, the call's texts, list elements, outputs written in place, the
// declaration's messages. (tests/python/test_bundle_cpp_messages.py compares the messages with
// Python's for the same calls.)
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <map>
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

TEST(Binder, ALowerRankLayoutArrayTakesTheLayoutsOrderOfItsAxes) {
  const mfa::Declaration d = declaration("sparse_topk");
  Views m;
  const mfa::TensorView q = m.view({2, 5, 3, 16}), k = m.view({2, 7, 1, 16}), weights = m.view({2, 5, 3});
  const mfa::TensorView indices = m.view({2, 5, 1, 4}, mfa::DType::int32), swapped = m.view({2, 3, 5});
  mfa::Binder good(d, "bshd", {{"q", &q}, {"k", &k}, {"weights", &weights}, {"indices", &indices}}, {{"topk", 4}});
  EXPECT_EQ(message_of(good), "");
  EXPECT_EQ(good.size("Hi"), 3);
  EXPECT_EQ(good.size("C"), 7);
  mfa::Binder bad(d, "bshd", {{"q", &q}, {"k", &k}, {"weights", &swapped}, {"indices", &indices}}, {{"topk", 4}});
  EXPECT_EQ(message_of(bad), "weights must have shape (2, 5, 3), got (2, 3, 5)");
}

TEST(Binder, LeadingAxesAreTheCallsAndTextsFillMessagesAndDtypes) {
  const mfa::Declaration d = declaration("quantize");
  Views m;
  const mfa::TensorView x = m.view({2, 3, 64}), data = m.view({2, 3, 68}, mfa::DType::uint8);
  const mfa::TensorView flat = m.view({6, 68}, mfa::DType::uint8), words = m.view({2, 3, 17}, mfa::DType::uint32);
  const mfa::SizeEnv sizes = {{"group_size", 32}, {"group_width", 34}, {"groups", 6}};
  const std::map<std::string, std::string> texts = {{"format", "q8_0"}, {"data_dtype", "uint8"}};
  mfa::Binder good(d, "none", {{"x", &x}, {"data", &data}}, sizes, texts);
  EXPECT_EQ(message_of(good), "");
  EXPECT_EQ(good.size("D"), 64);
  mfa::Binder rows(d, "none", {{"x", &x}, {"data", &flat}}, sizes, texts);
  EXPECT_EQ(message_of(rows), "data must be uint8 (2, 3, 68) for q8_0, got uint8 (6, 68)");
  mfa::Binder dtype(d, "none", {{"x", &x}, {"data", &words}}, sizes, texts);
  EXPECT_EQ(message_of(dtype), "data must be uint8 (2, 3, 68) for q8_0, got uint32 (2, 3, 17)");
}

TEST(Binder, AListsElementsAreCheckedEachByName) {
  const mfa::Declaration d = declaration("merge_attention");
  Views m;
  const mfa::TensorView part = m.view({1, 2, 3, 8}), other = m.view({1, 2, 3, 4}), rows = m.view({1, 2, 3});
  const mfa::TensorView out = m.view({1, 2, 3, 8}), wrong = m.view({1, 3, 2});
  mfa::Binder good(d, "bhsd", {{"outputs[0]", &part}, {"outputs[1]", &part}, {"lses[0]", &rows},
                               {"lses[1]", &rows}, {"out", &out}, {"lse", &rows}});
  EXPECT_EQ(message_of(good), "");
  EXPECT_EQ(good.size("Dv"), 8);
  mfa::Binder unlike(d, "bhsd", {{"outputs[0]", &part}, {"outputs[1]", &other}, {"lses[0]", &rows},
                                 {"lses[1]", &rows}, {"out", &out}, {"lse", &rows}});
  EXPECT_EQ(message_of(unlike), "outputs must be 4-d arrays of one dtype and shape: outputs[0] is float32 "
                                "(1, 2, 3, 8), outputs[1] is float32 (1, 2, 3, 4)");
  mfa::Binder lse(d, "bhsd", {{"outputs[0]", &part}, {"outputs[1]", &part}, {"lses[0]", &rows},
                              {"lses[1]", &wrong}, {"out", &out}, {"lse", &rows}});
  EXPECT_EQ(message_of(lse), "lses[1] must have shape (B, Hq, R) = (1, 2, 3), got (1, 3, 2)");
}
