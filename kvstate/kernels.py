"""A mask-free decode attention kernel for MLX's CUDA backend.

``ragged_attention(q, k, v, left_pad, ends, scale=...)`` reads, for each row,
only its own columns ``[left_pad[b], ends[b])`` of a fixed-capacity cache:
a split-K kernel (``mx.fast.cuda_kernel``) computes partial softmax sums
over column chunks, a second kernel merges them. No mask array is built,
which is what makes ragged decode on the H200 about as cheap as aligned
decode (``notes/compile.md``, ``notes/benchmarks.md``). Elsewhere (CPU,
Metal, shapes the kernel does not cover) it is the masked fused SDPA, with
the same result. ``kvstate.mlx_lm.Decoder(attention="kernel")`` routes a
compiled step's dense decode reads here.
"""

from __future__ import annotations

import mlx.core as mx

from .masks import rows_mask


_KERNEL_SRC = r"""
    constexpr int NT = 128;
    constexpr int ELEMS = 16 / sizeof(T);
    constexpr int LPK = D / ELEMS;
    constexpr int G = NT / LPK;
    constexpr int U = 2;
    __shared__ float sm_m[G][REP];
    __shared__ float sm_l[G][REP];
    __shared__ float sm_o[G][REP][D];

    const int split = blockIdx.x;
    const int bh = blockIdx.y;
    const int n = blockIdx.z;  // query n of the row's NQ (query NQ-1 is the newest)
    const int b = bh / HKV;
    const int h = bh % HKV;
    const int tid = threadIdx.x;
    const int g = tid / LPK;
    const int lane = tid % LPK;
    const int hi = en[b] - (NQ - 1 - n);  // one past the last column query n sees
    const int lo = W > 0 ? max(lp[b], hi - W) : lp[b];
    const int chunk = (hi - lo + S - 1) / S;
    const int start = lo + split * chunk;
    const int stop = min(start + chunk, hi);
    const float qs = scale[0];
    float qf[REP][ELEMS];
    float m[REP], l[REP], o[REP][ELEMS];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        uint4 raw = *reinterpret_cast<const uint4*>(
            q + (((size_t)(b * HKV + h) * REP + r) * NQ + n) * D + lane * ELEMS);
        const T* t = reinterpret_cast<const T*>(&raw);
        #pragma unroll
        for (int e = 0; e < ELEMS; ++e) { qf[r][e] = static_cast<float>(t[e]) * qs; o[r][e] = 0.f; }
        m[r] = -1e30f;
        l[r] = 0.f;
    }
    const T* kb = k + (size_t)bh * CAP * D + lane * ELEMS;
    const T* vb = v + (size_t)bh * CAP * D + lane * ELEMS;
    // U keys per group per iteration: all loads first, for more bytes in flight.
    for (int base = start; base < stop; base += U * G) {
        float kf[U][ELEMS], vf[U][ELEMS];
        bool ok[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * G + g;
            ok[u] = j < stop;
            if (ok[u]) {
                uint4 rk = *reinterpret_cast<const uint4*>(kb + (size_t)j * D);
                uint4 rv = *reinterpret_cast<const uint4*>(vb + (size_t)j * D);
                const T* tk = reinterpret_cast<const T*>(&rk);
                const T* tv = reinterpret_cast<const T*>(&rv);
                #pragma unroll
                for (int e = 0; e < ELEMS; ++e) {
                    kf[u][e] = static_cast<float>(tk[e]);
                    vf[u][e] = static_cast<float>(tv[e]);
                }
            } else {
                #pragma unroll
                for (int e = 0; e < ELEMS; ++e) { kf[u][e] = 0.f; vf[u][e] = 0.f; }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            #pragma unroll
            for (int r = 0; r < REP; ++r) {
                float s = 0.f;
                #pragma unroll
                for (int e = 0; e < ELEMS; ++e) s += qf[r][e] * kf[u][e];
                #pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1)
                    s += __shfl_xor_sync(0xffffffff, s, off, LPK);
                if (ok[u]) {
                    const float mn = fmaxf(m[r], s);
                    const float a = expf(m[r] - mn);
                    const float p = expf(s - mn);
                    l[r] = l[r] * a + p;
                    #pragma unroll
                    for (int e = 0; e < ELEMS; ++e) o[r][e] = o[r][e] * a + p * vf[u][e];
                    m[r] = mn;
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        if (lane == 0) { sm_m[g][r] = m[r]; sm_l[g][r] = l[r]; }
        #pragma unroll
        for (int e = 0; e < ELEMS; ++e) sm_o[g][r][lane * ELEMS + e] = o[r][e];
    }
    __syncthreads();
    for (int idx = tid; idx < REP * D; idx += NT) {
        const int r = idx / D;
        const int d = idx % D;
        float M = -1e30f;
        for (int gg = 0; gg < G; ++gg) M = fmaxf(M, sm_m[gg][r]);
        float L = 0.f, O = 0.f;
        for (int gg = 0; gg < G; ++gg) {
            const float w = expf(sm_m[gg][r] - M);
            L += w * sm_l[gg][r];
            O += w * sm_o[gg][r][d];
        }
        const size_t row = (((size_t)(b * HKV + h) * REP + r) * NQ + n) * S + split;
        po[row * D + d] = O;
        if (d == 0) { pm[row] = M; pl[row] = L; }
    }
"""

