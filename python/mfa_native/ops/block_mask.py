"""`mfa_native.BlockMask`: FlexAttention's block lists, the structure behind block-sparse attention.

Per query block of `Qb` rows, the key blocks of `Kb` keys it visits: "partial" blocks
(kv_num_blocks / kv_indices), inside which causal, window and a boolean mask apply, and
"full" blocks (full_kv_*), every pair of which is allowed. The transposed lists (q_*,
full_q_*: per key block, its query blocks) are what the backward pass walks: it builds
them from the kv lists on the device and checks given ones against its build (as
multisets per key block). Same names, shapes and meaning as
torch.nn.attention.flex_attention.BlockMask.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from ..codegen import BlockLists
from . import arguments as check
from . import block_lists
from .rules import Binding

# (num_blocks, indices) pairs, in the order the passes bind them.
PAIRS = (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
         ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices"))
# The partial blocks' mask bits (FlexAttention's mask_mod, evaluated by from_torch): kv_bit_blocks
# (the kv lists' shape) numbers the first bit block of each query block's partial list, kv_bits
# (int32 words) holds block p's pair (r, c) at bit p * Qb * Kb + r * Kb + c (bit i of the words
# is bit i % 32 of word i // 32).
BITS = ("kv_bit_blocks", "kv_bits")


def block_size_pair(block_size) -> tuple[int, int]:
    """block_size as (Qb, Kb), checked: an int or a pair of positive ints (any size: a block
    boundary may fall inside a kernel tile, FlexAttention's decode blocks (1, 64) included)."""
    if type(block_size) is int and block_size > 0:   # the common case, first (warm calls ask it)
        return block_size, block_size
    sizes = (block_size, block_size) if isinstance(block_size, numbers.Integral) else block_size
    if not isinstance(sizes, (tuple, list)) or len(sizes) != 2 or \
            not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in sizes):
        raise TypeError(f"block_size must be an int or a (Q_BLOCK, KV_BLOCK) pair of ints, got {block_size!r}")
    if any(s < 1 for s in sizes):
        raise ValueError(f"block sizes must be positive, got {tuple(sizes)}")
    return int(sizes[0]), int(sizes[1])


def _int32(x, name: str, ndim: int) -> np.ndarray:
    x = check.as_array(x, name)
    if x.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    return np.ascontiguousarray(x)


def joint_lead(arrays: dict[str, np.ndarray]) -> tuple[int, int]:
    """The (B|1, H|1) leading axes lists (name -> array) broadcast to together; ValueError
    naming the first list whose leading axes do not broadcast with those before it."""
    lead: tuple[int, ...] = (1, 1)
    for name, a in arrays.items():
        try:
            lead = np.broadcast_shapes(lead, a.shape[:2])
        except ValueError:
            raise ValueError(f"{name} has leading axes {a.shape[:2]}, which do not broadcast with the other "
                             f"lists' {lead}") from None
    return int(lead[0]), int(lead[1])


def _broadcast(lead: tuple[int, int]) -> Callable[[np.ndarray], np.ndarray]:
    """A list with its leading axes broadcast to `lead`, as a C-contiguous copy."""
    return lambda a: np.ascontiguousarray(np.broadcast_to(a, lead + a.shape[2:]))


class MaskRule(NamedTuple):
    """The rule inside a from_mask mask's partial blocks, kept with its lists: the causal mode,
    the window as given, and the mask as given (the caller's array, not a copy). A
    block-sparse call without causal, window or mask takes them from here. (A NamedTuple: made
    on every warm from_mask call.)"""

    causal: str
    window: tuple[int, int] | None
    mask: object | None


@dataclass(frozen=True)
class _Checked:
    """A block mask checked against one problem: its lists (as bound), how the kernels see
    them, and how a warm call turns each given list into the one bound (None: as given)."""

    lists: BlockLists
    arrays: dict[str, np.ndarray]
    converts: dict[str, Callable[[np.ndarray], np.ndarray] | None]
    binding: Binding   # the lists' rules' (block_lists.py): a warm call checks its lists' contents by it


