/* kernels/cuda/attention.cu — causal GQA attention over the paged KV cache.
 *
 * The host (backend.c) cuts the batch into work units of one warp each: one
 * (sequence, kv head, up to RK_CUDA_ATTN_QV query vectors sharing that kv
 * head, kv partition). Prefill rows give many units; a decode row (or a
 * short prefill over a long context) is split along the kv range into
 * partitions so the GPU has enough warps, and a merge kernel combines the
 * partitions with their log-sum-exp (split-K).
 *
 * A warp walks its kv range in tiles of 32 entries. Per tile:
 *  - each lane looks up the slot of one entry in the block table (a bad block
 *    id is recorded in the error word and block 0 read instead, so memory
 *    stays in bounds; the op then fails at the next sync);
 *  - K of the tile is widened to f32 into the warp's shared memory (rows
 *    padded to head_dim + 1 floats: lane i reading row i hits bank i);
 *  - lane i computes the scores of entry i against the warp's query vectors
 *    (query vectors broadcast from shared memory), scaled (then soft-capped,
 *    cap * tanh(s / cap), when the params ask), masked causally in table
 *    order: query row j of a sequence sees entries 0 .. kv_len - n_q + j,
 *    with a sliding window only the last `window` of them (a tile or a whole
 *    partition before a vector's window gives it nothing: -inf scores, and
 *    the merge weighs such a partition by e^-inf = 0);
 *  - online softmax in f32: tile max and sum by warp reductions, rescale of
 *    the running sum and accumulators, p = exp(s - max);
 *  - P·V: lane i owns head dims [i * DPL, (i + 1) * DPL) and reads them of
 *    every entry's V row (one coalesced row per entry, vector loads).
 * Entries past a vector's causal limit contribute exactly zero, and entries
 * past the last visible one are never read.
 *
 * Segments (a sequence cut into runs, each from a block of its own and with a
 * position delta; see rk_attn_batch): the kernel's SEG instance walks a
 * unit's kv range run piece by run piece. Tiles restart at a run's first
 * entry, whose slot is looked up from the run's own table entries; entering a
 * run with delta d != 0 the unit's query vectors in shared memory are
 * replaced by the given ones rotated by -d (the run's cos/sin table, made on
 * the host like the CPU's), re-read from global memory each time so
 * rotations never compound; a run with delta 0 uses them as given. The
 * online softmax state carries across pieces and the causal limits stay in
 * table order, so a partition may span any number of runs. Batches without
 * segments run the other instance, whose single piece is the whole range. */
#include <string.h>

#include "kernels/cuda/cuda.h"

#define QV   RK_CUDA_ATTN_QV
#define TILE RK_CUDA_ATTN_TILE

/* Floats of shared memory one warp uses: K tile, query vectors, probabilities,
 * rounded up so every warp's slice stays 16-byte aligned. */
static __host__ __device__ __forceinline__ size_t warp_floats(int head_dim) {
    size_t hd4 = (size_t)(head_dim + 3) & ~(size_t)3;
    size_t f = (size_t)TILE * (head_dim + 1) + QV * hd4 + QV * TILE;
    return (f + 3) & ~(size_t)3;
}

extern "C" size_t rk_cuda_attn_warp_smem(int head_dim) {
    return warp_floats(head_dim) * sizeof(float);
}

/* N consecutive elements of a row as f32, p aligned to min(16, N * sizeof(T)). */
template <typename T, int N> static __device__ __forceinline__ void load_vec(const T *p, float *o) {
    constexpr int BYTES = N * (int)sizeof(T);
    if constexpr (BYTES >= 16) {
        constexpr int PER = 16 / (int)sizeof(T);
#pragma unroll
        for (int c = 0; c < BYTES / 16; c++) {
            uint4 r = __ldg((const uint4 *)p + c);
            T tmp[PER];
            memcpy(tmp, &r, 16);
#pragma unroll
            for (int e = 0; e < PER; e++) o[c * PER + e] = rk_cu_f32(tmp[e]);
        }
    } else if constexpr (BYTES == 8) {
        uint2 r = __ldg((const uint2 *)p);
        T tmp[N];
        memcpy(tmp, &r, 8);
#pragma unroll
        for (int e = 0; e < N; e++) o[e] = rk_cu_f32(tmp[e]);
    } else if constexpr (BYTES == 4) {
        unsigned r = __ldg((const unsigned *)p);
        T tmp[N];
        memcpy(tmp, &r, 4);
#pragma unroll
        for (int e = 0; e < N; e++) o[e] = rk_cu_f32(tmp[e]);
    } else {
        o[0] = rk_cu_f32(p[0]);
    }
}

