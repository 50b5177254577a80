"""A short tour of kvstate's functional API (runs in a second on a CPU)."""

import mlx.core as mx

import kvstate as kv

mx.random.seed(0)
B, H, D = 2, 2, 16


def tokens(n, b=B):
    return mx.random.normal((b, H, n, D)), mx.random.normal((b, H, n, D))


# Records are immutable: every function returns a new one.
s = kv.append(kv.empty(B, step=8), *tokens(5))
print("prefill      ", s)

# Speculative decoding: checkpoint, append a 3-token draft, keep 1 and 3.
cp = kv.checkpoint(s)  # holds row lengths only, no arrays
draft = kv.append(s, *tokens(3))
s = kv.rollback(draft, cp, keep=[1, 3])
print("after verify ", "lengths", s.lengths, "ends", s.ends, "aligned", s.aligned)

# Rows now end at different columns: attention needs a per-row mask, built
# once per forward and shared by every layer through a memo.
memo = kv.MaskMemo()
s = kv.append(s, *tokens(1))
q = mx.random.normal((B, 2 * H, 1, D))  # grouped-query attention
for _layer in range(4):
    out = kv.attend(s, q, scale=D**-0.5, memo=memo)
print("attend       ", out.shape, "masks built", memo.builds, "leases live", memo.live)
print("RoPE offsets ", kv.positions(s))

# Continuous batching: a new request joins, a finished one leaves.
newcomer = kv.append(kv.empty(1, step=8), *tokens(2, b=1))
s = kv.extend(s, newcomer)
print("joined       ", "lengths", s.lengths, "left_pad", s.left_pad)
s = kv.filter_rows(s, [1, 2])
print("filtered     ", "lengths", s.lengths, "left_pad", s.left_pad)

# A row leaves as a compact copy that does not pin the batch buffer.
solo = kv.extract_row(s, 0)
print("extracted    ", solo)

# Quantized rows share the layout; their bytes are moved, never requantized.
qs = kv.append(kv.quantized(B, group_size=32, bits=4), *(mx.random.normal((B, H, 4, 64)),) * 2)
print("quantized    ", qs.lengths, f"{qs.nbytes} bytes")

try:
    kv.trim(s, 99)
except kv.KVStateError as e:
    print("bad input    ", e)