_MERGE_SRC = r"""
    const int row = blockIdx.y;
    const int d = threadIdx.x;
    const float* m = pm + (size_t)row * S;
    const float* l = pl + (size_t)row * S;
    float M = -1e30f;
    for (int s = 0; s < S; ++s) M = fmaxf(M, m[s]);
    float L = 0.f, O = 0.f;
    for (int s = 0; s < S; ++s) {
        const float w = expf(m[s] - M);
        L += w * l[s];
        O += w * po[((size_t)row * S + s) * D + d];
    }
    out[(size_t)row * D + d] = static_cast<T>(O / L);
"""

_kernels: dict = {}


def _get_kernels():
    if not _kernels:
        _kernels["split"] = mx.fast.cuda_kernel(
            name="kvstate_ragged_decode",
            input_names=["q", "k", "v", "lp", "en", "scale"],
            output_names=["po", "pm", "pl"],
            source=_KERNEL_SRC,
        )
        _kernels["merge"] = mx.fast.cuda_kernel(
            name="kvstate_ragged_merge",
            input_names=["po", "pm", "pl"],
            output_names=["out"],
            source=_MERGE_SRC,
        )
    return _kernels


#: Most queries per row the kernel takes (a verify window); more go to the stock read.
MAX_QUERIES = 8
#: Blocks a read aims for (B * H * N * S): measured on the H200 (``notes/gpu.md``), about
#: 512 blocks of 128 threads beat 4096: a split's merge costs more than the extra waves save.
TARGET_BLOCKS = 512
#: Fewest splits per (row, head, query) when the span allows them (measured: 16 was the best
#: of 16/64/256 at B=8 and B=32 for 2K-32K columns).
MIN_SPLITS = 16
#: Fewest columns a split reads (below this the merge costs more than the split saves).
MIN_SPLIT = 64


