/* kernels/ — the compute backend of ragkv.
 *
 * A backend owns device memory and implements a table of ops. The CPU backend
 * (kernels/cpu/) is the reference: multithreaded, SIMD where it pays, OpenBLAS
 * for large GEMMs. The CUDA backend (kernels/cuda/) implements the same table.
 * Every pointer passed to an op is backend memory (host memory for the CPU
 * backend). Activations are f32; weights may be F32, F16, BF16 or one of the
 * block-quantized GGML types below (matmul and embed only; the CUDA backend
 * refuses the ones it does not compute, by name); KV storage has the dtype of
 * the cache (F32, F16, BF16 or Q8_0, see rk_kv_dtype_ok).
 *
 * Errors: every op checks its arguments first (the rk_*_check functions
 * below) and returns RK_ERR_INVALID, naming the op, without writing
 * anything; RK_ERR_NOMEM when its scratch cannot be had; RK_ERR_UNSUPPORTED
 * for a dtype or shape the backend does not compute; a device failure is
 * RK_ERR_DEVICE (CUDA), after which the backend should be freed.
 *
 * Threads: a backend belongs to one thread, which calls all its ops (the
 * engine thread); ops are not reentrant and may use the backend's own worker
 * threads inside (the CPU backend's pool of n_threads). Ops run in call
 * order: on the CPU each returns with its result written; on CUDA results
 * are ordered on the backend's stream and visible to the host after
 * download or sync. The free functions below that take no backend (dtype
 * helpers, conversions, checks, rk_attn_key_mass) are pure and may be
 * called from any thread.
 *
 * Paged KV: the cache of one layer is an array of blocks, shape
 *   (n_blocks, block_size, n_kv_heads, head_dim)
 * and a token's K/V live at slot = block_id * block_size + offset. One block id
 * addresses that block in every layer. A sequence is described by its block
 * table: the i-th KV entry of the sequence lives in block table[i / block_size]
 * at offset i % block_size. */
#ifndef RK_KERNELS_H
#define RK_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"

typedef enum rk_dtype {
    RK_DTYPE_F32 = 0,
    RK_DTYPE_F16 = 1,
    RK_DTYPE_BF16 = 2,
    /* Block-quantized weights in GGML's layouts (Q8_0 also stores KV, see
     * rk_kv_dtype_ok):
     * a row of k elements is k / rk_dtype_block() blocks of
     * rk_dtype_block_bytes() bytes each. */
    RK_DTYPE_Q8_0 = 3,    /* 32: f16 d, i8 q[32]; x = d q */
    RK_DTYPE_Q4_0 = 4,    /* 32: f16 d, u8 q[16] (two nibbles); x = d (q - 8) */
    RK_DTYPE_Q4_K = 5,    /* 256: f16 d, dmin, 8 x 6-bit scale and min, 4-bit q */
    RK_DTYPE_Q5_K = 6,    /* 256: as Q4_K plus a fifth bit per weight */
    RK_DTYPE_Q6_K = 7,    /* 256: 6-bit q, 16 x i8 scales, f16 d; x = d s (q - 32) */
    RK_DTYPE_Q4_1 = 8,    /* 32: f16 d, m, 4-bit q; x = d q + m */
    RK_DTYPE_Q5_0 = 9,    /* 32: f16 d, 5-bit q; x = d (q - 16) */
    RK_DTYPE_Q5_1 = 10,   /* 32: f16 d, m, 5-bit q; x = d q + m */
    RK_DTYPE_Q2_K = 11,   /* 256: 16 x 4-bit scale and min, 2-bit q, f16 d, dmin */
    RK_DTYPE_Q3_K = 12,   /* 256: 3-bit q, 16 x 6-bit scales, f16 d; x = d (s - 32) q */
    RK_DTYPE_IQ4_NL = 13, /* 32: f16 d, 4-bit codebook index; x = d v[q] */
    RK_DTYPE_IQ4_XS = 14, /* 256: f16 d, 8 x 6-bit scales, 4-bit codebook index */
    /* 32 elements in 17 bytes: u8 e (E8M0 scale 2^(e - 127)), u8 q[16] (byte i:
     * element i low nibble, i + 16 high), each nibble an E2M1 float (sign bit
     * 3; 0, .5, 1, 1.5, 2, 3, 4, 6); x = e2m1(q) 2^(e - 127). GGML type 39. */
    RK_DTYPE_MXFP4 = 15,
} rk_dtype;

