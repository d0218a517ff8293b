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
 *    out = O / S and lse = M + ln S.
 * All query heads of one kv head (the GQA group), and in prefill several
 * query rows, share one pass over each K/V tile. Parallelism: a prefill
 * sequence runs tasks of (row block, kv head) that walk the partitions in
 * order; a decode sequence (one query row) runs one task per (kv head,
 * partition) and a second pass merges the partials (split-K). Both give the
 * same bits: the per-partition arithmetic and the merge order are the same,
 * whatever the thread count or the block table layout. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define TILE      32
#define PART      RK_CPU_ATTN_PARTITION
#define ROW_QVECS 16 /* query vectors per prefill task: rows * group >= this */

/* ---------------------------------------------------------------- kv addressing */

/* Where the K/V entries of one sequence and kv head live. */
typedef struct kv_src {
    const unsigned char *k, *v; /* paged: the layer's base; contiguous: the sequence's */
    const int32_t *table;       /* block table of the sequence, NULL when contiguous */
    int block_size;
    size_t row_bytes; /* bytes per kv entry (all kv heads) */
    size_t head_off;  /* bytes from an entry's start to this kv head */
} kv_src;

/* Per-thread working memory of one task. */
typedef struct work {
    const float **kp, **vp; /* (TILE) f32 rows of the current tile */
    float *kt, *vt;         /* (TILE, head_dim) widened rows for F16/BF16 caches */
    float *sc;              /* (TILE) scores, then probabilities */
    const float **q;        /* (nq) query vectors */
    int *lim;               /* (nq) visible entries per query vector */
    float *m, *l, *acc;     /* (nq), (nq), (nq, head_dim): partition state */
    float *M, *S, *O;       /* (nq), (nq), (nq, head_dim): merged state */
} work;

/* Point kp/vp at the f32 rows of entries [t0, t0 + n), widening them into
 * kt/vt when the cache is not f32. */
static void gather(const kv_src *src, rk_dtype dt, int hd, int t0, int n, work *w) {
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
        if (dt == RK_DTYPE_F32) {
            w->kp[i] = (const float *)(src->k + off);
            w->vp[i] = (const float *)(src->v + off);
        } else {
            float *kd = w->kt + (size_t)i * hd, *vd = w->vt + (size_t)i * hd;
            rk_cpu_to_f32(kd, src->k + off, dt, (size_t)hd);
            rk_cpu_to_f32(vd, src->v + off, dt, (size_t)hd);
            w->kp[i] = kd;
            w->vp[i] = vd;
        }
        slot++;
        blk_left--;
    }
}

/* ---------------------------------------------------------------- inner kernels */

/* s[t] = scale * q·k[t] for t < n; every dot product has the same order
 * whether it is computed alone or four at a time. */
static void qk_scores(const float *q, const float *const *kp, int n, int hd, float scale,
                      float *s) {
    int t = 0;
#ifdef __AVX2__
    for (; t + 4 <= n; t += 4) {
        const float *k0 = kp[t], *k1 = kp[t + 1], *k2 = kp[t + 2], *k3 = kp[t + 3];
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
        __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
        int j = 0;
        for (; j + 16 <= hd; j += 16) {
            __m256 q0 = _mm256_loadu_ps(q + j), q1 = _mm256_loadu_ps(q + j + 8);
            a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k0 + j), a0);
            a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k0 + j + 8), a1);
            b0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k1 + j), b0);
            b1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k1 + j + 8), b1);
            c0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k2 + j), c0);
            c1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k2 + j + 8), c1);
            d0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k3 + j), d0);
            d1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k3 + j + 8), d1);
        }
        if (j + 8 <= hd) {
            __m256 q0 = _mm256_loadu_ps(q + j);
            a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k0 + j), a0);
            b0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k1 + j), b0);
            c0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k2 + j), c0);
            d0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k3 + j), d0);
            j += 8;
        }
        float sa = rk_hsum256(_mm256_add_ps(a0, a1)), sb = rk_hsum256(_mm256_add_ps(b0, b1));
        float sc = rk_hsum256(_mm256_add_ps(c0, c1)), sd = rk_hsum256(_mm256_add_ps(d0, d1));
        for (; j < hd; j++) {
            sa += q[j] * k0[j];
            sb += q[j] * k1[j];
            sc += q[j] * k2[j];
            sd += q[j] * k3[j];
        }
        s[t] = sa * scale;
        s[t + 1] = sb * scale;
        s[t + 2] = sc * scale;
        s[t + 3] = sd * scale;
    }
    for (; t < n; t++) {
        const float *k0 = kp[t];
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int j = 0;
        for (; j + 16 <= hd; j += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k0 + j), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(k0 + j + 8), a1);
        }
        if (j + 8 <= hd) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k0 + j), a0);
            j += 8;
        }
        float sa = rk_hsum256(_mm256_add_ps(a0, a1));
        for (; j < hd; j++) sa += q[j] * k0[j];
        s[t] = sa * scale;
    }
