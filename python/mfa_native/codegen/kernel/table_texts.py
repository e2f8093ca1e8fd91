"""The tile tables' values, as text: one readable row per line, parsed by tables.py (whose
docstring says what each column does). Keyed by (family, precision)."""

# Tables per (family, precision): "float32" for float32 inputs, "16-bit" for float16 and
# bfloat16 (MFA has one set for its low-precision inputs, FP16 Q/K/V and BF16 dO, used for both).
# Every value up to head dimension 384 is metal-flash-attention's (Sources/FlashAttention/Attention/
# AttentionDescriptor/AttentionDescriptor+Parameters.swift: forward, backwardQuery,
# backwardKeyValue for FP32; forwardMixed, backwardQueryMixed, backwardKeyValueMixed for 16-bit;
# apple9 rows from its `supportsFamily(.apple9)` branch, apple7 from the other), mapped onto
# these columns:
#   MFA parallelization block -> query_rows (forward, dQ) / key_rows (dK/dV);
#   MFA traversal block       -> key_block (forward, dQ) / query_block (dK/dV);
#   cachedOperands            -> cache_q, cache_dout, cache_k, cache_v (in the set: yes);
#                                O, dQ, dK, dV not in the set are paged: o_block, dq_block,
#                                dk_block, dv_block = MFA's head block (in the set: 0);
#   MFA's head block of a cached operand has no column here (Q K^T re-reads Q 8 features at a time).
# A backward row joins MFA's dQ row and its dK/dV row for the range, so its ranges are the
# union of theirs. Departures, each forced by this kernel: MFA pages to device memory, these
# kernels to threadgroup memory, so where MFA's parallelization would make the pages exceed
# 32 KiB at the row's max_head_dim it is halved until they fit (apple7 above 256, dK/dV above
# 128/256); rows split at 256, where stage_apart starts (the packed-heads and sparse-indexed
# stages); MFA's tables end at 384 (larger heads take its last row), so the 576 rows are this
# project's own (8 rows per threadgroup, so the pages fit). tiles16 is MFA's registerPrecisions
# (Q, K, V, dO 16-bit for 16-bit inputs). p16 is "yes" for 16-bit inputs: MFA's mixed rows
# assume P in FP16 (registerPrecisions, lowPrecisionIntermediates), and on the cpu backend it
# raised the relative L2 error against float64 from 2.1e-4 to 2.6e-4..3.1e-4 (float16) and
# from 1.7e-3 to 2.1e-3..2.5e-3 (bfloat16) over O, dQ, dK, dV at D 33..256, C 64..4096, eight
# times under the tests' 2e-2. Neither 16-bit column applies to float32 inputs ("no" there).
FORWARD_TEXT = {
    ("apple7", "float32"): """
        # max_head_dim  query_rows  key_block  cache_q  stage_apart  o_block  tiles16  p16  stage_kv  vector_access
               24           32          64       yes       no          0      no      no      yes           yes
               32           32          64       no        no          0      no      no      yes           yes
               56           32          32       no        no          0      no      no      yes           yes
              256           32          80       no        no         16      no      no       no           yes
              384           16          80       no        yes        16      no      no       no           yes
              576            8          16       no        yes        64      no      no       no           yes
    """,
    ("apple7", "16-bit"): """
        # max_head_dim  query_rows  key_block  cache_q  stage_apart  o_block  tiles16  p16  stage_kv  vector_access
               96           32         128       yes       no          0      yes     yes      yes           yes
              128           32         128       yes       no         32      yes     yes       no           yes
              256           32         128       no        no         32      yes     yes       no           yes
              384           16         128       no        yes        32      yes     yes       no           yes
              576            8          16       no        yes        64      yes     yes       no           yes
    """,
    ("apple9", "float32"): """
        # max_head_dim  query_rows  key_block  cache_q  stage_apart  o_block  tiles16  p16  stage_kv  vector_access
                8           16         128       yes       no          0      no      no       no           yes
               16           16          64       yes       no          0      no      no       no           yes
               48           16          32       yes       no          0      no      no       no           yes
              192           16          64       no        no          0      no      no       no           yes
              256           16         128       no        no         16      no      no       no           yes
              384           16         128       no        yes        16      no      no       no           yes
              576            8          32       no        yes        64      no      no       no           yes
    """,
    ("apple9", "16-bit"): """
        # max_head_dim  query_rows  key_block  cache_q  stage_apart  o_block  tiles16  p16  stage_kv  vector_access
               96           16         128       yes       no          0      yes     yes       no           yes
              160           16         128       no        no          0      yes     yes       no           yes
              224           16         128       yes       no         32      yes     yes       no           yes
              256           16         128       no        no         32      yes     yes       no           yes
              384           16         128       no        yes        32      yes     yes       no           yes
              576            8          32       no        yes        64      yes     yes       no           yes
    """,
    # apple10 (Apple M5): products as Metal 4 tensor ops (tensor_ops), starting from ccv's published
    # fused-attention blocks for them (blockR 16 query rows, blockC 64 keys; a staging footprint
    # past 32 KiB fails rather than slows). O stays in registers: a page of it would not fit
    # beside the stage and the products' memory (at D 576 / Dv 512 that is 128 floats a lane,
    # which the GPU may spill). Retune on an M5 (python -m mfa_native tune).
    ("apple10", "float32"): """
        # max_head_dim  query_rows  key_block  cache_q  stage_apart  o_block  tiles16  p16  stage_kv  vector_access  tensor_ops
              256           16          64       no        no          0      no      no      yes           yes         yes
              384           16          64       no        yes         0      no      no      yes           yes         yes
              576            8          32       no        yes         0      no      no      yes           yes         yes
    """,
    ("apple10", "16-bit"): """
        # max_head_dim  query_rows  key_block  cache_q  stage_apart  o_block  tiles16  p16  stage_kv  vector_access  tensor_ops
              256           16          64       no        no          0      yes     yes      yes           yes         yes
              384           16          64       no        yes         0      yes     yes      yes           yes         yes
              576            8          32       no        yes         0      yes     yes      yes           yes         yes
    """,
}