#define RK_DTYPE_COUNT 16

/* Bytes per element of an unquantized dtype; 0 for the quantized ones (and
 * for values outside the enum). */
size_t rk_dtype_size(rk_dtype t);
const char *rk_dtype_name(rk_dtype t);
/* 1 for the block-quantized dtypes. */
int rk_dtype_is_quant(rk_dtype t);
/* Elements per block (1 for F32/F16/BF16) and bytes per block; 0 for a value
 * outside the enum. */
size_t rk_dtype_block(rk_dtype t);
size_t rk_dtype_block_bytes(rk_dtype t);
/* Bytes of a row of n elements (n a multiple of the block size); 0 when n is
 * not a multiple of the block or t is outside the enum. */
size_t rk_dtype_row_bytes(rk_dtype t, size_t n);
/* Index of the first NaN or infinite element of the n elements at p (F32,
 * F16 or BF16, any alignment; Q8_0: n a multiple of 32, the first element of
 * the first block whose scale is not finite), or -1 when all are finite;
 * other dtypes are not examined (-1). Vectorised: the model's weights at load and every KV
 * payload loaded from the tiers go through it. */
int64_t rk_dtype_first_nonfinite(rk_dtype dt, const void *p, size_t n);

/* Whether t can store KV of heads head_dim wide: F32, F16, BF16, or Q8_0
 * when head_dim is a multiple of its 32-element block (each head's
 * elements are whole blocks of their own). A KV row of n elements takes
 * rk_dtype_row_bytes(t, n) bytes. */
int rk_kv_dtype_ok(rk_dtype t, int head_dim);

/* Reference (portable C) conversions of the quantized dtypes, n a multiple of
 * the block size. dequantize writes dst(n) f32 from n elements of src;
 * quantize writes n elements of dtype t to dst from src(n) f32 (round to
 * nearest, scales chosen from each block's range; see kernels/cpu/quant.c).
 * For F32/F16/BF16 they convert as rk_dtype_to_f32 and rounding does. */
void rk_dequantize(float *dst, const void *src, rk_dtype t, size_t n);
void rk_quantize(void *dst, const float *src, rk_dtype t, size_t n);

/* Scalar conversions (round-to-nearest-even for the narrowing ones). */
float rk_f16_to_f32(uint16_t h);
uint16_t rk_f32_to_f16(float f);
float rk_bf16_to_f32(uint16_t h);
uint16_t rk_f32_to_bf16(float f);
/* dst(n) = src(n) of dtype t widened to f32 (host memory). */
void rk_dtype_to_f32(float *dst, const void *src, rk_dtype t, size_t n);

/* ---------------------------------------------------------------- RoPE */

#define RK_ROPE_MAX_PAIRS 256 /* head_dim up to 512 */

typedef enum rk_rope_pairing {
    RK_ROPE_NORMAL = 0, /* rotate (x[2i], x[2i+1])          — llama */
    RK_ROPE_NEOX = 1,   /* rotate (x[i], x[i + n_rot/2])     — qwen2, qwen3 */
} rk_rope_pairing;

typedef enum rk_rope_scaling {
    RK_ROPE_SCALING_NONE = 0,
    RK_ROPE_SCALING_LINEAR,
    RK_ROPE_SCALING_YARN,
    RK_ROPE_SCALING_LLAMA3,
} rk_rope_scaling;