#else
    for (; t < n; t++) {
        float sa = 0.0f;
        for (int j = 0; j < hd; j++) sa += q[j] * kp[t][j];
        s[t] = sa * scale;
    }
#endif
}

/* acc(hd) += sum over t < n of p[t] * v[t], in t order for every element. */
static void pv_accum(float *acc, const float *p, const float *const *vp, int n, int hd) {
    int d = 0;
#ifdef __AVX2__
    for (; d + 32 <= hd; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int t = 0; t < n; t++) {
            __m256 pb = _mm256_set1_ps(p[t]);
            const float *v = vp[t] + d;
            a0 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d + 8 <= hd; d += 8) {
        __m256 a0 = _mm256_loadu_ps(acc + d);
        for (int t = 0; t < n; t++)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vp[t] + d), a0);
        _mm256_storeu_ps(acc + d, a0);
    }
#endif
    for (; d < hd; d++) {
        float a = acc[d];
        for (int t = 0; t < n; t++) a += p[t] * vp[t][d];
        acc[d] = a;
    }
}

/* Reduce the partition starting at p0 for the nq query vectors in w: vector i
 * sees entries [p0, min(p0 + PART, lim[i])). Sets w->m, w->l, w->acc (a vector
 * with an empty range is left at m = -inf, l = 0, acc = 0). */
static void attn_partition(const kv_src *src, rk_dtype dt, int hd, float scale, int nq, int p0,
                           work *w) {
    int p_end = 0;
    for (int i = 0; i < nq; i++) {
        int e = w->lim[i] < p0 + PART ? w->lim[i] : p0 + PART;
        if (e > p_end) p_end = e;
        w->m[i] = -INFINITY;
        w->l[i] = 0.0f;
    }
    memset(w->acc, 0, (size_t)nq * hd * sizeof(float));
    for (int t0 = p0; t0 < p_end; t0 += TILE) {
        int t1 = t0 + TILE < p_end ? t0 + TILE : p_end;
        gather(src, dt, hd, t0, t1 - t0, w);
        for (int i = 0; i < nq; i++) {
            int e = w->lim[i] < p0 + PART ? w->lim[i] : p0 + PART;
            if (e > t1) e = t1;
            int n = e - t0;
            if (n <= 0) continue;
            float *sc = w->sc;
            qk_scores(w->q[i], w->kp, n, hd, scale, sc);
            float mt = sc[0];
            for (int t = 1; t < n; t++) mt = sc[t] > mt ? sc[t] : mt;
            float m_new = w->m[i] > mt ? w->m[i] : mt;
            float alpha = expf(w->m[i] - m_new); /* 0 on the first tile */
            for (int t = 0; t < n; t++) sc[t] -= m_new;
            rk_cpu_exp(sc, sc, (size_t)n);
            float ls = 0.0f;
            for (int t = 0; t < n; t++) ls += sc[t];
            w->l[i] = w->l[i] * alpha + ls;
            w->m[i] = m_new;
            float *acc = w->acc + (size_t)i * hd;
            if (alpha != 1.0f)
                for (int d = 0; d < hd; d++) acc[d] *= alpha;
            pv_accum(acc, sc, w->vp, n, hd);
        }
    }
}

