/* kernels/cuda/cuda.h — private header of the CUDA backend (the op table of
 * kernels/kernels.h on an NVIDIA GPU). Not for use outside kernels/ except by
 * kernels/kernels.c (creation) and tests/test_cuda.c (check mode).
 *
 * Split: kernels/cuda/backend.c (C, gcc) owns the backend object, device
 * memory, the stream, cuBLAS, every argument check and the launch plans;
 * the .cu files hold the kernels and one C-callable launcher each, which
 * returns the cudaError_t of the launch (cudaGetLastError right after it).
 *
 * Pointer kinds (see docs/cuda.md): every tensor an op takes is device
 * memory; rk_attn_batch.q_start, kv_len and its segments (seg_start,
 * seg_end, seg_delta, rope) and the three index arrays of rope_shift_copy
 * are host memory; slots (kv_write), ids (embed), pos (rope)
 * and the attention block table are device memory (the engine uploads them).
 *
 * Device-side checks: index arrays that live on the device cannot be checked
 * before a launch without a round trip, so the kernels check them and record
 * the first bad index in an error word on the device; sync() and download()
 * read it and fail with RK_ERR_INVALID. In check mode (RAGKV_CUDA_CHECK=1 or
 * rk_cuda_set_check) every op copies its device index arrays back, checks
 * them like the CPU backend before launching, and synchronizes after each
 * launch, so a bad index fails the op itself. */
#ifndef RK_KERNELS_CUDA_H
#define RK_KERNELS_CUDA_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- backend */

/* Create the CUDA backend on device 0 (choose another GPU with
 * CUDA_VISIBLE_DEVICES): one stream, one cuBLAS handle. n_threads is ignored
 * (kernels run on the GPU; be->n_threads is 1). Returns RK_ERR_DEVICE when no
 * usable GPU or driver is present, with the CUDA reason in the message. The
 * caller owns *out and frees it with rk_backend_free(). */
rk_status rk_cuda_backend_create(int n_threads, rk_backend **out);

/* Free a CUDA backend: waits for its stream, frees its scratch, its stream
 * and its cuBLAS handle. Buffers from ops->alloc must be freed first. Accepts
 * NULL. */
void rk_cuda_backend_free(rk_backend *be);

/* Turn check mode on (1) or off (0) for this backend (initially on when the
 * environment has RAGKV_CUDA_CHECK set to anything but "" or "0"). */
void rk_cuda_set_check(rk_backend *be, int on);

/* Tests: fix the attention kv partition length (0: automatic, the default;
 * < 0: never split; > 0: that many entries, rounded up to a multiple of
 * RK_CUDA_ATTN_TILE), so every path can be compared with the CPU. */
void rk_cuda_set_attn_partition(rk_backend *be, int part_len);

/* ---------------------------------------------------------------- device error word */

/* The error word is four ints on the device: code, then three details. The
 * first kernel to find a bad index claims it (atomicCAS on the code). */
enum {
    RK_CUDA_ERR_NONE = 0,
    RK_CUDA_ERR_KV_SLOT = 1,    /* kv_write: (token, slot, total slots) */
    RK_CUDA_ERR_KV_DUP = 2,     /* kv_write: (token, slot, 0) written twice */
    RK_CUDA_ERR_ATTN_BLOCK = 3, /* attention: (sequence, table index, block id) */
    RK_CUDA_ERR_EMBED_ID = 4,   /* embed: (row, id, 0) negative id */
};

/* ---------------------------------------------------------------- attention plan */

/* Attention runs as a list of work units, one warp each: a unit is one
 * (sequence, kv head, set of up to RK_CUDA_ATTN_QV query vectors, kv
 * partition). A query vector is one query row of one head; the vectors of a
 * unit share the kv head (rows x heads of its GQA group). When a vector's
 * visible kv range spans more than one partition, the units write partial
 * results (max, sum, unnormalised output) that a merge kernel combines. */
#define RK_CUDA_ATTN_QV   4  /* query vectors per unit (per warp) */
#define RK_CUDA_ATTN_TILE 32 /* kv entries per tile (one per lane) */

typedef struct rk_cuda_attn_seq {
    int32_t q_start, n_q, kv_len, n_parts; /* n_parts: partitions of the whole kv range */
    int64_t pbase;                         /* float offset of its partials (n_parts > 1) */
    int32_t run0, n_runs; /* its runs (segments) in rk_cuda_attn_args.runs; n_runs 0: none */
} rk_cuda_attn_seq;