typedef struct rk_rope_params {
    int n_rot;   /* rotated dims per head (<= head_dim, even) */
    float theta; /* base frequency, e.g. 10000 or 1e6 */
    rk_rope_pairing pairing;
    rk_rope_scaling scaling;
    float factor;                            /* scaling factor (linear, yarn, llama3) */
    int orig_ctx;                            /* original training context (yarn, llama3) */
    float low_freq_factor, high_freq_factor; /* llama3 */
    float beta_fast, beta_slow;              /* yarn */
} rk_rope_params;

/* Frequencies derived once from rk_rope_params: the angle of pair i at
 * position p is (float)p * freq[i], and cos/sin are multiplied by mscale. */
typedef struct rk_rope {
    int n_rot;
    rk_rope_pairing pairing;
    float mscale;
    float freq[RK_ROPE_MAX_PAIRS];
} rk_rope;

/* Compute freq[] and mscale from the params (applies linear / yarn / llama3
 * scaling). Returns RK_ERR_INVALID for n_rot odd, too large, or theta <= 0. */
rk_status rk_rope_init(rk_rope *rope, const rk_rope_params *p);

/* ---------------------------------------------------------------- KV cache */

typedef struct rk_kv_cache {
    int n_layers;
    int n_blocks;
    int block_size;
    int n_kv_heads;
    int head_dim;
    rk_dtype dtype;
    void **k; /* [n_layers] -> (n_blocks, block_size, n_kv_heads, head_dim), backend memory */
    void **v; /* [n_layers] -> same */
} rk_kv_cache;

/* Attention over paged KV for a batch of sequences. Sequence s owns query rows
 * q_start[s] .. q_start[s+1]-1 (n_q of them) and attends over its first
 * kv_len[s] KV entries. Causal in entry order: its query row j (0-based) sees
 * entries 0 .. kv_len[s] - n_q + j. The new tokens' K/V must already be
 * written (kv_write) before the call.
 *
 * Without segments (seg_start NULL) the i-th entry lives in block
 * table[i / block_size] at offset i % block_size.
 *
 * Segments (position-shifted, "zero-copy" reuse): the entries of sequence s
 * are cut into the runs k = seg_start[s] .. seg_start[s+1]-1; run k holds the
 * entries [seg_end[k-1], seg_end[k]) (seg_end[k-1] read as 0 for the first run
 * of a sequence), strictly increasing, the last ending at kv_len[s]. Each run
 * starts at offset 0 of a block of its own: the table of s is the
 * concatenation of the runs' blocks, run k taking ceil(len_k / block_size)
 * table entries right after those of run k-1 (so a chunk's cached blocks can
 * be put in the table as they are, its partial last block included; the
 * unused tail of a partial block is never read).
 * The keys of run k were rotated at positions that are seg_delta[k] lower than
 * the live ones (delta = live offset - base): attention scores them as if
 * they had been moved by rope_shift_copy with that delta, by rotating each
 * query by -delta against that run, R(-d)q · K = q · R(d)K, with the angles
 * (float)d * rope->freq[i] (no mscale) of rope_shift_copy. The softmax is over
 * all runs together. A run with delta 0 costs nothing extra; one with
 * delta != 0 costs one rotation per query vector (per KV partition it
 * spans, in a split decode), no K is read twice or copied.
 * Each query vector must already carry its live-position rotation (the rope
 * op), as without segments. */
typedef struct rk_attn_batch {
    int n_seqs;
    const int32_t *q_start;     /* (n_seqs + 1), host memory */
    const int32_t *kv_len;      /* (n_seqs), host memory */
    const int32_t *block_table; /* (n_seqs, max_blocks) block ids, -1 unused; backend memory */
    int max_blocks;
    /* Optional segments; all NULL: none. Host memory. */
    const int32_t *seg_start; /* (n_seqs + 1) runs of sequence s: [seg_start[s], seg_start[s+1]) */
    const int32_t *seg_end;   /* (seg_start[n_seqs]) entry (exclusive) where run k ends */
    const int32_t *seg_delta; /* (seg_start[n_seqs]) live - base position of run k's keys */
    const rk_rope *rope;      /* the model's RoPE table; needed when some seg_delta != 0 */
} rk_attn_batch;

