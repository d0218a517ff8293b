/* kernels/cuda/backend.c — the CUDA backend: creation, device memory, the
 * stream, cuBLAS matmul, the argument checks of every op (the same checks,
 * and the same messages, as the CPU backend) and the launch plans. The
 * kernels live in the .cu files of this folder (see cuda.h).
 *
 * Ordering: every op is enqueued on the backend's one stream, so ops run in
 * call order; only download() and sync() wait for the GPU (and check mode,
 * which waits after every launch). Host arrays an op takes (attention's
 * q_start, kv_len and segments, rope_shift_copy's slot arrays) are read
 * before the op returns; uploads from pageable memory are staged before
 * cudaMemcpyAsync returns, and uploads from pinned memory are waited for, so
 * the caller may reuse any host buffer as soon as an op returns. */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda.h"

/* ---------------------------------------------------------------- state */

typedef struct dbuf {
    void *p; /* device memory */
    size_t cap;
} dbuf;

typedef struct rk_cuda {
    int n_sm;
    size_t smem_optin; /* shared memory a block may opt into */
    cudaStream_t stream;
    cublasHandle_t blas;
    int check;
    int force_part;   /* attention partition length: 0 automatic, < 0 never split */
    int *err_dev;     /* (4) device error word: code, three details */
    unsigned *kv_bad; /* device word: generation of the last kv_write that failed its check */
    int *err_host;    /* (4) pinned copy of the error word */
    unsigned kv_gen;
    dbuf bits;     /* kv_write: one bit per cache slot, all zero between calls */
    dbuf xconv;    /* matmul: x split into hi and lo of the weight type, (2, n, k) */
    dbuf wpanel;   /* matmul: a panel of quantized weight rows dequantized to f32 */
    dbuf shift;    /* rope_shift_copy: (2 * n_layers) layer pointers, then (3, n_tokens) ints */
    dbuf plan;     /* attention: sequences, units, merges */
    dbuf partials; /* attention: split-K partial results */
    /* The attention plan of the last call, reused while its inputs repeat
     * (every layer of a forward pass has the same batch). */
    int32_t *plan_key; /* (plan_key_len) the inputs the plan was built from */
    size_t plan_key_len, plan_key_cap;
    int32_t *plan_next; /* the key of the current call, compared with plan_key */
    size_t plan_next_cap;
    int plan_ok, plan_units, plan_merges, plan_part_len, plan_wpc;
    int plan_runs, plan_n_rot, plan_neox; /* segments: runs in all (0: none), the rope's */
    size_t plan_units_off, plan_merges_off, plan_runs_off, plan_cs_off, plan_partials;
    unsigned char *host; /* host scratch: checks and staging */
    size_t host_cap;
} rk_cuda;

static rk_cuda *cu_of(rk_backend *be) { return (rk_cuda *)be->impl; }

/* ---------------------------------------------------------------- errors */

static rk_status cu_fail(cudaError_t e, const char *what) {
    return rk_errorf(RK_ERR_DEVICE, "cuda: %s: %s (%s)", what, cudaGetErrorString(e),
                     cudaGetErrorName(e));
}

static rk_status blas_fail(cublasStatus_t st, const char *what) {
    return rk_errorf(RK_ERR_DEVICE, "cuda: %s: cuBLAS %s (%s)", what, cublasGetStatusString(st),
                     cublasGetStatusName(st));
}

#define CU(call, what)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return cu_fail(e_, what);                                           \
    } while (0)

/* Turn a device error word into a status and message, and clear it. Call
 * only after the stream was synchronized with err_host copied. */
static rk_status take_device_error(rk_cuda *cu) {
    int code = cu->err_host[0], a = cu->err_host[1], b = cu->err_host[2], c = cu->err_host[3];
    if (code == RK_CUDA_ERR_NONE) return RK_OK;
    memset(cu->err_host, 0, 4 * sizeof(int));
    cudaError_t e = cudaMemsetAsync(cu->err_dev, 0, 4 * sizeof(int), cu->stream);
    if (e != cudaSuccess) return cu_fail(e, "clearing the device error word");
    switch (code) {
    case RK_CUDA_ERR_KV_SLOT:
        return rk_errorf(RK_ERR_INVALID,
                         "kv_write: token %d slot %d out of range [0, %d) (found on the device)", a,
                         b, c);
    case RK_CUDA_ERR_KV_DUP:
        return rk_errorf(RK_ERR_INVALID, "kv_write: slot %d is written twice (found on the device)",
                         b);
    case RK_CUDA_ERR_ATTN_BLOCK:
        return rk_errorf(
            RK_ERR_INVALID,
            "attention: sequence %d block %d is %d, out of range (found on the device)", a, b, c);
    case RK_CUDA_ERR_EMBED_ID:
        return rk_errorf(RK_ERR_INVALID, "embed: token id %d < 0 (row %d, found on the device)", b,
                         a);
    default:
        return rk_errorf(RK_ERR_INTERNAL, "cuda: unknown device error code %d (%d, %d, %d)", code,
                         a, b, c);
    }
}

/* Wait for the stream, then report the first device-side error, if any. */
static rk_status sync_and_check(rk_cuda *cu, const char *what) {
    CU(cudaMemcpyAsync(cu->err_host, cu->err_dev, 4 * sizeof(int), cudaMemcpyDeviceToHost,
                       cu->stream),
       what);
    CU(cudaStreamSynchronize(cu->stream), what);
    return take_device_error(cu);
}

/* After the launches of an op: a launch error fails it; check mode also
 * waits and reports device-side errors. */
static rk_status launched(rk_cuda *cu, cudaError_t e, const char *what) {
    if (e != cudaSuccess) return cu_fail(e, what);
    if (cu->check) return sync_and_check(cu, what);
    return RK_OK;
}

/* ---------------------------------------------------------------- memory */

static rk_status dev_malloc(size_t n_bytes, void **out, const char *what) {
    size_t n = n_bytes ? n_bytes : 1;
    *out = NULL;
    cudaError_t e = cudaMalloc(out, n);
    if (e == cudaSuccess) return RK_OK;
    *out = NULL;
    (void)cudaGetLastError(); /* an allocation failure is not sticky: clear it */
    if (e == cudaErrorMemoryAllocation) {
        size_t free_b = 0, total_b = 0;
        if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
        return rk_errorf(RK_ERR_DEVICE,
                         "cuda: out of device memory for %s: %zu bytes asked, %zu of %zu bytes "
                         "free",
                         what, n, free_b, total_b);
    }
    return cu_fail(e, what);
}

