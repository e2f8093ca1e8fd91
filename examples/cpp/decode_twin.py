"""examples/cpp/decode.cpp in numpy: the same toy decode engine (weights, prompt, arithmetic),
with mfa_native.attention_with_kvcache on the same paged q8_0 caches, printing the line
decode.cpp prints. On the cpu backend the two lines are identical (ctest's decode_example
checks it): every op outside attention rounds to float32 as the C++ does, and attention's
results and appended rows are bit-identical between the C++ API and Python.
    usage: python examples/cpp/decode_twin.py
"""

import numpy as np

import mfa_native

VOCAB, DIM, HIDDEN, LAYERS = 64, 64, 128, 2              # the model
HQ, HKV, D = 4, 2, 32                                    # attention heads (GQA 2), head dim
PAGE, PROMPT, STEPS = 16, 11, 8                          # cache page, prompt length, decode steps
PAGES = (PROMPT + STEPS + PAGE - 1) // PAGE              # pages of one layer's cache
Q8_0_BYTES = D // 32 * 34                                # a q8_0 row: per 32 values, a float16 scale + 32 int8

MASK = (1 << 64) - 1


class Rng:
    """splitmix64; uniform() is decode.cpp's: 24 random bits -> [-1, 1), exact in float32."""

    def __init__(self, seed: int) -> None:
        self.state = seed

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def weights(self, rows: int, cols: int) -> np.ndarray:
        """(rows, cols) float32, uniform / sqrt(rows) (rows = fan-in), drawn row by row."""
        u = np.array([(self.next() >> 40) / 2.0**23 - 1.0 for _ in range(rows * cols)])
        return (u / np.sqrt(rows)).astype(np.float32).reshape(rows, cols)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w summed in float64 in decode.cpp's order (i = 0, 1, ...), rounded to float32
    (a BLAS matmul sums in another order: its last bits could round differently)."""
    acc = np.zeros((x.shape[0], w.shape[1]))
    for i in range(w.shape[0]):
        acc += x[:, i, None].astype(np.float64) * w[i].astype(np.float64)
    return acc.astype(np.float32)


def rms_norm(x: np.ndarray) -> np.ndarray:
    squares = np.zeros(x.shape[0])
    for i in range(x.shape[1]):
        squares += x[:, i].astype(np.float64) ** 2
    inverse = 1.0 / np.sqrt(squares / x.shape[1] + 1e-5)
    return (x.astype(np.float64) * inverse[:, None]).astype(np.float32)


def main() -> None:
    rng = Rng(2024)
    embedding = rng.weights(VOCAB, DIM)
    layers = [{name: rng.weights(rows, cols) for name, rows, cols in
               (("wq", DIM, HQ * D), ("wk", DIM, HKV * D), ("wv", DIM, HKV * D), ("wo", HQ * D, DIM),
                ("w1", DIM, HIDDEN), ("w2", HIDDEN, DIM))} for _ in range(LAYERS)]
    head = rng.weights(DIM, VOCAB)

    # One pool of q8_0 pages for K and one for V, shared by the layers; zero bytes are a valid
    # q8_0 block (zeros). Layer l's logical page p is pool page p * LAYERS + l.
    k_pool, v_pool = (mfa_native.QuantizedTensor(np.zeros((LAYERS * PAGES, PAGE, HKV, Q8_0_BYTES), np.uint8),
                                                 format="q8_0") for _ in range(2))
    tables = [np.array([[p * LAYERS + layer for p in range(PAGES)]], np.int32) for layer in range(LAYERS)]

    tokens = [(7 * i + 3) % VOCAB for i in range(PROMPT)]
    generated, checksum, length = [], 0.0, 0
    for step in range(STEPS + 1):                        # the prefill, then one token a step
        x = embedding[tokens]                            # (R, DIM)
        rows = len(tokens)
        for layer, w in enumerate(layers):
            h = rms_norm(x)
            q = linear(h, w["wq"]).reshape(1, rows, HQ, D)
            k = linear(h, w["wk"]).reshape(1, rows, HKV, D)
            v = linear(h, w["wv"]).reshape(1, rows, HKV, D)
            o = mfa_native.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=np.array([length], np.int32),
                                                  k=k, v=v, block_table=tables[layer], causal=True)
            x = x + linear(o.reshape(rows, HQ * D), w["wo"])
            x = x + linear(np.maximum(linear(rms_norm(x), w["w1"]), np.float32(0)), w["w2"])
        length += rows
        logits = linear(rms_norm(x), head)               # (R, VOCAB)
        for value in logits.ravel():
            checksum += float(value)
        tokens = [int(np.argmax(logits[-1]))]
        generated += tokens
    print(f"logits checksum {checksum:.6f}, tokens {' '.join(map(str, generated))}")


if __name__ == "__main__":
    main()
