// The host side of Metal 4 tensor ops: which kernels use them (by the MSL
// lexer's tokens), which devices run them, MFA_NATIVE_TENSOR_OPS, and the
// error a tensor-op kernel gets where they are missing.
#include <gtest/gtest.h>

#include <string>

#include "core/tensor_ops.hpp"
#include "mfa/device.hpp"
#include "mfa/errors.hpp"

namespace {

using mfa::MacosVersion;
using mfa::TensorOpsSetting;

TEST(TensorOpKernels, AreTheOnesIncludingMetalTensorOrMetalPerformancePrimitives) {
  EXPECT_TRUE(mfa::uses_tensor_ops("#include <metal_stdlib>\n#include <metal_tensor>\nkernel void k() {}\n"));
  EXPECT_TRUE(mfa::uses_tensor_ops(
      "#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\nkernel void k() {}\n"));
  EXPECT_TRUE(mfa::uses_tensor_ops("  #  include   <metal_tensor>  // spaced out\n"));
  EXPECT_TRUE(mfa::uses_tensor_ops("#include<metal_tensor>\n"));
  EXPECT_FALSE(mfa::uses_tensor_ops("#include <metal_stdlib>\nkernel void k() {}\n"));
}

TEST(TensorOpKernels, AreNotRecognizedByNamesOutsideAnInclude) {
  EXPECT_FALSE(mfa::uses_tensor_ops("// #include <metal_tensor>\n#include <metal_stdlib>\n"));
  EXPECT_FALSE(mfa::uses_tensor_ops("/*\n#include <metal_tensor>\n*/\n"));
  EXPECT_FALSE(mfa::uses_tensor_ops("constant char name[] = \"#include <metal_tensor>\";\n"));
  EXPECT_FALSE(mfa::uses_tensor_ops("int metal_tensor = 0; // <metal_tensor>\n"));
  EXPECT_FALSE(mfa::uses_tensor_ops("#include_next <metal_tensor>\n"));
  EXPECT_FALSE(mfa::uses_tensor_ops("#include <metal_tensor_extras>\n#include <MetalPerformancePrimitives/Other.h>\n"));
  EXPECT_FALSE(mfa::uses_tensor_ops("#include \"metal_tensor\"\n"));  // a file of the caller's, not Metal's header
}

TEST(TensorOpKernels, AreReadWithTheLexersErrors) {
  EXPECT_THROW(mfa::uses_tensor_ops("#include <metal_tensor>\n/* never closed"), mfa::CompileError);
}

TEST(TensorOpsFacts, MetalNeedsAnApple10GpuOnMacos26Point2) {
  const auto automatic = TensorOpsSetting::automatic;
  EXPECT_TRUE(mfa::metal_tensor_ops(true, MacosVersion{26, 2, 0}, automatic));
  EXPECT_TRUE(mfa::metal_tensor_ops(true, MacosVersion{26, 4, 1}, automatic));
  EXPECT_TRUE(mfa::metal_tensor_ops(true, MacosVersion{27, 0, 0}, automatic));
  EXPECT_FALSE(mfa::metal_tensor_ops(true, MacosVersion{26, 1, 9}, automatic));  // the older cooperative-tensor ABI
  EXPECT_FALSE(mfa::metal_tensor_ops(true, MacosVersion{26, 0, 0}, automatic));
  EXPECT_FALSE(mfa::metal_tensor_ops(true, MacosVersion{15, 7, 0}, automatic));
  EXPECT_FALSE(mfa::metal_tensor_ops(false, MacosVersion{26, 2, 0}, automatic));  // an M4 or older
}

TEST(TensorOpsFacts, OffSwitchesMetalsOffAndOnSwitchesTheCpusOn) {
  EXPECT_FALSE(mfa::metal_tensor_ops(true, MacosVersion{26, 2, 0}, TensorOpsSetting::off));
  EXPECT_TRUE(mfa::metal_tensor_ops(true, MacosVersion{26, 2, 0}, TensorOpsSetting::on));
  EXPECT_FALSE(mfa::metal_tensor_ops(false, MacosVersion{26, 2, 0}, TensorOpsSetting::on));  // on cannot make an M5
  EXPECT_TRUE(mfa::cpu_tensor_ops(TensorOpsSetting::on));
  EXPECT_FALSE(mfa::cpu_tensor_ops(TensorOpsSetting::automatic));
  EXPECT_FALSE(mfa::cpu_tensor_ops(TensorOpsSetting::off));
}

TEST(TensorOpsSetting, IsOnOffOrAutomatic) {
  EXPECT_EQ(mfa::parse_tensor_ops_setting(nullptr), TensorOpsSetting::automatic);
  EXPECT_EQ(mfa::parse_tensor_ops_setting(""), TensorOpsSetting::automatic);
  EXPECT_EQ(mfa::parse_tensor_ops_setting("auto"), TensorOpsSetting::automatic);
  EXPECT_EQ(mfa::parse_tensor_ops_setting("on"), TensorOpsSetting::on);
  EXPECT_EQ(mfa::parse_tensor_ops_setting("off"), TensorOpsSetting::off);
  try {
    mfa::parse_tensor_ops_setting("1");
    FAIL() << "expected ArgumentError";
  } catch (const mfa::ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()), "MFA_NATIVE_TENSOR_OPS must be 'on', 'off' or 'auto' (or unset), got '1'");
  }
}

// tests/python/test_tensor_op_support.py runs the device under each setting.
TEST(TensorOpsFacts, TheCpuDeviceReportsThemOnlyWhenSwitchedOn) {
  const bool on = mfa::tensor_ops_setting() == TensorOpsSetting::on;
  EXPECT_EQ(mfa::Device::get(mfa::DeviceKind::cpu).tuning().tensor_ops, on);
}

TEST(TensorOpKernels, AreRefusedNamingTheDeviceAndWhy) {
  const std::string m3 = "Apple M3 Max (apple9, macOS 26.2.0)";
  try {
    mfa::refuse_tensor_op_kernel(m3, TensorOpsSetting::automatic);
  } catch (const mfa::ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the kernel uses Metal 4 tensor ops (it includes <metal_tensor> or MetalPerformancePrimitives), which "
              "Apple M3 Max (apple9, macOS 26.2.0) does not run: they need an Apple10 GPU (M5 or newer) on macOS 26.2 "
              "or later. Generate kernels for the device's TuningFacts (tensor_ops is False here: the simdgroup path)");
  }
  try {
    mfa::refuse_tensor_op_kernel("Apple M5 (apple10, macOS 26.2.0)", TensorOpsSetting::off);
  } catch (const mfa::ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("Apple M5 (apple10, macOS 26.2.0) does not run: "
                                         "MFA_NATIVE_TENSOR_OPS=off switched them off."),
              std::string::npos)
        << e.what();
  }
}

TEST(MacosVersions, AreComparedByReleaseAndWrittenInFull) {
  EXPECT_EQ((MacosVersion{26, 2, 1}.text()), "26.2.1");
  EXPECT_EQ((MacosVersion{26, 0, 0}.text()), "26.0.0");
  EXPECT_TRUE((MacosVersion{26, 2, 0}.at_least(26, 2)));
  EXPECT_FALSE((MacosVersion{25, 9, 0}.at_least(26, 2)));
}

}  // namespace