/* Segments: the unit's nv query vectors into sQ (rows of hd4 floats, zero
 * past head_dim; the slots past nv stay as the kernel's start zeroed them):
 * as given when cs is NULL, else rotated with the angles of cs (cos of pair i
 * at cs[i], sin at cs[n_rot / 2 + i]) exactly as rk_cpu_rotate_head does,
 * uncontracted so the rounding is the CPU's. Each lane computes its own dims
 * from the query in global memory, which is never written, so rotations do
 * not compound and no barrier is needed between reads and writes. */
static __device__ __forceinline__ void load_query(float *sQ, const rk_cuda_attn_args &a,
                                                  const rk_cuda_attn_seq &sq,
                                                  const rk_cuda_attn_unit &u, int nv,
                                                  const float *cs, int lane) {
    const int hd = a.head_dim, hd4 = (hd + 3) & ~3, half = a.n_rot / 2;
    for (int v = 0; v < nv; v++) {
        float *dst = sQ + v * hd4;
        int j = u.j0 + v / u.n_g, hq = u.kv_head * a.group + u.g0 + v % u.n_g;
        const float *src = a.q + ((size_t)(sq.q_start + j) * a.n_heads + hq) * hd;
        for (int d = lane; d < hd4; d += 32) {
            float x = d < hd ? src[d] : 0.0f;
            if (cs && d < a.n_rot) {
                /* pair i rotates (i0, i1): (x0 c - x1 s, x0 s + x1 c) */
                int i = a.neox ? (d < half ? d : d - half) : d >> 1;
                int i0 = a.neox ? i : 2 * i, i1 = a.neox ? i + half : 2 * i + 1;
                float x0 = src[i0], x1 = src[i1], c = cs[i], sn = cs[half + i];
                x = d == i0 ? __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn))
                            : __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
            }
            dst[d] = x;
        }
    }
}

/* DPL: head dims per lane (a power of two, 32 * DPL >= head_dim). exact: head_dim
 * == 32 * DPL and the cache 16-byte aligned, so V rows load as vectors. SEG:
 * the batch has segments (a.runs), walked run piece by run piece. */