/* Make b hold at least n_bytes (contents are not kept; zeroed when zero is
 * set). The old buffer may still be in use by queued work: wait first. */
static rk_status dbuf_reserve(rk_cuda *cu, dbuf *b, size_t n_bytes, int zero, const char *what) {
    if (n_bytes <= b->cap && b->p) return RK_OK;
    size_t cap = n_bytes + n_bytes / 4;
    if (cap < n_bytes) cap = n_bytes;
    cap = (cap + 255) / 256 * 256;
    if (b->p) {
        CU(cudaStreamSynchronize(cu->stream), what);
        CU(cudaFree(b->p), what);
        b->p = NULL;
        b->cap = 0;
    }
    rk_status st = dev_malloc(cap, &b->p, what);
    if (st != RK_OK) return st;
    b->cap = cap;
    if (zero) CU(cudaMemsetAsync(b->p, 0, cap, cu->stream), what);
    return RK_OK;
}

static void dbuf_free(dbuf *b) {
    if (b->p) (void)cudaFree(b->p);
    b->p = NULL;
    b->cap = 0;
}

static rk_status host_reserve(rk_cuda *cu, size_t n_bytes, const char *what) {
    if (n_bytes <= cu->host_cap) return RK_OK;
    size_t cap = n_bytes + n_bytes / 4;
    unsigned char *p = realloc(cu->host, cap);
    if (!p) return rk_errorf(RK_ERR_NOMEM, "cuda: %s: cannot allocate %zu bytes", what, cap);
    cu->host = p;
    cu->host_cap = cap;
    return RK_OK;
}

/* Host -> device on the stream; the source may be reused when this returns
 * (pageable memory is staged by the copy call; pinned memory is waited for). */
static rk_status h2d(rk_cuda *cu, void *dst, const void *src, size_t n_bytes, const char *what) {
    if (n_bytes == 0) return RK_OK;
    CU(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, cu->stream), what);
    struct cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, src) != cudaSuccess) {
        (void)cudaGetLastError();
        at.type = cudaMemoryTypeUnregistered;
    }
    if (at.type != cudaMemoryTypeUnregistered) CU(cudaStreamSynchronize(cu->stream), what);
    return RK_OK;
}

/* Device -> host, waited for (check mode reads device index arrays). */
static rk_status d2h_sync(rk_cuda *cu, void *dst, const void *src, size_t n_bytes,
                          const char *what) {
    if (n_bytes == 0) return RK_OK;
    CU(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, cu->stream), what);
    CU(cudaStreamSynchronize(cu->stream), what);
    return RK_OK;
}

static rk_status cuda_alloc(rk_backend *be, size_t n_bytes, void **out) {
    (void)be;
    if (!out) return rk_errorf(RK_ERR_INVALID, "cuda: alloc: NULL out");
    return dev_malloc(n_bytes, out, "alloc");
}

/* cudaFree waits for the device, so queued work that uses p finishes first. */
static void cuda_free(rk_backend *be, void *p) {
    (void)be;
    if (!p) return;
    if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
}

static rk_status cuda_upload(rk_backend *be, void *dst, const void *src, size_t n_bytes) {
    if (n_bytes == 0) return RK_OK;
    if (!dst || !src) return rk_errorf(RK_ERR_INVALID, "cuda: upload: NULL pointer");
    return h2d(cu_of(be), dst, src, n_bytes, "upload");
}

static rk_status cuda_download(rk_backend *be, void *dst, const void *src, size_t n_bytes) {
    rk_cuda *cu = cu_of(be);
    if (n_bytes && (!dst || !src)) return rk_errorf(RK_ERR_INVALID, "cuda: download: NULL pointer");
    if (n_bytes)
        CU(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, cu->stream), "download");
    return sync_and_check(cu, "download");
}

static rk_status cuda_memset(rk_backend *be, void *dst, int value, size_t n_bytes) {
    if (n_bytes == 0) return RK_OK;
    if (!dst) return rk_errorf(RK_ERR_INVALID, "cuda: memset: NULL pointer");
    rk_cuda *cu = cu_of(be);
    return launched(cu, cudaMemsetAsync(dst, value, n_bytes, cu->stream), "memset");
}

static rk_status cuda_sync(rk_backend *be) { return sync_and_check(cu_of(be), "sync"); }

/* ---------------------------------------------------------------- matmul */

/* y(n, m) = x(n, k) · w(m, k)^T. Row-major y is column-major y^T (m, n) with
 * ld m; row-major w (m rows of k) is column-major (k, m) with ld k; row-major
 * x is column-major (k, n) with ld k. So y^T = op(W) · X with op = T on w:
 * gemm(T, N, m, n, k, w, lda = k, x, ldb = k, y, ldc = m).
 * n <= RK_CUDA_MATVEC_MAX_N: our matrix-vector kernel (f32 math). Otherwise
 * F32 weights: cublasSgemm with FP32 math (no TF32). F16/BF16 weights: x is
 * split into hi + lo of the weight type and y = W·hi + W·lo by two
 * cublasGemmEx calls (f32 accumulation and output): the activations keep
 * about 16 (bf16) or 22 (f16) mantissa bits instead of 8 or 11, so results
 * stay within f32 rounding of the CPU's and do not depend on whether a row
 * was multiplied alone (matrix-vector kernel) or in a batch. */
/* Quantized weights: n <= RK_CUDA_MATVEC_MAX_N, the quantized matvec;
 * otherwise panels of rows dequantized to f32 (at most QUANT_PANEL_BYTES)
 * and cublasSgemm with FP32 math on each, into its rows of y^T. */
#define QUANT_PANEL_BYTES ((size_t)64 << 20)

