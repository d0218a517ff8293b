/* kernels/cuda/kvops.cu — writes into the paged KV cache on the GPU:
 * kv_write (two passes: check the slots, then convert and store) and
 * rope_shift_copy (every layer in one launch).
 *
 * kv_write's slots are device memory, so they are checked on the device. The
 * first pass marks every slot in a bitmap (one bit per cache slot) and flags
 * a slot past the cache or one named twice; the second pass clears the bits
 * again (the bitmap is all zero between calls) and writes nothing when the
 * first pass flagged this call, so a failed call leaves the cache as it was,
 * as on the CPU. The error surfaces at the next sync or download. */
#include "kernels/cuda/cuda.h"

/* ---------------------------------------------------------------- kv_write */

__global__ void kv_check_kernel(const int32_t *__restrict__ slots, int n_tokens, int64_t total,
                                unsigned *bits, unsigned *bad, unsigned gen, int *err) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < n_tokens; t += gridDim.x * blockDim.x) {
        int32_t sl = slots[t];
        if (sl < 0) continue;
        if ((int64_t)sl >= total) {
            *bad = gen;
            rk_cu_report(err, RK_CUDA_ERR_KV_SLOT, t, sl,
                         total > INT32_MAX ? INT32_MAX : (int)total);
            continue;
        }
        unsigned bit = 1u << (sl & 31);
        if (atomicOr(bits + (sl >> 5), bit) & bit) {
            *bad = gen;
            rk_cu_report(err, RK_CUDA_ERR_KV_DUP, t, sl, 0);
        }
    }
}

extern "C" cudaError_t rk_cuda_launch_kv_check(const int32_t *slots, int n_tokens, int64_t total,
                                               unsigned *bits, unsigned *bad, unsigned gen,
                                               int *err, cudaStream_t s) {
    if (n_tokens <= 0) return cudaSuccess;
    int blocks = (n_tokens + 255) / 256;
    kv_check_kernel<<<blocks, 256, 0, s>>>(slots, n_tokens, total, bits, bad, gen, err);
    return cudaGetLastError();
}

/* One block per token. */
template <typename T>
__global__ void kv_write_kernel(T *k_layer, T *v_layer, const float *__restrict__ k,
                                const float *__restrict__ v, const int32_t *__restrict__ slots,
                                int row, int64_t total, unsigned *bits, const unsigned *bad,
                                unsigned gen) {
    int t = blockIdx.x;
    int32_t sl = slots[t];
    if (sl < 0 || (int64_t)sl >= total) return;
    int flagged = *(const volatile unsigned *)bad == gen;
    if (threadIdx.x == 0) atomicAnd(bits + (sl >> 5), ~(1u << (sl & 31)));
    if (flagged) return;
    const float *ks = k + (size_t)t * row, *vs = v + (size_t)t * row;
    T *kd = k_layer + (size_t)sl * row, *vd = v_layer + (size_t)sl * row;
    for (int j = threadIdx.x; j < row; j += blockDim.x) {
        rk_cu_store(kd + j, ks[j]);
        rk_cu_store(vd + j, vs[j]);
    }
}

