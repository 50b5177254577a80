"""A mask-free decode attention kernel for MLX's CUDA backend.

``ragged_attention(q, k, v, left_pad, ends, scale=...)`` reads, for each row,
only its own columns ``[left_pad[b], ends[b])`` of a fixed-capacity cache:
a split-K kernel (``mx.fast.cuda_kernel``) computes partial softmax sums
over column chunks, a second kernel merges them. No mask array is built,
which is what makes ragged decode on the H200 about as cheap as aligned
decode (``notes/kernels.md``, ``notes/figures.md``). Elsewhere (CPU,
Metal, shapes the kernel does not cover) it is the masked fused SDPA, with
the same result. ``kvstate.mlx_lm.Decoder(attention="kernel")`` routes a
compiled step's dense decode reads here.
"""

from __future__ import annotations

import mlx.core as mx

from ..core.masks import rows_mask
from ..errors import check
from .stock import column_writer, quantized_sdpa

# The split pass. One block of NT threads per (split, row x KV head, query): grid x holds
# each (row, KV head)'s S splits (and a fused write's copy blocks) one after another, z
# the query (CUDA caps grid y and z at 65535 blocks, x at 2^31 - 1). LPK lanes read one
# key row with 16-byte loads (ELEMS elements each), so G = NT / LPK keys per
# group step, U steps loaded before any is used (bytes in flight). A row is a *virtual*
# run of columns: with a prefix, its first plen[b] columns are columns [pstart[b],
# +plen[b]) of row prow[b] of the prefix planes pk/pv, then its own columns [lp[b],
# en[b]) of k/v. Without one, just the latter. Query n of NQ stands at the run's column
# hi - 1. The online softmax is updated once per U keys (one rescale per step, not per
# key). Quantized planes (QB bits, QGS elements per scale and bias, mx.quantize's
# layout: element e of a 32-bit word at bits [QB*e, QB*e+QB)) are dequantized in
# registers as they are read. EPILOGUE: the S partial results (po, pm, pl) for the
# merge, or with S == 1 the normalised output itself (one launch).
_SPLIT_BODY = r"""
    constexpr int QE = 16 / sizeof(T);  // elements of T in 16 bytes
    constexpr int ELEMS = QB ? 128 / QB : QE;  // elements in one 16-byte load of K or V
    constexpr int LPK = D / ELEMS;
    constexpr int RS = QB ? D * QB / 32 : D;  // row stride, in elements of KT
    constexpr int LS = QB ? 4 : ELEMS;  // lane stride, in elements of KT
    constexpr int G = NT / LPK;
    __shared__ float sm_m[G][REP];
    __shared__ float sm_l[G][REP];
    __shared__ float sm_o[G][REP][D];

    const int PER = gridDim.x / (k_shape[0] * HKV);  // blocks per (row, KV head): S splits, copies
    const int split = blockIdx.x % PER;
    const int bh = blockIdx.x / PER;  // rows x heads folded into x (grid y/z stop at 65535)
    const int n = blockIdx.z;
    const int b = bh / HKV;
    const int h = bh % HKV;
    const int CAP = k_shape[2];  // the capacity: a runtime value (one build for every bucket)
    const int NQ = gridDim.z;  // queries per row: a runtime value too
    const int tid = threadIdx.x;
    const int g = tid / LPK;
    const int lane = tid % LPK;
    COPY_BLOCKS
    const int sl = lp[b];
    const int plen_b = PLEN_B;
    const int hi = plen_b + (en[b] - sl) - (NQ - 1 - n);  // one past query n's last column
    const int lo = W > 0 ? max(0, hi - W) : 0;
    const int chunk = (hi - lo + S - 1) / S;
    const int start = lo + split * chunk;
    const int stop = min(start + chunk, hi);
    const float qs = scale[0];
    // fast exp for 16-bit types; exact expf in float32 (the float32 tests compare at 1e-5)
    auto ex = [](float x) { return sizeof(T) == 4 ? expf(x) : __expf(x); };
    float qf[REP][ELEMS];
    float m[REP], l[REP], o[REP][ELEMS];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        #pragma unroll
        for (int c = 0; c < ELEMS / QE; ++c) {
            uint4 raw = *reinterpret_cast<const uint4*>(
                q + (((size_t)(b * HKV + h) * REP + r) * NQ + n) * D + lane * ELEMS + c * QE);
            const T* t = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int e = 0; e < QE; ++e) qf[r][c * QE + e] = static_cast<float>(t[e]) * qs;
        }
        #pragma unroll
        for (int e = 0; e < ELEMS; ++e) o[r][e] = 0.f;
        m[r] = -1e30f;
        l[r] = 0.f;
    }
    QUANT_BASES
    // Columns [a, z) of the run, where run column j is row column j + off of kp/vp.
    auto run = [&](const KT* kp, const KT* vp, int off, int a, int z) {
LOADS
            float s[U][REP];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const bool ok = base + u * G + g < z;
                float kf[ELEMS];
                #pragma unroll
                for (int e = 0; e < ELEMS; ++e) kf[e] = KELEM;
                #pragma unroll
                for (int r = 0; r < REP; ++r) {
                    float acc = 0.f;
                    #pragma unroll
                    for (int e = 0; e < ELEMS; ++e) acc += qf[r][e] * kf[e];
                    #pragma unroll
                    for (int sh = LPK / 2; sh > 0; sh >>= 1)
                        acc += __shfl_xor_sync(0xffffffff, acc, sh, LPK);
                    s[u][r] = ok ? acc : __int_as_float(0xff800000);  // -inf
                }
            }
            #pragma unroll
            for (int r = 0; r < REP; ++r) {
                float mn = m[r];
                #pragma unroll
                for (int u = 0; u < U; ++u) mn = fmaxf(mn, s[u][r]);
                const float a_ = ex(m[r] - mn);
                l[r] *= a_;
                #pragma unroll
                for (int e = 0; e < ELEMS; ++e) o[r][e] *= a_;
                m[r] = mn;
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                float vf[ELEMS];
                #pragma unroll
                for (int e = 0; e < ELEMS; ++e) vf[e] = VELEM;
                #pragma unroll
                for (int r = 0; r < REP; ++r) {
                    const float p = ex(s[u][r] - m[r]);
                    l[r] += p;
                    #pragma unroll
                    for (int e = 0; e < ELEMS; ++e) o[r][e] += p * vf[e];
                }
            }
        }
    };
    PREFIX_RUN
    OWN_RUN
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
            const float w = ex(sm_m[gg][r] - M);
            L += w * sm_l[gg][r];
            O += w * sm_o[gg][r][d];
        }
        const size_t qrow = ((size_t)(b * HKV + h) * REP + r) * NQ + n;
        EPILOGUE
    }
"""