# The backward pass (dQ kernel, dK/dV kernel), from the same sources.
BACKWARD_TEXT = {
    ("apple7", "float32"): """
        # max_head_dim  query_rows  key_block  key_rows  query_block  cache_q  cache_dout  cache_k  cache_v  dq_block  dk_block  dv_block  tiles16  p16  stage_kv  stage_q_dout  vector_access
                  16          32         64        32           32      yes          no       no      yes         0         0         0       no   no       yes        yes           yes
                  24          32         64        32           64       no          no       no       no         0         0         0       no   no       yes        yes           yes
                  56          32         64        32           80       no          no       no       no         0        16         0       no   no       yes         no           yes
                 128          32         80        32           80       no          no       no       no        16        16        16       no   no        no         no           yes
                 256          32         80        16           80       no          no       no       no        16        16        16       no   no        no         no           yes
                 384          16         80         8           80       no          no       no       no        16        16        16       no   no        no         no           yes
                 576           8         16         8           16       no          no       no       no        64        64         0       no   no        no         no           yes
    """,
    ("apple7", "16-bit"): """
        # max_head_dim  query_rows  key_block  key_rows  query_block  cache_q  cache_dout  cache_k  cache_v  dq_block  dk_block  dv_block  tiles16  p16  stage_kv  stage_q_dout  vector_access
                  16          32         64        32           64      yes          no       no      yes         0         0         0      yes   yes       yes        yes           yes
                  32          32         64        32           64      yes          no       no       no         0         0         0      yes   yes       yes        yes           yes
                  56          32         64        32           80       no          no       no       no         0        32         0      yes   yes       yes         no           yes
                  96          32         64        32           64       no          no       no       no         0        32         0      yes   yes       yes         no           yes
                 128          32         64        32           64       no          no       no       no        32        32        32      yes   yes        no         no           yes
                 256          32         64        16           64       no          no       no       no        32        32        32      yes   yes        no         no           yes
                 384          16         64         8           64       no          no       no       no        32        32        32      yes   yes        no         no           yes
                 576           8         16         8           16       no          no       no       no        64        64         0      yes   yes        no         no           yes
    """,
    ("apple9", "float32"): """
        # max_head_dim  query_rows  key_block  key_rows  query_block  cache_q  cache_dout  cache_k  cache_v  dq_block  dk_block  dv_block  tiles16  p16  stage_kv  stage_q_dout  vector_access
                  16          16         64        16           64      yes         yes      yes      yes         0         0         0       no   no        no         no           yes
                  32          16         64        16           32      yes          no      yes      yes         0         0         0       no   no        no         no           yes
                  64          16         64        16           32      yes          no       no      yes         0         0         0       no   no        no         no           yes
                 128          16         64        16          128      yes          no       no       no         0         0         0       no   no        no         no           yes
                 160          16         64        16          128      yes          no       no       no         0        16         0       no   no        no         no           yes
                 192          16         64        16          128      yes          no       no       no         0        16        16       no   no        no         no           yes
                 256          16        128        16          128       no          no       no       no        16        16        16       no   no        no         no           yes
                 384          16        128         8          128       no          no       no       no        16        16        16       no   no        no         no           yes
                 576           8         16         8           16       no          no       no       no        64        64         0       no   no        no         no           yes
    """,
    ("apple9", "16-bit"): """
        # max_head_dim  query_rows  key_block  key_rows  query_block  cache_q  cache_dout  cache_k  cache_v  dq_block  dk_block  dv_block  tiles16  p16  stage_kv  stage_q_dout  vector_access
                  56          16         64        16           64      yes         yes      yes      yes         0         0         0      yes   yes        no         no           yes
                  80          16         64        16           32      yes         yes       no      yes         0         0         0      yes   yes        no         no           yes
                 144          16         64        16          128      yes          no       no       no         0         0         0      yes   yes        no         no           yes
                 192          16         64        16          128      yes          no       no       no         0        16         0      yes   yes        no         no           yes
                 224          16        128        16          128       no          no       no       no        32        16         0      yes   yes        no         no           yes
                 256          16        128        16          128       no          no       no       no        32        32        32      yes   yes        no         no           yes
                 384          16        128         8          128       no          no       no       no        32        32        32      yes   yes        no         no           yes
                 576           8         16         8           16       no          no       no       no        64        64         0      yes   yes        no         no           yes
    """,
    # apple10: both kernels' products as Metal 4 tensor ops up to head dim 256, their blocks staged
    # (64 rows, fewer where the stage and the products' memory would pass 24 KiB) and dQ, dK, dV in
    # registers; wider heads keep apple9's simdgroup rows, which page dQ and dK (beside a stage
    # there is no room for those pages, and in registers they would be 136 tiles a lane at
    # D 576 / Dv 512). The tensor-op kernels run there too when forced (the tests do). Retune on an M5.
    ("apple10", "float32"): """
        # max_head_dim  query_rows  key_block  key_rows  query_block  cache_q  cache_dout  cache_k  cache_v  dq_block  dk_block  dv_block  tiles16  p16  stage_kv  stage_q_dout  vector_access  tensor_ops
                 256          16         64        16           64       no          no       no       no         0         0         0       no    no       yes        yes           yes         yes
                 384          16        128         8          128       no          no       no       no        16        16        16       no    no        no         no           yes          no
                 576           8         16         8           16       no          no       no       no        64        64         0       no    no        no         no           yes          no
    """,
    ("apple10", "16-bit"): """
        # max_head_dim  query_rows  key_block  key_rows  query_block  cache_q  cache_dout  cache_k  cache_v  dq_block  dk_block  dv_block  tiles16  p16  stage_kv  stage_q_dout  vector_access  tensor_ops
                 256          16         64        16           64       no          no       no       no         0         0         0      yes   yes       yes        yes           yes         yes
                 384          16        128         8          128       no          no       no       no        32        32        32      yes   yes        no         no           yes          no
                 576           8         16         8           16       no          no       no       no        64        64         0      yes   yes        no         no           yes          no
    """,
}

# stage_kv / stage_q_dout "yes" on apple7/8 where a threadgroup has several simdgroups and the
# kernel pages no accumulator (pages and a 24 KiB stage may not fit 32 KiB together),
# "no" on apple9: MFA shares reads among threads through threadgroup memory (preferAsyncLoad)
# unless the GPU is Apple9+ (preferAsyncCache: per-lane reads; AttentionKernel*.swift,
# GEMMKernelDescriptor).
