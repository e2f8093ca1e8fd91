// MSL source -> MTLLibrary -> specialized MTLComputePipelineState, with every
// compile option set on purpose. Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mfa/backend.hpp"
#include "metal/metal_objects.h"
#include "metal/objc_util.h"
#include "metal/pipeline_archive.h"

namespace mfa::metal {

// The MSL version every library is compiled with: 3.1, or the newest this
// macOS supports when that is above it. "3.1", "3.2" or "4.0".
MFA_METAL_AVAILABILITY std::string language_version_name();

// Throws CompileError carrying Metal's compiler log; ArgumentError for source
// or options that are not valid UTF-8 or ask for an MSL version this OS lacks.
// A `tensor_op_kernel` (core/tensor_ops.hpp uses_tensor_ops) compiles as MSL
// 4.0 for macOS 26.2, whose cooperative-tensor ABI it needs; the caller has
// checked that the device runs tensor ops.
MFA_METAL_AVAILABILITY std::shared_ptr<MetalLibrary> compile_msl(id<MTLDevice> device, const std::string& source,
                                                                 const CompileOptions& options, bool tensor_op_kernel);

// The library in `metallib` (the bytes of a .metallib file: a bundle's
// `--metallib`), loaded with no compiling. Throws CompileError carrying
// Metal's reason when it cannot load it (not a library, or built for a newer OS).
MFA_METAL_AVAILABILITY std::shared_ptr<MetalLibrary> load_metallib(id<MTLDevice> device,
                                                                   const std::vector<unsigned char>& metallib);

// Specializes `function` with its constants and builds its pipeline, through
// `archive` when there is one (nullptr: compile every time). Throws
// CompileError carrying Metal's log.
MFA_METAL_AVAILABILITY std::shared_ptr<MetalPipeline> build_pipeline(
    id<MTLDevice> device, const MetalLibrary& library, const FunctionInfo& function,
    const std::map<int, ConstantValue>& constants, PipelineArchive* archive);

}  // namespace mfa::metal
