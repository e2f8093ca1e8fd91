// The bundle reader's C++-only parts: the JSON reader, size expressions, the
// refusals of bad bundle bytes, NoBundleEntryError, base64 and the compiled
// libraries (metallibs) a bundle may store. (tests/python/
// test_bundle_cpp.py compares the evaluator and mfa::attention with Python.)
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/base64.hpp"
#include "core/bundle.hpp"
#include "core/json.hpp"
#include "core/sha256.hpp"
#include "core/size_expression.hpp"
#include "mfa/attention.hpp"

namespace {

std::string bundle_bytes(const std::string& payload, std::uint32_t version = mfa::kBundleFormatVersion) {
  std::string out("MFABNDL\0", 8);
  for (int i = 0; i < 4; ++i) out += char((version >> (8 * i)) & 0xFF);
  out += std::string(4, '\0');
  const std::uint64_t length = payload.size();
  for (int i = 0; i < 8; ++i) out += char((length >> (8 * i)) & 0xFF);
  const std::string hex = mfa::sha256_hex(payload);
  for (std::size_t i = 0; i < 64; i += 2) out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out + payload;
}

// The ops' declarations as the writer puts them in a bundle (tests/cpp/declarations.json;
// tests/python/test_bundle_cpp.py checks it is the writer's current data).
std::string declarations() {
  std::ifstream file(MFA_DECLARATIONS_JSON);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

const std::string kEmpty = R"({"format":"mfa_native.bundle","template_schema":1,"declarations":)" + declarations() +
                           R"(,"entries":[],"metallibs":{}})";

}  // namespace

TEST(Json, ParsesValuesAndRefusesBadText) {
  const mfa::json::Value v = mfa::json::parse(R"({"a": [1, -2, 2.5e1, true, null, "x\u00e9\ud83d\ude00\n"]})");
  const auto& a = v.at("a").as_array("a");
  EXPECT_EQ(a[0].as_int("n"), 1);
  EXPECT_EQ(a[1].as_int("n"), -2);
  EXPECT_DOUBLE_EQ(a[2].as_double("n"), 25.0);
  EXPECT_TRUE(a[3].as_bool("b"));
  EXPECT_TRUE(a[4].is_null());
  EXPECT_EQ(a[5].as_string("s"), "x\xc3\xa9\xf0\x9f\x98\x80\n");
  EXPECT_THROW(a[2].as_int("n"), mfa::json::JsonError);
  for (const char* bad : {"", "[1,]", "{\"a\" 1}", "[1] 2", "\"abc", "01", "-", "[\"\\ud800\"]", "tru", "{1:2}"})
    EXPECT_THROW(mfa::json::parse(bad), mfa::json::JsonError) << bad;
  EXPECT_THROW(mfa::json::parse(std::string(1000, '[')), mfa::json::JsonError);
}

TEST(SizeExpression, EvaluatesLikePython) {
  const mfa::SizeEnv env = {{"R", 9}, {"B", 2}, {"C", 0}};
  EXPECT_EQ(mfa::evaluate_size("cdiv(R * 4, 32) * B", env), 4);
  EXPECT_EQ(mfa::evaluate_size("-7 / 2", env), -4);  // rounds down, as Python's //
  EXPECT_EQ(mfa::evaluate_size("-7 % 3", env), 2);
  EXPECT_EQ(mfa::evaluate_size("cdiv(-7, 2)", env), -3);
  EXPECT_EQ(mfa::evaluate_size("R > 8 && !(B == 3) || C", env), 1);
  EXPECT_EQ(mfa::evaluate_size("min(R, B, 5) + max(1)", env), 3);
  EXPECT_EQ(mfa::evaluate_size("C && 1 / C", env), 0);  // && short-circuits
  EXPECT_THROW(mfa::evaluate_size("1 / C", env), mfa::ArgumentError);
  EXPECT_THROW(mfa::evaluate_size("Hq", env), mfa::ArgumentError);
  EXPECT_THROW(mfa::evaluate_size("R +", env), mfa::ArgumentError);
  EXPECT_THROW(mfa::evaluate_size("cdiv(R)", env), mfa::ArgumentError);
  EXPECT_THROW(mfa::evaluate_size("9223372036854775807 + 1", env), mfa::ArgumentError);
}

TEST(Bundle, RefusesDamagedTruncatedAndFutureBytes) {
  const std::string good = bundle_bytes(kEmpty);
  EXPECT_TRUE(mfa::Bundle::from_memory(good.data(), good.size()).entries().empty());
  std::string damaged = good;
  damaged[damaged.size() - 3] ^= 1;
  const std::string future = bundle_bytes(kEmpty, mfa::kBundleFormatVersion + 1),
                    earlier = bundle_bytes(kEmpty, mfa::kBundleFormatVersion - 1);
  const std::string cases[] = {damaged, good.substr(0, good.size() - 1), good.substr(0, 30), "X" + good.substr(1),
                               future, earlier, bundle_bytes("{\"format\": 3}"), bundle_bytes("[[[[")};
  for (const std::string& bad : cases) EXPECT_THROW(mfa::Bundle::from_memory(bad.data(), bad.size()), mfa::BundleError);
  try {
    mfa::Bundle::from_memory(future.data(), future.size());
  } catch (const mfa::BundleError& e) {
    EXPECT_NE(std::string(e.what()).find("newer"), std::string::npos);
  }
  try {
    mfa::Bundle::from_memory(earlier.data(), earlier.size());
  } catch (const mfa::BundleError& e) {
    EXPECT_NE(std::string(e.what()).find("write the bundle again"), std::string::npos);
  }
  // Every truncation of a good bundle is refused, never a crash.
  for (std::size_t n = 0; n < good.size(); ++n) EXPECT_THROW(mfa::Bundle::from_memory(good.data(), n), mfa::BundleError);
  EXPECT_THROW(mfa::Bundle::load("/nonexistent/file.mfab"), mfa::BundleError);
}

TEST(Bundle, MissingEntryListsWhatItHolds) {
  const std::string bytes = bundle_bytes(kEmpty);
  const mfa::Bundle bundle = mfa::Bundle::from_memory(bytes.data(), bytes.size());
  std::vector<float> q(2 * 4 * 8), out(q.size());
  const mfa::TensorView view{q.data(), mfa::DType::float32, {1, 2, 4, 8}, {}};
  const mfa::TensorView o{out.data(), mfa::DType::float32, {1, 2, 4, 8}, {}};
  const mfa::Device device = mfa::Device::get(mfa::DeviceKind::cpu);
  try {
    mfa::attention(device, bundle, view, view, view, o);
    FAIL() << "no NoBundleEntryError";
  } catch (const mfa::NoBundleEntryError& e) {
    EXPECT_NE(std::string(e.what()).find("no entry for attention float32 D=8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("holds: nothing"), std::string::npos) << e.what();
  }
  const mfa::TensorView half{q.data(), mfa::DType::float16, {1, 2, 4, 8}, {}};
  EXPECT_THROW(mfa::attention(device, bundle, view, half, view, o), mfa::TypeError);
  const mfa::TensorView three{q.data(), mfa::DType::float32, {2, 4, 8}, {}};
  EXPECT_THROW(mfa::attention(device, bundle, three, view, view, o), mfa::ArgumentError);
}

TEST(Base64, DecodesWhatPythonWritesAndRefusesTheRest) {
  const auto text = [](const std::optional<std::vector<unsigned char>>& bytes) {
    return bytes ? std::string(bytes->begin(), bytes->end()) : std::string("<refused>");
  };
  // RFC 4648's test vectors (base64.b64encode's output).
  EXPECT_EQ(text(mfa::base64_decode("")), "");
  EXPECT_EQ(text(mfa::base64_decode("Zg==")), "f");
  EXPECT_EQ(text(mfa::base64_decode("Zm8=")), "fo");
  EXPECT_EQ(text(mfa::base64_decode("Zm9v")), "foo");
  EXPECT_EQ(text(mfa::base64_decode("Zm9vYmFy")), "foobar");
  EXPECT_EQ(text(mfa::base64_decode("/+8A")), std::string("\xff\xef\x00", 3));
  for (const char* bad : {"Zg=", "Zm9", "Zg===", "Z===", "Zm=v", "Zm9v!A==", "Zh==", "Zm9=Zm9v", "Zm 9v"})
    EXPECT_FALSE(mfa::base64_decode(bad)) << bad;
}

namespace {

// A bundle of one entry whose one template has one kernel of `source`, and `metallibs`.
std::string bundle_with_metallibs(const std::string& source, const std::string& metallibs) {
  const std::string facts =
      R"({"dtype":"float32","head_dim":8,"value_dim":8,"gqa_ratio":1,"causal":"none","mask":"none",)"
      R"("mask_dtype":null,"window":false,"sinks":false,"layout":"bhsd","softcap":null,"alibi":"none",)"
      R"("score_mod":null,"family":"apple9",)"
      R"("backward":false})";
  const std::string kernel = R"({"entry":"k","source":")" + source +
                             R"(","threadgroups":["1","1","1"],"threads_per_threadgroup":[1,1,1],"buffers":[]})";
  const std::string forward = R"({"schema":1,"name":"t","sizes":[],"derived":[],"guards":[],)"
                              R"("valid_for":[["scale","runtime"]],"kernels":[)" + kernel + R"(],"buffers":[]})";
  return bundle_bytes(R"({"format":"mfa_native.bundle","template_schema":1,"declarations":{},)"
                      R"("entries":[{"op":"attention","facts":)" +
                      facts + R"(,"forward":[)" + forward + R"(],"backward":[]}],"metallibs":)" + metallibs + "}");
}

}  // namespace

