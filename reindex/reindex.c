/* reindex/reindex.c — see reindex.h. */
#include "reindex/reindex.h"

#include <stdlib.h>
#include <string.h>

rk_status rk_layout_plan(rk_position_mode mode, int n_system, const int *chunk_lens, int n_chunks,
                         rk_layout *out) {
    memset(out, 0, sizeof *out);
    out->pos = malloc((size_t)(n_chunks ? n_chunks : 1) * sizeof *out->pos);
    out->index = malloc((size_t)(n_chunks ? n_chunks : 1) * sizeof *out->index);
    if (!out->pos || !out->index) {
        rk_layout_free(out);
        return rk_errorf(RK_ERR_NOMEM, "reindex: out of memory");
    }
    out->n_chunks = n_chunks;
    int index = n_system, longest = 0;
    for (int k = 0; k < n_chunks; k++) {
        out->index[k] = index;
        out->pos[k] = mode == RK_POSITIONS_PARALLEL ? n_system : index;
        index += chunk_lens[k];
        longest = chunk_lens[k] > longest ? chunk_lens[k] : longest;
    }
    out->question_index = index;
    out->question_pos = mode == RK_POSITIONS_PARALLEL ? n_system + longest : index;
    return RK_OK;
}

void rk_layout_free(rk_layout *l) {
    free(l->pos);
    free(l->index);
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

rk_status rk_copy_plan_run(rk_copy_plan *p, rk_backend *be, rk_arena *a, const rk_rope *rope) {
    if (p->n == 0) return RK_OK;
    rk_status st =
        be->ops->rope_shift_copy(be, rk_arena_kv(a), p->src, p->dst, p->delta, p->n, rope);
    p->n = 0;
    return st;
}

void rk_copy_plan_free(rk_copy_plan *p) {
    free(p->src);
    free(p->dst);
    free(p->delta);
    memset(p, 0, sizeof *p);
}