/* How the scores of an attention call are formed and which entries a query
 * row sees, beyond causality:
 *  - score = scale * q·k, then, when softcap > 0, softcap * tanh(score /
 *    softcap) (attention-logit soft-capping, Gemma 2);
 *  - window > 0 (a sliding-window layer): the query row whose own entry is
 *    e (its index in the sequence's kv order, as causality counts it) sees
 *    only the entries j with e - window < j <= e, the window most recent
 *    ones itself included. The boundary is the reference engine's: an entry
 *    window or more entries back is masked. With segments the indices are
 *    the entries' places in the concatenated runs, not their positions.
 *  - sinks (gpt-oss): one learned logit per query head that joins each of
 *    the head's softmax denominators and contributes no value,
 *    out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j)); lse includes it.
 *    It belongs to the head, not to a position, so moving or reusing KV
 *    entries never touches it.
 * Zero-initialise and set scale for plain causal attention. */
typedef struct rk_attn_params {
    float scale;        /* multiplies q·k */
    float softcap;      /* > 0: soft-cap the scaled scores at it; 0: none */
    int window;         /* > 0: sliding window of this many entries; 0: the whole range */
    const float *sinks; /* (n_heads) host memory, finite; NULL: none (CUDA refuses them) */
} rk_attn_params;

/* Bad params (a scale or cap not finite, a negative cap or window) are
 * RK_ERR_INVALID. */
rk_status rk_attn_check_params(const rk_attn_params *p);

/* ---------------------------------------------------------------- backend */

typedef struct rk_backend rk_backend;

