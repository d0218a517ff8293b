/* kernels/cuda/elementwise.cu — the row-wise and element-wise ops of the CUDA
 * backend: embed, rmsnorm, rope, swiglu, add, add_bias and the f32 -> f16/bf16
 * split the cuBLAS matmul path uses. Every kernel matches its CPU op in
 * kernels/cpu/backend.c: the same formula in f32, the same operation order
 * where rounding would otherwise differ (rope uses uncontracted multiplies so
 * it rounds like the CPU). */
#include "kernels/cuda/cuda.h"

#define EW_THREADS    256
#define EW_MAX_BLOCKS 4096 /* grid-stride loops cover the rest */

static unsigned ew_blocks(size_t n) {
    size_t b = (n + EW_THREADS - 1) / EW_THREADS;
    return (unsigned)(b < EW_MAX_BLOCKS ? (b ? b : 1) : EW_MAX_BLOCKS);
}

/* ---------------------------------------------------------------- embed */

/* One block per output row: out[r] = table[ids[r]] widened to f32. A negative
 * id is recorded in the error word and its row left unwritten. */
template <typename T>
__global__ void embed_kernel(float *__restrict__ out, const T *__restrict__ table,
                             const int32_t *__restrict__ ids, int dim, int *err) {
    int r = blockIdx.x;
    int id = ids[r];
    if (id < 0) {
        if (threadIdx.x == 0) rk_cu_report(err, RK_CUDA_ERR_EMBED_ID, r, id, 0);
        return;
    }
    const T *row = table + (size_t)id * dim;
    float *o = out + (size_t)r * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = rk_cu_f32(row[j]);
}

extern "C" cudaError_t rk_cuda_launch_embed(float *out, const void *table, rk_dtype dtype,
                                            const int32_t *ids, int n, int dim, int *err,
                                            cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    int threads = dim < 256 ? 128 : 256;
    switch (dtype) {
    case RK_DTYPE_F32:
        embed_kernel<<<n, threads, 0, s>>>(out, (const float *)table, ids, dim, err);
        break;
    case RK_DTYPE_F16:
        embed_kernel<<<n, threads, 0, s>>>(out, (const __half *)table, ids, dim, err);
        break;
    case RK_DTYPE_BF16:
        embed_kernel<<<n, threads, 0, s>>>(out, (const __nv_bfloat16 *)table, ids, dim, err);
        break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

/* ---------------------------------------------------------------- rmsnorm */

/* out = x / sqrt(mean(x^2) + eps) * w per row; out may equal x (every element
 * is read by the thread that writes it, after the reduction). */

/* One warp per row, for rows of up to 1024 elements. */
__global__ void rmsnorm_warp_kernel(float *out, const float *x, const float *__restrict__ w,
                                    int rows, int dim, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *xr = x + (size_t)row * dim;
    float *o = out + (size_t)row * dim;
    float ss = 0.0f;
    for (int j = lane; j < dim; j += 32) ss += xr[j] * xr[j];
    ss = rk_cu_warp_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int j = lane; j < dim; j += 32) o[j] = xr[j] * inv * w[j];
}

/* One block per row, for longer rows. */
__global__ void rmsnorm_block_kernel(float *out, const float *x, const float *__restrict__ w,
                                     int dim, float eps) {
    __shared__ float partial[32];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *o = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) ss += xr[j] * xr[j];
    ss = rk_cu_warp_sum(ss);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float t = lane < n_warps ? partial[lane] : 0.0f;
        t = rk_cu_warp_sum(t);
        if (lane == 0) partial[0] = t;
    }
    __syncthreads();
    float inv = 1.0f / sqrtf(partial[0] / (float)dim + eps);
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = xr[j] * inv * w[j];
}

extern "C" cudaError_t rk_cuda_launch_rmsnorm(float *out, const float *x, const float *w, int rows,
                                              int dim, float eps, cudaStream_t s) {
    if (rows <= 0) return cudaSuccess;
    if (dim <= 1024) {
        int warps = 8;
        rmsnorm_warp_kernel<<<(rows + warps - 1) / warps, warps * 32, 0, s>>>(out, x, w, rows, dim,
                                                                              eps);
    } else {
        rmsnorm_block_kernel<<<rows, 512, 0, s>>>(out, x, w, dim, eps);
    }
    return cudaGetLastError();
}

/* ---------------------------------------------------------------- rope */

/* The pair (i0, i1) that pair i of a head rotates. */
static __device__ __forceinline__ void rope_pair(int i, int n_half, int pairing, int *i0, int *i1) {
    if (pairing == RK_ROPE_NEOX) {
        *i0 = i;
        *i1 = i + n_half;
    } else {
        *i0 = 2 * i;
        *i1 = 2 * i + 1;
    }
}

/* One block per token: the angles (float)pos * freq[i] once per pair in
 * shared memory (cos and sin times mscale), then every head's pairs:
 * (x0, x1) -> (x0 c - x1 s, x0 s + x1 c), uncontracted like the CPU. */
