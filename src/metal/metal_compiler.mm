#include "metal/metal_compiler.h"

#include <algorithm>
#include <cctype>
#include <optional>

#include "mfa/errors.hpp"
#include "metal/function_constants.h"

namespace mfa::metal {

namespace {

struct LanguageVersion {
  MTLLanguageVersion value;
  const char* name;
};

// Metal numbers MSL versions (major << 16) + minor. Written as numbers, the
// versions older SDKs do not name (3.2 before macOS 15, 4.0 before macOS 26)
// compile against every SDK, so the SDK check sees both sides of each
// @available below.
constexpr MTLLanguageVersion language_version(unsigned major, unsigned minor) {
  return static_cast<MTLLanguageVersion>((major << 16) + minor);
}

// The only MSL version a tensor-op kernel compiles as: <metal_tensor> and
// MetalPerformancePrimitives exist from 4.0 on.
constexpr LanguageVersion kTensorOpsLanguage = {language_version(4, 0), "4.0"};

// MTLCompileOptions has no deployment target (up to the macOS 27 SDK); the
// run-time compiler takes its defaults from the SDK the process was linked
// against. MetalPerformancePrimitives picks its cooperative-tensor ABI by the
// compiler's minimum-OS macro (the macOS 26.2 ABI from 260200 on), so a
// tensor-op kernel names its target the way -mmacosx-version-min=26.2 would.
constexpr const char* kMinimumMacosMacros[] = {"__ENVIRONMENT_OS_VERSION_MIN_REQUIRED__",
                                               "__ENVIRONMENT_MAC_OS_X_VERSION_MIN_REQUIRED__"};
constexpr const char* kTensorOpsMinimumMacos = "260200";

MFA_METAL_AVAILABILITY LanguageVersion newest_language_version() {
  if (@available(macOS 26.0, *)) return {language_version(4, 0), "4.0"};
  if (@available(macOS 15.0, *)) return {language_version(3, 2), "3.2"};
  return {MTLLanguageVersion3_1, "3.1"};
}

// "M.m" with one to three digits each, as Metal numbers it: (M << 16) + m.
std::optional<NSUInteger> parse_language_version(const std::string& text) {
  const auto is_number = [](const std::string& part) {
    return !part.empty() && part.size() <= 3 &&
           std::all_of(part.begin(), part.end(), [](unsigned char c) { return std::isdigit(c); });
  };
  const std::size_t dot = text.find('.');
  if (dot == std::string::npos || !is_number(text.substr(0, dot)) || !is_number(text.substr(dot + 1)))
    return std::nullopt;
  return (NSUInteger(std::stoul(text.substr(0, dot))) << 16) + std::stoul(text.substr(dot + 1));
}

// CompileOptions::language_version is the oldest MSL the source needs; the
// library is compiled with the newest the OS has (a tensor-op kernel: 4.0),
// which must not be older.
MFA_METAL_AVAILABILITY LanguageVersion checked_language_version(const std::string& requested, bool tensor_op_kernel) {
  const std::optional<NSUInteger> version = parse_language_version(requested);
  if (!version)
    throw ArgumentError("CompileOptions.language_version must look like \"3.1\", got \"" + requested + "\"");
  const LanguageVersion chosen = tensor_op_kernel ? kTensorOpsLanguage : newest_language_version();
  if (*version > chosen.value)
    throw ArgumentError("the source asks for MSL " + requested + ", but " +
                        (tensor_op_kernel ? "tensor-op kernels compile as" : "this macOS compiles") + " MSL " +
                        chosen.name + " at most");
  return chosen;
}

// fast_math=false: IEEE-safe arithmetic and precise math functions (kernels
// call fast:: where they want it). fast_math=true: Metal's fast mode.
MFA_METAL_AVAILABILITY void set_math_mode(MTLCompileOptions* options, bool fast_math) {
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
  if (@available(macOS 15.0, *)) {
    options.mathMode = fast_math ? MTLMathModeFast : MTLMathModeSafe;
    options.mathFloatingPointFunctions =
        fast_math ? MTLMathFloatingPointFunctionsFast : MTLMathFloatingPointFunctionsPrecise;
    return;
  }
#endif
#if __MAC_OS_X_VERSION_MIN_REQUIRED < 150000
  options.fastMathEnabled = fast_math;  // the only switch before macOS 15, deprecated from it
#endif
}

// The caller's macros, and for a tensor-op kernel its minimum macOS (set last, so it wins).
MFA_METAL_AVAILABILITY NSDictionary<NSString*, NSObject*>* preprocessor_macros(const CompileOptions& options,
                                                                             bool tensor_op_kernel) {
  NSMutableDictionary<NSString*, NSObject*>* macros = [NSMutableDictionary dictionary];
  for (const auto& [name, value] : options.macros) {
    NSString* ns_name = to_ns_string(name);
    NSString* ns_value = to_ns_string(value);
    if (name.empty() || !ns_name || !ns_value)
      throw ArgumentError("CompileOptions.macros: macro '" + name + "' needs a non-empty UTF-8 name and a UTF-8 value");
    macros[ns_name] = ns_value;
  }
  if (tensor_op_kernel)
    for (const char* name : kMinimumMacosMacros) macros[@(name)] = @(kTensorOpsMinimumMacos);
  return macros;
}

// Nothing is left to MTLCompileOptions' defaults, which differ between OS releases.
MFA_METAL_AVAILABILITY MTLCompileOptions* make_compile_options(const CompileOptions& options,
                                                               const LanguageVersion& version, bool tensor_op_kernel) {
  MTLCompileOptions* compile = [MTLCompileOptions new];
  compile.languageVersion = version.value;
  set_math_mode(compile, options.fast_math);
  compile.preprocessorMacros = preprocessor_macros(options, tensor_op_kernel);
  compile.libraryType = MTLLibraryTypeExecutable;
  compile.optimizationLevel = MTLLibraryOptimizationLevelDefault;
  compile.preserveInvariance = NO;
  return compile;
}

MFA_METAL_AVAILABILITY std::string compiler_log(NSError* error) {
  return error ? to_std_string(error.localizedDescription) : "Metal gave no log";
}

// The byte size of what each [[buffer(i)]] points or refers to, as Metal reflects it.
MFA_METAL_AVAILABILITY std::map<int, std::size_t> buffer_sizes(MTLComputePipelineReflection* reflection) {
  std::map<int, std::size_t> sizes;
  for (id<MTLBinding> binding in reflection.bindings) {
    if (binding.type != MTLBindingTypeBuffer || ![binding conformsToProtocol:@protocol(MTLBufferBinding)]) continue;
    sizes[static_cast<int>(binding.index)] = static_cast<id<MTLBufferBinding>>(binding).bufferDataSize;
  }
  return sizes;
}

MFA_METAL_AVAILABILITY id<MTLFunction> specialize(const MetalLibrary& library, const FunctionInfo& function,
                                                  const std::map<int, ConstantValue>& constants) {
  NSString* name = to_ns_string(function.name);
  if (function.constants.empty()) {
    if (id<MTLFunction> kernel = [library.library() newFunctionWithName:name]) return kernel;
    throw CompileError("Metal found no kernel '" + function.name + "' in the compiled library", "");
  }
  NSError* error = nil;
  id<MTLFunction> kernel = [library.library() newFunctionWithName:name
                                                   constantValues:make_constant_values(function, constants)
                                                            error:&error];
  if (!kernel)
    throw CompileError("Metal could not specialize kernel '" + function.name + "' with its function constants",
                       compiler_log(error));
  return kernel;
}

}  // namespace

std::string language_version_name() { return newest_language_version().name; }

std::shared_ptr<MetalLibrary> compile_msl(id<MTLDevice> device, const std::string& source,
                                          const CompileOptions& options, bool tensor_op_kernel) {
  NSString* text = to_ns_string(source);
  if (!text) throw ArgumentError("the MSL source is not valid UTF-8");
  const LanguageVersion version = checked_language_version(options.language_version, tensor_op_kernel);
  NSError* error = nil;
  id<MTLLibrary> library = [device newLibraryWithSource:text
                                                options:make_compile_options(options, version, tensor_op_kernel)
                                                  error:&error];
  if (!library)
    throw CompileError(std::string("Metal could not compile the library (MSL ") + version.name + ")",
                       compiler_log(error));
  return std::make_shared<MetalLibrary>(library);
}

std::shared_ptr<MetalLibrary> load_metallib(id<MTLDevice> device, const std::vector<unsigned char>& metallib) {
  // DISPATCH_DATA_DESTRUCTOR_DEFAULT copies the bytes: the library owns what it reads.
  dispatch_data_t data = dispatch_data_create(metallib.data(), metallib.size(), nullptr,
                                              DISPATCH_DATA_DESTRUCTOR_DEFAULT);
  NSError* error = nil;
  id<MTLLibrary> library = [device newLibraryWithData:data error:&error];
  if (!library)
    throw CompileError("Metal could not load the bundle's compiled library (" + std::to_string(metallib.size()) +
                           " bytes); write the bundle without --metallib, or on the oldest macOS the app runs on",
                       compiler_log(error));
  return std::make_shared<MetalLibrary>(library);
}

std::shared_ptr<MetalPipeline> build_pipeline(id<MTLDevice> device, const MetalLibrary& library,
                                              const FunctionInfo& function,
                                              const std::map<int, ConstantValue>& constants,
                                              PipelineArchive* archive) {
  MTLComputePipelineDescriptor* descriptor = [MTLComputePipelineDescriptor new];
  descriptor.computeFunction = specialize(library, function, constants);
  descriptor.label = to_ns_string(function.name);

  const MTLPipelineOption options = MTLPipelineOptionArgumentInfo | MTLPipelineOptionBufferTypeInfo;
  MTLComputePipelineReflection* reflection = nil;
  id<MTLComputePipelineState> state = archive ? archive->find(descriptor, options, &reflection) : nil;
  if (!state) {
    NSError* error = nil;
    state = [device newComputePipelineStateWithDescriptor:descriptor
                                                  options:options
                                               reflection:&reflection
                                                    error:&error];
    if (!state)
      throw CompileError("Metal could not build the pipeline of kernel '" + function.name + "'",
                         compiler_log(error));
    if (archive) archive->add(descriptor);
  }
  return std::make_shared<MetalPipeline>(state, buffer_sizes(reflection));
}

}  // namespace mfa::metal
