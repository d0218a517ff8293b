/* kernels/cpu/attention.c — causal GQA attention over a paged (or, for tests
 * and benchmarks, contiguous) KV cache.
 *
 * The algorithm, identical for both cache layouts:
 *  - The kv range [0, L) a query row sees is cut into partitions of
 *    RK_CPU_ATTN_PARTITION entries (boundaries at multiples of it, so they
 *    depend on L only), each partition into tiles of TILE entries.
 *  - Per partition, online softmax in f32: per tile the scores
 *    s = scale * q·k, the tile max, rescale of the running sum and
 *    accumulator, p = exp(s - max) and acc += p v in kv order.
 *  - Partitions are merged in order with their (max, sum): M' = max(M, m),
 *    S' = S e^(M-M') + l e^(m-M'), O' = O e^(M-M') + acc e^(m-M');
 *    out = O / S and lse = M + ln S; a head's sink logit (rk_attn_params)
 *    joins (M, S) as a last score of value zero before that.
 * All query heads of one kv head (the GQA group), and in prefill several
 * query rows, share one pass over each K/V tile. Parallelism: a prefill
 * sequence runs tasks of (row block, kv head) that walk the partitions in
 * order; a decode sequence (one query row) runs one task per (partition,
 * range of kv heads) -- whole kv entries stream from memory -- and a second
 * pass merges the partials (split-K). Every query vector's arithmetic is the
 * same whichever task, blocking or thread computes it, so the results do not
 * depend on the thread count, on the task split or on the block table.
 *
 * Segments (rk_attn_batch): a sequence's kv range is a list of runs, each
 * stored from a block of its own and carrying a position delta. A partition
 * is walked run piece by run piece (tiles restart at a run's first entry);
 * for a piece of a run with delta d != 0 the task's query vectors are
 * replaced by copies rotated by -d, made when the walk enters the run (the
 * cos/sin of each run are computed once per call). The online softmax state
 * carries across pieces, so the softmax is over all runs. Without segments
 * the walk is the single piece [p0, partition end) and nothing changes. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define TILE 32
#define PART RK_CPU_ATTN_PARTITION
/* Query vectors per prefill task: up to ROW_QVECS_MAX (rows * group), so each
 * K/V tile a task brings into L1 serves many queries, halved down to
 * ROW_QVECS_MIN while that leaves fewer than four tasks a thread. */
#define ROW_QVECS_MAX 128
#define ROW_QVECS_MIN 16
/* Query vectors the score and P·V kernels take at once: four needs 21 vector
 * registers, which AVX-512 provides; with 16, two. */
#ifdef __AVX512VL__
#define GROUP 4
#else
#define GROUP 2
#endif

/* ---------------------------------------------------------------- kv addressing */

/* Where the K/V entries of one sequence live and which of their kv heads a
 * task reads. */
typedef struct kv_src {
    const unsigned char *k, *v; /* paged: the layer's base; contiguous: the sequence's */
    const int32_t *table;       /* block table of the sequence, NULL when contiguous */
    int block_size;
    size_t row_bytes; /* bytes per kv entry (all kv heads) */
    size_t head_off;  /* bytes from an entry's start to the first kv head of the task */
    int seg;          /* elements per entry the task reads (its kv heads x head_dim) */
} kv_src;

/* Per-thread working memory of one task. */
typedef struct work {
    const void **kp, **vp; /* (TILE) row segments of the current tile in the cache */
    rk_dtype ty;           /* the cache's type */
    float *sc;             /* (nq, TILE + 8) scores, then probabilities */
    const float **q;       /* (nq) query vectors the kernels read */
    const float **q0;      /* (nq) the query vectors as given */
    float *qr;             /* (nq, head_dim) q0 rotated for run qrun */
    int qrun;              /* run whose rotation qr holds; -1: none */
    int *koff;             /* (nq) offset of the vector's kv head in a segment */
    int *lim;              /* (nq) visible entries per query vector */
    int *lo;               /* (nq) first visible entry (0 without a window) */
    int lo_min;            /* the smallest lo */
    float softcap;         /* > 0: scores soft-capped at it */
    float *m, *l, *acc;    /* (nq), (nq), (nq, head_dim): partition state */
    float *M, *S, *O;      /* (nq), (nq), (nq, head_dim): merged state */
} work;

/* Point kp/vp at the cache's segments of entries [t0, t0 + n) and prefetch
 * the next n_next. */
static void gather(const kv_src *src, rk_dtype dt, int t0, int n, int n_next, work *w) {
    w->ty = dt;
    int seg = src->seg;
    size_t slot = (size_t)t0, blk_left = SIZE_MAX;
    int b = 0;
    if (src->table) {
        b = t0 / src->block_size;
        int off = t0 % src->block_size;
        slot = (size_t)src->table[b] * src->block_size + off;
        blk_left = (size_t)(src->block_size - off);
    }
    for (int i = 0; i < n; i++) {
        if (blk_left == 0) { /* next block of the table (only when paged) */
            b++;
            slot = (size_t)src->table[b] * src->block_size;
            blk_left = (size_t)src->block_size;
        }
        size_t off = slot * src->row_bytes + src->head_off;
        w->kp[i] = src->k + off;
        w->vp[i] = src->v + off;
        slot++;
        blk_left--;
    }
    /* Prefetch the next n_next entries into L2: the hardware prefetcher does
     * not follow segments that lie a whole kv entry apart. */
    size_t seg_bytes = rk_dtype_row_bytes(dt, (size_t)seg);
    for (int i = 0; i < n_next; i++) {
        if (blk_left == 0) {
            b++;
            slot = (size_t)src->table[b] * src->block_size;
            blk_left = (size_t)src->block_size;
        }
        size_t off = slot * src->row_bytes + src->head_off;
        for (size_t l = 0; l < seg_bytes; l += 64) {
            __builtin_prefetch(src->k + off + l, 0, 2); /* into L2 */
            __builtin_prefetch(src->v + off + l, 0, 2);
        }
        slot++;
        blk_left--;
    }
}

/* ---------------------------------------------------------------- inner kernels */

