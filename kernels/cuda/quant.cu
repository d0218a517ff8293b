/* kernels/cuda/quant.cu — GGML block-quantized weights (Q8_0, Q4_0, Q4_K,
 * Q5_K, Q6_K) on the GPU: the decode-sized matmul, the dequantization of row
 * panels that feed cuBLAS for larger batches, and embedding rows.
 *
 * Every kernel reads an element through quant_elem, the block layouts of
 * kernels/cpu/quant.c element by element, with the same operations in the
 * same order as rk_dequantize (no contraction into FMAs), so a dequantized
 * weight has the bits the CPU reference gives it. The math after that is f32,
 * as in matvec.cu: activations are not quantized, unlike the CPU's int8 dot
 * products.
 *
 * Matrix-vector: one warp per row of w; lane l takes elements l, l + 32, ...
 * so a warp reads 32 consecutive elements per step (one Q8_0/Q4_0 block, an
 * eighth of a K-quant super-block), the block headers shared through L1. */
#include "kernels/cuda/cuda.h"

#define QV_WARPS 8

static __device__ __forceinline__ float half_at(const uint8_t *p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (unsigned)p[1] << 8)));
}

/* Elements and bytes per block of a quantized dtype. */
static __device__ __forceinline__ int block_elems(rk_dtype t) {
    return t == RK_DTYPE_Q8_0 || t == RK_DTYPE_Q4_0 ? 32 : 256;
}

static __device__ __forceinline__ int block_bytes(rk_dtype t) {
    switch (t) {
    case RK_DTYPE_Q8_0: return 34;
    case RK_DTYPE_Q4_0: return 18;
    case RK_DTYPE_Q4_K: return 144;
    case RK_DTYPE_Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}

/* Scale and min of sub-block j of a Q4_K/Q5_K super-block (12 packed bytes s). */
static __device__ __forceinline__ void kq_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* Element e (0 .. block_elems - 1) of block b, as rk_dequantize computes it. */
static __device__ __forceinline__ float block_elem(const uint8_t *b, rk_dtype t, int e) {
    switch (t) {
    case RK_DTYPE_Q8_0: return __fmul_rn(half_at(b), (float)(int8_t)b[2 + e]);
    case RK_DTYPE_Q4_0: {
        int q = e < 16 ? b[2 + e] & 15 : b[2 + e - 16] >> 4;
        return __fmul_rn(half_at(b), (float)(q - 8));
    }
    case RK_DTYPE_Q4_K:
    case RK_DTYPE_Q5_K: {
        int j = e >> 5, l = e & 31, sc, m;
        kq_scale_min(b + 4, j, &sc, &m);
        const uint8_t *qs = b + (t == RK_DTYPE_Q4_K ? 16 : 48);
        int v = (qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
        if (t == RK_DTYPE_Q5_K && (b[16 + l] >> j & 1)) v += 16;
        float ds = __fmul_rn(half_at(b), (float)sc), dm = __fmul_rn(half_at(b + 2), (float)m);
        return __fsub_rn(__fmul_rn(ds, (float)v), dm);
    }
    default: { /* Q6_K: ql[128] | qh[64] | i8 scales[16] | f16 d */
        int h = e >> 7, g = (e >> 5) & 3, l = e & 31;
        int lo = b[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1)) & 15;
        int hi = b[128 + 32 * h + l] >> (2 * g) & 3;
        float s = __fmul_rn(half_at(b + 208), (float)(int8_t)b[192 + e / 16]);
        return __fmul_rn(s, (float)((lo | hi << 4) - 32));
    }
    }
}

/* Element c of a row of the dtype. */
static __device__ __forceinline__ float quant_elem(const uint8_t *row, rk_dtype t, int c) {
    int be = block_elems(t);
    return block_elem(row + (size_t)(c / be) * block_bytes(t), t, c % be);
}

template <int NR>
__global__ void __launch_bounds__(QV_WARPS * 32)
    quant_matvec_kernel(float *__restrict__ y, const float *__restrict__ x,
                        const uint8_t *__restrict__ w, rk_dtype t, size_t row_bytes, int k, int m) {
    int row = blockIdx.x * QV_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= m) return;
    const uint8_t *wr = w + (size_t)row * row_bytes;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    for (int c = lane; c < k; c += 32) {
        float wv = quant_elem(wr, t, c);
#pragma unroll
        for (int r = 0; r < NR; r++) acc[r] = fmaf(x[(size_t)r * k + c], wv, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < NR; r++) {
        float v = rk_cu_warp_sum(acc[r]);
        if (lane == r) y[(size_t)r * m + row] = v;
    }
}

extern "C" cudaError_t rk_cuda_launch_matvec_quant(float *y, const float *x, const void *w,
                                                   rk_dtype wtype, size_t row_bytes, int n, int k,
                                                   int m, cudaStream_t s) {
    if (n <= 0 || m <= 0) return cudaSuccess;
    if (n > RK_CUDA_MATVEC_MAX_N) return cudaErrorInvalidValue;
    dim3 grid((unsigned)((m + QV_WARPS - 1) / QV_WARPS)), block(QV_WARPS * 32);
    const uint8_t *wb = (const uint8_t *)w;
    switch (n) {
    case 1: quant_matvec_kernel<1><<<grid, block, 0, s>>>(y, x, wb, wtype, row_bytes, k, m); break;
    case 2: quant_matvec_kernel<2><<<grid, block, 0, s>>>(y, x, wb, wtype, row_bytes, k, m); break;
    case 3: quant_matvec_kernel<3><<<grid, block, 0, s>>>(y, x, wb, wtype, row_bytes, k, m); break;
    case 4: quant_matvec_kernel<4><<<grid, block, 0, s>>>(y, x, wb, wtype, row_bytes, k, m); break;
    case 5: quant_matvec_kernel<5><<<grid, block, 0, s>>>(y, x, wb, wtype, row_bytes, k, m); break;
    case 6: quant_matvec_kernel<6><<<grid, block, 0, s>>>(y, x, wb, wtype, row_bytes, k, m); break;
    case 7: quant_matvec_kernel<7><<<grid, block, 0, s>>>(y, x, wb, wtype, row_bytes, k, m); break;
    default: quant_matvec_kernel<8><<<grid, block, 0, s>>>(y, x, wb, wtype, row_bytes, k, m); break;
    }
    return cudaGetLastError();
}

/* dst(n_rows, k) f32 = rows [0, n_rows) of w dequantized; one thread per element. */
__global__ void dequant_rows_kernel(float *__restrict__ dst, const uint8_t *__restrict__ w,
                                    rk_dtype t, size_t row_bytes, int k, size_t total) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    size_t row = i / (size_t)k;
    dst[i] = quant_elem(w + row * row_bytes, t, (int)(i - row * (size_t)k));
}

