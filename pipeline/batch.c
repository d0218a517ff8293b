/* pipeline/batch.c — a forward pass under construction (see internal.h):
 * sequences added with their tokens, slots and block or run tables, then
 * run through the model in one rk_model_forward. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"

/* ---------------------------------------------------------------- batches */

void rk_batch_reset(batch *b) {
    b->n_tok = b->n_seq = b->n_logits = b->n_prompt_rows = 0;
    b->max_blocks = 0;
    b->n_layers = 0;
}

void rk_batch_free(batch *b) {
    free(b->tokens);
    free(b->pos);
    free(b->slots);
    free(b->q_start);
    free(b->kv_len);
    free(b->logit_rows);
    free(b->tables);
    free(b->runs);
    free(b->seg_start);
    free(b->seg_end);
    free(b->seg_delta);
    free(b->table);
    free(b->logits);
    memset(b, 0, sizeof *b);
}

static rk_status grow32(int32_t **p, int n) {
    int32_t *q = realloc(*p, (size_t)n * sizeof *q);
    if (!q) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    *p = q;
    return RK_OK;
}

/* Add a sequence: n tokens at positions pos0.., written at table indices
 * idx0.. of seq (of its run table when runs is not NULL), attending over its
 * first idx0 + n entries. */
static rk_status batch_add_seq(batch *b, int bs, const rk_seq *seq, const rk_runs *runs,
                               const int32_t *tokens, int n, int pos0, int idx0, int want_logits) {
    rk_status st;
    if (b->n_tok + n > b->cap_tok) {
        int cap = b->cap_tok ? b->cap_tok : 256;
        while (cap < b->n_tok + n) cap *= 2;
        if ((st = grow32(&b->tokens, cap)) || (st = grow32(&b->pos, cap)) ||
            (st = grow32(&b->slots, cap)))
            return st;
        b->cap_tok = cap;
    }
    if (b->n_seq + 1 >= b->cap_seq) {
        int cap = b->cap_seq ? b->cap_seq * 2 : 16;
        const rk_seq **t = realloc(b->tables, (size_t)cap * sizeof *t);
        if (!t) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        b->tables = t;
        const rk_runs **rt = realloc(b->runs, (size_t)cap * sizeof *rt);
        if (!rt) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        b->runs = rt;
        if ((st = grow32(&b->q_start, cap + 1)) || (st = grow32(&b->kv_len, cap))) return st;
        b->cap_seq = cap;
    }
    int rows = want_logits == RK_LOGITS_ALL ? n : want_logits ? 1 : 0;
    if (b->n_logits + rows > b->cap_rows) {
        int cap = b->cap_rows ? b->cap_rows : 16;
        while (cap < b->n_logits + rows) cap *= 2;
        if ((st = grow32(&b->logit_rows, cap))) return st;
        b->cap_rows = cap;
    }
    for (int j = 0; j < n; j++) {
        b->tokens[b->n_tok + j] = tokens[j];
        b->pos[b->n_tok + j] = pos0 + j;
        b->slots[b->n_tok + j] =
            runs ? rk_runs_slot(runs, bs, idx0 + j) : rk_seq_slot(seq, bs, idx0 + j);
    }
    b->q_start[b->n_seq] = b->n_tok;
    b->n_tok += n;
    b->q_start[b->n_seq + 1] = b->n_tok;
    b->kv_len[b->n_seq] = idx0 + n;
    b->tables[b->n_seq] = seq;
    b->runs[b->n_seq] = runs;
    for (int j = b->n_tok - rows; j < b->n_tok; j++) b->logit_rows[b->n_logits++] = j;
    int nb = (idx0 + n + bs - 1) / bs;
    if (runs) rk_runs_cover(runs, bs, idx0 + n, NULL, NULL, &nb);
    b->max_blocks = nb > b->max_blocks ? nb : b->max_blocks;
    b->n_seq++;
    return RK_OK;
}

rk_status rk_batch_add(batch *b, int bs, const rk_seq *seq, const int32_t *tokens, int n, int pos0,
                       int idx0, int want_logits) {
    return batch_add_seq(b, bs, seq, NULL, tokens, n, pos0, idx0, want_logits);
}

/* Add tokens of a request's merged sequence, addressed through its run
 * table when it reuses chunks in place. */
rk_status rk_batch_add_req(batch *b, int bs, const rk_req_state *s, const int32_t *tokens, int n,
                           int pos0, int idx0, int want_logits) {
    return batch_add_seq(b, bs, &s->kv, s->zc ? &s->runs : NULL, tokens, n, pos0, idx0,
                         want_logits);
}

/* The segments of a batch with some run table: every sequence's runs (one
 * unshifted run for a plain one), cut at its kv_len. */
