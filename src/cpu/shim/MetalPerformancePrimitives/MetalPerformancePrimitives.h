// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> for the cpu
// backend: the subset of Metal 4 tensor ops that kernels use --
// mpp::tensor_ops::matmul2d (mfa_matmul2d.h), its cooperative tensors
// (mfa_cooperative_tensor.h) and their reduce_rows / reduce_columns
// (mfa_tensor_reductions.h), over the tensors of <metal_tensor>.
#pragma once

#include <metal_tensor>

#include "mfa_cooperative_tensor.h"
#include "mfa_cooperative_exchange.h"
#include "mfa_matmul2d.h"
#include "mfa_tensor_reductions.h"