# The loads of one group step: U keys' 16 bytes of K and V per thread, issued before any
# is used (LOADS); with PREFETCH, the next step's are issued before this step's compute
# (a second set of registers: the loads of step i + 1 are in flight while step i computes).
_LOADS = r"""
        for (int base = a; base < z; base += U * G) {
            uint4 rk[U], rv[U];
            QUANT_DECL
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = base + u * G + g;
                if (j < z) {
                    rk[u] = *reinterpret_cast<const uint4*>(kp + (size_t)(j + off) * RS);
                    rv[u] = *reinterpret_cast<const uint4*>(vp + (size_t)(j + off) * RS);
                    QUANT_LOAD
                } else {
                    rk[u] = make_uint4(0, 0, 0, 0);
                    rv[u] = rk[u];
                    QUANT_ZERO
                }
            }
"""

_LOADS_PREFETCH = r"""
        uint4 nk[U], nv[U];  // the next step's keys and values, in flight
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = a + u * G + g;
            nk[u] = make_uint4(0, 0, 0, 0);
            nv[u] = nk[u];
            if (j < z) {
                nk[u] = *reinterpret_cast<const uint4*>(kp + (size_t)(j + off) * RS);
                nv[u] = *reinterpret_cast<const uint4*>(vp + (size_t)(j + off) * RS);
            }
        }
        for (int base = a; base < z; base += U * G) {
            uint4 rk[U], rv[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                rk[u] = nk[u];
                rv[u] = nv[u];
                const int j = base + U * G + u * G + g;
                if (j < z) {
                    nk[u] = *reinterpret_cast<const uint4*>(kp + (size_t)(j + off) * RS);
                    nv[u] = *reinterpret_cast<const uint4*>(vp + (size_t)(j + off) * RS);
                } else {
                    nk[u] = make_uint4(0, 0, 0, 0);
                    nv[u] = nk[u];
                }
            }
"""

_OWN_RUN = r"""
    run(k + (size_t)bh * CAP * RS + lane * LS, v + (size_t)bh * CAP * RS + lane * LS,
        sl - plen_b, max(start, plen_b), stop);
"""

# A write fused into the read (``write_and_read``): the last NQ columns of the row,
# [en[b] - NQ, en[b]), are the new tokens kn/vn [B, H, NQ, D] (not yet in k/v), and
# blocks S .. S + COPIES - 1 copy the planes into ko/vo with those columns written.
_FUSED_RUN = r"""
    const int hold = plen_b + (en[b] - NQ - sl);  // run columns before the new tokens
    run(k + (size_t)bh * CAP * RS + lane * LS, v + (size_t)bh * CAP * RS + lane * LS,
        sl - plen_b, max(start, plen_b), min(stop, hold));
    run(kn + (size_t)bh * NQ * D + lane * ELEMS, vn + (size_t)bh * NQ * D + lane * ELEMS,
        -hold, max(start, hold), stop);
"""