/* One run of a segmented sequence (see rk_attn_batch): the entries
 * [end of the previous run (0 for the first), end), entry e of it in block
 * table[block + (e - begin) / block_size] at offset (e - begin) % block_size;
 * its keys are scored against the query rotated by -delta. */
typedef struct rk_cuda_attn_run {
    int32_t end;   /* entry (exclusive) where the run ends */
    int32_t block; /* first table entry of the run */
    int32_t delta; /* live - base position of its keys */
    int32_t pad;
} rk_cuda_attn_run;

typedef struct rk_cuda_attn_unit {
    int32_t seq, j0, n_rows;  /* query rows j0 .. j0 + n_rows - 1 of the sequence */
    int32_t kv_head, g0, n_g; /* query heads kv_head * group + g0 .. + n_g - 1 */
    int32_t part, pad;        /* kv partition [part * part_len, (part + 1) * part_len) */
} rk_cuda_attn_unit;

typedef struct rk_cuda_attn_merge {
    int32_t qi;      /* query vector: row * n_heads + head */
    int32_t n_parts; /* partitions its kv range spans (> 1) */
    int64_t pbase;   /* float offset of its n_parts records of (head_dim + 2) floats */
} rk_cuda_attn_merge;

typedef struct rk_cuda_attn_args {
    float *out;           /* (n_rows_total, n_heads, head_dim) */
    float *lse;           /* (n_rows_total, n_heads) or NULL */
    const float *q;       /* (n_rows_total, n_heads, head_dim) */
    const void *k, *v;    /* this layer: (n_blocks, block_size, n_kv_heads, head_dim) */
    const int32_t *table; /* (n_seqs, max_blocks), device */
    int max_blocks, n_blocks, block_size, n_kv_heads, head_dim, n_heads, group;
    int part_len; /* kv entries per partition, a multiple of the tile */
    float scale;
    float softcap;                  /* > 0: scores soft-capped (rk_attn_params) */
    int window;                     /* > 0: sliding window of this many entries */
    const rk_cuda_attn_seq *seqs;   /* device */
    const rk_cuda_attn_unit *units; /* device */
    int n_units;
    /* Segments; runs NULL: no sequence has any. run_cs (n_runs, n_rot): per
     * run the cos of its n_rot / 2 angles (float)delta * freq[i], then their
     * -sin (zeros for delta 0); n_rot and neox from the batch's rope. */
    const rk_cuda_attn_run *runs; /* device */
    const float *run_cs;          /* device */
    int n_rot, neox;
    float *partials; /* device, may be NULL when no unit writes partials */
    int *err;        /* device error word */
} rk_cuda_attn_args;

/* ---------------------------------------------------------------- launchers
 * Each returns the error of its launch (cudaGetLastError after it). Shapes are
 * checked by the caller; n == 0 launches nothing. */

cudaError_t rk_cuda_launch_embed(float *out, const void *table, rk_dtype dtype, const int32_t *ids,
                                 int n, int dim, int *err, cudaStream_t s);
cudaError_t rk_cuda_launch_rmsnorm(float *out, const float *x, const float *w, int rows, int dim,
                                   float eps, cudaStream_t s);
cudaError_t rk_cuda_launch_rope(float *x, const int32_t *pos, int n_tokens, int n_heads,
                                int head_dim, const rk_rope *rope, cudaStream_t s);
cudaError_t rk_cuda_launch_swiglu(float *out, const float *gate, const float *up, size_t n,
                                  cudaStream_t s);
cudaError_t rk_cuda_launch_geglu(float *out, const float *gate, const float *up, size_t n,
                                 cudaStream_t s);
cudaError_t rk_cuda_launch_scale(float *x, float v, size_t n, cudaStream_t s);
cudaError_t rk_cuda_launch_add(float *y, const float *x, size_t n, cudaStream_t s);
cudaError_t rk_cuda_launch_add_bias(float *y, const float *b, int n, int m, cudaStream_t s);
/* Split src(n) f32 into hi(n) + lo(n) of dtype (F16 or BF16): hi = round(x),
 * lo = round(x - hi), both to nearest even. */
cudaError_t rk_cuda_launch_split(void *hi, void *lo, rk_dtype dtype, const float *src, size_t n,
                                 cudaStream_t s);

/* Largest n the matrix-vector kernel takes (rows of x); larger n go to cuBLAS. */
#define RK_CUDA_MATVEC_MAX_N 8
/* y(n, m) = x(n, k) · w(m, k)^T for 1 <= n <= RK_CUDA_MATVEC_MAX_N, f32 math. */
cudaError_t rk_cuda_launch_matvec(float *y, const float *x, const void *w, rk_dtype wtype, int n,
                                  int k, int m, cudaStream_t s);
