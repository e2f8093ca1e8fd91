#include "bindings.hpp"

NB_MODULE(_core, m) {
  m.doc() = "mfa_native's native core: devices, kernel compilation and dispatch.";
  // What the library holds itself (the ops' prepared passes, the devices' facts) is released at
  // exit (ops/declaration.py, release_caches); what nanobind would still report then are the
  // caller's live outputs (a torch tensor over a pool Buffer, an autograd graph saving one), which
  // interpreter teardown frees after its check: not leaks, and nothing to print.
  nanobind::set_leak_warnings(false);
  mfa::bindings::bind_errors(m);
  mfa::bindings::bind_device(m);
  mfa::bindings::bind_dispatch(m);
  mfa::bindings::bind_cpu(m);
  mfa::bindings::bind_dlpack(m);
  mfa::bindings::bind_pass(m);
  mfa::bindings::bind_bundle(m);
}