_COPY_BLOCKS = r"""
    if (split >= S) {  // a copy block: columns [c0, c1) of row bh of the written planes
        if (n != 0) return;
        constexpr int VR = D / QE;  // 16-byte vectors per key row
        constexpr int CU = 4;  // vectors per thread in flight
        const int COPIES = PER - S;  // copy blocks per (row, KV head)
        const int cchunk = (CAP + COPIES - 1) / COPIES;
        const int c0 = (split - S) * cchunk;
        const int c1 = min(c0 + cchunk, CAP);
        const int w0 = en[b] - NQ;  // the first written column
        const size_t base = (size_t)bh * CAP * D;
        const int c_end = c1 * VR;
        for (int i0 = c0 * VR + tid; i0 < c_end; i0 += NT * CU) {
            uint4 kk[CU], vv[CU];  // CU vectors of each plane loaded before any is stored
            #pragma unroll
            for (int u = 0; u < CU; ++u) {
                const int i = i0 + u * NT;
                const int w = i / VR - w0;
                if (i >= c_end) {
                } else if (w >= 0 && w < NQ) {
                    const size_t at = ((size_t)bh * NQ + w) * D + (i % VR) * QE;
                    kk[u] = *reinterpret_cast<const uint4*>(kn + at);
                    vv[u] = *reinterpret_cast<const uint4*>(vn + at);
                } else {
                    kk[u] = *reinterpret_cast<const uint4*>(k + base + (size_t)i * QE);
                    vv[u] = *reinterpret_cast<const uint4*>(v + base + (size_t)i * QE);
                }
            }
            #pragma unroll
            for (int u = 0; u < CU; ++u) {
                const int i = i0 + u * NT;
                if (i < c_end) {
                    *reinterpret_cast<uint4*>(ko + base + (size_t)i * QE) = kk[u];
                    *reinterpret_cast<uint4*>(vo + base + (size_t)i * QE) = vv[u];
                }
            }
        }
        return;
    }
"""

_PREFIX_RUN = r"""
    if (start < plen_b) {
        const size_t pbase = ((size_t)prow[b] * HKV + h) * pk_shape[2] * D + lane * ELEMS;
        run(pk + pbase, pv + pbase, pstart[b], start, min(stop, plen_b));
    }
"""

# Quantized planes: per key and lane one scale and bias of K and of V (a lane's ELEMS
# elements lie in one group: ELEMS <= 32 <= QGS).
_QUANT = {
    "QUANT_BASES": r"""
    constexpr int GR = D / QGS;  // groups per row
    const T* ksb = ks + (size_t)bh * CAP * GR + lane * ELEMS / QGS;
    const T* kbb = kb + (size_t)bh * CAP * GR + lane * ELEMS / QGS;
    const T* vsb = vs + (size_t)bh * CAP * GR + lane * ELEMS / QGS;
    const T* vbb = vb + (size_t)bh * CAP * GR + lane * ELEMS / QGS;
""",
    "QUANT_DECL": "float ksc[U], kbi[U], vsc[U], vbi[U];",
    "QUANT_LOAD": r"""
                    const size_t gi = (size_t)(j + off) * GR;
                    ksc[u] = static_cast<float>(ksb[gi]);
                    kbi[u] = static_cast<float>(kbb[gi]);
                    vsc[u] = static_cast<float>(vsb[gi]);
                    vbi[u] = static_cast<float>(vbb[gi]);
""",
    "QUANT_ZERO": "ksc[u] = kbi[u] = vsc[u] = vbi[u] = 0.f;",
    "KELEM": "_deq<QB>(rk[u], e) * ksc[u] + kbi[u]",
    "VELEM": "_deq<QB>(rv[u], e) * vsc[u] + vbi[u]",
}
_PLAIN = {
    "QUANT_BASES": "",
    "QUANT_DECL": "",
    "QUANT_LOAD": "",
    "QUANT_ZERO": "",
    "KELEM": "static_cast<float>(reinterpret_cast<const T*>(&rk[u])[e])",
    "VELEM": "static_cast<float>(reinterpret_cast<const T*>(&rv[u])[e])",
}

_QUANT_HEADER = r"""
template <int QB>
__device__ __forceinline__ float _deq(const uint4& raw, int e) {
    constexpr int PER = 32 / QB;
    const unsigned int w = reinterpret_cast<const unsigned int*>(&raw)[e / PER];
    return static_cast<float>((w >> (QB * (e % PER))) & ((1u << QB) - 1u));
}
"""

_EPILOGUE_SPLIT = r"""
        const size_t row = qrow * S + split;
        po[row * D + d] = O;
        if (d == 0) { pm[row] = M; pl[row] = L; }
"""

_EPILOGUE_DIRECT = r"""
        out[qrow * D + d] = static_cast<T>(O / L);
"""


def _split_source(
    prefix: bool, direct: bool, quant: bool = False, fused: bool = False, prefetch: bool = False
) -> str:
    src = _SPLIT_BODY.replace("LOADS\n", _LOADS_PREFETCH if prefetch else _LOADS)
    src = src.replace("PREFIX_RUN", _PREFIX_RUN if prefix else "")
    src = src.replace("OWN_RUN", _FUSED_RUN if fused else _OWN_RUN)
    src = src.replace("COPY_BLOCKS", _COPY_BLOCKS if fused else "")
    src = src.replace("PLEN_B", "plen[b]" if prefix else "0")
    for key, text in (_QUANT if quant else _PLAIN).items():
        src = src.replace(key, text)
    src = src.replace("KT", "uint32_t" if quant else "T")
    return src.replace("EPILOGUE", _EPILOGUE_DIRECT if direct else _EPILOGUE_SPLIT)