/* Block-quantized weights (kernels/cuda/quant.cu), rows of row_bytes bytes:
 * the same matvec; dst(n_rows, k) f32 = the first n_rows rows dequantized;
 * embed rows of a quantized table (negative ids as rk_cuda_launch_embed). */
cudaError_t rk_cuda_launch_matvec_quant(float *y, const float *x, const void *w, rk_dtype wtype,
                                        size_t row_bytes, int n, int k, int m, cudaStream_t s);
cudaError_t rk_cuda_launch_dequant_rows(float *dst, const void *w, rk_dtype wtype, size_t row_bytes,
                                        int n_rows, int k, cudaStream_t s);
cudaError_t rk_cuda_launch_embed_quant(float *out, const void *table, rk_dtype dtype,
                                       size_t row_bytes, const int32_t *ids, int n, int dim,
                                       int *err, cudaStream_t s);

/* kv_write, first pass: check every slot < total and mark it in the bitmap
 * bits (one bit per cache slot, all zero between calls); a bad or repeated
 * slot sets *bad = gen and records the error word. */
cudaError_t rk_cuda_launch_kv_check(const int32_t *slots, int n_tokens, int64_t total,
                                    unsigned *bits, unsigned *bad, unsigned gen, int *err,
                                    cudaStream_t s);
/* kv_write, second pass: clear the bits the first pass set and, unless
 * *bad == gen, convert k and v (n_tokens, row) to dtype into their slots. */
cudaError_t rk_cuda_launch_kv_write(void *k_layer, void *v_layer, rk_dtype dtype, const float *k,
                                    const float *v, const int32_t *slots, int n_tokens, int row,
                                    int64_t total, unsigned *bits, const unsigned *bad,
                                    unsigned gen, cudaStream_t s);

/* rope_shift_copy over every layer at once: layers (2 * n_layers) device
 * pointers, K layers then V layers; idx (3 * n_tokens) device ints: src
 * slots, dst slots, deltas. */
cudaError_t rk_cuda_launch_shift(void *const *layers, int n_layers, rk_dtype dtype,
                                 const int32_t *idx, int n_tokens, int n_kv_heads, int head_dim,
                                 const rk_rope *rope, cudaStream_t s);

/* Shared memory one attention warp needs for head_dim (bytes). */
size_t rk_cuda_attn_warp_smem(int head_dim);
/* Run the units of a (see rk_cuda_attn_args); warps_per_block warps a block,
 * smem_limit the opt-in shared memory per block of the device. */
cudaError_t rk_cuda_launch_attention(const rk_cuda_attn_args *a, rk_dtype dtype,
                                     int warps_per_block, cudaStream_t s);
/* Combine the partials of n_items query vectors into out (and lse). */
cudaError_t rk_cuda_launch_attn_merge(const rk_cuda_attn_merge *items, int n_items,
                                      const float *partials, float *out, float *lse, int head_dim,
                                      cudaStream_t s);

#ifdef __cplusplus
}
#endif

/* ---------------------------------------------------------------- device helpers (.cu only) */

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define RK_CUDA_FULL_MASK 0xffffffffu

/* Element conversions: widening is exact; narrowing rounds to nearest even. */
static __device__ __forceinline__ float rk_cu_f32(float x) { return x; }
static __device__ __forceinline__ float rk_cu_f32(__half x) { return __half2float(x); }
static __device__ __forceinline__ float rk_cu_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ void rk_cu_store(float *p, float x) { *p = x; }
static __device__ __forceinline__ void rk_cu_store(__half *p, float x) { *p = __float2half_rn(x); }
static __device__ __forceinline__ void rk_cu_store(__nv_bfloat16 *p, float x) {
    *p = __float2bfloat16_rn(x);
}

static __device__ __forceinline__ float rk_cu_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(RK_CUDA_FULL_MASK, x, o);
    return x;
}

static __device__ __forceinline__ float rk_cu_warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(RK_CUDA_FULL_MASK, x, o));
    return x;
}

/* Record the first device-side error: the thread that claims the code writes
 * the details. */
static __device__ __forceinline__ void rk_cu_report(int *err, int code, int a, int b, int c) {
    if (atomicCAS(err, 0, code) == 0) {
        err[1] = a;
        err[2] = b;
        err[3] = c;
    }
}
#endif

#endif