static rk_status matmul_quant(rk_cuda *cu, float *y, const float *x, const void *w, rk_dtype wtype,
                              int n, int k, int m) {
    size_t row_bytes = rk_dtype_row_bytes(wtype, (size_t)k);
    if (n <= RK_CUDA_MATVEC_MAX_N)
        return launched(cu,
                        rk_cuda_launch_matvec_quant(y, x, w, wtype, row_bytes, n, k, m, cu->stream),
                        "matmul");
    size_t per_row = (size_t)k * sizeof(float);
    int panel = QUANT_PANEL_BYTES / per_row > (size_t)m ? m : (int)(QUANT_PANEL_BYTES / per_row);
    if (panel < 1) panel = 1;
    rk_status st = dbuf_reserve(cu, &cu->wpanel, (size_t)panel * per_row, 0, "matmul scratch");
    if (st != RK_OK) return st;
    const float one = 1.0f, zero = 0.0f;
    for (int r0 = 0; r0 < m; r0 += panel) {
        int rows = m - r0 < panel ? m - r0 : panel;
        cudaError_t e = rk_cuda_launch_dequant_rows(
            cu->wpanel.p, (const unsigned char *)w + (size_t)r0 * row_bytes, wtype, row_bytes, rows,
            k, cu->stream);
        if (e != cudaSuccess) return cu_fail(e, "matmul: dequantizing weights");
        cublasStatus_t bs = cublasSgemm(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, k, &one,
                                        cu->wpanel.p, k, x, k, &zero, y + r0, m);
        if (bs != CUBLAS_STATUS_SUCCESS) return blas_fail(bs, "matmul");
    }
    return launched(cu, cudaGetLastError(), "matmul");
}

/* The block types with kernels here: Q8_0, Q4_0, Q4_K, Q5_K and Q6_K. The
 * others (Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, IQ4_XS, MXFP4) are computed on
 * the CPU only; the model loader refuses them first, with the same list. */
static rk_status quant_computed(rk_dtype t, const char *op) {
    if (!rk_dtype_is_quant(t) || t <= RK_DTYPE_Q6_K) return RK_OK;
    return rk_errorf(RK_ERR_UNSUPPORTED,
                     "%s: %s weights are not computed on the cuda backend; it computes with F32, "
                     "F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K",
                     op, rk_dtype_name(t));
}