template <typename T, int DPL, bool SEG>
__global__ void __launch_bounds__(128) attn_kernel(const rk_cuda_attn_args a, int exact) {
    extern __shared__ float4 smem4[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int unit_id = blockIdx.x * (blockDim.x >> 5) + warp;
    if (unit_id >= a.n_units) return; /* no block-wide barrier below: leaving is safe */
    const int hd = a.head_dim, ks = hd + 1, hd4 = (hd + 3) & ~3;
    float *sK = (float *)smem4 + (size_t)warp * warp_floats(hd);
    float *sQ = sK + TILE * ks; // (QV, hd4)
    float *sP = sQ + QV * hd4;  // (QV, TILE)

    const rk_cuda_attn_unit u = a.units[unit_id];
    const rk_cuda_attn_seq sq = a.seqs[u.seq];
    const int nv = u.n_rows * u.n_g;

    int lim[QV]; /* visible entries of each vector (0 for an empty slot) */
    int lo[QV];  /* its first visible entry: 0, or with a window lim - window */
#pragma unroll
    for (int v = 0; v < QV; v++) {
        float *dst = sQ + v * hd4;
        if (v < nv) {
            int j = u.j0 + v / u.n_g, hq = u.kv_head * a.group + u.g0 + v % u.n_g;
            const float *src = a.q + ((size_t)(sq.q_start + j) * a.n_heads + hq) * hd;
            for (int d = lane; d < hd4; d += 32) dst[d] = d < hd ? src[d] : 0.0f;
            lim[v] = sq.kv_len - sq.n_q + j + 1;
        } else {
            for (int d = lane; d < hd4; d += 32) dst[d] = 0.0f;
            lim[v] = 0;
        }
        lo[v] = a.window > 0 && lim[v] > a.window ? lim[v] - a.window : 0;
    }
    const int lim_max = sq.kv_len - sq.n_q + u.j0 + u.n_rows;
    const int p0 = u.part * a.part_len;
    const int p1 = lim_max - p0 > a.part_len ? p0 + a.part_len : lim_max;

    float m[QV], l[QV], acc[QV][DPL];
#pragma unroll
    for (int v = 0; v < QV; v++) {
        m[v] = -INFINITY;
        l[v] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[v][i] = 0.0f;
    }
    const int32_t *trow = a.table + (size_t)u.seq * a.max_blocks;
    const size_t row_elems = (size_t)a.n_kv_heads * hd, head_off = (size_t)u.kv_head * hd;
    const T *kbase = (const T *)a.k + head_off, *vbase = (const T *)a.v + head_off;
    __syncwarp();

    /* SEG: the run the walk enters next (the first ending past p0) and
     * whether sQ holds rotated vectors */
    int run = 0, rotated = 0;
    if constexpr (SEG) {
        int hi = sq.n_runs - 1; /* the last run ends at kv_len >= p1 > p0 */
        while (run < hi) {
            int mid = (run + hi) >> 1;
            if (a.runs[sq.run0 + mid].end > p0)
                hi = mid;
            else
                run = mid + 1;
        }
    }
    for (int pa = p0; pa < p1;) {
        /* the piece [pa, pe): entry e at table entry tb + (e - rb) / block_size */
        int pe = p1, rb = 0;
        const int32_t *tb = trow;
        if constexpr (SEG) {
            const rk_cuda_attn_run r = a.runs[sq.run0 + run];
            rb = run > 0 ? a.runs[sq.run0 + run - 1].end : 0;
            pe = r.end < p1 ? r.end : p1;
            tb = trow + r.block;
            if (r.delta != 0 || rotated) { /* the last tile's reads of sQ are behind a barrier */
                const float *cs = r.delta ? a.run_cs + (size_t)(sq.run0 + run) * a.n_rot : nullptr;
                load_query(sQ, a, sq, u, nv, cs, lane);
                rotated = r.delta != 0;
            }
            run++;
        }
        for (int t0 = pa; t0 < pe; t0 += TILE) {
            const int nt = pe - t0 < TILE ? pe - t0 : TILE;
            long long slot = 0;
            if (lane < nt) {
                int key = t0 + lane - rb, b = key / a.block_size;
                int id = tb[b];
                if (id < 0 || id >= a.n_blocks) {
                    rk_cu_report(a.err, RK_CUDA_ERR_ATTN_BLOCK, u.seq, (int)(tb - trow) + b, id);
                    id = 0;
                }
                slot = (long long)id * a.block_size + (key - b * a.block_size);
            }
            /* K tile -> shared memory, f32 */
            for (int r = 0; r < nt; r++) {
                long long sr = __shfl_sync(RK_CUDA_FULL_MASK, slot, r);
                const T *kr = kbase + (size_t)sr * row_elems;
                for (int d = lane; d < hd; d += 32) sK[r * ks + d] = rk_cu_f32(kr[d]);
            }
            __syncwarp();

            /* scores of entry t0 + lane */
            float s[QV];
#pragma unroll
            for (int v = 0; v < QV; v++) s[v] = 0.0f;
            const float *kk = sK + lane * ks;
            if ((hd & 3) == 0) {
                for (int d = 0; d < hd; d += 4) {
                    float k0 = kk[d], k1 = kk[d + 1], k2 = kk[d + 2], k3 = kk[d + 3];
#pragma unroll
                    for (int v = 0; v < QV; v++) {
                        float4 q4 = *(const float4 *)(sQ + v * hd4 + d);
                        float t = s[v];
                        t = fmaf(q4.x, k0, t);
                        t = fmaf(q4.y, k1, t);
                        t = fmaf(q4.z, k2, t);
                        t = fmaf(q4.w, k3, t);
                        s[v] = t;
                    }
                }
            } else {
                for (int d = 0; d < hd; d++) {
                    float kd = kk[d];
#pragma unroll
                    for (int v = 0; v < QV; v++) s[v] = fmaf(sQ[v * hd4 + d], kd, s[v]);
                }
            }

            /* online softmax */
#pragma unroll
            for (int v = 0; v < QV; v++) {
                float sv = s[v] * a.scale;
                if (a.softcap > 0.0f) sv = a.softcap * tanhf(sv / a.softcap);
                if (!(lane < nt && t0 + lane < lim[v] && t0 + lane >= lo[v])) sv = -INFINITY;
                float m_new = fmaxf(m[v], rk_cu_warp_max(sv));
                float alpha = 1.0f, p = 0.0f;
                if (m_new != -INFINITY) {
                    alpha = expf(m[v] - m_new); /* 0 on the first visible tile */
                    p = expf(sv - m_new);
                }
                l[v] = l[v] * alpha + rk_cu_warp_sum(p);
                m[v] = m_new;
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[v][i] *= alpha;
                sP[v * TILE + lane] = p;
            }
            __syncwarp();

            /* P·V */
            for (int r = 0; r < nt; r++) {
                long long sr = __shfl_sync(RK_CUDA_FULL_MASK, slot, r);
                const T *vr = vbase + (size_t)sr * row_elems;
                float vv[DPL];
                if (exact) {
                    load_vec<T, DPL>(vr + lane * DPL, vv);
                } else {
#pragma unroll
                    for (int i = 0; i < DPL; i++) {
                        int d = lane * DPL + i;
                        vv[i] = d < hd ? rk_cu_f32(vr[d]) : 0.0f;
                    }
                }
#pragma unroll
                for (int v = 0; v < QV; v++) {
                    float p = sP[v * TILE + r];
#pragma unroll
                    for (int i = 0; i < DPL; i++) acc[v][i] = fmaf(p, vv[i], acc[v][i]);
                }
            }
            __syncwarp(); /* the next tile overwrites sK and sP (and a run entry sQ) */
        }
        pa = pe;
    }

    /* results: final output when the vector's range is one partition,
     * otherwise this partition's (max, sum, accumulator) for the merge */
#pragma unroll
    for (int v = 0; v < QV; v++) {
        if (v >= nv) continue;
        int n_parts = lim[v] <= a.part_len ? 1 : (lim[v] + a.part_len - 1) / a.part_len;
        if (u.part >= n_parts) continue; /* nothing of this vector lies here */
        int j = u.j0 + v / u.n_g, hq = u.kv_head * a.group + u.g0 + v % u.n_g;
        size_t qi = (size_t)(sq.q_start + j) * a.n_heads + hq;
        float *o;
        if (n_parts == 1) {
            o = a.out + qi * hd;
            if (a.lse && lane == 0) a.lse[qi] = m[v] + logf(l[v]);
        } else {
            float *rec = a.partials + sq.pbase +
                         ((size_t)(j * a.n_heads + hq) * sq.n_parts + u.part) * (size_t)(hd + 2);
            if (lane == 0) {
                rec[0] = m[v];
                rec[1] = l[v];
            }
            o = rec + 2;
        }
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            int d = lane * DPL + i;
            if (d < hd) o[d] = n_parts == 1 ? acc[v][i] / l[v] : acc[v][i];
        }
    }
}