def splits_for(B: int, H: int, span: int, N: int = 1) -> int:
    """Key splits per (row, KV head, query): from the rows' longest span of
    columns ``span`` (the capacity bucket in a compiled step, which is within
    one ``step`` of the longest row) and the blocks the other axes give.

    ``B * H * N * S`` aims at ``TARGET_BLOCKS`` with at least ``MIN_SPLITS``
    splits (so one row at B=1 is spread over 64 splits per head, and B=32
    still gets 16), and no split reads fewer than ``MIN_SPLIT`` columns of
    the span. Inside the kernel each row divides its own length, so a short
    row's splits are short. The constants come from the split sweep in
    ``benchmarks/suite.py --micro`` (``notes/gpu.md``).
    """
    want = max(MIN_SPLITS, TARGET_BLOCKS // max(1, B * H * N))
    return max(1, min(256, want, span // MIN_SPLIT))


def kernel_available(dtype=None) -> bool:
    """Whether the mask-free decode kernel runs here (MLX's CUDA backend, GPU stream)."""
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:
        return False


def kernel_fits(q, k) -> bool:
    """Whether ``ragged_attention``'s kernel covers these shapes and dtypes
    (on a backend where it runs): 1 to ``MAX_QUERIES`` queries per row, a key
    row a power-of-two number (<= 32) of 16-byte loads, a float dtype."""
    N, D = q.shape[2], k.shape[-1]
    lanes = D * k.dtype.size // 16  # threads that read one key row, 16 bytes each
    return (
        1 <= N <= MAX_QUERIES
        and (D * k.dtype.size) % 16 == 0
        and 0 < lanes <= 32
        and lanes & (lanes - 1) == 0
        and q.shape[1] % k.shape[1] == 0
        and k.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


def decode_read(N: int, q=None, k=None) -> str:
    """THE choice of attention read over a fixed-capacity buffer (a compiled
    decode or verify step), in one place: ``"kernel"`` (``ragged_attention``'s
    split-K kernel: only the valid columns, no mask) or ``"masked"`` (the
    stock fused SDPA with a per-row bool mask over the capacity).

    The stock fused SDPA *without* a mask (mlx-lm's read of aligned rows, and
    the eager bridge's: its fetch cuts aligned rows to their exact width, so
    ``_rows.rows_read_mask`` gives ``None``/``"causal"``) cannot read a fixed
    capacity: the spare columns past the ends would enter every softmax, and
    a compiled step's width is a shape, fixed per capacity bucket. With a mask,
    MLX CUDA's SDPA falls back to matmul + softmax + matmul (4-6x slower per
    layer, ``notes/gpu.md``), so on CUDA the kernel reads every row layout,
    aligned ones included; the notes record it against the unmasked read.

    Args:
        N: queries per row.
        q, k: the arrays (for the shape check), when known.
    """
    fits = kernel_fits(q, k) if q is not None else 1 <= N <= MAX_QUERIES
    return "kernel" if kernel_available() and fits else "masked"


def ragged_attention(q, k, v, left_pad, ends, *, scale: float, window: int = 0, splits: int = 0):
    """Attention of each row's last ``N`` positions over its own columns.

    ``q`` ``[B, Hq, N, D]`` (``N`` <= ``MAX_QUERIES``), ``k``/``v`` ``[B, H, C, D]``
    (``Hq`` a multiple of ``H``), ``left_pad``/``ends`` int32 ``[B]`` arrays
    (traceable). Query ``i`` of row ``b`` stands at column ``ends[b] - N + i``
    and reads columns ``[left_pad[b], ends[b] - N + i]`` (with ``window`` > 0,
    only the last ``window`` of them): ``masks.rows_mask``'s rule. No mask
    array is built: on MLX's CUDA backend a split-K kernel reads only those
    columns; elsewhere this is the masked fused SDPA (same result). A ring
    row whose held entries fill columns ``[0, held)`` reads with
    ``left_pad=0, ends=held`` (one query). The caller guarantees
    ``0 <= left_pad <= ends - N`` and ``ends <= C``.
    ``splits`` overrides ``splits_for`` (for measurements).
    """
    B, Hq, N, D = q.shape
    H, C = k.shape[1], k.shape[2]
    if decode_read(N, q, k) != "kernel":
        mask = rows_mask(N, left_pad, ends, C, window=window or None)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    rep = Hq // H
    S = splits or splits_for(B, H, C, N)
    kern = _get_kernels()
    if q.dtype != k.dtype:
        q = q.astype(k.dtype)
    po, pm, pl = kern["split"](
        inputs=[q, k, v, left_pad, ends, mx.array([scale], mx.float32)],
        template=[
            ("T", k.dtype),
            ("D", D),
            ("REP", rep),
            ("HKV", H),
            ("S", S),
            ("CAP", C),
            ("NQ", N),
            ("W", int(window)),
        ],
        grid=(128 * S, B * H, N),
        threadgroup=(128, 1, 1),
        output_shapes=[(B, Hq, N, S, D), (B, Hq, N, S), (B, Hq, N, S)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    (out,) = kern["merge"](
        inputs=[po, pm, pl],
        template=[("T", k.dtype), ("D", D), ("S", S)],
        grid=(D, B * Hq * N, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(B, Hq, N, D)],
        output_dtypes=[k.dtype],
    )
    return out


def folded_attention(q, k, v, scale: float, mask=None):
    """Grouped-query attention with each KV head's query heads folded into query rows.

    ``q`` ``[B, Hq, N, D]`` with ``Hq = G * H`` reads ``k``, ``v`` ``[B, H, C, D]``
    as ``[B, H, G * N, D]`` queries (query head ``h * G + g`` uses KV head
    ``h``, MLX's grouping), so the fused kernel sees one query head per KV
    head; a bool ``mask`` ``[B, 1, N, C]`` is repeated over the ``G`` groups
    (``"causal"`` is built as an array: its bottom-right rule does not
    survive folding). The result equals the stock read's; where it is
    faster is measured by ``benchmarks/verify_read.py`` (``notes/speculative.md``).
    """
    B, Hq, N, D = q.shape
    H = k.shape[1]
    G = Hq // H
    if G == 1:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    if isinstance(mask, str):
        C = k.shape[2]
        mask = (mx.arange(C)[None, :] <= (C - N + mx.arange(N))[:, None])[None, None]
    if mask is not None:
        m = mask if mask.ndim == 4 else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        m = mx.broadcast_to(m[:, :, None], (m.shape[0], 1, G, N, m.shape[-1]))
        mask = m.reshape(m.shape[0], 1, G * N, m.shape[-1])
    out = mx.fast.scaled_dot_product_attention(
        q.reshape(B, H, G * N, D), k, v, scale=scale, mask=mask
    )
    return out.reshape(B, Hq, N, out.shape[-1])
