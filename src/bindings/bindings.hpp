// The pieces of mfa_native._core, one function per file.
#pragma once

#include <nanobind/nanobind.h>

namespace mfa::bindings {

void bind_errors(nanobind::module_& m);
void bind_device(nanobind::module_& m);
void bind_dispatch(nanobind::module_& m);
void bind_cpu(nanobind::module_& m);
void bind_dlpack(nanobind::module_& m);
void bind_pass(nanobind::module_& m);
void bind_bundle(nanobind::module_& m);

}  // namespace mfa::bindings