/* The kernels read K and V as the cache stores them, F32, F16, BF16 or Q8_0
 * (type ty; Q8_0: eight int8 of a 32-value block times its f16 scale),
 * widening each load to f32 in registers, which is exact: a copy widened
 * ahead into f32 tiles measured slower (its stores and reloads cost more than
 * the widening), by about half for a decode query over 4k F16 entries. Each
 * kernel is written once as an always-inline body over ty and instantiated
 * per type by qk_group and pv_group, so every instance compiles to its type's
 * own loads. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Element e of a row of type ty, in f32. A Q8_0 row is blocks of 32: an f16
 * scale d, then 32 int8 q; the element is d * q. */
ALWAYS_INLINE float kv_at(const void *row, int e, rk_dtype ty) {
    if (ty == RK_DTYPE_Q8_0) {
        const unsigned char *b = (const unsigned char *)row + (size_t)(e / 32) * 34;
        uint16_t d;
        memcpy(&d, b, 2);
        return rk_f16_to_f32(d) * (float)(int8_t)b[2 + e % 32];
    }
    if (ty == RK_DTYPE_F16) return rk_f16_to_f32(((const uint16_t *)row)[e]);
    if (ty == RK_DTYPE_BF16) return rk_bf16_to_f32(((const uint16_t *)row)[e]);
    return ((const float *)row)[e];
}

/* A row of type ty advanced by off elements. */
ALWAYS_INLINE const void *kv_skip(const void *row, int off, rk_dtype ty) {
    if (ty == RK_DTYPE_Q8_0) return (const char *)row + (size_t)(off / 32) * 34; /* off % 32 == 0 */
    return (const char *)row + (size_t)off * (ty == RK_DTYPE_F32 ? 4 : 2);
}

/* Every score is one dot product with a fixed order: an 8-lane FMA chain over
 * the head dims in steps of 8, the lanes summed as
 * ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)), then the scalar tail, then * scale.
 * The kernels compute eight or sixteen dots at a time (two query vectors x
 * four keys, one x eight, four x four); a lane's arithmetic never depends on
 * the others, so a score has the same bits in every blocking. */
#ifdef __AVX2__
/* Elements e..e+7 of a row of type ty, in f32. */
ALWAYS_INLINE __m256 kv_load8(const void *row, int e, rk_dtype ty) {
    if (ty == RK_DTYPE_F32) return _mm256_loadu_ps((const float *)row + e);
    if (ty == RK_DTYPE_Q8_0) { /* e % 8 == 0: the eight lie in one block */
        const unsigned char *b = (const unsigned char *)row + (size_t)(e / 32) * 34;
        uint16_t d;
        memcpy(&d, b, 2);
        __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + e % 32));
        return _mm256_mul_ps(_mm256_set1_ps(rk_f16_to_f32(d)),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + e));
    if (ty == RK_DTYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Keep a loaded vector in a register: the compiler would otherwise fold the
 * load into each of the FMAs that use it, four loads instead of one. */
#define KEEP_IN_REGISTER(x) __asm__("" : "+v"(x))

static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                             __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* out[j] = scale * (sum[j] + the scalar tail of qs[j]·ks[j] over dims
 * [hd8, hd)) for eight dots whose 8-lane part is summed in sum. */
ALWAYS_INLINE void finish8(const float *sum, const float *const *qs, const void *const *ks, int hd8,
                           int hd, float scale, float *out, rk_dtype ty) {
    for (int j = 0; j < 8; j++) {
        float a = sum[j];
        for (int e = hd8; e < hd; e++) a += qs[j][e] * kv_at(ks[j], e, ty);
        out[j] = a * scale;
    }
}

/* The 8-lane parts of eight dots qs[j]·ks[j] without intrinsics (the
 * portable build): the same lanes and the same sum. */
ALWAYS_INLINE void sum8_portable(float *sum, const float *const *qs, const void *const *ks, int hd8,
                                 rk_dtype ty) {
    for (int j = 0; j < 8; j++) {
        float lane[8] = {0};
        for (int e = 0; e < hd8; e += 8)
            for (int l = 0; l < 8; l++) lane[l] += qs[j][e + l] * kv_at(ks[j], e + l, ty);
        sum[j] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
                 ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
}

/* out[j] = scale * qs[j]·ks[j] for eight (query, key) pairs where the queries
 * come as two vectors x four keys (q0 q0 q0 q0 q1 q1 q1 q1). */
ALWAYS_INLINE void dot8_2x4(const float *q0, const float *q1, const void *const *k, int hd,
                            float scale, float *out, rk_dtype ty) {
    int hd8 = hd & ~7;
    const float *qs[8] = {q0, q0, q0, q0, q1, q1, q1, q1};
    const void *ks[8] = {k[0], k[1], k[2], k[3], k[0], k[1], k[2], k[3]};
    float sum[8];
#ifdef __AVX2__
    __m256 a[4], b[4];
    for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();
    for (int e = 0; e < hd8; e += 8) {
        __m256 x0 = _mm256_loadu_ps(q0 + e), x1 = _mm256_loadu_ps(q1 + e);
        for (int j = 0; j < 4; j++) {
            __m256 kv = kv_load8(k[j], e, ty);
            a[j] = _mm256_fmadd_ps(x0, kv, a[j]);
            b[j] = _mm256_fmadd_ps(x1, kv, b[j]);
        }
    }
    __m256 r = reduce8(a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]);
    if (hd8 == hd) { /* no tail: the same bits as finish8 */
        _mm256_storeu_ps(out, _mm256_mul_ps(r, _mm256_set1_ps(scale)));
        return;
    }
    _mm256_storeu_ps(sum, r);
#else
    sum8_portable(sum, qs, ks, hd8, ty);
#endif
    finish8(sum, qs, ks, hd8, hd, scale, out, ty);
}

/* out[j] = scale * q·k[j] for eight keys. */
ALWAYS_INLINE void dot8_1x8(const float *q, const void *const *k, int hd, float scale, float *out,
                            rk_dtype ty) {
    int hd8 = hd & ~7;
    const float *qs[8] = {q, q, q, q, q, q, q, q};
    float sum[8];
#ifdef __AVX2__
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int e = 0; e < hd8; e += 8) {
        __m256 x = _mm256_loadu_ps(q + e);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(x, kv_load8(k[j], e, ty), a[j]);
    }
    __m256 r = reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    if (hd8 == hd) {
        _mm256_storeu_ps(out, _mm256_mul_ps(r, _mm256_set1_ps(scale)));
        return;
    }
    _mm256_storeu_ps(sum, r);
#else
    sum8_portable(sum, qs, k, hd8, ty);
#endif
    finish8(sum, qs, k, hd8, hd, scale, out, ty);
}

