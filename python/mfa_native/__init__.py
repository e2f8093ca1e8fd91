"""mfa_native: flash attention for Apple GPUs.

Kernels are Metal Shading Language generated for each problem and run by a
native core: on Metal where available, else on the cpu backend, which runs
the very same MSL on the CPU.
"""

from __future__ import annotations

from ._core import CompileError, DeviceUnavailableError, DispatchError, DispatchStats
from . import reference
from .embedding import cmake_dir, cpp_flags
from .errors import Unsupported
from .ops.attention import attention
from .ops.attention_backward import attention_backward
from .ops.block_mask import BlockMask
from .ops.block_mask_pass import from_mask as _from_mask  # declares block_mask_from_mask
from .ops.block_sparse import block_sparse_attention, block_sparse_attention_backward
from .ops.int8_attention import int8_attention
from .ops.kvcache import attention_with_kvcache
from .ops.sparse import sparse_attention, sparse_attention_backward
from .ops.topk import sparse_topk
from .ops.varlen import attention_varlen, attention_varlen_backward
from .ops.merge import merge_attention
from .ops.quantize import quantize
from .precompiling import Precompiled, precompile
from .quantized import QuantizedTensor
from .runtime.devices import Device, default_device, devices
from .runtime.kernel import Kernel
from .runtime.passes import PassDescription
from .runtime.profiling import DispatchRecord, Profile, profile

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "CompileError",
    "Device",
    "DeviceUnavailableError",
    "DispatchError",
    "DispatchRecord",
    "DispatchStats",
    "Kernel",
    "PassDescription",
    "Precompiled",
    "QuantizedTensor",
    "Unsupported",
    "Profile",
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "block_sparse_attention",
    "block_sparse_attention_backward",
    "cmake_dir",
    "cpp_flags",
    "default_device",
    "devices",
    "int8_attention",
    "merge_attention",
    "precompile",
    "profile",
    "quantize",
    "reference",
    "sparse_attention",
    "sparse_attention_backward",
    "sparse_topk",
]