static rk_status cuda_matmul(rk_backend *be, float *y, const float *x, const void *w,
                             rk_dtype wtype, int n, int k, int m) {
    rk_cuda *cu = cu_of(be);
    rk_status st = rk_matmul_check(wtype, n, k, m);
    if (!st) st = quant_computed(wtype, "matmul");
    if (st) return st;
    if (rk_dtype_is_quant(wtype)) {
        if (n == 0 || m == 0) return RK_OK;
        if (k == 0)
            return launched(cu, cudaMemsetAsync(y, 0, (size_t)n * m * sizeof(float), cu->stream),
                            "matmul");
        return matmul_quant(cu, y, x, w, wtype, n, k, m);
    }
    if (rk_dtype_size(wtype) == 0)
        return rk_errorf(RK_ERR_INVALID, "matmul: bad weight dtype %d", (int)wtype);
    if (n == 0 || m == 0) return RK_OK;
    if (k == 0)
        return launched(cu, cudaMemsetAsync(y, 0, (size_t)n * m * sizeof(float), cu->stream),
                        "matmul");
    if (n <= RK_CUDA_MATVEC_MAX_N)
        return launched(cu, rk_cuda_launch_matvec(y, x, w, wtype, n, k, m, cu->stream), "matmul");
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t bs;
    if (wtype == RK_DTYPE_F32) {
        bs = cublasSgemm(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, (const float *)w, k, x,
                         k, &zero, y, m);
    } else {
        size_t elems = (size_t)n * (size_t)k;
        st = dbuf_reserve(cu, &cu->xconv, elems * 4, 0, "matmul scratch");
        if (st != RK_OK) return st;
        unsigned char *hi = cu->xconv.p, *lo = hi + elems * 2;
        cudaError_t e = rk_cuda_launch_split(hi, lo, wtype, x, elems, cu->stream);
        if (e != cudaSuccess) return cu_fail(e, "matmul: splitting x");
        cudaDataType_t t = wtype == RK_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
        bs = cublasGemmEx(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w, t, k, hi, t, k,
                          &zero, y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (bs == CUBLAS_STATUS_SUCCESS)
            bs = cublasGemmEx(cu->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w, t, k, lo, t, k,
                              &one, y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    if (bs != CUBLAS_STATUS_SUCCESS) return blas_fail(bs, "matmul");
    return launched(cu, cudaGetLastError(), "matmul");
}

/* ---------------------------------------------------------------- element-wise */

static rk_status cuda_add_bias(rk_backend *be, float *y, const float *b, int n, int m) {
    if (n < 0 || m < 0) return rk_errorf(RK_ERR_INVALID, "add_bias: negative shape %d x %d", n, m);
    if (n == 0 || m == 0) return RK_OK;
    rk_cuda *cu = cu_of(be);
    return launched(cu, rk_cuda_launch_add_bias(y, b, n, m, cu->stream), "add_bias");
}

static rk_status cuda_add(rk_backend *be, float *y, const float *x, size_t n) {
    if (n == 0) return RK_OK;
    rk_cuda *cu = cu_of(be);
    return launched(cu, rk_cuda_launch_add(y, x, n, cu->stream), "add");
}

static rk_status cuda_rmsnorm(rk_backend *be, float *out, const float *x, const float *w, int rows,
                              int dim, float eps) {
    if (rows < 0 || dim <= 0)
        return rk_errorf(RK_ERR_INVALID, "rmsnorm: bad shape %d x %d", rows, dim);
    if (rows == 0) return RK_OK;
    rk_cuda *cu = cu_of(be);
    return launched(cu, rk_cuda_launch_rmsnorm(out, x, w, rows, dim, eps, cu->stream), "rmsnorm");
}

/* ids are device memory: a negative id is found by the kernel (reported at
 * the next sync), or before the launch in check mode. As on the CPU, ids
 * past the table are the caller's to exclude (the table has no row count). */
static rk_status cuda_embed(rk_backend *be, float *out, const void *table, rk_dtype dtype,
                            const int32_t *ids, int n, int dim) {
    rk_cuda *cu = cu_of(be);
    if (n < 0 || dim <= 0) return rk_errorf(RK_ERR_INVALID, "embed: bad shape %d x %d", n, dim);
    if (rk_dtype_block(dtype) == 0) return rk_errorf(RK_ERR_INVALID, "embed: bad dtype %d", dtype);
    rk_status qst = quant_computed(dtype, "embed");
    if (qst) return qst;
    if (dim % (int)rk_dtype_block(dtype))
        return rk_errorf(RK_ERR_INVALID, "embed: dim %d is not a multiple of the %s block of %zu",
                         dim, rk_dtype_name(dtype), rk_dtype_block(dtype));
    if (n == 0) return RK_OK;
    if (cu->check) {
        rk_status st = host_reserve(cu, (size_t)n * sizeof(int32_t), "embed");
        if (st == RK_OK) st = d2h_sync(cu, cu->host, ids, (size_t)n * sizeof(int32_t), "embed");
        if (st != RK_OK) return st;
        const int32_t *h = (const int32_t *)cu->host;
        for (int i = 0; i < n; i++)
            if (h[i] < 0) return rk_errorf(RK_ERR_INVALID, "embed: token id %d < 0", h[i]);
    }
    if (rk_dtype_is_quant(dtype))
        return launched(cu,
                        rk_cuda_launch_embed_quant(out, table, dtype,
                                                   rk_dtype_row_bytes(dtype, (size_t)dim), ids, n,
                                                   dim, cu->err_dev, cu->stream),
                        "embed");
    return launched(
        cu, rk_cuda_launch_embed(out, table, dtype, ids, n, dim, cu->err_dev, cu->stream), "embed");
}

static rk_status cuda_rope(rk_backend *be, float *x, const int32_t *pos, int n_tokens, int n_heads,
                           int head_dim, const rk_rope *rope) {
    rk_status st = rk_rope_check(n_tokens, n_heads, head_dim, rope);
    if (st != RK_OK) return st;
    if (n_tokens == 0) return RK_OK;
    rk_cuda *cu = cu_of(be);
    return launched(cu, rk_cuda_launch_rope(x, pos, n_tokens, n_heads, head_dim, rope, cu->stream),
                    "rope");
}

static rk_status cuda_swiglu(rk_backend *be, float *out, const float *gate, const float *up,
                             size_t n) {
    if (n == 0) return RK_OK;
    rk_cuda *cu = cu_of(be);
    return launched(cu, rk_cuda_launch_swiglu(out, gate, up, n, cu->stream), "swiglu");
}

static rk_status cuda_geglu(rk_backend *be, float *out, const float *gate, const float *up,
                            size_t n) {
    if (n == 0) return RK_OK;
    rk_cuda *cu = cu_of(be);
    return launched(cu, rk_cuda_launch_geglu(out, gate, up, n, cu->stream), "geglu");
}

static rk_status cuda_scale(rk_backend *be, float *x, float s, size_t n) {
    if (n == 0) return RK_OK;
    rk_cuda *cu = cu_of(be);
    return launched(cu, rk_cuda_launch_scale(x, s, n, cu->stream), "scale");
}

/* ---------------------------------------------------------------- KV cache ops */

/* The CUDA kernels read F32, F16 and BF16 KV; a Q8_0 cache (CPU only) is
 * refused before anything is read or written. */
static rk_status no_q8_0_kv(const rk_kv_cache *kv, const char *op) {
    if (kv->dtype != RK_DTYPE_Q8_0) return RK_OK;
    return rk_errorf(RK_ERR_UNSUPPORTED, "%s: q8_0 KV is not supported on the cuda backend", op);
}

/* slots are device memory. The kernels check them (a slot past the cache or
 * a slot named twice fails the call with nothing written, reported at the
 * next sync); check mode copies them back and checks them here first. */
static rk_status cuda_kv_write(rk_backend *be, const rk_kv_cache *kv, int layer, const float *k,
                               const float *v, const int32_t *slots, int n_tokens) {
    rk_cuda *cu = cu_of(be);
    rk_status st = rk_kv_check_write(kv, layer, n_tokens);
    if (st == RK_OK) st = no_q8_0_kv(kv, "kv_write");
    if (st != RK_OK || n_tokens == 0) return st;
    int64_t total = rk_kv_slots(kv);
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    if (row > INT32_MAX) return rk_errorf(RK_ERR_LIMIT, "kv_write: rows of %zu elements", row);
    if (cu->check) {
        size_t nb = (size_t)n_tokens * sizeof(int32_t);
        if ((st = host_reserve(cu, 2 * nb, "kv_write")) != RK_OK ||
            (st = d2h_sync(cu, cu->host, slots, nb, "kv_write")) != RK_OK)
            return st;
        st = rk_kv_check_write_slots(kv, (const int32_t *)cu->host, n_tokens,
                                     (int32_t *)(cu->host + nb));
        if (st != RK_OK) return st;
    }
    size_t words = (size_t)((total + 31) / 32);
    if ((st = dbuf_reserve(cu, &cu->bits, words * sizeof(unsigned), 1, "kv_write bitmap")) != RK_OK)
        return st;
    if (++cu->kv_gen == 0) cu->kv_gen = 1;
    cudaError_t e = rk_cuda_launch_kv_check(slots, n_tokens, total, cu->bits.p, cu->kv_bad,
                                            cu->kv_gen, cu->err_dev, cu->stream);
    if (e != cudaSuccess) return cu_fail(e, "kv_write");
    e = rk_cuda_launch_kv_write(kv->k[layer], kv->v[layer], kv->dtype, k, v, slots, n_tokens,
                                (int)row, total, cu->bits.p, cu->kv_bad, cu->kv_gen, cu->stream);
    if (e != cudaSuccess) {
        /* the check pass set bits nobody clears: restore the all-zero bitmap */
        (void)cudaMemsetAsync(cu->bits.p, 0, cu->bits.cap, cu->stream);
        return cu_fail(e, "kv_write");
    }
    return launched(cu, cudaSuccess, "kv_write");
}

/* src_slots, dst_slots and delta are host memory (the pipeline's copy plan):
 * checked here exactly like the CPU op (nothing is written on failure), then
 * uploaded with the layer pointers into one scratch buffer; one launch per
 * distinct RoPE covers the layers that use it (their K pointers, then their V
 * pointers, staged together). */
static rk_status cuda_rope_shift_copy(rk_backend *be, const rk_kv_cache *kv,
                                      const int32_t *src_slots, const int32_t *dst_slots,
                                      const int32_t *delta, int n_tokens,
                                      const rk_rope *const *ropes) {
    rk_cuda *cu = cu_of(be);
    rk_status st = rk_kv_check_shift(kv, n_tokens, ropes);
    if (st == RK_OK) st = no_q8_0_kv(kv, "rope_shift_copy");
    if (st != RK_OK || n_tokens == 0) return st;
    if (kv->n_layers > 65535)
        return rk_errorf(RK_ERR_LIMIT, "rope_shift_copy: %d layers (at most 65535)", kv->n_layers);
    size_t nb = (size_t)n_tokens * sizeof(int32_t);
    size_t ptr_bytes = 2 * (size_t)kv->n_layers * sizeof(void *);
    size_t stage = ptr_bytes + 3 * nb;
    if ((st = host_reserve(cu, stage + 2 * nb, "rope_shift_copy")) != RK_OK ||
        (st = rk_kv_check_shift_slots(kv, src_slots, dst_slots, n_tokens,
                                      (int32_t *)(cu->host + stage))) != RK_OK)
        return st;
    /* staging: per RoPE group its layer pointers (K then V), then src, dst,
     * delta */
    void **ptrs = (void **)cu->host;
    size_t at = 0;
    for (int g = 0; g < kv->n_layers; g++) {
        int seen = 0;
        for (int e = 0; e < g && !seen; e++) seen = rk_rope_same(ropes[e], ropes[g]);
        if (seen) continue;
        size_t n = 0;
        for (int l = g; l < kv->n_layers; l++)
            if (rk_rope_same(ropes[l], ropes[g])) n++;
        for (int l = g, i = 0; l < kv->n_layers; l++)
            if (rk_rope_same(ropes[l], ropes[g])) {
                ptrs[at + i] = kv->k[l];
                ptrs[at + n + i] = kv->v[l];
                i++;
            }
        at += 2 * n;
    }
    int32_t *idx = (int32_t *)(cu->host + ptr_bytes);
    memcpy(idx, src_slots, nb);
    memcpy(idx + n_tokens, dst_slots, nb);
    memcpy(idx + 2 * (size_t)n_tokens, delta, nb);
    if ((st = dbuf_reserve(cu, &cu->shift, stage, 0, "rope_shift_copy scratch")) != RK_OK ||
        (st = h2d(cu, cu->shift.p, cu->host, stage, "rope_shift_copy")) != RK_OK)
        return st;
    const unsigned char *d = cu->shift.p;
    at = 0;
    for (int g = 0; g < kv->n_layers; g++) {
        int seen = 0;
        for (int e = 0; e < g && !seen; e++) seen = rk_rope_same(ropes[e], ropes[g]);
        if (seen) continue;
        int n = 0;
        for (int l = g; l < kv->n_layers; l++) n += rk_rope_same(ropes[l], ropes[g]);
        cudaError_t e = rk_cuda_launch_shift((void *const *)(d + at * sizeof(void *)), n, kv->dtype,
                                             (const int32_t *)(d + ptr_bytes), n_tokens,
                                             kv->n_kv_heads, kv->head_dim, ropes[g], cu->stream);
        if (e != cudaSuccess) return launched(cu, e, "rope_shift_copy");
        at += 2 * (size_t)n;
    }
    return launched(cu, cudaSuccess, "rope_shift_copy");
}

/* ---------------------------------------------------------------- attention */

static size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The inputs an attention plan is built from, as words in cu->plan_next:
 * the shape, the block size, q_start and kv_len and, with segments, the runs
 * and the rope angles they rotate by. Sets *len to the words written. */
static rk_status plan_key_make(rk_cuda *cu, const rk_attn_batch *b, int n_heads, int n_kv_heads,
                               int head_dim, int block_size, size_t *len) {
    int n_seqs = b->n_seqs;
    size_t n_runs = b->seg_start ? (size_t)b->seg_start[n_seqs] : 0;
    int n_rot = n_runs && b->rope ? b->rope->n_rot : 0;
    size_t n = 8 + 2 * (size_t)n_seqs + 1;
    if (n_runs) n += (size_t)n_seqs + 1 + 2 * n_runs + (size_t)n_rot / 2;
    if (n > cu->plan_next_cap) {
        int32_t *k = realloc(cu->plan_next, n * sizeof(int32_t));
        if (!k) return rk_errorf(RK_ERR_NOMEM, "attention: out of memory");
        cu->plan_next = k;
        cu->plan_next_cap = n;
    }
    int32_t *k = cu->plan_next;
    k[0] = n_seqs;
    k[1] = n_heads;
    k[2] = n_kv_heads;
    k[3] = head_dim;
    k[4] = block_size;
    k[5] = (int32_t)n_runs;
    k[6] = n_rot;
    k[7] = n_rot ? (int32_t)b->rope->pairing : 0;
    size_t o = 8;
    memcpy(k + o, b->q_start, ((size_t)n_seqs + 1) * sizeof(int32_t));
    o += (size_t)n_seqs + 1;
    memcpy(k + o, b->kv_len, (size_t)n_seqs * sizeof(int32_t));
    o += (size_t)n_seqs;
    if (n_runs) {
        memcpy(k + o, b->seg_start, ((size_t)n_seqs + 1) * sizeof(int32_t));
        o += (size_t)n_seqs + 1;
        memcpy(k + o, b->seg_end, n_runs * sizeof(int32_t));
        o += n_runs;
        memcpy(k + o, b->seg_delta, n_runs * sizeof(int32_t));
        o += n_runs;
        if (n_rot) memcpy(k + o, b->rope->freq, (size_t)n_rot / 2 * sizeof(float));
        o += (size_t)n_rot / 2;
    }
    *len = o;
    return RK_OK;
}

/* The runs of every sequence (see rk_cuda_attn_run) and their cos/sin tables,
 * as the CPU's plan_runs builds them: a run's blocks follow those of the run
 * before it in the table; cos and -sin of (float)delta * freq[i], no mscale. */
static void plan_runs(const rk_attn_batch *b, int block_size, int n_rot, rk_cuda_attn_run *runs,
                      float *cs_all) {
    int half = n_rot / 2;
    for (int s = 0; s < b->n_seqs; s++) {
        int32_t block = 0, begin = 0;
        for (int32_t k = b->seg_start[s]; k < b->seg_start[s + 1]; k++) {
            runs[k] = (rk_cuda_attn_run){b->seg_end[k], block, b->seg_delta[k], 0};
            block += (b->seg_end[k] - begin + block_size - 1) / block_size;
            begin = b->seg_end[k];
            float *cs = cs_all + (size_t)k * n_rot;
            if (b->seg_delta[k] == 0) {
                memset(cs, 0, (size_t)n_rot * sizeof(float));
                continue;
            }
            float fd = (float)b->seg_delta[k];
            for (int i = 0; i < half; i++) {
                float a = fd * b->rope->freq[i];
                cs[i] = cosf(a);
                cs[half + i] = -sinf(a);
            }
        }
    }
}

/* Build the work units of a batch (see cuda.h), with its runs when it has
 * segments, and upload them, unless the last plan was built from the same
 * inputs. The partition length is chosen so that the GPU gets about four
 * warps per SM slot: when the unsplit units are fewer, long kv ranges are cut
 * into partitions of at least 64 entries. */
static rk_status attn_plan(rk_cuda *cu, const rk_attn_batch *b, int n_heads, int n_kv_heads,
                           int head_dim, int block_size) {
    int n_seqs = b->n_seqs;
    size_t key_len;
    rk_status st = plan_key_make(cu, b, n_heads, n_kv_heads, head_dim, block_size, &key_len);
    if (st != RK_OK) return st;
    if (cu->plan_ok && cu->plan_key_len == key_len &&
        memcmp(cu->plan_key, cu->plan_next, key_len * sizeof(int32_t)) == 0)
        return RK_OK;
    cu->plan_ok = 0;
    int n_runs = b->seg_start ? b->seg_start[n_seqs] : 0;
    int n_rot = n_runs && b->rope ? b->rope->n_rot : 0;

    int group = n_heads / n_kv_heads;
    int n_g = group < RK_CUDA_ATTN_QV ? group : RK_CUDA_ATTN_QV;
    int head_sets = (group + RK_CUDA_ATTN_QV - 1) / RK_CUDA_ATTN_QV;
    int rows_per = group <= RK_CUDA_ATTN_QV ? RK_CUDA_ATTN_QV / group : 1;

    int64_t base_units = 0, max_len = 0;
    for (int s = 0; s < n_seqs; s++) {
        int n_q = b->q_start[s + 1] - b->q_start[s];
        if (n_q == 0) continue;
        base_units += ceil_div(n_q, rows_per) * head_sets * n_kv_heads;
        if (b->kv_len[s] > max_len) max_len = b->kv_len[s];
    }
    int64_t part_len = (int64_t)1 << 30;
    int64_t target = 4 * (int64_t)cu->n_sm * 4;
    if (cu->force_part > 0) {
        part_len = ceil_div(cu->force_part, RK_CUDA_ATTN_TILE) * RK_CUDA_ATTN_TILE;
    } else if (cu->force_part == 0 && base_units > 0 && base_units < target) {
        int64_t want = ceil_div(target, base_units);
        int64_t pl = ceil_div(ceil_div(max_len, want), RK_CUDA_ATTN_TILE) * RK_CUDA_ATTN_TILE;
        if (pl < 64) pl = 64;
        if (pl < max_len) part_len = pl;
    }

    /* count */
    int64_t n_units = 0, n_merges = 0, n_partials = 0;
    for (int s = 0; s < n_seqs; s++) {
        int n_q = b->q_start[s + 1] - b->q_start[s], L = b->kv_len[s];
        if (n_q == 0) continue;
        int64_t n_parts = ceil_div(L, part_len);
        for (int j0 = 0; j0 < n_q; j0 += rows_per) {
            int j1 = j0 + rows_per < n_q ? j0 + rows_per : n_q;
            n_units += ceil_div(L - n_q + j1, part_len) * head_sets * n_kv_heads;
        }
        if (n_parts > 1) {
            n_partials += (int64_t)n_q * n_heads * n_parts * (head_dim + 2);
            for (int j = 0; j < n_q; j++)
                if (L - n_q + j + 1 > part_len) n_merges += n_heads;
        }
    }
    if (n_units > INT32_MAX || n_merges > INT32_MAX)
        return rk_errorf(RK_ERR_LIMIT, "attention: batch too large (%lld work units)",
                         (long long)n_units);

    size_t seq_bytes = align16((size_t)n_seqs * sizeof(rk_cuda_attn_seq));
    size_t unit_bytes = align16((size_t)n_units * sizeof(rk_cuda_attn_unit));
    size_t merge_bytes = align16((size_t)n_merges * sizeof(rk_cuda_attn_merge));
    size_t run_bytes = align16((size_t)n_runs * sizeof(rk_cuda_attn_run));
    size_t cs_bytes = align16((size_t)n_runs * n_rot * sizeof(float));
    size_t runs_off = seq_bytes + unit_bytes + merge_bytes, cs_off = runs_off + run_bytes;
    size_t total = cs_off + cs_bytes;
    if ((st = host_reserve(cu, total, "attention plan")) != RK_OK) return st;
    rk_cuda_attn_seq *seqs = (rk_cuda_attn_seq *)cu->host;
    rk_cuda_attn_unit *units = (rk_cuda_attn_unit *)(cu->host + seq_bytes);
    rk_cuda_attn_merge *merges = (rk_cuda_attn_merge *)(cu->host + seq_bytes + unit_bytes);
    if (n_runs > 0)
        plan_runs(b, block_size, n_rot, (rk_cuda_attn_run *)(cu->host + runs_off),
                  (float *)(cu->host + cs_off));

    int64_t pbase = 0;
    size_t ui = 0, mi = 0;
    for (int s = 0; s < n_seqs; s++) {
        int n_q = b->q_start[s + 1] - b->q_start[s], L = b->kv_len[s];
        int64_t n_parts = n_q ? ceil_div(L, part_len) : 1;
        int32_t run0 = n_runs ? b->seg_start[s] : 0;
        int32_t seq_runs = n_runs ? b->seg_start[s + 1] - run0 : 0;
        seqs[s] =
            (rk_cuda_attn_seq){b->q_start[s], n_q, L, (int32_t)n_parts, pbase, run0, seq_runs};
        if (n_q == 0) continue;
        /* units of one (sequence, kv head) are adjacent: neighbouring warps
         * read the same K/V tiles */
        for (int h = 0; h < n_kv_heads; h++)
            for (int hs = 0; hs < head_sets; hs++)
                for (int j0 = 0; j0 < n_q; j0 += rows_per) {
                    int j1 = j0 + rows_per < n_q ? j0 + rows_per : n_q;
                    int g0 = hs * RK_CUDA_ATTN_QV;
                    int ng = group - g0 < n_g ? group - g0 : n_g;
                    int64_t parts = ceil_div(L - n_q + j1, part_len);
                    for (int64_t p = 0; p < parts; p++)
                        units[ui++] = (rk_cuda_attn_unit){s, j0, j1 - j0, h, g0, ng, (int32_t)p, 0};
                }
        if (n_parts > 1) {
            for (int j = 0; j < n_q; j++) {
                int lim = L - n_q + j + 1;
                if (lim <= part_len) continue;
                for (int hq = 0; hq < n_heads; hq++)
                    merges[mi++] = (rk_cuda_attn_merge){
                        (b->q_start[s] + j) * n_heads + hq, (int32_t)ceil_div(lim, part_len),
                        pbase + ((int64_t)j * n_heads + hq) * n_parts * (head_dim + 2)};
            }
            pbase += (int64_t)n_q * n_heads * n_parts * (head_dim + 2);
        }
    }
    if ((st = dbuf_reserve(cu, &cu->plan, total, 0, "attention plan")) != RK_OK ||
        (st = h2d(cu, cu->plan.p, cu->host, total, "attention plan")) != RK_OK)
        return st;
    if (n_partials > 0 && (st = dbuf_reserve(cu, &cu->partials, (size_t)n_partials * sizeof(float),
                                             0, "attention partials")) != RK_OK)
        return st;

    /* the key of this call becomes the plan's */
    int32_t *k = cu->plan_key;
    size_t k_cap = cu->plan_key_cap;
    cu->plan_key = cu->plan_next;
    cu->plan_key_cap = cu->plan_next_cap;
    cu->plan_next = k;
    cu->plan_next_cap = k_cap;
    cu->plan_key_len = key_len;
    cu->plan_units = (int)n_units;
    cu->plan_merges = (int)n_merges;
    cu->plan_part_len = (int)part_len;
    cu->plan_units_off = seq_bytes;
    cu->plan_merges_off = seq_bytes + unit_bytes;
    cu->plan_runs = n_runs;
    cu->plan_n_rot = n_rot;
    cu->plan_neox = n_rot && b->rope->pairing == RK_ROPE_NEOX;
    cu->plan_runs_off = runs_off;
    cu->plan_cs_off = cs_off;
    cu->plan_partials = (size_t)n_partials;
    cu->plan_ok = 1;
    return RK_OK;
}

/* Paged attention. q_start, kv_len and the segments are host memory and
 * checked here like the CPU op (the runs and their rotations go up with the
 * plan); the block table is device memory: its ids are checked by the kernel
 * (reported at the next sync) or, in check mode, copied back and checked
 * here. */
static rk_status cuda_attention(rk_backend *be, float *out, float *lse, const float *q,
                                const rk_kv_cache *kv, int layer, const rk_attn_batch *batch,
                                int n_heads, const rk_attn_params *params) {
    rk_cuda *cu = cu_of(be);
    rk_status st = rk_attn_check_params(params);
    if (st != RK_OK) return st;
    if (params->sinks)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "attention: attention sinks (gpt-oss) are not computed on the cuda "
                         "backend");
    float scale = params->scale;
    st = rk_attn_check_batch(kv, layer, batch, n_heads);
    if (st == RK_OK) st = no_q8_0_kv(kv, "attention");
    if (st != RK_OK) return st;
    int max_kv = 0; /* the longest kv range: no block is read when it is 0 */
    for (int s = 0; s < batch->n_seqs; s++)
        if (batch->kv_len[s] > max_kv) max_kv = batch->kv_len[s];
    if (kv->head_dim > 512)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "attention: head_dim %d > 512 is not supported on CUDA", kv->head_dim);
    size_t warp_smem = rk_cuda_attn_warp_smem(kv->head_dim);
    int wpc = 4;
    while (wpc > 1 && (size_t)wpc * warp_smem > cu->smem_optin) wpc--;
    if (warp_smem > cu->smem_optin)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "attention: head_dim %d needs %zu bytes of shared memory, the device "
                         "allows %zu",
                         kv->head_dim, warp_smem, cu->smem_optin);
    if (cu->check && max_kv > 0) {
        size_t nb = (size_t)batch->n_seqs * batch->max_blocks * sizeof(int32_t);
        if ((st = host_reserve(cu, nb, "attention")) != RK_OK ||
            (st = d2h_sync(cu, cu->host, batch->block_table, nb, "attention")) != RK_OK)
            return st;
        if ((st = rk_attn_check_block_ids(kv, batch, (const int32_t *)cu->host)) != RK_OK)
            return st;
    }
    if ((st = attn_plan(cu, batch, n_heads, kv->n_kv_heads, kv->head_dim, kv->block_size)) != RK_OK)
        return st;
    if (cu->plan_units == 0) return RK_OK;
    const unsigned char *plan = cu->plan.p;
    rk_cuda_attn_args a = {
        .out = out,
        .lse = lse,
        .q = q,
        .k = kv->k[layer],
        .v = kv->v[layer],
        .table = batch->block_table,
        .max_blocks = batch->max_blocks,
        .n_blocks = kv->n_blocks,
        .block_size = kv->block_size,
        .n_kv_heads = kv->n_kv_heads,
        .head_dim = kv->head_dim,
        .n_heads = n_heads,
        .group = n_heads / kv->n_kv_heads,
        .part_len = cu->plan_part_len,
        .scale = scale,
        .softcap = params->softcap,
        .window = params->window,
        .seqs = (const rk_cuda_attn_seq *)plan,
        .units = (const rk_cuda_attn_unit *)(plan + cu->plan_units_off),
        .n_units = cu->plan_units,
        .partials = cu->plan_partials ? (float *)cu->partials.p : NULL,
        .err = cu->err_dev,
        .runs = cu->plan_runs ? (const rk_cuda_attn_run *)(plan + cu->plan_runs_off) : NULL,
        .run_cs = cu->plan_runs ? (const float *)(plan + cu->plan_cs_off) : NULL,
        .n_rot = cu->plan_n_rot,
        .neox = cu->plan_neox,
    };
    cudaError_t e = rk_cuda_launch_attention(&a, kv->dtype, wpc, cu->stream);
    if (e != cudaSuccess) return cu_fail(e, "attention");
    if (cu->plan_merges > 0) {
        e = rk_cuda_launch_attn_merge((const rk_cuda_attn_merge *)(plan + cu->plan_merges_off),
                                      cu->plan_merges, (const float *)cu->partials.p, out, lse,
                                      kv->head_dim, cu->stream);
        if (e != cudaSuccess) return cu_fail(e, "attention merge");
    }
    return launched(cu, cudaSuccess, "attention");
}