typedef struct rk_backend_ops {
    /* memory */
    rk_status (*alloc)(rk_backend *be, size_t n_bytes, void **out);
    void (*free)(rk_backend *be, void *p);
    rk_status (*upload)(rk_backend *be, void *dst, const void *src, size_t n_bytes);
    rk_status (*download)(rk_backend *be, void *dst, const void *src, size_t n_bytes);
    rk_status (*memset)(rk_backend *be, void *dst, int value, size_t n_bytes);
    rk_status (*sync)(rk_backend *be);

    /* y(n, m) = x(n, k) · w(m, k)^T ; w of dtype wtype, row-major with k contiguous */
    rk_status (*matmul)(rk_backend *be, float *y, const float *x, const void *w, rk_dtype wtype,
                        int n, int k, int m);
    /* Optional (NULL: every weight is computed as stored). A weight w(m, k)
     * of wtype rewritten once, at load, into the layout matmul_packed reads:
     * packed_bytes is its size, 0 for a wtype (or shape) this backend keeps
     * as stored; pack writes it to dst (backend memory of that size).
     * matmul_packed(packed) computes matmul(w): with the same bits on the
     * prefill side, within the type's rounding on the decode side, and a
     * row of x gets the same bits alone or in a batch of either side. */
    size_t (*packed_bytes)(rk_backend *be, rk_dtype wtype, int k, int m);
    rk_status (*pack)(rk_backend *be, void *dst, const void *w, rk_dtype wtype, int k, int m);
    rk_status (*matmul_packed)(rk_backend *be, float *y, const float *x, const void *packed,
                               rk_dtype wtype, int n, int k, int m);
    /* Where rows r0.. of a packed weight start, in bytes from its start, so
     * they can be multiplied alone as a packed weight of their own; SIZE_MAX
     * when r0 does not start a unit of the layout. */
    size_t (*packed_offset)(rk_backend *be, rk_dtype wtype, int k, int r0);
    /* y(n, m) += b(m) broadcast over rows */
    rk_status (*add_bias)(rk_backend *be, float *y, const float *b, int n, int m);
    /* y(n) += x(n) */
    rk_status (*add)(rk_backend *be, float *y, const float *x, size_t n);
    /* out(rows, dim) = x / rms(x) * w(dim), per row; out may equal x */
    rk_status (*rmsnorm)(rk_backend *be, float *out, const float *x, const float *w, int rows,
                         int dim, float eps);
    /* out(n, dim) = rows ids[i] of table(n_vocab, dim) of dtype, as f32 */
    rk_status (*embed)(rk_backend *be, float *out, const void *table, rk_dtype dtype,
                       const int32_t *ids, int n, int dim);
    /* x(n_tokens, n_heads, head_dim) rotated in place at positions pos(n_tokens) */
    rk_status (*rope)(rk_backend *be, float *x, const int32_t *pos, int n_tokens, int n_heads,
                      int head_dim, const rk_rope *rope);
    /* out(n) = silu(gate(n)) * up(n); out may equal gate */
    rk_status (*swiglu)(rk_backend *be, float *out, const float *gate, const float *up, size_t n);
    /* out(n) = gelu(gate(n)) * up(n), gelu the tanh approximation
     * 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) in f32 (Gemma's FFN);
     * out may equal gate */
    rk_status (*geglu)(rk_backend *be, float *out, const float *gate, const float *up, size_t n);
    /* x(n) *= s */
    rk_status (*scale)(rk_backend *be, float *x, float s, size_t n);
    /* write k, v (n_tokens, n_kv_heads, head_dim) of layer to slots(n_tokens); slot < 0 skipped */
    rk_status (*kv_write)(rk_backend *be, const rk_kv_cache *kv, int layer, const float *k,
                          const float *v, const int32_t *slots, int n_tokens);
    /* out(n_q, n_heads, head_dim) = softmax(scores) v, GQA (n_heads % n_kv_heads == 0),
     * the scores and the visible entries as params says (rk_attn_params);
     * lse(n_q, n_heads) natural-log sum-exp of the scores, may be NULL */
    rk_status (*attention)(rk_backend *be, float *out, float *lse, const float *q,
                           const rk_kv_cache *kv, int layer, const rk_attn_batch *batch,
                           int n_heads, const rk_attn_params *params);
    /* For every layer l and token t: K at dst_slots[t] = R_l(delta[t]) · K at src_slots[t],
     * R_l the rotation of ropes[l] (ropes has kv->n_layers entries: a model whose
     * layers use different RoPE, Gemma 3's local and global ones, shifts each
     * layer with its own), V copied unchanged. src and dst must not overlap.
     * src_slots, dst_slots, delta and ropes are HOST arrays (the reindex plan
     * is built on the host); the backend uploads them itself. */
    rk_status (*rope_shift_copy)(rk_backend *be, const rk_kv_cache *kv, const int32_t *src_slots,
                                 const int32_t *dst_slots, const int32_t *delta, int n_tokens,
                                 const rk_rope *const *ropes);
} rk_backend_ops;

struct rk_backend {
    const rk_backend_ops *ops;
    const char *name; /* "cpu" or "cuda" */
    int n_threads;
    void *impl; /* backend-private state */
};

/* Create a backend by name ("cpu"; "cuda" when built with RAGKV_CUDA).
 * n_threads <= 0 means one per online core. Free with rk_backend_free(). */
rk_status rk_backend_create(const char *name, int n_threads, rk_backend **out);
void rk_backend_free(rk_backend *be);

/* ---------------------------------------------------------------- argument checks
 * What every backend verifies before an op touches memory, so that a bad call
 * fails with RK_ERR_INVALID (the op's name in the message) and writes nothing.
 * Index arrays here are host memory; tmp is caller scratch of the size given. */

/* matmul: a shape of no negative size, a weight type, k whole blocks of it. */
rk_status rk_matmul_check(rk_dtype wtype, int n, int k, int m);