extern "C" cudaError_t rk_cuda_launch_kv_write(void *k_layer, void *v_layer, rk_dtype dtype,
                                               const float *k, const float *v, const int32_t *slots,
                                               int n_tokens, int row, int64_t total, unsigned *bits,
                                               const unsigned *bad, unsigned gen, cudaStream_t s) {
    if (n_tokens <= 0) return cudaSuccess;
    int threads = row >= 256 ? 256 : 128;
    switch (dtype) {
    case RK_DTYPE_F32:
        kv_write_kernel<<<n_tokens, threads, 0, s>>>((float *)k_layer, (float *)v_layer, k, v,
                                                     slots, row, total, bits, bad, gen);
        break;
    case RK_DTYPE_F16:
        kv_write_kernel<<<n_tokens, threads, 0, s>>>((__half *)k_layer, (__half *)v_layer, k, v,
                                                     slots, row, total, bits, bad, gen);
        break;
    case RK_DTYPE_BF16:
        kv_write_kernel<<<n_tokens, threads, 0, s>>>((__nv_bfloat16 *)k_layer,
                                                     (__nv_bfloat16 *)v_layer, k, v, slots, row,
                                                     total, bits, bad, gen);
        break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

/* ---------------------------------------------------------------- rope_shift_copy */

/* One block per (token, layer): K[dst] = R(delta) K[src] with angles
 * (float)delta * freq[i] and no mscale (a shift composes rotations; the
 * cached K carries mscale once), rounded like the CPU (uncontracted); dims
 * past n_rot and all of V are copied as they are. Slots were checked on the
 * host: in range, destinations distinct, no destination a source. */
template <typename T>
__global__ void shift_kernel(void *const *layers, int n_layers, const int32_t *__restrict__ idx,
                             int n_tokens, int n_kv_heads, int head_dim, rk_rope r) {
    __shared__ float cs[RK_ROPE_MAX_PAIRS], sn[RK_ROPE_MAX_PAIRS];
    int t = blockIdx.x, l = blockIdx.y, n_half = r.n_rot / 2;
    int32_t src = idx[t], dst = idx[n_tokens + t], delta = idx[2 * n_tokens + t];
    float fd = (float)delta;
    for (int i = threadIdx.x; i < n_half; i += blockDim.x) {
        float sa, ca;
        sincosf(__fmul_rn(fd, r.freq[i]), &sa, &ca);
        cs[i] = ca;
        sn[i] = sa;
    }
    __syncthreads();
    size_t row = (size_t)n_kv_heads * head_dim;
    const T *ks = (const T *)layers[l] + (size_t)src * row;
    T *kd = (T *)layers[l] + (size_t)dst * row;
    const T *vs = (const T *)layers[n_layers + l] + (size_t)src * row;
    T *vd = (T *)layers[n_layers + l] + (size_t)dst * row;
    for (int p = threadIdx.x; p < n_kv_heads * n_half; p += blockDim.x) {
        int h = p / n_half, i = p - h * n_half;
        int i0 = r.pairing == RK_ROPE_NEOX ? i : 2 * i;
        int i1 = r.pairing == RK_ROPE_NEOX ? i + n_half : 2 * i + 1;
        size_t o = (size_t)h * head_dim;
        float x0 = rk_cu_f32(ks[o + i0]), x1 = rk_cu_f32(ks[o + i1]), c = cs[i], sv = sn[i];
        rk_cu_store(kd + o + i0, __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sv)));
        rk_cu_store(kd + o + i1, __fadd_rn(__fmul_rn(x0, sv), __fmul_rn(x1, c)));
    }
    int tail = head_dim - r.n_rot;
    for (int p = threadIdx.x; p < n_kv_heads * tail; p += blockDim.x) {
        int h = p / tail;
        size_t o = (size_t)h * head_dim + r.n_rot + (p - h * tail);
        kd[o] = ks[o];
    }
    for (size_t j = threadIdx.x; j < row; j += blockDim.x) vd[j] = vs[j];
}

extern "C" cudaError_t rk_cuda_launch_shift(void *const *layers, int n_layers, rk_dtype dtype,
                                            const int32_t *idx, int n_tokens, int n_kv_heads,
                                            int head_dim, const rk_rope *rope, cudaStream_t s) {
    if (n_tokens <= 0 || n_layers <= 0) return cudaSuccess;
    if (n_layers > 65535) return cudaErrorInvalidValue;
    dim3 grid((unsigned)n_tokens, (unsigned)n_layers);
    switch (dtype) {
    case RK_DTYPE_F32:
        shift_kernel<float>
            <<<grid, 128, 0, s>>>(layers, n_layers, idx, n_tokens, n_kv_heads, head_dim, *rope);
        break;
    case RK_DTYPE_F16:
        shift_kernel<__half>
            <<<grid, 128, 0, s>>>(layers, n_layers, idx, n_tokens, n_kv_heads, head_dim, *rope);
        break;
    case RK_DTYPE_BF16:
        shift_kernel<__nv_bfloat16>
            <<<grid, 128, 0, s>>>(layers, n_layers, idx, n_tokens, n_kv_heads, head_dim, *rope);
        break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