/* ---------------------------------------------------------------- backend */

static const rk_backend_ops cuda_ops = {
    .alloc = cuda_alloc,
    .free = cuda_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .memset = cuda_memset,
    .sync = cuda_sync,
    .matmul = cuda_matmul,
    .add_bias = cuda_add_bias,
    .add = cuda_add,
    .rmsnorm = cuda_rmsnorm,
    .embed = cuda_embed,
    .rope = cuda_rope,
    .swiglu = cuda_swiglu,
    .geglu = cuda_geglu,
    .scale = cuda_scale,
    .kv_write = cuda_kv_write,
    .attention = cuda_attention,
    .rope_shift_copy = cuda_rope_shift_copy,
};

static void cuda_destroy(rk_cuda *cu) {
    if (!cu) return;
    if (cu->stream && cudaStreamSynchronize(cu->stream) != cudaSuccess) (void)cudaGetLastError();
    dbuf_free(&cu->bits);
    dbuf_free(&cu->xconv);
    dbuf_free(&cu->wpanel);
    dbuf_free(&cu->shift);
    dbuf_free(&cu->plan);
    dbuf_free(&cu->partials);
    if (cu->blas) (void)cublasDestroy(cu->blas);
    if (cu->stream) (void)cudaStreamDestroy(cu->stream);
    if (cu->err_dev) (void)cudaFree(cu->err_dev);
    if (cu->err_host) (void)cudaFreeHost(cu->err_host);
    (void)cudaGetLastError();
    free(cu->plan_key);
    free(cu->plan_next);
    free(cu->host);
    free(cu);
}