extern "C" cudaError_t rk_cuda_launch_dequant_rows(float *dst, const void *w, rk_dtype wtype,
                                                   size_t row_bytes, int n_rows, int k,
                                                   cudaStream_t s) {
    size_t total = (size_t)n_rows * (size_t)k;
    if (total == 0) return cudaSuccess;
    unsigned blocks = (unsigned)((total + 255) / 256);
    dequant_rows_kernel<<<blocks, 256, 0, s>>>(dst, (const uint8_t *)w, wtype, row_bytes, k, total);
    return cudaGetLastError();
}

/* One block per output row, as embed_kernel: out[r] = row ids[r] dequantized. */
__global__ void quant_embed_kernel(float *__restrict__ out, const uint8_t *__restrict__ table,
                                   rk_dtype t, size_t row_bytes, const int32_t *__restrict__ ids,
                                   int dim, int *err) {
    int r = blockIdx.x;
    int id = ids[r];
    if (id < 0) {
        if (threadIdx.x == 0) rk_cu_report(err, RK_CUDA_ERR_EMBED_ID, r, id, 0);
        return;
    }
    const uint8_t *row = table + (size_t)id * row_bytes;
    float *o = out + (size_t)r * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = quant_elem(row, t, j);
}

extern "C" cudaError_t rk_cuda_launch_embed_quant(float *out, const void *table, rk_dtype dtype,
                                                  size_t row_bytes, const int32_t *ids, int n,
                                                  int dim, int *err, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    int threads = dim < 256 ? 128 : 256;
    quant_embed_kernel<<<n, threads, 0, s>>>(out, (const uint8_t *)table, dtype, row_bytes, ids,
                                             dim, err);
    return cudaGetLastError();
}