static rk_status batch_segments(batch *b, int bs) {
    int n_runs = 0;
    for (int s = 0; s < b->n_seq; s++)
        n_runs += b->runs[s] ? rk_runs_cover(b->runs[s], bs, b->kv_len[s], NULL, NULL, NULL) : 1;
    rk_status st;
    if (n_runs > b->cap_segs) {
        if ((st = grow32(&b->seg_end, n_runs)) || (st = grow32(&b->seg_delta, n_runs))) return st;
        b->cap_segs = n_runs;
    }
    if ((st = grow32(&b->seg_start, b->cap_seq + 1))) return st;
    int k = 0;
    for (int s = 0; s < b->n_seq; s++) {
        b->seg_start[s] = k;
        if (b->runs[s]) {
            k +=
                rk_runs_cover(b->runs[s], bs, b->kv_len[s], b->seg_end + k, b->seg_delta + k, NULL);
        } else {
            b->seg_end[k] = b->kv_len[s];
            b->seg_delta[k++] = 0;
        }
    }
    b->seg_start[b->n_seq] = k;
    return RK_OK;
}

rk_status rk_batch_run(rk_service *svc, batch *b) {
    if (b->n_seq == 0) return RK_OK;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    rk_status st = grow32(&b->table, b->n_seq * b->max_blocks);
    if (st) return st;
    int segments = 0;
    for (int s = 0; s < b->n_seq; s++) {
        const int32_t *blocks = b->runs[s] ? b->runs[s]->blocks : b->tables[s]->blocks;
        int n = b->runs[s] ? b->runs[s]->n_blocks : b->tables[s]->n_blocks;
        for (int k = 0; k < b->max_blocks; k++)
            b->table[s * b->max_blocks + k] = k < n ? blocks[k] : -1;
        segments |= b->runs[s] != NULL;
    }
    if (segments && (st = batch_segments(b, rk_arena_block_size(svc->arena)))) return st;
    if (b->n_logits > b->cap_logits) {
        float *l = realloc(b->logits, (size_t)b->n_logits * hp->n_vocab * sizeof *l);
        if (!l) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory for logits");
        b->logits = l;
        b->cap_logits = b->n_logits;
    }
    rk_batch fb = {.n_tokens = b->n_tok,
                   .tokens = b->tokens,
                   .pos = b->pos,
                   .slots = b->slots,
                   .attn = {.n_seqs = b->n_seq,
                            .q_start = b->q_start,
                            .kv_len = b->kv_len,
                            .block_table = b->table,
                            .max_blocks = b->max_blocks,
                            .seg_start = segments ? b->seg_start : NULL,
                            .seg_end = segments ? b->seg_end : NULL,
                            .seg_delta = segments ? b->seg_delta : NULL,
                            .rope = NULL /* the forward pass sets each layer's */},
                   .n_logits = b->n_logits,
                   .logit_rows = b->logit_rows,
                   .n_layers = b->n_layers,
                   .out_q = b->out_q};
    return rk_model_forward(svc->model, rk_arena_kv(svc->arena), &fb, b->logits);
}

/* ---------------------------------------------------------------- chunks fed a slice at a time */

rk_status rk_feed_chunk(batch *b, int bs, chunk_feed *f, rk_chunk_entry *e, const rk_seq *seq,
                        const rk_runs *runs, int *left) {
    if (e->state != RK_CHUNK_PENDING || e->loading || e->progress >= e->n_tokens) return RK_OK;
    for (int i = 0; i < f->n; i++)
        if (f->e[i] == e) return RK_OK; /* another request feeds it this pass */
    int n = e->n_tokens - e->progress;
    if (*left >= 0 && n > *left) n = *left;
    if (n <= 0) return RK_OK;
    if (f->n == f->cap) {
        int cap = f->cap ? f->cap * 2 : 16;
        rk_chunk_entry **ne = realloc(f->e, (size_t)cap * sizeof *ne);
        if (ne) f->e = ne;
        int *nt = realloc(f->tokens, (size_t)cap * sizeof *nt);
        if (nt) f->tokens = nt;
        if (!ne || !nt) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        f->cap = cap;
    }
    /* The chunk's tokens at its base positions progress.., attending to the
     * ones computed before (an isolated chunk's base is 0) and to its
     * context (the base_pos entries of the runs' first run). */
    int idx0 = (runs ? e->base_pos : 0) + e->progress;
    rk_status st = batch_add_seq(b, bs, seq, runs, e->tokens + e->progress, n,
                                 e->base_pos + e->progress, idx0, 0);
    if (st) return st;
    f->e[f->n] = e;
    f->tokens[f->n++] = n;
    if (*left >= 0) *left -= n;
    return RK_OK;
}

void rk_feed_done(chunk_feed *f) {
    for (int i = 0; i < f->n; i++) f->e[i]->progress += f->tokens[i];
    f->n = 0;
}

void rk_feed_free(chunk_feed *f) {
    free(f->e);
    free(f->tokens);
    memset(f, 0, sizeof *f);
}
