/* kernels/cuda/matvec.cu — the decode-sized matmul: y(n, m) = x(n, k) ·
 * w(m, k)^T for n <= RK_CUDA_MATVEC_MAX_N, weights F32, F16 or BF16, all math
 * in f32 (x is never rounded to the weight type, unlike the cuBLAS path).
 *
 * One warp per row of w: the row streams from memory once, 16 bytes per lane
 * per step (coalesced across the warp), and meets every row of x (read
 * through L1, shared by the warps of a block); each lane accumulates its
 * share of the n dot products, then a butterfly reduction gives the sums. */
#include "kernels/cuda/cuda.h"

#define MV_WARPS 8

/* Eight consecutive weights as f32 (p 16-byte aligned for the 2-byte types,
 * 32-byte steps of two 16-byte loads for f32). */
static __device__ __forceinline__ void load8(const float *p, float *o) {
    float4 a = __ldg((const float4 *)p), b = __ldg((const float4 *)p + 1);
    o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
}

static __device__ __forceinline__ void load8(const __half *p, float *o) {
    uint4 r = __ldg((const uint4 *)p);
    const __half2 *h = (const __half2 *)&r;
    for (int i = 0; i < 4; i++) {
        float2 f = __half22float2(h[i]);
        o[2 * i] = f.x;
        o[2 * i + 1] = f.y;
    }
}

static __device__ __forceinline__ void load8(const __nv_bfloat16 *p, float *o) {
    uint4 r = __ldg((const uint4 *)p);
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&r;
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(h[i]);
        o[2 * i] = f.x;
        o[2 * i + 1] = f.y;
    }
}

/* vec: k % 8 == 0 and x, w 16-byte aligned (every row then is too). */
template <typename T, int NR>
__global__ void __launch_bounds__(MV_WARPS * 32)
    matvec_kernel(float *__restrict__ y, const float *__restrict__ x, const T *__restrict__ w,
                  int k, int m, int vec) {
    int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= m) return;
    const T *wr = w + (size_t)row * k;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    if (vec) {
#pragma unroll 2
        for (int c = lane * 8; c < k; c += 256) {
            float wf[8];
            load8(wr + c, wf);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                const float4 *xp = (const float4 *)(x + (size_t)r * k + c);
                float4 a = __ldg(xp), b = __ldg(xp + 1);
                float s = acc[r];
                s = fmaf(a.x, wf[0], s);
                s = fmaf(a.y, wf[1], s);
                s = fmaf(a.z, wf[2], s);
                s = fmaf(a.w, wf[3], s);
                s = fmaf(b.x, wf[4], s);
                s = fmaf(b.y, wf[5], s);
                s = fmaf(b.z, wf[6], s);
                s = fmaf(b.w, wf[7], s);
                acc[r] = s;
            }
        }
    } else {
        for (int c = lane; c < k; c += 32) {
            float wv = rk_cu_f32(wr[c]);
#pragma unroll
            for (int r = 0; r < NR; r++) acc[r] = fmaf(x[(size_t)r * k + c], wv, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) {
        float v = rk_cu_warp_sum(acc[r]);
        if (lane == r) y[(size_t)r * m + row] = v;
    }
}

template <typename T>
static void matvec_dispatch(float *y, const float *x, const T *w, int n, int k, int m, int vec,
                            cudaStream_t s) {
    dim3 grid((unsigned)((m + MV_WARPS - 1) / MV_WARPS)), block(MV_WARPS * 32);
    switch (n) {
    case 1: matvec_kernel<T, 1><<<grid, block, 0, s>>>(y, x, w, k, m, vec); break;
    case 2: matvec_kernel<T, 2><<<grid, block, 0, s>>>(y, x, w, k, m, vec); break;
    case 3: matvec_kernel<T, 3><<<grid, block, 0, s>>>(y, x, w, k, m, vec); break;
    case 4: matvec_kernel<T, 4><<<grid, block, 0, s>>>(y, x, w, k, m, vec); break;
    case 5: matvec_kernel<T, 5><<<grid, block, 0, s>>>(y, x, w, k, m, vec); break;
    case 6: matvec_kernel<T, 6><<<grid, block, 0, s>>>(y, x, w, k, m, vec); break;
    case 7: matvec_kernel<T, 7><<<grid, block, 0, s>>>(y, x, w, k, m, vec); break;
    default: matvec_kernel<T, 8><<<grid, block, 0, s>>>(y, x, w, k, m, vec); break;
    }
}

extern "C" cudaError_t rk_cuda_launch_matvec(float *y, const float *x, const void *w,
                                             rk_dtype wtype, int n, int k, int m, cudaStream_t s) {
    if (n <= 0 || m <= 0) return cudaSuccess;
    if (n > RK_CUDA_MATVEC_MAX_N) return cudaErrorInvalidValue;
    int vec = k % 8 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0;
    switch (wtype) {
    case RK_DTYPE_F32: matvec_dispatch(y, x, (const float *)w, n, k, m, vec, s); break;
    case RK_DTYPE_F16: matvec_dispatch(y, x, (const __half *)w, n, k, m, vec, s); break;
    case RK_DTYPE_BF16: matvec_dispatch(y, x, (const __nv_bfloat16 *)w, n, k, m, vec, s); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