/* out[4a + b] = scale * q[a]·k[b] for four query vectors x four keys: 16
 * chains, so every key row loaded meets four queries (the prefill case). */
ALWAYS_INLINE void dot16_4x4(const float *const *q, const void *const *k, int hd, float scale,
                             float *out, rk_dtype ty) {
#ifdef __AVX2__
    int hd8 = hd & ~7;
    __m256 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
    for (int e = 0; e < hd8; e += 8) {
        __m256 kv[4];
        for (int j = 0; j < 4; j++) {
            kv[j] = kv_load8(k[j], e, ty);
            KEEP_IN_REGISTER(kv[j]);
        }
        for (int i = 0; i < 4; i++) {
            __m256 x = _mm256_loadu_ps(q[i] + e);
            KEEP_IN_REGISTER(x);
            for (int j = 0; j < 4; j++) a[i][j] = _mm256_fmadd_ps(x, kv[j], a[i][j]);
        }
    }
    for (int h = 0; h < 2; h++) {
        const float *const *qh = q + 2 * h;
        __m256 r = reduce8(a[2 * h][0], a[2 * h][1], a[2 * h][2], a[2 * h][3], a[2 * h + 1][0],
                           a[2 * h + 1][1], a[2 * h + 1][2], a[2 * h + 1][3]);
        if (hd8 == hd) {
            _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(r, _mm256_set1_ps(scale)));
            continue;
        }
        float sum[8];
        _mm256_storeu_ps(sum, r);
        const float *qs[8] = {qh[0], qh[0], qh[0], qh[0], qh[1], qh[1], qh[1], qh[1]};
        const void *ks[8] = {k[0], k[1], k[2], k[3], k[0], k[1], k[2], k[3]};
        finish8(sum, qs, ks, hd8, hd, scale, out + 8 * h, ty);
    }
#else
    dot8_2x4(q[0], q[1], k, hd, scale, out, ty);
    dot8_2x4(q[2], q[3], k, hd, scale, out + 8, ty);
#endif
}

/* Scores of the nv query vectors v[0..nv) (at most four, of one kv head)
 * against the first n keys of the tile; rows of sc are TILE + 8 long. Keys
 * past n are padded with the last one (their scores are computed and
 * ignored). */
ALWAYS_INLINE void qk_group_of(work *w, const int *v, int nv, int n, int hd, float scale,
                               rk_dtype ty) {
    const void *kp[TILE + 8];
    int off = w->koff[v[0]];
    for (int t = 0; t < n; t++) kp[t] = kv_skip(w->kp[t], off, ty);
    for (int t = n; t < TILE + 8; t++) kp[t] = kp[n - 1];
    float *s[4];
    const float *q[4];
    for (int i = 0; i < nv; i++) {
        s[i] = w->sc + (size_t)v[i] * (TILE + 8);
        q[i] = w->q[v[i]];
    }
    float out[16];
    if (nv == 4) {
        for (int t = 0; t < n; t += 4) {
            dot16_4x4(q, kp + t, hd, scale, out, ty);
            for (int i = 0; i < 4; i++) memcpy(s[i] + t, out + 4 * i, 4 * sizeof(float));
        }
        return;
    }
    int i = 0;
    if (nv >= 2) {
        for (int t = 0; t < n; t += 4) {
            dot8_2x4(q[0], q[1], kp + t, hd, scale, out, ty);
            memcpy(s[0] + t, out, 4 * sizeof(float));
            memcpy(s[1] + t, out + 4, 4 * sizeof(float));
        }
        i = 2;
    }
    if (i < nv)
        for (int t = 0; t < n; t += 8) dot8_1x8(q[i], kp + t, hd, scale, s[i] + t, ty);
}

/* acc(hd) += sum over t < n of p[t] * v[t]: for every element an FMA chain in
 * t order (the same in pv_1, pv_2 and pv_4). */
ALWAYS_INLINE void pv_1(float *acc, const float *p, const void *const *vp, int n, int hd,
                        rk_dtype ty) {
    int d = 0;
#ifdef __AVX2__
    for (; d + 64 <= hd; d += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + d + 8 * j);
        for (int t = 0; t < n; t++) {
            __m256 pb = _mm256_set1_ps(p[t]);
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_fmadd_ps(pb, kv_load8(vp[t], d + 8 * j, ty), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + d + 8 * j, a[j]);
    }
    for (; d + 8 <= hd; d += 8) {
        __m256 a0 = _mm256_loadu_ps(acc + d);
        for (int t = 0; t < n; t++)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), kv_load8(vp[t], d, ty), a0);
        _mm256_storeu_ps(acc + d, a0);
    }
    for (; d < hd; d++) {
        float a = acc[d];
        for (int t = 0; t < n; t++) a = fmaf(p[t], kv_at(vp[t], d, ty), a);
        acc[d] = a;
    }
#else
    for (; d < hd; d++) {
        float a = acc[d];
        for (int t = 0; t < n; t++) a += p[t] * kv_at(vp[t], d, ty);
        acc[d] = a;
    }
#endif
}

/* pv_1 for two query vectors over the same n entries, sharing the V loads. */
ALWAYS_INLINE void pv_2(float *acc0, float *acc1, const float *p0, const float *p1,
                        const void *const *vp, int n, int hd, rk_dtype ty) {
    int d = 0;
#ifdef __AVX2__
    for (; d + 32 <= hd; d += 32) {
        __m256 a[4], b[4];
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_loadu_ps(acc0 + d + 8 * j);
            b[j] = _mm256_loadu_ps(acc1 + d + 8 * j);
        }
        for (int t = 0; t < n; t++) {
            __m256 pa = _mm256_set1_ps(p0[t]), pb = _mm256_set1_ps(p1[t]);
            for (int j = 0; j < 4; j++) {
                __m256 x = kv_load8(vp[t], d + 8 * j, ty);
                a[j] = _mm256_fmadd_ps(pa, x, a[j]);
                b[j] = _mm256_fmadd_ps(pb, x, b[j]);
            }
        }
        for (int j = 0; j < 4; j++) {
            _mm256_storeu_ps(acc0 + d + 8 * j, a[j]);
            _mm256_storeu_ps(acc1 + d + 8 * j, b[j]);
        }
    }