_MERGE_SRC = r"""
    const int row = blockIdx.x;  // (row, head, query), in x: grid y/z stop at 65535
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


def _split_kernel(
    prefix: bool, direct: bool, quant: bool = False, fused: bool = False, prefetch: bool = False
):
    """The split pass (with a prefix source or not, over quantized planes or not,
    writing the new tokens' planes or not, loading one step ahead or not; partial
    results or, with one split, the output itself), built once per variant."""
    prefetch = prefetch and not quant  # (packed planes: no prefetch variant)
    key = ("split", prefix, direct, quant, fused, prefetch)
    if key not in _kernels:
        inputs = ["q", "k", "v", "lp", "en", "scale"]
        outputs = ["out"] if direct else ["po", "pm", "pl"]
        if fused:
            inputs += ["kn", "vn"]
            outputs += ["ko", "vo"]
        if prefix:
            inputs += ["pk", "pv", "prow", "pstart", "plen"]
        if quant:
            inputs += ["ks", "kb", "vs", "vb"]
        _kernels[key] = mx.fast.cuda_kernel(
            name="kvstate_ragged_decode"
            + ("_prefix" if prefix else "")
            + ("_q" if quant else "")
            + ("_w" if fused else "")
            + ("_pf" if prefetch else "")
            + ("_1" if direct else ""),
            input_names=inputs,
            output_names=outputs,
            source=_split_source(prefix, direct, quant, fused, prefetch),
            header=_QUANT_HEADER,
        )
    return _kernels[key]


def _merge_kernel():
    if "merge" not in _kernels:
        _kernels["merge"] = mx.fast.cuda_kernel(
            name="kvstate_ragged_merge",
            input_names=["po", "pm", "pl"],
            output_names=["out"],
            source=_MERGE_SRC,
        )
    return _kernels["merge"]


#: Most queries per row the kernel takes (a verify window); more go to the stock read.
MAX_QUERIES = 8
#: Most queries per row the kernel takes for rows with a shared prefix (``prefix=``):
#: a cached request's rest (the tokens after its cached prefix, and its last) is read
#: over the prefix in one launch, one block per query, where the alternative is the
#: cascade's ~35 uncompiled operations per layer (``notes/kinds.md``).
#: Measured on the H200 (``benchmarks/shared_prefix.py --part wide``): the
#: kernel read such rests in 0.17-0.43x the cascade's time at every width to 512 (B=1, 4);
#: tested there to 512 queries (``tests/kernels/test_prefix_read.py``).
PREFIX_QUERIES = 512
#: Blocks a split read aims for (B * H * N * S): measured on the H200 (``notes/kernels.md``),
#: about 512 blocks beat 4096: a split's merge costs more than the extra waves save.
TARGET_BLOCKS = 512
#: (row, KV head, query) blocks from which one split per block fills the GPU: one launch,
#: no merge (measured: B=32 x 8 heads read 8K columns in 176-184 us at one split, 203-215
#: at 16; ``notes/kernels.md``).
SINGLE_ROWS = 128
#: Longest span read in one split whatever the batch (measured: one row of 2K columns per
#: head reads in 33-39 us in one launch against 39-44 us split 36 ways; 8K needs splits).
SINGLE_SPAN = 2560
#: Fewest columns a split reads (below this the merge costs more than the split saves).
MIN_SPLIT = 64
#: Most splits per (row, KV head, query). Measured on the H200 (``notes/kernels.md``):
#: B=1 8K aligned whole steps, 32 splits 2.16 ms [2.15-2.22], 16 splits 2.19,
#: 64 (the ``TARGET_BLOCKS`` count) 2.58 [2.22-2.69], one run; at 32K, 16 and 64 splits
#: read alike (59.7 vs 60.0 us a layer).
MAX_SPLITS = 32
#: Threads per block of the split pass (measured: 256 beat 128 at every shape swept).
THREADS = 256
#: Key-group steps loaded before any is used, dense planes (bytes in flight per thread:
#: 2 * 16 * UNROLL, twice that with PREFETCH). Measured on the H200 (``notes/kernels.md``):
#: B=32 x 32K aligned columns per layer, one split, 256 threads: U=2 750 us,
#: U=4 592 us, U=4 with PREFETCH 537 us (4.0 TB/s; MLX's cuDNN read of the exact width
#: 520 us in the same run); U=2 beat 1 and 8 in an earlier sweep.
UNROLL = 4
#: Key-group steps of the packed-plane (quantized) pass: from the first sweep, not re-measured.
UNROLL_PACKED = 2
#: Whether the split pass issues the next group step's loads before this step's compute
#: (dense planes; same measurement: U=2 750 -> 609 us, U=4 592 -> 537 us).
PREFETCH = True
#: Largest pair of planes (``2 * B * H * C * D * itemsize`` bytes) whose write
#: ``write_and_read`` fuses into the read: the launch copies both planes whole, so it
#: pays while the copy costs less than the two scatter launches it replaces (measured
#: on the H200, ``notes/kernels.md``: a scatter costs 25-50 us whatever the capacity; fused
#: won at pairs of 4, 17 and 151 MB, lost at 604 MB).
FUSED_BYTES = 160 * 1024 * 1024
#: Bytes of one plane that one copy block of ``write_and_read`` copies.
COPY_BYTES = 32 * 1024
#: Shared memory the split pass may use for its in-block combine (static limit).
_SMEM = 48 * 1024


def splits_for(B: int, H: int, span: int, N: int = 1) -> int:
    """Key splits per (row, KV head, query): from the rows' longest span of
    columns ``span`` (the capacity bucket in a compiled step, which is within
    one ``step`` of the longest row, plus a prefix's columns) and the blocks
    the other axes give.

    One split (one launch, no merge) when ``B * H * N`` blocks fill the GPU
    (``SINGLE_ROWS``) or the span is short (``SINGLE_SPAN``); otherwise
    ``B * H * N * S`` aims at ``TARGET_BLOCKS``, at least 2, at most
    ``MAX_SPLITS`` (so one row of 8K columns at B=1 is spread over 32 splits
    per head), and no split reads fewer than ``MIN_SPLIT`` columns. Inside the
    kernel each row divides its own length, so a short row's splits are short.
    The constants come from kernel sweeps and whole-step timings on the H200
    (``notes/kernels.md``; the figures in ``notes/figures.md``).
    """
    rows = max(1, B * H * N)
    if rows >= SINGLE_ROWS or span <= SINGLE_SPAN:
        return 1
    return max(1, min(MAX_SPLITS, max(2, TARGET_BLOCKS // rows), span // MIN_SPLIT))


def kernel_available(dtype=None) -> bool:
    """Whether the mask-free decode kernel runs here (MLX's CUDA backend, GPU stream)."""
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:
        return False


def kernel_fits(q, k, most: int = MAX_QUERIES) -> bool:
    """Whether ``ragged_attention``'s kernel covers these shapes and dtypes
    (on a backend where it runs): at least one row (CUDA takes no empty grid),
    1 to ``most`` queries per row, a key row a power-of-two number (<= 32) of
    16-byte loads, a float dtype."""
    N, D = q.shape[2], k.shape[-1]
    lanes = D * k.dtype.size // 16  # threads that read one key row, 16 bytes each
    return (
        q.shape[0] > 0
        and 1 <= N <= most
        and (D * k.dtype.size) % 16 == 0
        and 0 < lanes <= 32
        and lanes & (lanes - 1) == 0
        and q.shape[1] % k.shape[1] == 0
        and k.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


def decode_read(
    N: int,
    q=None,
    k=None,
    *,
    group_size: int = 0,
    bits: int = 0,
    written: bool = False,
    prefix: bool = False,
) -> str:
    """THE choice of attention read over a fixed-capacity buffer (a compiled
    decode or verify step, or shared-prefix rows), in one place: ``"kernel"``
    (``ragged_attention``'s split-K kernel: only the valid columns, no mask)
    or ``"masked"`` (the stock fused SDPA with a per-row bool mask over the
    capacity; with a prefix, over the gathered prefix columns too).

    The stock fused SDPA *without* a mask (mlx-lm's read of aligned rows, and
    the eager bridge's: its fetch cuts aligned rows to their exact width, so
    ``_rows.rows_read_mask`` gives ``None``/``"causal"``) cannot read a fixed
    capacity: the spare columns past the ends would enter every softmax, and
    a compiled step's width is a shape, fixed per capacity bucket. With a mask,
    MLX CUDA's SDPA falls back to matmul + softmax + matmul (4-6x slower per
    layer, ``notes/kernels.md``), so on CUDA the kernel reads every row layout,
    aligned ones included; the notes record it against the unmasked read.

    Quantized rows (``k`` a ``(packed, scales, biases)`` triple) read the same
    way: the kernel reads the packed planes where ``quantized_fits``; else the
    stock quantized read (``quantized_matmul``) under a mask.

    With ``written`` (a compiled step whose last ``N`` columns were just
    written by scatter, and the planes before that write are at hand),
    ``"fused"`` where the kernel reads and the two planes together take at
    most ``FUSED_BYTES``: ``write_and_read`` then does the write in the read's
    launch (one launch per layer instead of three; it copies the planes whole).

    Args:
        N: queries per row.
        q: the queries (for the shape check), when known.
        k: the keys (for the shape check), when known.
        group_size: a quantized ``k``'s format.
        bits: a quantized ``k``'s format.
        written: whether a fused write may be chosen (dense ``k`` only).
        prefix: rows read a shared prefix first (``kvstate.kinds.shared``): up to
            ``PREFIX_QUERIES`` queries per row go to the kernel (a cached
            request's uncached rest, read over its prefix in one launch).
    """
    most = PREFIX_QUERIES if prefix else MAX_QUERIES
    if q is None:
        fits = 1 <= N <= most
    elif isinstance(k, tuple):
        fits = quantized_fits(q, k, group_size, bits)
    else:
        fits = kernel_fits(q, k, most)
    if not (kernel_available() and fits):
        return "masked"
    if written and k is not None and not isinstance(k, tuple) and 2 * k.nbytes <= FUSED_BYTES:
        return "fused"
    return "kernel"


def _prefix_fits(prefix, k) -> bool:
    pk, pv = prefix[0], prefix[1]
    return (
        pk.dtype == k.dtype
        and pk.shape == pv.shape
        and pk.ndim == 4
        and pk.shape[1] == k.shape[1]
        and pk.shape[3] == k.shape[3]
    )


def _prefix_reference(q, k, v, left_pad, ends, prefix, scale):
    """``ragged_attention`` with a prefix by the stock path: each row's prefix
    columns gathered in front of its own buffer, one masked fused SDPA."""
    pk, pv, rows, starts, lens = prefix
    B, N = q.shape[0], q.shape[2]
    H, Cp, D = pk.shape[1], pk.shape[2], pk.shape[3]
    cols = mx.clip(starts[:, None] + mx.arange(Cp, dtype=mx.int32)[None], 0, Cp - 1)
    index = mx.broadcast_to(cols[:, None, :, None], (B, H, Cp, D))
    gk = mx.take_along_axis(pk[rows], index, axis=2)
    gv = mx.take_along_axis(pv[rows], index, axis=2)
    seen = mx.arange(Cp, dtype=mx.int32)[None] < lens[:, None]  # [B, Cp]
    seen = mx.broadcast_to(seen[:, None, None, :], (B, 1, N, Cp))
    mask = mx.concatenate([seen, rows_mask(N, left_pad, ends, k.shape[2])], axis=-1)
    keys = mx.concatenate([gk, k], axis=2)
    values = mx.concatenate([gv, v], axis=2)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def ragged_attention(
    q,
    k,
    v,
    left_pad,
    ends,
    *,
    scale: float,
    window: int = 0,
    splits: int = 0,
    prefix=None,
    threads: int = 0,
    unroll: int = 0,
    prefetch: bool | None = None,
):
    """Attention of each row's last ``N`` positions over its own columns.

    ``q`` ``[B, Hq, N, D]`` (``N`` <= ``MAX_QUERIES``; ``PREFIX_QUERIES`` with a
    ``prefix``), ``k``/``v`` ``[B, H, C, D]``
    (``Hq`` a multiple of ``H``), ``left_pad``/``ends`` int32 ``[B]`` arrays
    (traceable). Query ``i`` of row ``b`` stands at column ``ends[b] - N + i``
    and reads columns ``[left_pad[b], ends[b] - N + i]`` (with ``window`` > 0,
    only the last ``window`` of them): ``masks.rows_mask``'s rule. No mask
    array is built: on MLX's CUDA backend a split-K kernel reads only those
    columns; elsewhere this is the masked fused SDPA (same result). A ring
    row whose held entries fill columns ``[0, held)`` reads with
    ``left_pad=0, ends=held`` (one query). The caller guarantees
    ``0 <= left_pad <= ends - N`` and ``ends <= C``.

    Args:
        prefix: shared-prefix rows (``kvstate.kinds.shared``): ``(pk, pv, rows,
            starts, lens)``, ``pk``/``pv`` ``[P, H, Cp, D]`` one prefix
            record's planes (``k``'s dtype, never written), ``rows``,
            ``starts``, ``lens`` int32 ``[B]``: row ``b`` first reads columns
            ``[starts[b], starts[b] + lens[b])`` of prefix row ``rows[b]``
            (``lens`` may be 0), all visible to every query, then its own
            columns as above, in the same launches: the split pass divides
            each row's whole run, so the prefix is read from one buffer
            (hot in L2 for the rows that share it). ``window`` must be 0;
            the queries stand in the row's own columns (``N <= ends -
            left_pad``). Off CUDA, the gathered columns and one masked SDPA.
        splits: overrides ``splits_for`` (for measurements); 1 is one launch.
        threads: overrides ``THREADS`` (for measurements).
        unroll: overrides ``UNROLL`` (for measurements).
        prefetch: overrides ``PREFETCH`` (for measurements).
    """
    N, C = q.shape[2], k.shape[2]
    if not _kernel_reads(q, k, window, prefix):
        if prefix is not None:
            return _prefix_reference(q, k, v, left_pad, ends, prefix, scale)
        mask = rows_mask(N, left_pad, ends, C, window=window or None)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    knobs = (window, splits, threads, unroll, prefetch)
    return _dense_launch(q, k, v, left_pad, ends, scale, knobs, prefix)


def _kernel_reads(q, k, window: int, prefix) -> bool:
    """Whether the split-K kernel reads ``q`` over ``k`` (and ``prefix``): the
    checks of a prefix argument, then ``decode_read``'s answer and the prefix
    planes' fit."""
    if prefix is not None:
        check(window == 0, "window", "0 with a prefix (no windowed shared read)", window)
        check(len(prefix) == 5, "prefix", "(pk, pv, rows, starts, lens)", len(prefix))
    route = decode_read(q.shape[2], q, k, prefix=prefix is not None)
    return route == "kernel" and (prefix is None or _prefix_fits(prefix, k))


def _dense_launch(q, k, v, left_pad, ends, scale, knobs, prefix, new=None):
    """``_launch`` over dense planes ``k``/``v`` ``[B, H, C, D]`` (``q`` in their
    dtype; one lane per 16 bytes), with ``prefix``'s source when given and, with
    ``new`` (``write_and_read``'s tokens), the fused write (``copies_for`` blocks).
    ``knobs``: ``(window, splits, threads, unroll, prefetch)`` as the callers take
    them (``splits`` 0: ``splits_for`` the rows' span, prefix columns included)."""
    window, splits, threads, unroll, prefetch = knobs
    B, H, C, D = k.shape
    if q.dtype != k.dtype:
        q = q.astype(k.dtype)
    fused = {} if new is None else dict(new=new, copies=copies_for(C, D, k.dtype.size))
    source = {} if prefix is None else dict(extra=list(prefix), prefix=True)
    span = C + (0 if prefix is None else prefix[0].shape[2])  # a row's run: prefix, then own
    return _launch(
        q,
        k,
        v,
        left_pad,
        ends,
        scale=scale,
        window=window,
        splits=splits or splits_for(B, H, span, q.shape[2]),
        lanes=D * k.dtype.size // 16,
        threads=threads,
        unroll=unroll,
        prefetch=prefetch,
        **source,
        **fused,
    )


def copies_for(C: int, D: int, itemsize: int) -> int:
    """Copy blocks per (row, KV head) of ``write_and_read``: ``COPY_BYTES`` of a
    plane row each (at least one, at most one per 16 columns)."""
    return max(1, min(C // 16 or 1, -(-C * D * itemsize // COPY_BYTES)))


def write_and_read(
    q,
    k,
    v,
    new_k,
    new_v,
    left_pad,
    ends,
    *,
    scale: float,
    window: int = 0,
    prefix=None,
    splits: int = 0,
    threads: int = 0,
    unroll: int = 0,
    prefetch: bool | None = None,
) -> tuple:
    """Write ``N`` new tokens at each row's columns ``[ends - N, ends)`` and read
    them with the rows: ``(out, keys, values)``, ``keys``/``values`` the planes
    with the tokens written, ``out`` what ``ragged_attention(q, keys, values,
    left_pad, ends, ...)`` gives.

    ``q`` ``[B, Hq, N, D]``, ``k``/``v`` ``[B, H, C, D]`` the planes before the
    write, ``new_k``/``new_v`` ``[B, H, N, D]``, ``ends`` the rows' ends after
    the write (int32 ``[B]``; ``N <= ends - left_pad``, ``ends <= C``). On MLX's
    CUDA backend, where ``decode_read`` fits, one launch: the read takes the
    new columns from ``new_k``/``new_v``, and extra blocks copy ``k``/``v``
    into fresh planes with those columns written (a custom kernel cannot
    write its inputs in place, so the planes are copied whole: worth it
    where the two scatter launches it saves cost more, ``FUSED_BYTES``).
    Elsewhere, the compiled step's scatter write (``stock.column_writer``)
    and ``ragged_attention``.

    Args:
        prefix: shared-prefix rows, as ``ragged_attention`` takes them: each
            row's run is its prefix columns, then its own (``k``/``v`` are a
            ``SharedState``'s suffix planes; only they are written).
    """
    N = q.shape[2]
    new_k, new_v = new_k.astype(k.dtype), new_v.astype(v.dtype)
    if not _kernel_reads(q, k, window, prefix):
        write = column_writer(ends - N, N)
        keys, values = write(k, new_k), write(v, new_v)
        out = ragged_attention(
            q, keys, values, left_pad, ends, scale=scale, window=window, prefix=prefix
        )
        return out, keys, values
    knobs = (window, splits, threads, unroll, prefetch)
    return _dense_launch(q, k, v, left_pad, ends, scale, knobs, prefix, new=(new_k, new_v))


def _launch(
    q,
    k,
    v,
    left_pad,
    ends,
    *,
    scale: float,
    window: int,
    splits: int,
    lanes: int,
    threads: int = 0,
    unroll: int = 0,
    prefetch: bool | None = None,
    extra: list | tuple = (),
    template: list | tuple = (),
    prefix: bool = False,
    quant: bool = False,
    new: tuple | None = None,
    copies: int = 0,
):
    """The split pass (and, for ``splits > 1``, the merge) over ``k``/``v`` planes
    ``[B, H, C, *]`` (dense, or packed with ``extra`` scales and biases).

    Args:
        splits: key splits per (row, KV head, query); 1 is one launch.
        lanes: threads that read one key row (16 bytes each).
        extra, template: more inputs (a prefix's or the scales and biases) and
            template constants of the variant.
        prefix, quant: the variant (a prefix source; packed planes).
        new: ``(kn, vn)`` ``[B, H, N, D]``: the tokens of the last ``N`` columns
            ``[ends - N, ends)``, not yet in ``k``/``v``; the launch also returns
            ``k``/``v`` with them written (``copies`` blocks per row and head copy).
    """
    B, Hq, N, D = q.shape
    H = k.shape[1]
    rep = Hq // H
    NT = threads or THREADS
    while NT > 64 and (NT // lanes) * rep * D * 4 > _SMEM:  # the in-block combine must fit
        NT //= 2
    S = splits
    pf = PREFETCH if prefetch is None else prefetch
    fused = new is not None
    copies = copies if fused else 0
    blocks = (S + copies) * B * H  # grid x; MLX takes grids in threads, as int32s
    check(
        max(NT * blocks, D * B * Hq * N) < 2**31,
        "k",
        "fewer rows x heads (a launch grid holds at most 2^31 - 1 threads)",
        f"{B} x {H}",
    )
    launch = dict(
        inputs=[q, k, v, left_pad, ends, mx.array([scale], mx.float32), *(new or ()), *extra],
        template=[
            ("T", q.dtype),
            ("D", D),
            ("REP", rep),
            ("HKV", H),
            ("S", S),
            ("W", int(window)),
            ("NT", NT),
            ("U", unroll or (UNROLL_PACKED if quant else UNROLL)),
            *([] if quant else [("QB", 0)]),
            *template,
        ],
        grid=(NT * blocks, 1, N),  # rows in x: see _SPLIT_BODY
        threadgroup=(NT, 1, 1),
    )
    planes = [k.shape, v.shape] if fused else []
    if S == 1:  # one split: the split pass writes the output (one launch)
        out, *written = _split_kernel(prefix, True, quant, fused, pf)(
            **launch,
            output_shapes=[(B, Hq, N, D), *planes],
            output_dtypes=[q.dtype] + [k.dtype] * len(planes),
        )
        return (out, *written) if fused else out
    po, pm, pl, *written = _split_kernel(prefix, False, quant, fused, pf)(
        **launch,
        output_shapes=[(B, Hq, N, S, D), (B, Hq, N, S), (B, Hq, N, S), *planes],
        output_dtypes=[mx.float32, mx.float32, mx.float32] + [k.dtype] * len(planes),
    )
    (out,) = _merge_kernel()(
        inputs=[po, pm, pl],
        template=[("T", q.dtype), ("D", D), ("S", S)],
        grid=(D * B * Hq * N, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(B, Hq, N, D)],
        output_dtypes=[q.dtype],
    )
    return (out, *written) if fused else out


#: Bits per element the quantized read takes (each packs evenly into 16-byte loads).
QUANT_BITS = (4, 8)


def quantized_fits(q, keys, group_size: int, bits: int) -> bool:
    """Whether ``quantized_attention``'s kernel covers these shapes: ``kernel_fits``'s
    rules for the queries, ``bits`` in ``QUANT_BITS``, a key row a power-of-two
    number (<= 32) of 16-byte loads, each load inside one scale group."""
    D = q.shape[-1]
    lanes = D * bits // 128
    return (
        bits in QUANT_BITS
        and q.shape[0] > 0
        and 1 <= q.shape[2] <= MAX_QUERIES
        and (D * bits) % 128 == 0
        and 0 < lanes <= 32
        and lanes & (lanes - 1) == 0
        and group_size % (128 // bits) == 0
        and D % group_size == 0
        and q.shape[1] % keys[0].shape[1] == 0
        and keys[1].dtype == q.dtype
        and q.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


def quantized_attention(
    q,
    keys,
    values,
    left_pad,
    ends,
    *,
    scale: float,
    group_size: int,
    bits: int,
    window: int = 0,
    splits: int = 0,
    threads: int = 0,
    unroll: int = 0,
):
    """``ragged_attention`` over quantized planes, read packed.

    ``keys``/``values`` are ``(packed, scales, biases)`` triples as
    ``mx.quantize`` makes them, each ``[B, H, C, *]`` (``QuantizedState``'s
    planes); ``q`` ``[B, Hq, N, D]`` in the scales' dtype. Rows, queries and
    ``window`` as in ``ragged_attention``. On MLX's CUDA backend the split-K
    kernel reads the packed planes and dequantizes in registers (MLX 0.32.4's
    CUDA ``quantized_matmul`` fails for most KV shapes, so this is the
    quantized read there); elsewhere, and for shapes it does not cover, it is
    ``kvstate``'s stock quantized read (``quantized_matmul``) under a per-row
    mask. The kernel's result equals the dequantized planes' attention within
    float rounding, not bit for bit the stock quantized read's arithmetic.
    """
    B, Hq, N, D = q.shape
    H, C = keys[0].shape[1], keys[0].shape[2]
    if decode_read(N, q, keys, group_size=group_size, bits=bits) != "kernel":
        mask = rows_mask(N, left_pad, ends, C, window=window or None)
        return quantized_sdpa(
            q, keys, values, scale=scale, mask=mask, group_size=group_size, bits=bits
        )
    return _launch(
        q,
        keys[0],
        values[0],
        left_pad,
        ends,
        scale=scale,
        window=window,
        splits=splits or splits_for(B, H, C, N),
        lanes=D * bits // 128,
        threads=threads,
        unroll=unroll,
        extra=[keys[1], keys[2], values[1], values[2]],
        template=[("QB", bits), ("QGS", group_size)],
        quant=True,
    )


def folded_attention(q, k, v, scale: float, mask=None):
    """Grouped-query attention with each KV head's query heads folded into query rows.

    ``q`` ``[B, Hq, N, D]`` with ``Hq = G * H`` reads ``k``, ``v`` ``[B, H, C, D]``
    as ``[B, H, G * N, D]`` queries (query head ``h * G + g`` uses KV head
    ``h``, MLX's grouping), so the fused kernel sees one query head per KV
    head; a bool ``mask`` ``[B, 1, N, C]`` is repeated over the ``G`` groups
    (``"causal"`` is built as an array: its bottom-right rule does not
    survive folding). The result equals the stock read's; where it is
    faster was measured on the CPU and the H200 (``notes/kernels.md``).
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
