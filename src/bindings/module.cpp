#include "bindings.hpp"

NB_MODULE(_core, m) {
  m.doc() = "mfa_native's native core: devices, kernel compilation and dispatch.";
  mfa::bindings::bind_errors(m);
  mfa::bindings::bind_device(m);
  mfa::bindings::bind_dispatch(m);
  mfa::bindings::bind_cpu(m);
  mfa::bindings::bind_dlpack(m);
  mfa::bindings::bind_pass(m);
  mfa::bindings::bind_bundle(m);
}