/* Raise a kernel's dynamic shared memory limit once, to the largest asked. */
template <typename T, int DPL, bool SEG> static cudaError_t ensure_smem(size_t bytes) {
    static size_t set = 48 * 1024;
    if (bytes <= set) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(attn_kernel<T, DPL, SEG>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e == cudaSuccess) set = bytes;
    return e;
}

template <typename T, int DPL, bool SEG>
static cudaError_t attn_launch(const rk_cuda_attn_args *a, int wpc, int exact, cudaStream_t s) {
    size_t smem = (size_t)wpc * rk_cuda_attn_warp_smem(a->head_dim);
    cudaError_t e = ensure_smem<T, DPL, SEG>(smem);
    if (e != cudaSuccess) return e;
    unsigned blocks = (unsigned)((a->n_units + wpc - 1) / wpc);
    attn_kernel<T, DPL, SEG><<<blocks, wpc * 32, smem, s>>>(*a, exact);
    return cudaGetLastError();
}

template <typename T, bool SEG>
static cudaError_t attn_dispatch_dpl(const rk_cuda_attn_args *a, int wpc, int dpl, int exact,
                                     cudaStream_t s) {
    switch (dpl) {
    case 1: return attn_launch<T, 1, SEG>(a, wpc, exact, s);
    case 2: return attn_launch<T, 2, SEG>(a, wpc, exact, s);
    case 4: return attn_launch<T, 4, SEG>(a, wpc, exact, s);
    case 8: return attn_launch<T, 8, SEG>(a, wpc, exact, s);
    case 16: return attn_launch<T, 16, SEG>(a, wpc, exact, s);
    default: return cudaErrorInvalidValue; /* head_dim > 512 */
    }
}

