// Everything a C++ program needs to compile and run MSL kernels with mfa.
//
//   mfa::Device device = mfa::Device::default_device();
//   auto pipeline = device.pipeline(source, "add_one");
//   mfa::CommandBatch batch(device);
//   batch.dispatch(pipeline, {4}, {256}).host(0, data, bytes, /*writable=*/true);
//   batch.run();
#pragma once

#include "mfa/attention.hpp"
#include "mfa/block_sparse.hpp"
#include "mfa/int8.hpp"
#include "mfa/kvcache.hpp"
#include "mfa/merge.hpp"
#include "mfa/quantize.hpp"
#include "mfa/sparse.hpp"
#include "mfa/varlen.hpp"
#include "mfa/backend.hpp"
#include "mfa/buffer.hpp"
#include "mfa/command_batch.hpp"
#include "mfa/device.hpp"
#include "mfa/dispatch_timing.hpp"
#include "mfa/errors.hpp"
#include "mfa/pipeline.hpp"
#include "mfa/prepared_pass.hpp"
#include "mfa/reflection.hpp"
#include "mfa/types.hpp"