/* Stream, error words, pinned memory and cuBLAS of a new backend. */
static rk_status cuda_init(rk_cuda *cu) {
    cudaError_t e = cudaStreamCreateWithFlags(&cu->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        cu->stream = NULL;
        return cu_fail(e, "creating the stream");
    }
    void *words;
    rk_status st = dev_malloc(64, &words, "the error word");
    if (st != RK_OK) return st;
    cu->err_dev = words;
    cu->kv_bad = (unsigned *)((int *)words + 4);
    CU(cudaMemsetAsync(words, 0, 64, cu->stream), "clearing the error word");
    e = cudaMallocHost((void **)&cu->err_host, 4 * sizeof(int));
    if (e != cudaSuccess) {
        cu->err_host = NULL;
        return cu_fail(e, "allocating pinned memory");
    }
    memset(cu->err_host, 0, 4 * sizeof(int));
    cublasStatus_t bs = cublasCreate(&cu->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        cu->blas = NULL;
        return blas_fail(bs, "creating the cuBLAS handle");
    }
    if ((bs = cublasSetStream(cu->blas, cu->stream)) != CUBLAS_STATUS_SUCCESS ||
        (bs = cublasSetMathMode(cu->blas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS)
        return blas_fail(bs, "configuring cuBLAS");
    CU(cudaStreamSynchronize(cu->stream), "starting the stream");
    return RK_OK;
}

/* See cuda.h. */
rk_status rk_cuda_backend_create(int n_threads, rk_backend **out) {
    (void)n_threads;
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return rk_errorf(RK_ERR_DEVICE, "cuda: no usable device: %s (%s)", cudaGetErrorString(e),
                         cudaGetErrorName(e));
    }
    if (count <= 0) return rk_errorf(RK_ERR_DEVICE, "cuda: no CUDA device found");
    CU(cudaSetDevice(0), "selecting device 0");
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0), "reading the device properties");
    if (prop.major < 8)
        return rk_errorf(RK_ERR_DEVICE,
                         "cuda: %s has compute capability %d.%d; this build needs 8.0 or newer",
                         prop.name, prop.major, prop.minor);

    rk_backend *be = calloc(1, sizeof *be);
    rk_cuda *cu = calloc(1, sizeof *cu);
    if (!be || !cu) {
        free(be);
        free(cu);
        return rk_errorf(RK_ERR_NOMEM, "cuda backend: out of memory");
    }
    cu->n_sm = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
    cu->smem_optin =
        prop.sharedMemPerBlockOptin ? prop.sharedMemPerBlockOptin : prop.sharedMemPerBlock;
    const char *chk = getenv("RAGKV_CUDA_CHECK");
    cu->check = chk && *chk && strcmp(chk, "0") != 0;

    rk_status st = cuda_init(cu);
    if (st != RK_OK) {
        cuda_destroy(cu);
        free(be);
        return st;
    }
    memset(cu->err_host, 0, 4 * sizeof(int));
    be->ops = &cuda_ops;
    be->name = "cuda";
    be->n_threads = 1;
    be->impl = cu;
    *out = be;
    return RK_OK;
}

void rk_cuda_backend_free(rk_backend *be) {
    if (!be) return;
    cuda_destroy(be->impl);
    free(be);
}

void rk_cuda_set_check(rk_backend *be, int on) {
    if (be && be->impl && be->name && strcmp(be->name, "cuda") == 0) cu_of(be)->check = on != 0;
}

void rk_cuda_set_attn_partition(rk_backend *be, int part_len) {
    if (!be || !be->impl || !be->name || strcmp(be->name, "cuda") != 0) return;
    cu_of(be)->force_part = part_len;
    cu_of(be)->plan_ok = 0;
}
