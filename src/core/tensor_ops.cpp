#include "core/tensor_ops.hpp"

#include <algorithm>
#include <cstdlib>

#include "core/msl_lexer.hpp"
#include "mfa/errors.hpp"

namespace mfa {

namespace {

constexpr int kTensorOpsMacosMajor = 26;
constexpr int kTensorOpsMacosMinor = 2;

std::string_view without_leading_blanks(std::string_view text) {
  return text.substr(std::min(text.find_first_not_of(" \t"), text.size()));
}

// The header an `#include <header>` directive names; empty for any other directive.
std::string_view included_header(std::string_view directive) {
  constexpr std::string_view kInclude = "include";
  std::string_view rest = without_leading_blanks(directive.substr(1));  // after the '#'
  if (rest.substr(0, kInclude.size()) != kInclude) return {};
  rest.remove_prefix(kInclude.size());
  if (rest.empty() || (rest[0] != '<' && rest[0] != ' ' && rest[0] != '\t')) return {};  // #include_next, ...
  rest = without_leading_blanks(rest);
  const std::size_t close = rest.find('>');
  if (rest.empty() || rest[0] != '<' || close == std::string_view::npos) return {};
  return rest.substr(1, close - 1);
}

bool is_tensor_op_header(std::string_view header) {
  return header == "metal_tensor" || header == "MetalPerformancePrimitives/MetalPerformancePrimitives.h";
}

}  // namespace

TensorOpsSetting parse_tensor_ops_setting(const char* value) {
  const std::string text = value ? value : "";
  if (text.empty() || text == "auto") return TensorOpsSetting::automatic;
  if (text == "on") return TensorOpsSetting::on;
  if (text == "off") return TensorOpsSetting::off;
  throw ArgumentError("MFA_NATIVE_TENSOR_OPS must be 'on', 'off' or 'auto' (or unset), got '" + text + "'");
}

TensorOpsSetting tensor_ops_setting() {
  static const TensorOpsSetting setting = parse_tensor_ops_setting(std::getenv("MFA_NATIVE_TENSOR_OPS"));
  return setting;
}

bool metal_tensor_ops(bool apple10, const MacosVersion& macos, TensorOpsSetting setting) {
  return apple10 && macos.at_least(kTensorOpsMacosMajor, kTensorOpsMacosMinor) && setting != TensorOpsSetting::off;
}

bool cpu_tensor_ops(TensorOpsSetting setting) { return setting == TensorOpsSetting::on; }

bool uses_tensor_ops(std::string_view source) {
  for (const msl::Token& token : msl::lex(source, "kernel.metal"))
    if (token.kind == msl::TokenKind::preprocessor && is_tensor_op_header(included_header(token.text))) return true;
  return false;
}

void refuse_tensor_op_kernel(const std::string& device, TensorOpsSetting setting) {
  const std::string reason = setting == TensorOpsSetting::off
                                 ? "MFA_NATIVE_TENSOR_OPS=off switched them off"
                                 : "they need an Apple10 GPU (M5 or newer) on macOS 26.2 or later";
  throw ArgumentError("the kernel uses Metal 4 tensor ops (it includes <metal_tensor> or MetalPerformancePrimitives), "
                      "which " + device + " does not run: " + reason +
                      ". Generate kernels for the device's TuningFacts (tensor_ops is False here: "
                      "the simdgroup path)");
}

}  // namespace mfa