__global__ void rope_kernel(float *x, const int32_t *__restrict__ pos, int n_heads, int head_dim,
                            rk_rope r) {
    __shared__ float cs[RK_ROPE_MAX_PAIRS], sn[RK_ROPE_MAX_PAIRS];
    int t = blockIdx.x, n_half = r.n_rot / 2;
    float fp = (float)pos[t];
    for (int i = threadIdx.x; i < n_half; i += blockDim.x) {
        float sa, ca;
        sincosf(__fmul_rn(fp, r.freq[i]), &sa, &ca);
        cs[i] = __fmul_rn(ca, r.mscale);
        sn[i] = __fmul_rn(sa, r.mscale);
    }
    __syncthreads();
    float *xt = x + (size_t)t * n_heads * head_dim;
    for (int p = threadIdx.x; p < n_heads * n_half; p += blockDim.x) {
        int h = p / n_half, i = p - h * n_half, i0, i1;
        rope_pair(i, n_half, r.pairing, &i0, &i1);
        float *xh = xt + (size_t)h * head_dim;
        float x0 = xh[i0], x1 = xh[i1], c = cs[i], sv = sn[i];
        xh[i0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sv));
        xh[i1] = __fadd_rn(__fmul_rn(x0, sv), __fmul_rn(x1, c));
    }
}

extern "C" cudaError_t rk_cuda_launch_rope(float *x, const int32_t *pos, int n_tokens, int n_heads,
                                           int head_dim, const rk_rope *rope, cudaStream_t s) {
    if (n_tokens <= 0) return cudaSuccess;
    rope_kernel<<<n_tokens, 128, 0, s>>>(x, pos, n_heads, head_dim, *rope);
    return cudaGetLastError();
}

/* ---------------------------------------------------------------- swiglu, add, bias */

__global__ void swiglu_kernel(float *out, const float *gate, const float *up, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

extern "C" cudaError_t rk_cuda_launch_swiglu(float *out, const float *gate, const float *up,
                                             size_t n, cudaStream_t s) {
    if (n == 0) return cudaSuccess;
    swiglu_kernel<<<ew_blocks(n), EW_THREADS, 0, s>>>(out, gate, up, n);
    return cudaGetLastError();
}

/* The CPU's formula (kernels/cpu/backend.c), in f32 with round-to-nearest
 * products; tanhf may differ from the host's in the last bits. */
__global__ void geglu_kernel(float *out, const float *gate, const float *up, size_t n) {
    const float c = 0.79788456080286535588f; /* sqrt(2 / pi) */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = 0.5f * g * (1.0f + tanhf(c * g * (1.0f + 0.044715f * g * g))) * up[i];
    }
}

extern "C" cudaError_t rk_cuda_launch_geglu(float *out, const float *gate, const float *up,
                                            size_t n, cudaStream_t s) {
    if (n == 0) return cudaSuccess;
    geglu_kernel<<<ew_blocks(n), EW_THREADS, 0, s>>>(out, gate, up, n);
    return cudaGetLastError();
}

__global__ void scale_kernel(float *x, float v, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] *= v;
}

extern "C" cudaError_t rk_cuda_launch_scale(float *x, float v, size_t n, cudaStream_t s) {
    if (n == 0) return cudaSuccess;
    scale_kernel<<<ew_blocks(n), EW_THREADS, 0, s>>>(x, v, n);
    return cudaGetLastError();
}

__global__ void add_kernel(float *y, const float *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

extern "C" cudaError_t rk_cuda_launch_add(float *y, const float *x, size_t n, cudaStream_t s) {
    if (n == 0) return cudaSuccess;
    add_kernel<<<ew_blocks(n), EW_THREADS, 0, s>>>(y, x, n);
    return cudaGetLastError();
}

__global__ void add_bias_kernel(float *y, const float *__restrict__ b, size_t total, int m) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += b[i % (size_t)m];
}

extern "C" cudaError_t rk_cuda_launch_add_bias(float *y, const float *b, int n, int m,
                                               cudaStream_t s) {
    if (n <= 0 || m <= 0) return cudaSuccess;
    size_t total = (size_t)n * (size_t)m;
    add_bias_kernel<<<ew_blocks(total), EW_THREADS, 0, s>>>(y, b, total, m);
    return cudaGetLastError();
}

/* ---------------------------------------------------------------- conversion */

/* x = hi + lo in the narrow type: hi(n) = round(x), lo(n) = round(x - hi), so
 * hi + lo carries about twice the narrow type's mantissa (16 bits for bf16,
 * 22 for f16): two GEMMs over hi and lo give nearly f32 activations. */
template <typename T> __global__ void split_kernel(T *hi, T *lo, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float x = src[i];
        T h;
        rk_cu_store(&h, x);
        hi[i] = h;
        rk_cu_store(lo + i, x - rk_cu_f32(h)); /* exact in f32: h is x rounded */
    }
}

extern "C" cudaError_t rk_cuda_launch_split(void *hi, void *lo, rk_dtype dtype, const float *src,
                                            size_t n, cudaStream_t s) {
    if (n == 0) return cudaSuccess;
    switch (dtype) {
    case RK_DTYPE_F16:
        split_kernel<<<ew_blocks(n), EW_THREADS, 0, s>>>((__half *)hi, (__half *)lo, src, n);
        break;
    case RK_DTYPE_BF16:
        split_kernel<<<ew_blocks(n), EW_THREADS, 0, s>>>((__nv_bfloat16 *)hi, (__nv_bfloat16 *)lo,
                                                         src, n);
        break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
