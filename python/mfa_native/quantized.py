"""`QuantizedTensor`: a logical float tensor stored quantized along its last axis.

The storage formats are quant_formats.py's: MLX's affine format, bit-exact with
`mx.quantize`, and GGUF's q8_0, q4_0, q4_1, q5_0 and q5_1 blocks. Attention reads such a tensor as k or v
inside its kernels (nothing writes a dequantized copy); `dequantize()` is for checks and
for code that wants the floats.
"""

from __future__ import annotations

import numpy as np

from .quant_formats import GGUF_BLOCK, QuantFormat
from .runtime.arrays import DTYPES, FLOAT_DTYPES
from .runtime.frameworks import framework_of


def _numpy(x, name: str) -> np.ndarray:
    """A numpy view of a field given as numpy, a torch CPU tensor or an MLX array."""
    if isinstance(x, np.ndarray):
        return x
    framework = framework_of(x)
    if framework is None:
        raise TypeError(f"{name} must be a numpy array, a torch CPU tensor or an MLX array, got {type(x).__name__}")
    return framework.as_numpy(x, name)


class QuantizedTensor:
    """A float tensor of logical `shape` and `dtype`, stored quantized along its last axis.

    `attention` and `attention_with_kvcache` take one as k or v (a quantized K/V cache) and
    read it as stored, dequantizing in the kernel; `quantize` makes one from a float array,
    `from_mlx` wraps what `mx.quantize` returns. The formats: MLX's "affine" (bit-exact with
    `mx.quantize`: each group of group_size values has a float scale and bias, value =
    scale * q + bias with q of `bits` bits packed into uint32 words) and GGUF's "q8_0",
    "q4_0", "q4_1", "q5_0" and "q5_1" (blocks of 32 values: a float16 scale d, for q4_1 and
    q5_1 a float16 minimum m, then 8-, 4- or 5-bit integers; 34, 18, 20, 22 or 24 bytes).

    The fields may be numpy arrays, torch CPU tensors or MLX arrays (read without a copy
    where they allow it); `dequantize()` returns the kind of `data`. The attributes are the
    constructor's arguments (format, bits and group_size resolved), `shape` (the logical
    shape, read off `data`), `dtype` (numpy) and `signature` (what the ops' warm path keys
    on: the format and every field's shape, strides and dtype).

    Args:
        data: the stored values: uint32 words (affine) or uint8 blocks (GGUF), shape
            shape[:-1] + (words or bytes per row,).
        scales: affine: one per group, shape shape[:-1] + (D // group_size,), float32,
            float16 or bfloat16; None for GGUF (the scale is inside each block).
        biases: affine: like scales, of their dtype; None for GGUF.
        format: "affine", "q8_0", "q4_0", "q4_1", "q5_0" or "q5_1".
        bits: affine: 2, 3, 4, 5, 6 or 8 (None: 8); GGUF: None or the format's own (8, 4 or 5).
        group_size: affine: 32, 64 or 128 (None: 64); GGUF: None or 32.
        shape: the logical shape (the last axis is D), optional: checked against data's.
        dtype: the logical float dtype (numpy; ml_dtypes.bfloat16 for bfloat16): the scales'
            for affine unless given; float32 for GGUF unless given.

    Raises:
        TypeError: data not of the format's dtype (uint32 or uint8); scales or biases not
            float, or of different dtypes; a dtype that is not float32, float16 or bfloat16;
            a field that is not a numpy array, torch CPU tensor or MLX array.
        ValueError: an unknown format, bits or group_size; data without axes, or whose last
            axis holds no whole number of groups; a shape that is not data's logical shape;
            affine without scales and biases, or with them of the wrong shape; GGUF with them.

    Example:
        ```python
        import numpy as np
        import mfa_native
        from mfa_native.reference import attention_reference

        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(3))
        kq, vq = (mfa_native.quantize(x, "q8_0", device="cpu") for x in (k, v))   # GGUF's 8-bit blocks
        print(kq.shape, kq.format, kq.data.dtype, kq.data.shape)   # (1, 2, 16, 32) q8_0 uint8 (1, 2, 16, 34)
        o = mfa_native.attention(q, kq, vq, device="cpu")   # k and v dequantized in the kernel only
        assert np.allclose(o, attention_reference(q, kq.dequantize(), vq.dequantize()), atol=1e-4)
        ```
    """

    __slots__ = ("data", "scales", "biases", "format", "bits", "group_size", "shape", "dtype", "_numpy", "signature",
                 "_source")

    def __init__(self, data, scales=None, biases=None, *, format: str = "affine", bits: int | None = None,
                 group_size: int | None = None, shape: tuple[int, ...] | None = None, dtype=None) -> None:
        f = QuantFormat.of(format, bits, group_size)
        stored = _numpy(data, "data")
        if stored.dtype != DTYPES[f.data_dtype]:
            raise TypeError(f"data of format {f.name!r} must be {f.data_dtype}, got {stored.dtype}")
        if stored.ndim < 1:
            raise ValueError("data must have at least one axis (the quantized one)")
        width = stored.shape[-1]
        features = width * 32 // f.bits if f.affine else width // f.group_bytes * GGUF_BLOCK
        if features < f.group_size or features % f.group_size or f.data_width(features) != width:
            raise ValueError(f"data's last axis ({stored.shape[-1]}) holds no whole number of groups of "
                             f"format {f.describe()}")
        if shape is not None and tuple(shape) != (*stored.shape[:-1], features):
            raise ValueError(f"shape {tuple(shape)} is not the logical shape of this data, "
                             f"{(*stored.shape[:-1], features)}")
        groups = (*stored.shape[:-1], f.groups(features))
        arrays = {"data": stored}
        if f.affine:
            if scales is None or biases is None:
                raise ValueError("the affine format needs scales and biases")
            for name, x in (("scales", scales), ("biases", biases)):
                x = _numpy(x, name)
                if x.shape != groups:
                    raise ValueError(f"{name} must have shape {groups} (one per group of {f.group_size}), "
                                     f"got {x.shape}")
                if x.dtype not in FLOAT_DTYPES:
                    raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
                arrays[name] = x
            if arrays["biases"].dtype != arrays["scales"].dtype:
                raise TypeError(f"scales ({arrays['scales'].dtype}) and biases ({arrays['biases'].dtype}) "
                                "must share a dtype")
            logical = arrays["scales"].dtype if dtype is None else np.dtype(dtype)
        else:
            if scales is not None or biases is not None:
                raise ValueError(f"format {f.name!r} keeps its scales inside the blocks: scales and biases "
                                 "must be None")
            logical = np.dtype(np.float32) if dtype is None else np.dtype(dtype)
        if logical not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {logical}")
        self.data, self.scales, self.biases = data, scales, biases
        self.format, self.bits, self.group_size = f.name, f.bits, f.group_size
        self.shape = (*stored.shape[:-1], features)
        self.dtype = logical
        self._numpy = arrays
        # What a call's signature needs of the tensor (ops/warm.py), computed once.
        self.signature = (f.name, f.bits, f.group_size, logical,
                          *((x.shape, x.strides, x.dtype) for x in arrays.values()))
        self._source = None

    def quantized_from(self, source, why: str) -> QuantizedTensor:
        """Records the framework array this tensor was quantized from (quantize does), so that a
        gradient asked through `dequantize()` raises NotImplementedError(why), never a zero."""
        self._source = (source, why)
        return self

    @classmethod
    def from_mlx(cls, wq, scales, biases=None, *, group_size: int = 64, bits: int = 4,
                 mode: str = "affine") -> QuantizedTensor:
        """Wraps what `mx.quantize(w, group_size, bits)` returns (MLX arrays or numpy copies
        of them), without conversion. Only MLX's "affine" mode (wq, scales, biases) is read;
        its other modes ("mxfp4", "mxfp8", "nvfp4": no biases) are a ValueError naming mode."""
        if mode != "affine" or biases is None:
            raise ValueError(f"mode: mfa_native reads MLX's 'affine' quantization (wq, scales, biases), not "
                             f"{mode!r}{' without biases' if mode == 'affine' else ''}")
        return cls(wq, scales, biases, format="affine", bits=bits, group_size=group_size)

    def fields(self) -> dict:
        """The stored fields as given (numpy, torch or MLX), by name: data, and scales and biases
        where the format has them."""
        given = {"data": self.data, "scales": self.scales, "biases": self.biases}
        return {name: given[name] for name in self._numpy}

    def with_fields(self, **fields) -> QuantizedTensor:
        """This tensor with some stored fields (by name, as `fields()` gives them) replaced."""
        tensor = QuantizedTensor(**{**self.fields(), **fields}, format=self.format, bits=self.bits,
                                 group_size=self.group_size, dtype=self.dtype)
        tensor._source = self._source
        return tensor

    def reread(self) -> None:
        """Views the fields anew, after their framework gave them new memory in place (MLX's
        indexed assignment, `field[index] = rows`, does: the old views would read the old values)."""
        source = self._source
        self.__init__(**self.fields(), format=self.format, bits=self.bits, group_size=self.group_size, dtype=self.dtype)
        self._source = source

    @property
    def quant_format(self) -> QuantFormat:
        """The storage format (format, bits, group_size) as one value."""
        return QuantFormat(self.format, self.bits, self.group_size)

    @property
    def ndim(self) -> int:
        """The number of logical axes, len(shape)."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored field: data, scales and biases."""
        return sum(x.nbytes for x in self.arrays().values())

    def arrays(self) -> dict[str, np.ndarray]:
        """The stored fields as numpy arrays (views of the given ones), by name: data, and
        scales and biases where the format has them."""
        return dict(self._numpy)

    def field(self, name: str) -> np.ndarray:
        """One stored field as a numpy array (a view of the given one): "data", "scales" or "biases"."""
        return self._numpy[name]

    def dequantize(self):
        """The logical tensor, in `dtype`, as numpy or the framework of `data`: scale * q + bias
        (GGUF: d * q) computed in float32 and rounded once to `dtype`, except for affine MLX
        arrays, which `mx.dequantize` dequantizes as MLX does (in the float dtype's own
        arithmetic: float16 and bfloat16 may differ from the float32 path by an ulp). Through
        the tensor `quantize` made of a torch or MLX x, a gradient asked with respect to x raises
        (quantize has none), never a silent zero."""
        framework = framework_of(self.data)
        if self.format == "affine" and framework is not None and framework.name == "mlx" and \
                all(framework_of(x) is framework for x in (self.scales, self.biases)) and \
                self._numpy["scales"].dtype == self.dtype:
            import mlx.core as mx

            out = mx.dequantize(self.data, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
        else:
            values = dequantize_numpy(self.quant_format, self._numpy).astype(self.dtype)
            if framework is None:
                return values
            out = framework.empty(values.shape, values.dtype, self.data)
            framework.as_numpy(out, "dequantize()")[...] = values
        return out if self._source is None else framework.refusing_gradient(out, *self._source)

    def __repr__(self) -> str:
        return (f"QuantizedTensor(shape={self.shape}, dtype={self.dtype}, "
                f"format={self.quant_format.describe()!r})")


def dequantize_numpy(f: QuantFormat, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The stored values as float32 (numpy), from the fields of a tensor of format `f`."""
    data = np.ascontiguousarray(arrays["data"])
    rows, width = data.shape[:-1], data.shape[-1]   # explicit sizes: an empty tensor reshapes too
    if f.affine:
        bits = np.unpackbits(data.astype("<u4").view(np.uint8).reshape(*rows, width * 4), axis=-1, bitorder="little")
        q = (bits.reshape(*rows, width * 32 // f.bits, f.bits).astype(np.uint32)
             << np.arange(f.bits, dtype=np.uint32)).sum(-1)
        scales = arrays["scales"].astype(np.float32).repeat(f.group_size, -1)
        biases = arrays["biases"].astype(np.float32).repeat(f.group_size, -1)
        return scales * q.astype(np.float32) + biases
    groups = width // f.group_bytes
    blocks = data.reshape(*rows, groups, f.group_bytes)
    def halves(at: int) -> np.ndarray:
        return blocks[..., at:at + 2].copy().view("<f2").astype(np.float32)

    d = halves(0)
    if f.name == "q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.float32)
    else:
        high_bits, nibbles = f.block_layout
        packed = blocks[..., nibbles:]
        q = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.uint32)
        if f.bits == 5:   # bit i of the little-endian uint32 is value i's fifth bit
            fifth = blocks[..., high_bits:high_bits + 4].copy().view("<u4")
            q |= ((fifth >> np.arange(32, dtype=np.uint32)) & 1) << 4
        q = q.astype(np.float32)
        if f.minimum:
            return (d * q + halves(2)).reshape(*rows, groups * f.group_size)
        q -= 1 << (f.bits - 1)
    return (d * q).reshape(*rows, groups * f.group_size)
