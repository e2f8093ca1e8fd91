// Factories for the backends this build contains. The device registry
// (device.cpp) is the only caller.
#pragma once

#include <memory>

#include "mfa/backend.hpp"

namespace mfa {

std::unique_ptr<Backend> make_cpu_backend();

#if defined(MFA_HAVE_METAL)
// nullptr when this Mac has no Metal device.
std::unique_ptr<Backend> make_metal_backend();
#endif

}  // namespace mfa