TEST(Bundle, AttachesItsMetallibsToTheKernelsOfTheirSource) {
  const std::string source = "kernel void k() {}";
  const std::string key = mfa::sha256_hex(source);
  const std::string bytes = bundle_with_metallibs(source, R"({")" + key + R"(":"Zm9vYmFy"})");
  const mfa::Bundle bundle = mfa::Bundle::from_memory(bytes.data(), bytes.size());
  const mfa::KernelTemplate& kernel = bundle.contents().entries.at(0).forward.at(0).kernels.at(0);
  ASSERT_TRUE(kernel.binary);
  EXPECT_EQ(std::string(kernel.binary->begin(), kernel.binary->end()), "foobar");
  const std::string plain = bundle_with_metallibs(source, "{}");
  EXPECT_FALSE(mfa::Bundle::from_memory(plain.data(), plain.size()).contents().entries.at(0).forward.at(0)
                   .kernels.at(0).binary);

  const std::pair<std::string, std::string> refused[] = {
      {R"({")" + key + R"(":"Zm9vYmF"})", "not valid base64"},
      {R"({")" + key + R"(":""})", "is empty"},
      {R"({")" + mfa::sha256_hex("other") + R"(":"Zm9v"})", "sha256 of no kernel source"},
      {R"({")" + key + R"(":7})", "unreadable"}};
  for (const auto& [metallibs, message] : refused) {
    const std::string bad = bundle_with_metallibs(source, metallibs);
    try {
      mfa::Bundle::from_memory(bad.data(), bad.size());
      ADD_FAILURE() << metallibs << ": no BundleError";
    } catch (const mfa::BundleError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}