int64_t rk_kv_slots(const rk_kv_cache *kv); /* n_blocks * block_size */
/* kv_write: a well-formed cache, layer in range, n_tokens >= 0. */
rk_status rk_kv_check_write(const rk_kv_cache *kv, int layer, int n_tokens);
/* kv_write slots(n_tokens): each below rk_kv_slots (negative: skipped), none
 * named twice; tmp (n_tokens). */
rk_status rk_kv_check_write_slots(const rk_kv_cache *kv, const int32_t *slots, int n_tokens,
                                  int32_t *tmp);
/* rope over (n_tokens, n_heads, head_dim): n_tokens >= 0, n_heads and
 * head_dim > 0, n_rot even and within head_dim. */
rk_status rk_rope_check(int n_tokens, int n_heads, int head_dim, const rk_rope *rope);
/* rope_shift_copy: a well-formed cache, n_tokens >= 0, every layer's rope
 * given, its n_rot fitting head_dim. */
rk_status rk_kv_check_shift(const rk_kv_cache *kv, int n_tokens, const rk_rope *const *ropes);
/* Whether two RoPE tables rotate alike (the same one or equal contents). */
int rk_rope_same(const rk_rope *a, const rk_rope *b);
/* rope_shift_copy slots: all in range, no destination twice, no slot both a
 * source and a destination; tmp (2 * n_tokens). */
rk_status rk_kv_check_shift_slots(const rk_kv_cache *kv, const int32_t *src_slots,
                                  const int32_t *dst_slots, int n_tokens, int32_t *tmp);
/* attention: n_heads a multiple of n_kv_heads, q_start non-decreasing from
 * >= 0, kv_len[s] >= the query rows of sequence s. */
rk_status rk_attn_check_shape(const int32_t *q_start, const int32_t *kv_len, int n_seqs,
                              int n_heads, int n_kv_heads, int head_dim);
/* attention over kv: a well-formed cache, layer in range, the shape above, and
 * every kv_len within the batch's max_blocks; with segments, seg_start starts
 * at 0 and does not decrease, each sequence's runs are non-empty, end in
 * increasing order at kv_len (a sequence with kv_len 0 has none), their blocks
 * fit max_blocks, and rope (required when some delta is not 0) fits head_dim. */
rk_status rk_attn_check_batch(const rk_kv_cache *kv, int layer, const rk_attn_batch *batch,
                              int n_heads);
/* every block id the kv range of a sequence uses (with segments: the blocks of
 * its runs) is in [0, n_blocks); table is a host copy of batch->block_table. */
rk_status rk_attn_check_block_ids(const rk_kv_cache *kv, const rk_attn_batch *batch,
                                  const int32_t *table);

/* Index of the largest element (first on ties); CPU helper used by samplers. */
int rk_argmax_f32(const float *x, int n);

/* Attention mass each key receives, a host reference computation for the
 * `query` repair policy: for every query row i (n_q rows of n_heads *
 * head_dim floats, already rotated) and head h, the softmax over keys
 * 0 .. q_len[i] - 1 (rows of n_kv_heads * head_dim floats, grouped query
 * attention: head h reads kv head h / (n_heads / n_kv_heads)) of the
 * scores params says (scale * q.k, soft-capped; with a window, row i sees
 * keys q_len[i] - window .. q_len[i] - 1 only; a head's sink in the
 * denominator), added into mass[j] for
 * every key j (in double). mass has
 * n_k entries (every q_len[i] in 1 .. n_k) and is added to, not cleared.
 * RK_ERR_NOMEM leaves it as it was; bad params are RK_ERR_INVALID. */
rk_status rk_attn_key_mass(const float *q, const int32_t *q_len, int n_q, const float *k, int n_k,
                           int n_heads, int n_kv_heads, int head_dim, const rk_attn_params *params,
                           double *mass);

#endif