#endif
    if (d < hd) {
        const void *vt[TILE];
        for (int t = 0; t < n; t++) vt[t] = kv_skip(vp[t], d, ty);
        pv_1(acc0 + d, p0, vt, n, hd - d, ty);
        pv_1(acc1 + d, p1, vt, n, hd - d, ty);
    }
}

/* pv_1 for four query vectors over the same n entries: every V element
 * loaded meets four probabilities. */
ALWAYS_INLINE void pv_4(float *const *acc, const float *const *p, const void *const *vp, int n,
                        int hd, rk_dtype ty) {
    int d = 0;
#ifdef __AVX2__
    for (; d + 32 <= hd; d += 32) {
        __m256 a[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm256_loadu_ps(acc[i] + d + 8 * j);
        for (int t = 0; t < n; t++) {
            __m256 v[4];
            for (int j = 0; j < 4; j++) {
                v[j] = kv_load8(vp[t], d + 8 * j, ty);
                KEEP_IN_REGISTER(v[j]);
            }
            for (int i = 0; i < 4; i++) {
                __m256 pb = _mm256_set1_ps(p[i][t]);
                for (int j = 0; j < 4; j++) a[i][j] = _mm256_fmadd_ps(pb, v[j], a[i][j]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc[i] + d + 8 * j, a[i][j]);
    }
#endif
    if (d < hd) {
        const void *vt[TILE];
        for (int t = 0; t < n; t++) vt[t] = kv_skip(vp[t], d, ty);
        for (int i = 0; i < 4; i++) pv_1(acc[i] + d, p[i], vt, n, hd - d, ty);
    }
}

/* P·V for the nv vectors v[0..nv) (at most four, of one kv head and the
 * same count) over the first n entries of the tile. */
ALWAYS_INLINE void pv_group_of(work *w, const int *v, int nv, int n, int hd, rk_dtype ty) {
    const void *vp[TILE];
    int off = w->koff[v[0]];
    for (int t = 0; t < n; t++) vp[t] = kv_skip(w->vp[t], off, ty);
    float *acc[4];
    const float *p[4];
    for (int i = 0; i < nv; i++) {
        acc[i] = w->acc + (size_t)v[i] * hd;
        p[i] = w->sc + (size_t)v[i] * (TILE + 8);
    }
    if (nv == 4) {
        pv_4(acc, p, vp, n, hd, ty);
        return;
    }
    int i = 0;
    if (nv >= 2) {
        pv_2(acc[0], acc[1], p[0], p[1], vp, n, hd, ty);
        i = 2;
    }
    if (i < nv) pv_1(acc[i], p[i], vp, n, hd, ty);
}

/* The instances, one per type the tile's rows can have. */
static void qk_group(work *w, const int *v, int nv, int n, int hd, float scale) {
    switch (w->ty) {
    case RK_DTYPE_F16: qk_group_of(w, v, nv, n, hd, scale, RK_DTYPE_F16); break;
    case RK_DTYPE_Q8_0: qk_group_of(w, v, nv, n, hd, scale, RK_DTYPE_Q8_0); break;
    case RK_DTYPE_BF16: qk_group_of(w, v, nv, n, hd, scale, RK_DTYPE_BF16); break;
    default: qk_group_of(w, v, nv, n, hd, scale, RK_DTYPE_F32); break;
    }
}

static void pv_group(work *w, const int *v, int nv, int n, int hd) {
    switch (w->ty) {
    case RK_DTYPE_F16: pv_group_of(w, v, nv, n, hd, RK_DTYPE_F16); break;
    case RK_DTYPE_Q8_0: pv_group_of(w, v, nv, n, hd, RK_DTYPE_Q8_0); break;
    case RK_DTYPE_BF16: pv_group_of(w, v, nv, n, hd, RK_DTYPE_BF16); break;
    default: pv_group_of(w, v, nv, n, hd, RK_DTYPE_F32); break;
    }
}

/* Entries of vector i in the tile [t0, t1) of the partition at p0 that its
 * scores cover, from t0 to its last visible one (those before its window
 * start, lo, are masked by mask_scores); 0 when it sees none. */
static inline int tile_count(const work *w, int i, int p0, int t0, int t1) {
    if (t1 <= w->lo[i]) return 0; /* wholly before the vector's window */
    int e = w->lim[i] < p0 + PART ? w->lim[i] : p0 + PART;
    if (e > t1) e = t1;
    return e - t0;
}

/* Online-softmax update of vector i with its n scores in sc (turned into
 * probabilities in place); returns the factor the accumulator must be scaled
 * by. */
/* Soft-cap the n scores of vector i for the tile at t0 and mask those before
 * its window (at least one remains, see tile_count). */
static void mask_scores(work *w, int i, int t0, int n) {
    float *sc = w->sc + (size_t)i * (TILE + 8);
    if (w->softcap > 0.0f) {
        float cap = w->softcap;
        for (int t = 0; t < n; t++) sc[t] = cap * tanhf(sc[t] / cap);
    }
    for (int t = 0; t < w->lo[i] - t0 && t < n; t++) sc[t] = -INFINITY;
}

static float softmax_update(work *w, int i, int n) {
    float *sc = w->sc + (size_t)i * (TILE + 8);
    float mt, ls = 0.0f;
#ifdef __AVX2__
    int n8 = (n + 7) & ~7;
    for (int t = n; t < n8; t++) sc[t] = -INFINITY; /* padding: exp gives 0 */
    __m256 mx = _mm256_loadu_ps(sc);
    for (int t = 8; t < n8; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    mt = lanes[0];
    for (int j = 1; j < 8; j++) mt = lanes[j] > mt ? lanes[j] : mt;
#else
    mt = sc[0];
    for (int t = 1; t < n; t++) mt = sc[t] > mt ? sc[t] : mt;
#endif
    float m_new = w->m[i] > mt ? w->m[i] : mt;
    float alpha = expf(w->m[i] - m_new); /* 0 on the first tile */
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(m_new), sum = _mm256_setzero_ps();
    for (int t = 0; t < n8; t += 8) {
        __m256 p = rk_exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mv));
        _mm256_storeu_ps(sc + t, p);
        sum = _mm256_add_ps(sum, p);
    }
    ls = rk_hsum256(sum);
#else
    for (int t = 0; t < n; t++) sc[t] -= m_new;
    rk_cpu_exp(sc, sc, (size_t)n);
    for (int t = 0; t < n; t++) ls += sc[t];
#endif
    w->l[i] = w->l[i] * alpha + ls;
    w->m[i] = m_new;
    return alpha;
}

/* The runs of one sequence (see rk_attn_batch), indexed from its first. */
typedef struct seq_runs {
    const int32_t *end;   /* (n) entry (exclusive) where run r ends */
    const int32_t *delta; /* (n) */
    const int32_t *block; /* (n) first table entry of run r */
    const float *cs;      /* (n, n_rot): cos of the n_rot / 2 pairs, then sin, of -delta */
    int n_rot;
    rk_rope_pairing pairing;
} seq_runs;

/* Online-softmax pass of the nq query vectors over the entries [a, b) of the
 * partition at p0, read from src with entry i at src's index i - base. */
static void attn_tiles(const kv_src *src, rk_dtype dt, int hd, float scale, int nq, int p0, int a,
                       int b, int base, work *w) {
    for (int t0 = a; t0 < b; t0 += TILE) {
        int t1 = t0 + TILE < b ? t0 + TILE : b;
        if (t1 <= w->lo_min) continue; /* before every vector's window */
        int n_next = b - t1 < TILE ? b - t1 : TILE;
        gather(src, dt, t0 - base, t1 - t0, n_next, w);
        /* scores, up to GROUP vectors at a time that see the tile and share a
         * kv head */
        int v[4], nv = 0, nmax = 0;
        for (int i = 0; i < nq; i++) {
            int n = tile_count(w, i, p0, t0, t1);
            if (n <= 0) continue;
            if (nv == GROUP || (nv > 0 && w->koff[v[0]] != w->koff[i])) {
                qk_group(w, v, nv, nmax, hd, scale);
                nv = nmax = 0;
            }
            v[nv++] = i;
            nmax = n > nmax ? n : nmax;
        }
        if (nv > 0) qk_group(w, v, nv, nmax, hd, scale);
        /* softmax, then P·V up to GROUP vectors at a time that also see the
         * same entries */
        int ncount = 0;
        nv = 0;
        for (int i = 0; i < nq; i++) {
            int n = tile_count(w, i, p0, t0, t1);
            if (n <= 0) continue;
            mask_scores(w, i, t0, n);
            float alpha = softmax_update(w, i, n);
            float *acc = w->acc + (size_t)i * hd;
            if (alpha != 1.0f)
                for (int d = 0; d < hd; d++) acc[d] *= alpha;
            if (nv == GROUP || (nv > 0 && (w->koff[v[0]] != w->koff[i] || ncount != n))) {
                pv_group(w, v, nv, ncount, hd);
                nv = 0;
            }
            v[nv++] = i;
            ncount = n;
        }
        if (nv > 0) pv_group(w, v, nv, ncount, hd);
    }
}

/* Point w->q at the query vectors to use against run r: the given ones for
 * delta 0, else copies rotated by -delta (made once while the walk stays in
 * the run). */
static void use_run(const seq_runs *runs, int r, int nq, int hd, work *w) {
    if (runs->delta[r] == 0) {
        memcpy(w->q, w->q0, (size_t)nq * sizeof *w->q);
        return;
    }
    if (w->qrun != r) {
        const float *c = runs->cs + (size_t)r * runs->n_rot, *sn = c + runs->n_rot / 2;
        for (int i = 0; i < nq; i++) {
            float *x = w->qr + (size_t)i * hd;
            memcpy(x, w->q0[i], (size_t)hd * sizeof(float));
            rk_cpu_rotate_head(x, c, sn, runs->n_rot, runs->pairing);
        }
        w->qrun = r;
    }
    for (int i = 0; i < nq; i++) w->q[i] = w->qr + (size_t)i * hd;
}

/* Reduce the partition starting at p0 for the nq query vectors in w: vector i
 * sees entries [p0, min(p0 + PART, lim[i])). Sets w->m, w->l, w->acc (a vector
 * with an empty range is left at m = -inf, l = 0, acc = 0). runs NULL: the
 * entries are packed in src's table; else walked run by run. */
static void attn_partition(const kv_src *src, const seq_runs *runs, rk_dtype dt, int hd,
                           float scale, int nq, int p0, work *w) {
    int p_end = 0;
    for (int i = 0; i < nq; i++) {
        int e = w->lim[i] < p0 + PART ? w->lim[i] : p0 + PART;
        if (e > p_end) p_end = e;
        w->m[i] = -INFINITY;
        w->l[i] = 0.0f;
    }
    memset(w->acc, 0, (size_t)nq * hd * sizeof(float));
    if (!runs) {
        attn_tiles(src, dt, hd, scale, nq, p0, p0, p_end, 0, w);
        return;
    }
    int r = 0;
    while (runs->end[r] <= p0) r++;
    for (int a = p0; a < p_end; r++) {
        int begin = r > 0 ? runs->end[r - 1] : 0;
        int b = runs->end[r] < p_end ? runs->end[r] : p_end;
        if (b <= w->lo_min) { /* before every vector's window: not rotated for */
            a = b;
            continue;
        }
        kv_src piece = *src;
        piece.table = src->table + runs->block[r];
        use_run(runs, r, nq, hd, w);
        attn_tiles(&piece, dt, hd, scale, nq, p0, a, b, begin, w);
        a = b;
    }
}

/* Merge one partition result (m, l, acc) into the running (M, S, O). A
 * partition the vector saw nothing of (before its window: m = -inf, l = 0)
 * leaves it as it was, and a running state of nothing is replaced. */
static void merge_part(float *M, float *S, float *O, float m, float l, const float *acc, int hd,
                       int first) {
    if (!first && m == -INFINITY) return;
    if (first || *M == -INFINITY) {
        *M = m;
        *S = l;
        memcpy(O, acc, (size_t)hd * sizeof(float));
        return;
    }
    float mn = *M > m ? *M : m;
    float a = expf(*M - mn), b = expf(m - mn);
    *S = *S * a + l * b;
    for (int d = 0; d < hd; d++) O[d] = O[d] * a + acc[d] * b;
    *M = mn;
}

/* out = O / S; with a sink logit (sinks non-NULL, its head's) first joined
 * to the running (M, S, O) as a score whose value is zero. */
static void finish(float *out, float *lse, float M, float S, const float *O, int hd,
                   const float *sinks, size_t qi, int n_heads) {
    float a = 1.0f;
    if (sinks) {
        float sk = sinks[qi % (size_t)n_heads], mn = M > sk ? M : sk;
        a = expf(M - mn);
        S = S * a + expf(sk - mn);
        M = mn;
    }
    for (int d = 0; d < hd; d++) out[d] = sinks ? O[d] * a / S : O[d] / S;
    if (lse) *lse = M + logf(S);
}

/* ---------------------------------------------------------------- driver */

typedef struct attn_task {
    int seq, j0, j1, h0, h1; /* query rows j0..j1-1, kv heads h0..h1-1 */
    int part;                /* split tasks: the partition; -1: walk all partitions */
    size_t partial;          /* split: offset (floats) of the sequence's partials */
} attn_task;

typedef struct attn_ctx {
    rk_cpu *cpu;
    float *out, *lse;
    const float *q;
    /* paged */
    const rk_kv_cache *kv;
    int layer;
    const int32_t *table;
    int max_blocks;
    /* contiguous */
    const void *const *ck, *const *cv;
    int n_kv_heads, head_dim;
    rk_dtype dtype;
    const int32_t *q_start, *kv_len;
    int n_heads, group, nq_max, heads_max;
    float scale, softcap;
    int window;
    const float *sinks;
    const attn_task *tasks;
    const attn_task *merges;
    float *partials; /* per decode sequence: (n_kv_heads, n_parts, group, head_dim + 2) */
    /* segments (paged only; seg_start NULL: none) */
    const int32_t *seg_start, *seg_end, *seg_delta;
    const rk_rope *rope;
    int32_t *seg_block; /* (runs) first table entry of each run */
    float *seg_cs;      /* (runs, n_rot) cos, sin of -delta per pair */
} attn_ctx;

/* The runs of sequence seq, or NULL when the batch has no segments. */
static const seq_runs *make_runs(const attn_ctx *c, int seq, seq_runs *runs) {
    if (!c->seg_start) return NULL;
    int k0 = c->seg_start[seq];
    runs->end = c->seg_end + k0;
    runs->delta = c->seg_delta + k0;
    runs->block = c->seg_block + k0;
    runs->n_rot = c->rope ? c->rope->n_rot : 0;
    runs->cs = c->seg_cs + (size_t)k0 * runs->n_rot;
    runs->pairing = c->rope ? c->rope->pairing : RK_ROPE_NORMAL;
    return runs;
}

static void make_src(const attn_ctx *c, int seq, int h0, int h1, kv_src *src) {
    src->row_bytes = rk_dtype_row_bytes(c->dtype, (size_t)c->n_kv_heads * c->head_dim);
    src->head_off = rk_dtype_row_bytes(c->dtype, (size_t)h0 * c->head_dim);
    src->seg = (h1 - h0) * c->head_dim;
    if (c->kv) {
        src->k = c->kv->k[c->layer];
        src->v = c->kv->v[c->layer];
        src->table = c->table + (size_t)seq * c->max_blocks;
        src->block_size = c->kv->block_size;
    } else {
        src->k = c->ck[seq];
        src->v = c->cv[seq];
        src->table = NULL;
        src->block_size = 0;
    }
}

static size_t work_bytes(int nq, int hd) {
    size_t f = (size_t)nq * (TILE + 8) + 3 * (size_t)nq * hd + 4 * (size_t)nq;
    return f * sizeof(float) + (2 * TILE + 2 * (size_t)nq) * sizeof(float *) +
           3 * (size_t)nq * sizeof(int) + 256;
}

static void work_init(work *w, void *mem, int nq, int hd) {
    const void **rows = mem;
    w->kp = rows;
    w->vp = rows + TILE;
    const float **pp = (const float **)(rows + 2 * TILE);
    w->q = pp;
    w->q0 = pp + nq;
    w->qrun = -1;
    float *f = (float *)(pp + 2 * nq);
    w->sc = f;
    f += (size_t)nq * (TILE + 8);
    w->m = f;
    f += nq;
    w->l = f;
    f += nq;
    w->M = f;
    f += nq;
    w->S = f;
    f += nq;
    w->acc = f;
    f += (size_t)nq * hd;
    w->O = f;
    f += (size_t)nq * hd;
    w->qr = f;
    f += (size_t)nq * hd;
    w->lim = (int *)f;
    w->koff = w->lim + nq;
    w->lo = w->koff + nq;
    w->lo_min = 0;
    w->softcap = 0.0f;
}

/* Fill the query vectors of rows j0..j1-1 of a sequence and kv heads h0..h1-1
 * (row-major, then head, then the head's group). Returns their number. */
static int setup_vectors(const attn_ctx *c, const attn_task *t, work *w) {
    int n_q = c->q_start[t->seq + 1] - c->q_start[t->seq];
    int L = c->kv_len[t->seq];
    int nq = 0;
    w->lo_min = INT32_MAX;
    w->softcap = c->softcap;
    for (int j = t->j0; j < t->j1; j++) {
        int lim = L - n_q + j + 1; /* the row's own entry is lim - 1 */
        int lo = c->window > 0 && lim > c->window ? lim - c->window : 0;
        if (lo < w->lo_min) w->lo_min = lo;
        size_t row = (size_t)(c->q_start[t->seq] + j);
        for (int h = t->h0; h < t->h1; h++)
            for (int g = 0; g < c->group; g++) {
                w->q[nq] = c->q + (row * c->n_heads + (size_t)h * c->group + g) * c->head_dim;
                w->q0[nq] = w->q[nq];
                w->koff[nq] = (h - t->h0) * c->head_dim;
                w->lim[nq] = lim;
                w->lo[nq] = lo;
                nq++;
            }
    }
    return nq;
}

static void task_run(void *p, int ti, int tid) {
    const attn_ctx *c = p;
    const attn_task *t = &c->tasks[ti];
    int hd = c->head_dim, G = c->group;
    work w;
    work_init(&w, rk_cpu_scratch(c->cpu, tid), c->nq_max, hd);
    kv_src src;
    make_src(c, t->seq, t->h0, t->h1, &src);
    seq_runs runs_mem;
    const seq_runs *runs = make_runs(c, t->seq, &runs_mem);
    int nq = setup_vectors(c, t, &w);
    if (t->part >= 0) { /* split-K: one partition, partials out */
        attn_partition(&src, runs, c->dtype, hd, c->scale, nq, t->part * PART, &w);
        int n_parts = (c->kv_len[t->seq] + PART - 1) / PART;
        for (int i = 0; i < nq; i++) {
            int h = t->h0 + i / G, g = i % G;
            float *dst = c->partials + t->partial +
                         (((size_t)h * n_parts + t->part) * G + g) * (size_t)(hd + 2);
            dst[0] = w.m[i];
            dst[1] = w.l[i];
            memcpy(dst + 2, w.acc + (size_t)i * hd, (size_t)hd * sizeof(float));
        }
        return;
    }
    int lmax = 0;
    for (int i = 0; i < nq; i++) lmax = w.lim[i] > lmax ? w.lim[i] : lmax;
    int pfirst = w.lo_min / PART * PART; /* partitions before it hold no window */
    for (int p0 = pfirst; p0 < lmax; p0 += PART) {
        attn_partition(&src, runs, c->dtype, hd, c->scale, nq, p0, &w);
        for (int i = 0; i < nq; i++)
            if (p0 < w.lim[i])
                merge_part(&w.M[i], &w.S[i], w.O + (size_t)i * hd, w.m[i], w.l[i],
                           w.acc + (size_t)i * hd, hd, p0 == pfirst);
    }
    int per_row = (t->h1 - t->h0) * G;
    for (int i = 0; i < nq; i++) {
        int j = t->j0 + i / per_row, h = t->h0 + (i % per_row) / G, g = i % G;
        size_t qi = (size_t)(c->q_start[t->seq] + j) * c->n_heads + (size_t)h * G + g;
        finish(c->out + qi * hd, c->lse ? c->lse + qi : NULL, w.M[i], w.S[i], w.O + (size_t)i * hd,
               hd, c->sinks, qi, c->n_heads);
    }
}

/* Merge the partials of one (decode sequence, kv head) in partition order. */
static void merge_run(void *p, int ti, int tid) {
    const attn_ctx *c = p;
    const attn_task *t = &c->merges[ti];
    int hd = c->head_dim, G = c->group;
    work w;
    work_init(&w, rk_cpu_scratch(c->cpu, tid), c->nq_max, hd);
    int n_parts = (c->kv_len[t->seq] + PART - 1) / PART;
    const float *base = c->partials + t->partial + (size_t)t->h0 * n_parts * G * (hd + 2);
    for (int pi = 0; pi < n_parts; pi++) {
        for (int g = 0; g < G; g++) {
            const float *e = base + ((size_t)pi * G + g) * (hd + 2);
            merge_part(&w.M[g], &w.S[g], w.O + (size_t)g * hd, e[0], e[1], e + 2, hd, pi == 0);
        }
    }
    size_t row = (size_t)c->q_start[t->seq];
    for (int g = 0; g < G; g++) {
        size_t qi = row * c->n_heads + (size_t)t->h0 * G + g;
        finish(c->out + qi * hd, c->lse ? c->lse + qi : NULL, w.M[g], w.S[g], w.O + (size_t)g * hd,
               hd, c->sinks, qi, c->n_heads);
    }
}

/* Fill seg_block (runs packed in the table, each from a block of its own) and
 * seg_cs: per pair i the cos and sin of -(float)delta * freq[i], the inverse
 * of the rotation rope_shift_copy applies for delta, built from the same
 * angle. */
static void plan_runs(attn_ctx *c, int n_seqs, int n_rot) {
    int bs = c->kv->block_size, half = n_rot / 2;
    for (int s = 0; s < n_seqs; s++) {
        int32_t block = 0, begin = 0;
        for (int32_t k = c->seg_start[s]; k < c->seg_start[s + 1]; k++) {
            c->seg_block[k] = block;
            block += (c->seg_end[k] - begin + bs - 1) / bs;
            begin = c->seg_end[k];
            if (c->seg_delta[k] == 0) continue;
            float fd = (float)c->seg_delta[k], *cs = c->seg_cs + (size_t)k * n_rot;
            for (int i = 0; i < half; i++) {
                float a = fd * c->rope->freq[i];
                cs[i] = cosf(a);
                cs[half + i] = -sinf(a);
            }
        }
    }
}

/* Plan the tasks, run them, then run the merges of the split sequences. The
 * plan may depend on the thread count (how finely decode heads are split);
 * the results do not. */
static rk_status attn_run(attn_ctx *c, int n_seqs) {
    rk_cpu *cpu = c->cpu;
    int G = c->group, hd = c->head_dim, H = c->n_kv_heads;
    int rows_per = 1;
    size_t n_prefill = 0;
    for (int vecs = ROW_QVECS_MAX; vecs >= ROW_QVECS_MIN; vecs /= 2) {
        rows_per = vecs / G > 1 ? vecs / G : 1;
        n_prefill = 0;
        for (int s = 0; s < n_seqs; s++) {
            int n_q = c->q_start[s + 1] - c->q_start[s];
            if (n_q > 1) n_prefill += (size_t)((n_q + rows_per - 1) / rows_per) * H;
        }
        if (n_prefill >= 4 * (size_t)cpu->n_threads) break;
    }
    size_t n_parts_total = 0, n_decode = 0, n_partials = 0;
    for (int s = 0; s < n_seqs; s++) {
        if (c->q_start[s + 1] - c->q_start[s] != 1) continue;
        size_t parts = (size_t)(c->kv_len[s] + PART - 1) / PART;
        n_parts_total += parts;
        n_decode++;
        n_partials += parts * H * G * (size_t)(hd + 2);
    }
    /* decode: whole kv entries per task unless that leaves threads idle */
    int n_groups = 1;
    if (n_parts_total > 0) {
        size_t want = 4 * (size_t)cpu->n_threads;
        if (n_parts_total < want) n_groups = (int)((want + n_parts_total - 1) / n_parts_total);
        if (n_groups > H) n_groups = H;
    }
    size_t n_tasks = n_prefill + n_parts_total * n_groups, n_merges = n_decode * H;
    if (n_tasks == 0) return RK_OK;
    if (n_tasks > INT32_MAX || n_merges > INT32_MAX)
        return rk_errorf(RK_ERR_LIMIT, "attention: batch too large (%zu tasks)", n_tasks);
    c->heads_max = n_parts_total > 0 ? (H + n_groups - 1) / n_groups : 1;
    c->nq_max = rows_per * G > c->heads_max * G ? rows_per * G : c->heads_max * G;
    size_t task_bytes = (n_tasks + n_merges) * sizeof(attn_task);
    task_bytes = (task_bytes + 63) / 64 * 64;
    size_t n_runs = c->seg_start ? (size_t)c->seg_start[n_seqs] : 0;
    int n_rot = c->rope ? c->rope->n_rot : 0;
    size_t run_bytes = n_runs * (sizeof(int32_t) + (size_t)n_rot * sizeof(float));
    void *mem;
    rk_status st =
        rk_cpu_reserve_shared(cpu, task_bytes + n_partials * sizeof(float) + run_bytes, &mem);
    if (st != RK_OK) return st;
    st = rk_cpu_reserve_scratch(cpu, work_bytes(c->nq_max, hd));
    if (st != RK_OK) return st;
    attn_task *tasks = mem, *merges = tasks + n_tasks;
    c->partials = (float *)((unsigned char *)mem + task_bytes);
    if (n_runs) {
        c->seg_cs = c->partials + n_partials;
        c->seg_block = (int32_t *)(c->seg_cs + n_runs * n_rot);
        plan_runs(c, n_seqs, n_rot);
    }

    size_t ti = 0, mi = 0, off = 0;
    for (int s = 0; s < n_seqs; s++) {
        int n_q = c->q_start[s + 1] - c->q_start[s];
        if (n_q == 0) continue;
        if (n_q == 1) {
            int parts = (c->kv_len[s] + PART - 1) / PART;
            for (int p = 0; p < parts; p++)
                for (int g = 0; g < n_groups; g++) {
                    int h0 = g * H / n_groups, h1 = (g + 1) * H / n_groups;
                    if (h1 > h0) tasks[ti++] = (attn_task){s, 0, 1, h0, h1, p, off};
                }
            for (int h = 0; h < H; h++) merges[mi++] = (attn_task){s, 0, 1, h, h + 1, 0, off};
            off += (size_t)parts * H * G * (hd + 2);
        } else {
            /* last rows first: they see the most entries, and the pool
             * ends better balanced when its longest tasks come first */
            for (int j0 = (n_q - 1) / rows_per * rows_per; j0 >= 0; j0 -= rows_per) {
                int j1 = j0 + rows_per < n_q ? j0 + rows_per : n_q;
                for (int h = 0; h < H; h++) tasks[ti++] = (attn_task){s, j0, j1, h, h + 1, -1, 0};
            }
        }
    }
    c->tasks = tasks;
    c->merges = merges;
    rk_threadpool_run(cpu->pool, (int)ti, task_run, c);
    if (mi) rk_threadpool_run(cpu->pool, (int)mi, merge_run, c);
    return RK_OK;
}

/* What both entry points set: the backend, the output, the queries and the
 * shape; the caller adds where the keys and values are. */
static attn_ctx attn_ctx_of(rk_backend *be, float *out, float *lse, const float *q, rk_dtype dtype,
                            int n_kv_heads, int head_dim, const int32_t *q_start,
                            const int32_t *kv_len, int n_heads, const rk_attn_params *p) {
    return (attn_ctx){.cpu = be->impl,
                      .out = out,
                      .lse = lse,
                      .q = q,
                      .n_kv_heads = n_kv_heads,
                      .head_dim = head_dim,
                      .dtype = dtype,
                      .q_start = q_start,
                      .kv_len = kv_len,
                      .n_heads = n_heads,
                      .group = n_heads / n_kv_heads,
                      .scale = p->scale,
                      .softcap = p->softcap,
                      .window = p->window,
                      .sinks = p->sinks};
}

/* Paged attention (the attention op of the table). Validates the batch: every
 * block id the kv range of a sequence uses must lie in [0, n_blocks), and
 * kv_len must fit the table and be >= the number of query rows. */
rk_status rk_cpu_attention(rk_backend *be, float *out, float *lse, const float *q,
                           const rk_kv_cache *kv, int layer, const rk_attn_batch *batch,
                           int n_heads, const rk_attn_params *params) {
    rk_status st = rk_attn_check_params(params);
    if (st == RK_OK) st = rk_attn_check_batch(kv, layer, batch, n_heads);
    if (st == RK_OK) st = rk_attn_check_block_ids(kv, batch, batch->block_table);
    if (st != RK_OK) return st;
    attn_ctx c = attn_ctx_of(be, out, lse, q, kv->dtype, kv->n_kv_heads, kv->head_dim,
                             batch->q_start, batch->kv_len, n_heads, params);
    c.kv = kv;
    c.layer = layer;
    c.table = batch->block_table;
    c.max_blocks = batch->max_blocks;
    c.seg_start = batch->seg_start;
    c.seg_end = batch->seg_end;
    c.seg_delta = batch->seg_delta;
    c.rope = batch->rope;
    return attn_run(&c, batch->n_seqs);
}

/* The same kernel over contiguous per-sequence caches (tests, benchmarks);
 * returns RK_ERR_INVALID for a bad batch shape. */
rk_status rk_cpu_attention_contig(rk_backend *be, float *out, float *lse, const float *q,
                                  const void *const *k, const void *const *v, rk_dtype dtype,
                                  int n_kv_heads, int head_dim, const int32_t *q_start,
                                  const int32_t *kv_len, int n_seqs, int n_heads,
                                  const rk_attn_params *params) {
    if (!rk_kv_dtype_ok(dtype, head_dim))
        return rk_errorf(RK_ERR_INVALID, "attention: bad dtype %d", (int)dtype);
    rk_status st = rk_attn_check_params(params);
    if (st == RK_OK)
        st = rk_attn_check_shape(q_start, kv_len, n_seqs, n_heads, n_kv_heads, head_dim);
    if (st != RK_OK) return st;
    attn_ctx c =
        attn_ctx_of(be, out, lse, q, dtype, n_kv_heads, head_dim, q_start, kv_len, n_heads, params);
    c.ck = k;
    c.cv = v;
    return attn_run(&c, n_seqs);
}