template <typename T>
static cudaError_t attn_dispatch(const rk_cuda_attn_args *a, int wpc, cudaStream_t s) {
    int hd = a->head_dim, dpl = 1;
    while (dpl * 32 < hd) dpl *= 2;
    int exact = hd == 32 * dpl && ((uintptr_t)a->k & 15) == 0 && ((uintptr_t)a->v & 15) == 0;
    if (a->runs) return attn_dispatch_dpl<T, true>(a, wpc, dpl, exact, s);
    return attn_dispatch_dpl<T, false>(a, wpc, dpl, exact, s);
}

extern "C" cudaError_t rk_cuda_launch_attention(const rk_cuda_attn_args *a, rk_dtype dtype,
                                                int warps_per_block, cudaStream_t s) {
    if (a->n_units <= 0) return cudaSuccess;
    if (warps_per_block < 1 || warps_per_block > 4) return cudaErrorInvalidValue;
    switch (dtype) {
    case RK_DTYPE_F32: return attn_dispatch<float>(a, warps_per_block, s);
    case RK_DTYPE_F16: return attn_dispatch<__half>(a, warps_per_block, s);
    case RK_DTYPE_BF16: return attn_dispatch<__nv_bfloat16>(a, warps_per_block, s);
    default: return cudaErrorInvalidValue;
    }
}

/* ---------------------------------------------------------------- merge */

/* One warp per query vector: out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M)
 * with M the largest partition max, lse = M + ln(sum). */
__global__ void attn_merge_kernel(const rk_cuda_attn_merge *__restrict__ items, int n_items,
                                  const float *__restrict__ partials, float *out, float *lse,
                                  int head_dim) {
    int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (w >= n_items) return;
    const rk_cuda_attn_merge it = items[w];
    const float *rec = partials + it.pbase;
    const size_t stride = (size_t)head_dim + 2;
    float M = -INFINITY;
    for (int p = 0; p < it.n_parts; p++) M = fmaxf(M, rec[p * stride]);
    float S = 0.0f;
    for (int p = 0; p < it.n_parts; p++) S += rec[p * stride + 1] * expf(rec[p * stride] - M);
    float *o = out + (size_t)it.qi * head_dim;
    for (int d = lane; d < head_dim; d += 32) {
        float acc = 0.0f;
        for (int p = 0; p < it.n_parts; p++)
            acc += rec[p * stride + 2 + d] * expf(rec[p * stride] - M);
        o[d] = acc / S;
    }
    if (lse && lane == 0) lse[it.qi] = M + logf(S);
}

extern "C" cudaError_t rk_cuda_launch_attn_merge(const rk_cuda_attn_merge *items, int n_items,
                                                 const float *partials, float *out, float *lse,
                                                 int head_dim, cudaStream_t s) {
    if (n_items <= 0) return cudaSuccess;
    int warps = 4;
    attn_merge_kernel<<<(n_items + warps - 1) / warps, warps * 32, 0, s>>>(items, n_items, partials,
                                                                           out, lse, head_dim);
    return cudaGetLastError();
}
