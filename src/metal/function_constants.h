// Function-constant values for MTLFunctionConstantValues, each converted to
// the type the kernel declares. Objective-C++ with ARC only.
#pragma once

#import <Metal/Metal.h>

#include <map>

#include "mfa/reflection.hpp"
#include "mfa/types.hpp"
#include "metal/objc_util.h"

namespace mfa::metal {

// Throws ArgumentError for an index the kernel does not declare, or a declared
// type Metal function constants cannot have here.
MFA_METAL_AVAILABILITY MTLFunctionConstantValues* make_constant_values(
    const FunctionInfo& function, const std::map<int, ConstantValue>& constants);

}  // namespace mfa::metal