class BlockMask:
    """Block lists for `block_sparse_attention`: FlexAttention's BlockMask, as numpy int32 arrays.

    Per query block of Qb rows, the key blocks of Kb keys it visits: "partial" blocks
    (kv_num_blocks, kv_indices), inside which causal, window and a boolean mask apply, and
    "full" blocks (full_kv_num_blocks, full_kv_indices), every pair of which is allowed. Same
    names, shapes and meaning as torch.nn.attention.flex_attention.BlockMask. Build one from
    lists (this constructor), from dense rules on the device (`BlockMask.from_mask`, which
    keeps its rule for the ops to apply), or from a FlexAttention mask (`BlockMask.from_torch`;
    the ops and `mfa_native.torch.flex_attention` also take those as they are).

    Each list's leading axes of size 1 broadcast, over the batch and the query heads and
    against the other lists' (a (1, 1) q list beside (1, H) kv lists), as in FlexAttention.
    The lists are read by name as attributes (`block_mask.kv_indices`; None where absent).
    Counts and indices are checked against each problem an op uses the mask for.

    Args:
        kv_num_blocks: int32 (B|1, H|1, ceil(R / Qb)): partial key blocks per query block.
        kv_indices: int32 (B|1, H|1, ceil(R / Qb), W): query block i visits the key blocks
            kv_indices[b, h, i, :kv_num_blocks[b, h, i]]; entries past the count are ignored.
        block_size: Qb, or (Qb, Kb); positive ints (default 128, as FlexAttention).
        full_kv_num_blocks: like kv_num_blocks, for full blocks (no mask rule inside);
            optional, given with full_kv_indices.
        full_kv_indices: like kv_indices, for full blocks.
        q_num_blocks: int32 (B|1, H|1, ceil(C / Kb)), optional, with q_indices: the
            transposed lists (per key block, the query blocks that list it). The backward pass
            builds them on the device and raises ValueError naming q_indices (full_q_indices)
            where given ones differ (see `block_sparse_attention_backward`).
        q_indices: int32 (B|1, H|1, ceil(C / Kb), W').
        full_q_num_blocks: the transposed full lists' counts (given with full_kv_* and q_*).
        full_q_indices: the transposed full lists.
        shape: (R, C), optional; when given it must match the problem.
        kv_bit_blocks: int32 (B|1, H|1, ceil(R / Qb)), optional, with kv_bits: mask bits of
            the partial blocks. The pair (r, c) of the n-th partial block of query block i is
            allowed only where bit (kv_bit_blocks[b, h, i] + n) * Qb * Kb + (r % Qb) * Kb +
            c % Kb of kv_bits is set. `from_torch` writes them from FlexAttention's mask_mod,
            for the partial blocks only (partial blocks x Qb x Kb bits).
        kv_bits: int32 (words,): bit i is bit i % 32 of word i // 32.

    Raises:
        TypeError: a list that is not int32; block_size neither an int nor a pair of ints.
        ValueError: a list without its pair (kv_num_blocks without kv_indices, ...), no kv
            lists, a list with the wrong number of axes, indices that do not extend their
            counts by one axis, leading axes that do not broadcast, full_q_* without q_* (or
            q_* beside full_kv_* without full_q_*), kv_bit_blocks not of kv_num_blocks'
            shape, a shape that is not a pair, block sizes below 1.

    Example:
        ```python
        import numpy as np
        import mfa_native
        from mfa_native.reference import attention_reference

        # Causal attention over 16 queries and 16 keys in blocks of 8, classified on the device:
        block_mask = mfa_native.BlockMask.from_mask(causal=True, R=16, C=16, block_size=8, device="cpu")
        print(block_mask.kv_num_blocks[0, 0], block_mask.full_kv_num_blocks[0, 0])   # [1 1] [0 1]
        # (each diagonal block is partial, the block below it full, the one above left out)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 2, 16, 32), dtype=np.float32) for _ in range(3))
        o = mfa_native.block_sparse_attention(q, k, v, block_mask, device="cpu")   # the mask's rule: causal
        assert np.allclose(o, attention_reference(q, k, v, causal=True), atol=1e-4)
        ```
    """

    def __init__(self, kv_num_blocks, kv_indices, *, block_size=(128, 128), full_kv_num_blocks=None,
                 full_kv_indices=None, q_num_blocks=None, q_indices=None, full_q_num_blocks=None,
                 full_q_indices=None, shape=None, kv_bit_blocks=None, kv_bits=None) -> None:
        self.block_size = block_size_pair(block_size)
        given = dict(kv_num_blocks=kv_num_blocks, kv_indices=kv_indices, full_kv_num_blocks=full_kv_num_blocks,
                     full_kv_indices=full_kv_indices, q_num_blocks=q_num_blocks, q_indices=q_indices,
                     full_q_num_blocks=full_q_num_blocks, full_q_indices=full_q_indices)
        self.arrays: dict[str, np.ndarray] = {}
        for num, indices in PAIRS:
            if (given[num] is None) != (given[indices] is None):
                raise ValueError(f"{num} and {indices} come together: pass both or neither")
            if given[num] is None:
                continue
            self.arrays[num] = _int32(given[num], num, 3)
            self.arrays[indices] = _int32(given[indices], indices, 4)
            if self.arrays[indices].shape[:3] != self.arrays[num].shape:
                raise ValueError(f"{indices} {self.arrays[indices].shape} must extend {num} "
                                 f"{self.arrays[num].shape} by one axis")
        if "kv_num_blocks" not in self.arrays:
            raise ValueError("kv_num_blocks and kv_indices are required")
        if "q_num_blocks" in self.arrays and ("full_kv_num_blocks" in self.arrays) != \
                ("full_q_num_blocks" in self.arrays):
            raise ValueError("with the transposed lists, give full_q_* exactly when full_kv_* are given")
        if "full_q_num_blocks" in self.arrays and "q_num_blocks" not in self.arrays:
            raise ValueError("full_q_* need q_num_blocks and q_indices too")
        joint_lead(self.arrays)
        self.bits: dict[str, np.ndarray] = {}
        if (kv_bit_blocks is None) != (kv_bits is None):
            raise ValueError("kv_bit_blocks and kv_bits come together: pass both or neither")
        if kv_bits is not None:
            self.bits = {"kv_bit_blocks": _int32(kv_bit_blocks, "kv_bit_blocks", 3),
                         "kv_bits": _int32(kv_bits, "kv_bits", 1)}
            if self.bits["kv_bit_blocks"].shape != self.arrays["kv_num_blocks"].shape:
                raise ValueError(f"kv_bit_blocks {self.bits['kv_bit_blocks'].shape} must have the shape of "
                                 f"kv_num_blocks {self.arrays['kv_num_blocks'].shape}")
        if shape is not None:
            if not isinstance(shape, (tuple, list)) or len(shape) != 2:
                raise ValueError(f"shape must be (R, C), got {shape!r}")
            shape = (int(shape[0]), int(shape[1]))
        self.shape = shape

    rule: MaskRule | None = None   # from_mask's rule (MaskRule); None for lists given or from_torch's

    @classmethod
    def built(cls, arrays: dict[str, np.ndarray], block_size: tuple[int, int], shape: tuple[int, int],
              rule: MaskRule) -> BlockMask:
        """A mask over lists this library's kernels wrote (int32, C-contiguous, of one problem's
        shapes), which need none of the constructor's checks, with the rule they were built by."""
        mask = cls.__new__(cls)
        mask.block_size, mask.arrays, mask.bits, mask.shape, mask.rule = block_size, arrays, {}, shape, rule
        return mask

    @classmethod
    def from_mask(cls, mask=None, *, causal=False, window=None, R: int, C: int, block_size=128, B: int = 1,
                  H: int = 1, device=None) -> BlockMask:
        """The block mask of dense rules, classified on the device: a block with no allowed pair is
        left out, a block whose pairs are all allowed is full, the rest are partial. The mask
        keeps its rule (causal, window, mask: MaskRule), which block-sparse calls apply inside
        partial blocks without being given it again. (The declaration of the op it runs,
        block_mask_pass.FROM_MASK, documents the arguments: its docstring replaces this one.)"""
        from .block_mask_pass import from_mask
        return from_mask(mask, causal=causal, window=window, R=R, C=C, block_size=block_size, B=B, H=H,
                         device=device)

    @classmethod
    def from_torch(cls, block_mask) -> BlockMask:
        """Converts a torch.nn.attention.flex_attention.BlockMask, mask rule included: its
        tensors (viewed through DLPack without a copy where they are CPU int32 and contiguous),
        BLOCK_SIZE, seq_lengths, and its mask_mod, evaluated (vectorized, once) for the pairs of
        its partial blocks into mask bits (see BITS; none for noop_mask). FlexAttention's no-op
        mask (one block of 2**30, seq_lengths (1, 1)) means every key, for any lengths."""
        from .flex_bits import converted
        return converted(cls, block_mask)

    def __getattr__(self, name: str):
        """The list tensors by their FlexAttention names, and the mask bits (None where absent)."""
        if name in {n for pair in PAIRS for n in pair}:
            return self.__dict__["arrays"].get(name)
        if name in BITS:
            return self.__dict__["bits"].get(name)
        raise AttributeError(name)

    @property
    def nbytes(self) -> int:
        """The memory the converted mask takes: its lists and its mask bits."""
        return sum(a.nbytes for a in self.arrays.values()) + sum(a.nbytes for a in self.bits.values())

    def array(self, name: str) -> np.ndarray | None:
        """A list or the mask bits by name (None where absent)."""
        return self.arrays.get(name, self.bits.get(name))

    def __repr__(self) -> str:
        lists = ", ".join(f"{n}{tuple(a.shape)}" for n, a in {**self.arrays, **self.bits}.items())
        return f"BlockMask(block_size={self.block_size}, {lists})"

    @property
    def structure(self) -> tuple:
        """Everything kernels depend on besides the list contents: block sizes, shapes, which lists."""
        return (self.block_size, self.shape, tuple((n, a.shape) for n, a in {**self.arrays, **self.bits}.items()))

    def checked(self, batch: int, q_heads: int, q_len: int, kv_len: int) -> _Checked:
        """The lists for a problem of these sizes: shapes and the counted entries checked
        (ValueError naming the list), and the BlockLists facts the kernels take. The kernels
        index every list with one (B|1, H|1): a list whose leading axes broadcast to the
        others' is bound as a copy broadcast to them."""
        if self.shape is not None and self.shape != (q_len, kv_len):
            raise ValueError(f"block_mask.shape is {self.shape} but the problem has (R, C) = {(q_len, kv_len)}")
        binding = check_lists({**self.arrays, **self.bits}, self.block_size, batch, q_heads, q_len, kv_len)
        lead = joint_lead(self.arrays)
        given = {**self.arrays, **self.bits}
        converts = {name: None if name == "kv_bits" or a.shape[:2] == lead else _broadcast(lead)
                    for name, a in given.items()}
        arrays = {name: a if converts[name] is None else converts[name](a) for name, a in given.items()}
        width = {indices: self.arrays[indices].shape[3] for _, indices in PAIRS if indices in self.arrays}
        lists = BlockLists(*self.block_size, lead[0] == 1, lead[1] == 1, width["kv_indices"],
                           width.get("full_kv_indices"), width.get("q_indices"), width.get("full_q_indices"),
                           self.bits["kv_bits"].shape[0] if self.bits else None)
        return _Checked(lists, arrays, converts, binding)


def check_lists(arrays: dict, block_size: tuple[int, int], batch: int, q_heads: int, q_len: int,
                kv_len: int) -> Binding:
    """The lists (name -> int32 array) against a problem of these sizes, by block_lists.py's
    rules: shapes and counted entries; ValueError naming the list. Entries past a row's count
    are never read, so any value goes there. Returns the binding, whose `check_contents_of`
    checks the contents of other lists of these shapes (a warm call's)."""
    sizes = {"B": batch, "Hq": q_heads, "R": q_len, "C": kv_len, "Qb": block_size[0], "Kb": block_size[1]}
    binding = Binding(block_lists.RULES, block_lists.CHECKS, "bhsd", sizes)
    binding.bind({})
    binding.check_arrays(arrays)
    return binding