/* Merge one partition result (m, l, acc) into the running (M, S, O). */
static void merge_part(float *M, float *S, float *O, float m, float l, const float *acc, int hd,
                       int first) {
    if (first) {
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

static void finish(float *out, float *lse, float M, float S, const float *O, int hd) {
    for (int d = 0; d < hd; d++) out[d] = O[d] / S;
    if (lse) *lse = M + logf(S);
}

/* ---------------------------------------------------------------- driver */

typedef struct attn_task {
    int seq, j0, j1, h, part; /* part < 0: walk all partitions of rows j0..j1-1 */
    size_t partial;           /* split tasks: offset (floats) of the partials */
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
    int n_heads, group, nq_max;
    float scale;
    const attn_task *tasks;
    const attn_task *merges;
    float *partials;
} attn_ctx;

static void make_src(const attn_ctx *c, int seq, int h, kv_src *src) {
    size_t es = rk_dtype_size(c->dtype);
    src->row_bytes = (size_t)c->n_kv_heads * c->head_dim * es;
    src->head_off = (size_t)h * c->head_dim * es;
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
    size_t f = 2 * (size_t)TILE * hd + TILE + 8 + 2 * (size_t)nq * hd + 4 * (size_t)nq;
    return f * sizeof(float) + 2 * TILE * sizeof(float *) + (size_t)nq * sizeof(float *) +
           (size_t)nq * sizeof(int) + 256;
}

static void work_init(work *w, void *mem, int nq, int hd) {
    const float **pp = mem;
    w->kp = pp;
    w->vp = pp + TILE;
    w->q = pp + 2 * TILE;
    float *f = (float *)(pp + 2 * TILE + nq);
    w->kt = f;
    f += (size_t)TILE * hd;
    w->vt = f;
    f += (size_t)TILE * hd;
    w->sc = f;
    f += TILE + 8;
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
    w->lim = (int *)f;
}

/* Fill the query pointers and limits of rows j0..j1-1 of a sequence, kv head h. */
static int setup_rows(const attn_ctx *c, int seq, int j0, int j1, int h, work *w) {
    int n_q = c->q_start[seq + 1] - c->q_start[seq];
    int L = c->kv_len[seq];
    int nq = 0;
    for (int j = j0; j < j1; j++) {
        size_t row = (size_t)(c->q_start[seq] + j);
        for (int g = 0; g < c->group; g++) {
            w->q[nq] = c->q + (row * c->n_heads + (size_t)h * c->group + g) * c->head_dim;
            w->lim[nq] = L - n_q + j + 1;
            nq++;
        }
    }
    return nq;
}

static void task_run(void *p, int ti, int tid) {
    const attn_ctx *c = p;
    const attn_task *t = &c->tasks[ti];
    int hd = c->head_dim;
    work w;
    work_init(&w, rk_cpu_scratch(c->cpu, tid), c->nq_max, hd);
    kv_src src;
    make_src(c, t->seq, t->h, &src);
    int nq = setup_rows(c, t->seq, t->j0, t->j1, t->h, &w);
    if (t->part >= 0) { /* split-K: one partition, partials out */
        attn_partition(&src, c->dtype, hd, c->scale, nq, t->part * PART, &w);
        float *dst = c->partials + t->partial;
        for (int i = 0; i < nq; i++) {
            dst[0] = w.m[i];
            dst[1] = w.l[i];
            memcpy(dst + 2, w.acc + (size_t)i * hd, (size_t)hd * sizeof(float));
            dst += hd + 2;
        }
        return;
    }
    int lmax = 0;
    for (int i = 0; i < nq; i++) lmax = w.lim[i] > lmax ? w.lim[i] : lmax;
    for (int p0 = 0; p0 < lmax; p0 += PART) {
        attn_partition(&src, c->dtype, hd, c->scale, nq, p0, &w);
        for (int i = 0; i < nq; i++)
            if (p0 < w.lim[i])
                merge_part(&w.M[i], &w.S[i], w.O + (size_t)i * hd, w.m[i], w.l[i],
                           w.acc + (size_t)i * hd, hd, p0 == 0);
    }
    for (int i = 0; i < nq; i++) {
        int j = t->j0 + i / c->group, g = i % c->group;
        size_t qi = (size_t)(c->q_start[t->seq] + j) * c->n_heads + (size_t)t->h * c->group + g;
        finish(c->out + qi * hd, c->lse ? c->lse + qi : NULL, w.M[i], w.S[i], w.O + (size_t)i * hd,
               hd);
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
    for (int pi = 0; pi < n_parts; pi++) {
        const float *src = c->partials + t->partial + (size_t)pi * G * (hd + 2);
        for (int g = 0; g < G; g++) {
            const float *e = src + (size_t)g * (hd + 2);
            merge_part(&w.M[g], &w.S[g], w.O + (size_t)g * hd, e[0], e[1], e + 2, hd, pi == 0);
        }
    }
    size_t row = (size_t)c->q_start[t->seq];
    for (int g = 0; g < G; g++) {
        size_t qi = row * c->n_heads + (size_t)t->h * G + g;
        finish(c->out + qi * hd, c->lse ? c->lse + qi : NULL, w.M[g], w.S[g], w.O + (size_t)g * hd,
               hd);
    }
}

/* Plan the tasks, run them, then run the merges of the split sequences. */
static rk_status attn_run(attn_ctx *c, int n_seqs) {
    rk_cpu *cpu = c->cpu;
    int G = c->group, hd = c->head_dim;
    int rows_per = ROW_QVECS / G > 1 ? ROW_QVECS / G : 1;
    c->nq_max = rows_per * G;

    size_t n_tasks = 0, n_merges = 0, n_partials = 0;
    for (int s = 0; s < n_seqs; s++) {
        int n_q = c->q_start[s + 1] - c->q_start[s];
        if (n_q == 0) continue;
        if (n_q == 1) {
            size_t parts = (size_t)(c->kv_len[s] + PART - 1) / PART;
            n_tasks += parts * c->n_kv_heads;
            n_merges += (size_t)c->n_kv_heads;
            n_partials += parts * c->n_kv_heads * G * (size_t)(hd + 2);
        } else {
            n_tasks += (size_t)((n_q + rows_per - 1) / rows_per) * c->n_kv_heads;
        }
    }
    if (n_tasks == 0) return RK_OK;
    if (n_tasks > INT32_MAX || n_merges > INT32_MAX)
        return rk_errorf(RK_ERR_LIMIT, "attention: batch too large (%zu tasks)", n_tasks);
    size_t task_bytes = (n_tasks + n_merges) * sizeof(attn_task);
    task_bytes = (task_bytes + 63) / 64 * 64;
    void *mem;
    rk_status st = rk_cpu_reserve_shared(cpu, task_bytes + n_partials * sizeof(float), &mem);
    if (st != RK_OK) return st;
    st = rk_cpu_reserve_scratch(cpu, work_bytes(c->nq_max, hd));
    if (st != RK_OK) return st;
    attn_task *tasks = mem, *merges = tasks + n_tasks;
    c->partials = (float *)((unsigned char *)mem + task_bytes);

    size_t ti = 0, mi = 0, off = 0;
    for (int s = 0; s < n_seqs; s++) {
        int n_q = c->q_start[s + 1] - c->q_start[s];
        if (n_q == 0) continue;
        if (n_q == 1) {
            int parts = (c->kv_len[s] + PART - 1) / PART;
            for (int h = 0; h < c->n_kv_heads; h++) {
                merges[mi++] = (attn_task){s, 0, 1, h, 0, off};
                for (int p = 0; p < parts; p++) {
                    tasks[ti++] = (attn_task){s, 0, 1, h, p, off};
                    off += (size_t)G * (hd + 2);
                }
            }
        } else {
            for (int j0 = 0; j0 < n_q; j0 += rows_per) {
                int j1 = j0 + rows_per < n_q ? j0 + rows_per : n_q;
                for (int h = 0; h < c->n_kv_heads; h++)
                    tasks[ti++] = (attn_task){s, j0, j1, h, -1, 0};
            }
        }
    }
    c->tasks = tasks;
    c->merges = merges;
    rk_threadpool_run(cpu->pool, (int)n_tasks, task_run, c);
    if (n_merges) rk_threadpool_run(cpu->pool, (int)n_merges, merge_run, c);
    return RK_OK;
}

static rk_status check_batch(const int32_t *q_start, const int32_t *kv_len, int n_seqs, int n_heads,
                             int n_kv_heads, int head_dim) {
    if (n_seqs < 0) return rk_errorf(RK_ERR_INVALID, "attention: n_seqs %d < 0", n_seqs);
    if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
        return rk_errorf(RK_ERR_INVALID,
                         "attention: n_heads %d must be a positive multiple of n_kv_heads %d",
                         n_heads, n_kv_heads);
    if (head_dim <= 0) return rk_errorf(RK_ERR_INVALID, "attention: head_dim %d", head_dim);
    if (n_seqs > 0 && q_start[0] < 0)
        return rk_errorf(RK_ERR_INVALID, "attention: q_start[0] = %d < 0", q_start[0]);
    for (int s = 0; s < n_seqs; s++) {
        int n_q = q_start[s + 1] - q_start[s];
        if (n_q < 0)
            return rk_errorf(RK_ERR_INVALID, "attention: q_start decreases at sequence %d", s);
        if (kv_len[s] < n_q)
            return rk_errorf(RK_ERR_INVALID, "attention: sequence %d has kv_len %d < %d query rows",
                             s, kv_len[s], n_q);
    }
    return RK_OK;
}

/* Paged attention (the attention op of the table). Validates the batch: every
 * block id the kv range of a sequence uses must lie in [0, n_blocks), and
 * kv_len must fit the table and be >= the number of query rows. */
rk_status rk_cpu_attention(rk_backend *be, float *out, float *lse, const float *q,
                           const rk_kv_cache *kv, int layer, const rk_attn_batch *batch,
                           int n_heads, float scale) {
    if (!kv || !batch || kv->block_size <= 0 || kv->n_blocks <= 0 || !kv->k || !kv->v ||
        rk_dtype_size(kv->dtype) == 0)
        return rk_errorf(RK_ERR_INVALID, "attention: malformed KV cache or batch");
    if (layer < 0 || layer >= kv->n_layers)
        return rk_errorf(RK_ERR_INVALID, "attention: layer %d out of range [0, %d)", layer,
                         kv->n_layers);
    rk_status st = check_batch(batch->q_start, batch->kv_len, batch->n_seqs, n_heads,
                               kv->n_kv_heads, kv->head_dim);
    if (st != RK_OK) return st;
    for (int s = 0; s < batch->n_seqs; s++) {
        int L = batch->kv_len[s];
        int64_t need = ((int64_t)L + kv->block_size - 1) / kv->block_size;
        if (need > batch->max_blocks)
            return rk_errorf(RK_ERR_INVALID,
                             "attention: sequence %d kv_len %d needs %lld blocks, table has %d", s,
                             L, (long long)need, batch->max_blocks);
        const int32_t *row = batch->block_table + (size_t)s * batch->max_blocks;
        for (int64_t b = 0; b < need; b++)
            if (row[b] < 0 || row[b] >= kv->n_blocks)
                return rk_errorf(RK_ERR_INVALID,
                                 "attention: sequence %d block %lld is %d, not in [0, %d)", s,
                                 (long long)b, row[b], kv->n_blocks);
    }
    attn_ctx c = {0};
    c.cpu = be->impl;
    c.out = out;
    c.lse = lse;
    c.q = q;
    c.kv = kv;
    c.layer = layer;
    c.table = batch->block_table;
    c.max_blocks = batch->max_blocks;
    c.n_kv_heads = kv->n_kv_heads;
    c.head_dim = kv->head_dim;
    c.dtype = kv->dtype;
    c.q_start = batch->q_start;
    c.kv_len = batch->kv_len;
    c.n_heads = n_heads;
    c.group = n_heads / kv->n_kv_heads;
    c.scale = scale;
    return attn_run(&c, batch->n_seqs);
}

rk_status rk_cpu_attention_contig(rk_backend *be, float *out, float *lse, const float *q,
                                  const void *const *k, const void *const *v, rk_dtype dtype,
                                  int n_kv_heads, int head_dim, const int32_t *q_start,
                                  const int32_t *kv_len, int n_seqs, int n_heads, float scale) {
    if (rk_dtype_size(dtype) == 0)
        return rk_errorf(RK_ERR_INVALID, "attention: bad dtype %d", (int)dtype);
    rk_status st = check_batch(q_start, kv_len, n_seqs, n_heads, n_kv_heads, head_dim);
    if (st != RK_OK) return st;
    attn_ctx c = {0};
    c.cpu = be->impl;
    c.out = out;
    c.lse = lse;
    c.q = q;
    c.ck = k;
    c.cv = v;
    c.n_kv_heads = n_kv_heads;
    c.head_dim = head_dim;
    c.dtype = dtype;
    c.q_start = q_start;
    c.kv_len = kv_len;
    c.n_heads = n_heads;
    c.group = n_heads / n_kv_heads;
    c.scale = scale;
    return attn_run(&c, n_seqs);
}
