/* reindex/reindex.c — see reindex.h. */
#include "reindex/reindex.h"

#include <stdlib.h>
#include <string.h>

rk_status rk_layout_plan(rk_position_mode mode, int n_system, const int *chunk_lens, int n_chunks,
                         const rk_layout_groups *groups, rk_layout *out) {
    memset(out, 0, sizeof *out);
    int n_groups = groups ? groups->n : 1, n_gaps = n_groups > 1 ? n_groups - 1 : 0;
    out->pos = malloc((size_t)(n_chunks ? n_chunks : 1) * sizeof *out->pos);
    out->index = malloc((size_t)(n_chunks ? n_chunks : 1) * sizeof *out->index);
    out->gap_pos = malloc((size_t)(n_gaps ? n_gaps : 1) * sizeof *out->gap_pos);
    out->gap_index = malloc((size_t)(n_gaps ? n_gaps : 1) * sizeof *out->gap_index);
    if (!out->pos || !out->index || !out->gap_pos || !out->gap_index) {
        rk_layout_free(out);
        return rk_errorf(RK_ERR_NOMEM, "reindex: out of memory");
    }
    out->n_chunks = n_chunks;
    out->n_gaps = n_gaps;
    int parallel = mode == RK_POSITIONS_PARALLEL;
    int index = n_system, pos = n_system; /* where the next segment starts */
    for (int g = 0, k = 0; g < n_groups; g++) {
        int end = groups ? groups->end[g] : n_chunks, longest = 0;
        for (; k < end; k++) {
            out->index[k] = index;
            out->pos[k] = parallel ? pos : index;
            index += chunk_lens[k];
            longest = chunk_lens[k] > longest ? chunk_lens[k] : longest;
        }
        pos = parallel ? pos + longest : index;
        if (g + 1 == n_groups) break;
        out->gap_index[g] = index;
        out->gap_pos[g] = pos;
        index += groups->gap_len[g];
        pos += groups->gap_len[g];
    }
    out->question_index = index;
    out->question_pos = pos;
    return RK_OK;
}

void rk_layout_free(rk_layout *l) {
    free(l->pos);
    free(l->index);
    free(l->gap_pos);
    free(l->gap_index);
    memset(l, 0, sizeof *l);
}

rk_status rk_copy_plan_add(rk_copy_plan *p, int block_size, const int32_t *src_blocks,
                           int src_first, const rk_seq *dst, int dst_first, int n, int delta) {
    if (p->n + n > p->cap) {
        int cap = p->cap ? p->cap : 256;
        while (cap < p->n + n) cap *= 2;
        int32_t *s = realloc(p->src, (size_t)cap * sizeof *s);
        if (s) p->src = s;
        int32_t *d = s ? realloc(p->dst, (size_t)cap * sizeof *d) : NULL;
        if (d) p->dst = d;
        int32_t *e = d ? realloc(p->delta, (size_t)cap * sizeof *e) : NULL;
        if (!e) return rk_errorf(RK_ERR_NOMEM, "reindex: out of memory");
        p->delta = e;
        p->cap = cap;
    }
    for (int j = 0; j < n; j++) {
        int si = src_first + j;
        p->src[p->n] = src_blocks[si / block_size] * block_size + si % block_size;
        p->dst[p->n] = rk_seq_slot(dst, block_size, dst_first + j);
        p->delta[p->n] = delta;
        p->n++;
    }
    return RK_OK;
}

rk_status rk_copy_plan_run(rk_copy_plan *p, rk_backend *be, rk_arena *a,
                           const rk_rope *const *ropes) {
    if (p->n == 0) return RK_OK;
    rk_status st =
        be->ops->rope_shift_copy(be, rk_arena_kv(a), p->src, p->dst, p->delta, p->n, ropes);
    p->n = 0;
    return st;
}

void rk_copy_plan_free(rk_copy_plan *p) {
    free(p->src);
    free(p->dst);
    free(p->delta);
    memset(p, 0, sizeof *p);
}

rk_status rk_runs_add(rk_runs *t, int block_size, const int32_t *blocks, int n, int delta) {
    int nb = (n + block_size - 1) / block_size;
    if (t->n_runs == t->cap_runs) {
        int cap = t->cap_runs ? t->cap_runs * 2 : 8;
        int32_t *e = realloc(t->end, (size_t)cap * sizeof *e);
        if (e) t->end = e;
        int32_t *d = e ? realloc(t->delta, (size_t)cap * sizeof *d) : NULL;
        if (d) t->delta = d;
        int32_t *f = d ? realloc(t->first, (size_t)cap * sizeof *f) : NULL;
        if (!f) return rk_errorf(RK_ERR_NOMEM, "reindex: out of memory");
        t->first = f;
        t->cap_runs = cap;
    }
    if (t->n_blocks + nb > t->cap_blocks) {
        int cap = t->cap_blocks ? t->cap_blocks : 16;
        while (cap < t->n_blocks + nb) cap *= 2;
        int32_t *b = realloc(t->blocks, (size_t)cap * sizeof *b);
        if (!b) return rk_errorf(RK_ERR_NOMEM, "reindex: out of memory");
        t->blocks = b;
        t->cap_blocks = cap;
    }
    int start = t->n_runs ? t->end[t->n_runs - 1] : 0;
    t->end[t->n_runs] = start + n;
    t->delta[t->n_runs] = delta;
    t->first[t->n_runs] = t->n_blocks;
    t->n_runs++;
    memcpy(t->blocks + t->n_blocks, blocks, (size_t)nb * sizeof *blocks);
    t->n_blocks += nb;
    return RK_OK;
}

/* The run holding entry i: the first whose end is above i. */
static int run_of(const rk_runs *t, int i) {
    int lo = 0, hi = t->n_runs - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (t->end[mid] > i)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

int32_t rk_runs_slot(const rk_runs *t, int block_size, int i) {
    int k = run_of(t, i), off = i - (k ? t->end[k - 1] : 0);
    return t->blocks[t->first[k] + off / block_size] * block_size + off % block_size;
}

int rk_runs_cover(const rk_runs *t, int block_size, int kv_len, int32_t *end, int32_t *delta,
                  int *n_table) {
    if (kv_len <= 0) {
        if (n_table) *n_table = 0;
        return 0;
    }
    int last = run_of(t, kv_len - 1);
    if (end && delta)
        for (int k = 0; k <= last; k++) {
            end[k] = k < last ? t->end[k] : kv_len;
            delta[k] = t->delta[k];
        }
    if (n_table) {
        int start = last ? t->end[last - 1] : 0;
        *n_table = t->first[last] + (kv_len - start + block_size - 1) / block_size;
    }
    return last + 1;
}

void rk_runs_free(rk_runs *t) {
    free(t->end);
    free(t->delta);
    free(t->first);
    free(t->blocks);
    memset(t, 0, sizeof *t);
}
