/* pipeline/repair.c — the repair stage (stage 5 of a request, see
 * pipeline.c): reused chunk tokens recomputed over the merged cache, chosen
 * by the request's policy: the deviation policy (every chunk's first token,
 * then the tokens whose layer-1 K/V moved most), the query policy (every
 * chunk's first token, then the tokens that either the question's attention
 * or the layer-1 deviation ranks high), or `first_k` (each chunk's first
 * repair_k tokens). The chosen runs are recorded in the request's state and
 * recomputed in one pass at admission, or, for a request joined with a step
 * budget, fed by the steps' passes a slice within the budget at a time
 * (rk_feed_prompt in question.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"

/* ---------------------------------------------------------------- deviation repair */

/* Layer 0's K/V depend only on a token and its position, so a reused chunk's
 * are exact once reindexed; layer 1 is the first that sees the rest of the
 * prompt, and where a token's reused K/V is measured against fresh ones. */
#define DEVIATION_LAYER 1

/* K and V that model layer `layer` attends over, of table entries idx0 .. idx0 + n - 1 of seq, as
 * f32 rows of n_kv_heads * head_dim: k (n rows), v (n rows). raw: block_size rows of scratch in the
 * cache dtype. Reads a block's run of entries per download. */
static rk_status read_kv(rk_service *svc, const rk_seq *seq, int layer, int idx0, int n, float *k,
                         float *v, unsigned char *raw) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    int bs = kv->block_size;
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim, rb = rk_dtype_row_bytes(kv->dtype, row);
    rk_status st;
    layer = rk_model_kv_layer(svc->model, layer); /* the KV layer it attends over */
    for (int j = 0; j < n;) {
        int i = idx0 + j, run = bs - i % bs < n - j ? bs - i % bs : n - j;
        size_t off = (size_t)rk_seq_slot(seq, bs, i) * rb;
        if ((st = svc->be->ops->download(svc->be, raw, (const unsigned char *)kv->k[layer] + off,
                                         run * rb)))
            return st;
        rk_dtype_to_f32(k + j * row, raw, kv->dtype, run * row);
        if ((st = svc->be->ops->download(svc->be, raw, (const unsigned char *)kv->v[layer] + off,
                                         run * rb)))
            return st;
        rk_dtype_to_f32(v + j * row, raw, kv->dtype, run * row);
        j += run;
    }
    return RK_OK;
}

/* A chunk token to rank: chunk first tokens before the others, then by
 * score, highest first. */
typedef struct dev_tok {
    double score;
    int chunk, off;
} dev_tok;

static int by_score_desc(const void *a, const void *b) {
    const dev_tok *x = a, *y = b;
    if ((x->off == 0) != (y->off == 0)) return x->off == 0 ? -1 : 1;
    if (x->score != y->score) return x->score < y->score ? 1 : -1;
    return x->chunk != y->chunk ? x->chunk - y->chunk : x->off - y->off; /* stable */
}

static rk_status push_run(rk_req_state *s, repair_run u) {
    if (s->n_repair == s->cap_repair) {
        int cap = s->cap_repair ? s->cap_repair * 2 : 8;
        repair_run *q = realloc(s->repair, (size_t)cap * sizeof *q);
        if (!q) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        s->repair = q;
        s->cap_repair = cap;
    }
    s->repair[s->n_repair++] = u;
    s->n_rtok += u.n;
    return RK_OK;
}

static int by_index(const void *a, const void *b) {
    const repair_run *x = a, *y = b;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/* s's runs in table order (none may be recorded yet: no array). */
static void sort_runs(rk_req_state *s) {
    if (s->n_repair > 1) qsort(s->repair, (size_t)s->n_repair, sizeof *s->repair, by_index);
}

/* Record a run of r's chunk k, its n tokens from off, for the recompute. */
static rk_status add_run(rk_request *r, int k, int off, int n) {
    rk_req_state *s = r->state;
    rk_status st = push_run(
        s, (repair_run){r->chunks[k] + off, n, s->layout.pos[k] + off, s->layout.index[k] + off});
    if (st) return st;
    r->chunk_reports[k].repaired += n;
    r->recomputed_tokens += n;
    return RK_OK;
}

/* The texts between r's chunk groups (what of them its radix prefix does
 * not hold) go with the repair runs: computed in table order over the merged
 * table, they attend to everything before them, and the isolated chunks
 * after them do not see them, as in the oracle. They are not repairs: no
 * chunk counts them. The runs are put back in table order. */
static rk_status add_gap_runs(rk_request *r) {
    rk_req_state *s = r->state;
    const rk_layout *L = &s->layout;
    for (int g = 0; g < L->n_gaps; g++) {
        int from = s->reused - L->gap_index[g];
        from = from < 0 ? 0 : from;
        if (from >= r->gap_len[g]) continue;
        rk_status st = push_run(s, (repair_run){r->gap[g] + from, r->gap_len[g] - from,
                                                L->gap_pos[g] + from, L->gap_index[g] + from});
        if (st) return st;
    }
    sort_runs(s);
    return RK_OK;
}

/* Both ratio policies, second half: sort r's n_toks scored chunk tokens
 * (every chunk's first token first, see by_score_desc), take the
 * repair_ratio of them that rank highest, and record their runs
 * (one per run of consecutive chosen tokens of a chunk) for the full
 * recompute. sel: scratch of the longest chunk's length. Sets
 * chunk_reports[].repaired and recomputed_tokens. */
static rk_status queue_chosen(rk_request *r, dev_tok *toks, int n_toks, unsigned char *sel) {
    rk_status st = RK_OK;
    int n_sel = (int)ceil(r->opt.repair_ratio * n_toks - 1e-9);
    n_sel = n_sel < n_toks ? n_sel : n_toks;
    qsort(toks, (size_t)n_toks, sizeof *toks, by_score_desc);
    for (int k = 0; k < r->n_chunks && !st; k++) {
        memset(sel, 0, (size_t)r->chunk_lens[k]);
        for (int j = 0; j < n_sel; j++)
            if (toks[j].chunk == k) sel[toks[j].off] = 1;
        for (int t = 0; t < r->chunk_lens[k] && !st;) { /* one run per run of chosen tokens */
            if (!sel[t]) {
                t++;
                continue;
            }
            int t1 = t;
            while (t1 < r->chunk_lens[k] && sel[t1]) t1++;
            st = add_run(r, k, t, t1 - t);
            t = t1;
        }
    }
    /* Among the texts between chunk groups, in table order (nothing of the
     * runs is fed before they are chosen). */
    if (!st) sort_runs(r->state);
    return st;
}

/* Both ratio policies measure the deviation (the query policy ranks by it
 * beside the question's attention); a model of one layer has none. */
static int wants_deviation(const rk_request *r, const rk_hparams *hp) {
    return r->opt.repair_ratio > 0 && r->opt.mode == RK_MODE_RAG && r->n_chunks > 0 &&
           hp->n_layers > DEVIATION_LAYER && !rk_chunk_from_prefix(r, 0);
}

/* The query policy's ranking: the better of a token's two ranks, by the
 * question's attention mass (q_mass) and by its deviation (score), the
 * other rank breaking ties, so the two lists are taken in turn. toks[]:
 * scored by deviation, in the order of q_mass. */
static rk_status fuse_ranks(dev_tok *toks, const float *q_mass, int n) {
    dev_tok *order = malloc((size_t)n * sizeof *order);
    int *by_dev = malloc((size_t)n * sizeof *by_dev), *by_q = malloc((size_t)n * sizeof *by_q);
    rk_status st = order && by_dev && by_q
                       ? RK_OK
                       : rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory for the query repair");
    for (int pass = 0; pass < 2 && !st; pass++) {
        int *rank = pass ? by_q : by_dev;
        for (int j = 0; j < n; j++) /* chunk is free here: it carries the index */
            order[j] = (dev_tok){pass ? q_mass[j] : toks[j].score, j, 1};
        qsort(order, (size_t)n, sizeof *order, by_score_desc);
        for (int j = 0; j < n; j++) rank[order[j].chunk] = j;
    }
    for (int j = 0; j < n && !st; j++) {
        int lo = by_dev[j] < by_q[j] ? by_dev[j] : by_q[j];
        int hi = by_dev[j] < by_q[j] ? by_q[j] : by_dev[j];
        /* A first token keeps its deviation: first tokens are ranked among
         * themselves by how far they moved. */
        if (toks[j].off != 0) toks[j].score = -(lo + (double)hi / (n + 1.0));
    }
    free(order);
    free(by_dev);
    free(by_q);
    return st;
}

/* The deviation pass, in three steps, so that its pass can be
 * fed a slice at a time (rk_repair_score_step) as well as whole
 * (deviation_select):
 *   dev_start   saves the reused layer-1 K/V of every chunk token of r
 *               (their KV is about to be replaced in its live blocks);
 *   dev_feed    adds up to *left of those tokens, in table order from
 *               dev_next, to a pass of layers 0..DEVIATION_LAYER over the
 *               merged cache (each slice attends to the earlier ones, fresh,
 *               as in one pass);
 *   dev_finish  scores each token by how far its layer-1 K/V moved (the
 *               query policy: fused with the question's attention ranks,
 *               fuse_ranks) and records the runs of the repair_ratio of r's
 *               chunk tokens that rank highest (a chunk's first token above
 *               all), for the full recompute. Sets chunk_reports[].repaired
 *               and recomputed_tokens. */
static rk_status dev_start(rk_service *svc, rk_request *r) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    rk_req_state *s = r->state;
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    int total = 0;
    for (int k = 0; k < r->n_chunks; k++) total += r->chunk_lens[k];
    s->dev_before = malloc((size_t)total * 2 * row * sizeof *s->dev_before);
    unsigned char *raw = malloc((size_t)kv->block_size * rk_dtype_row_bytes(kv->dtype, row));
    rk_status st = s->dev_before && raw
                       ? RK_OK
                       : rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory for the deviation "
                                                 "repair");
    size_t at = 0;
    for (int k = 0; k < r->n_chunks && !st; k++) {
        int n = r->chunk_lens[k];
        st = read_kv(svc, &s->kv, DEVIATION_LAYER, s->layout.index[k], n,
                     s->dev_before + at * 2 * row, s->dev_before + (at * 2 + n) * row, raw);
        at += (size_t)n;
    }
    free(raw);
    s->dev_total = total + r->n_gap_tokens; /* the texts between groups run too */
    s->dev_next = 0;
    return st;
}

/* Segment i of the tokens a deviation pass runs, in table order: r's
 * chunks and the texts between its chunk groups (run too, so that a chunk
 * after a text sees it, as in the full pass); its tokens, their count,
 * first position and table index. */
static void scored_segment(const rk_request *r, int i, const int32_t **tok, int *n, int *pos,
                           int *idx) {
    const rk_layout *L = &r->state->layout;
    int k = 0, g = 0;
    for (int j = 0;; j++) { /* merge the chunks and the texts by table index */
        int gap = g < L->n_gaps && (k == r->n_chunks || L->gap_index[g] <= L->index[k]);
        if (j == i) {
            *tok = gap ? r->gap[g] : r->chunks[k];
            *n = gap ? r->gap_len[g] : r->chunk_lens[k];
            *pos = gap ? L->gap_pos[g] : L->pos[k];
            *idx = gap ? L->gap_index[g] : L->index[k];
            return;
        }
        gap ? g++ : k++;
    }
}

static rk_status dev_feed(batch *b, int bs, rk_request *r, int *left) {
    rk_req_state *s = r->state;
    rk_status st;
    int n_segs = r->n_chunks + s->layout.n_gaps;
    for (int i = 0, first = 0, n = 0; i < n_segs && *left != 0; first += n, i++) {
        const int32_t *tok;
        int pos, idx;
        scored_segment(r, i, &tok, &n, &pos, &idx);
        int off = s->dev_next - first;
        if (off >= n) continue;
        int m = n - off;
        if (*left >= 0 && m > *left) m = *left;
        if ((st = rk_batch_add(b, bs, &s->kv, tok + off, m, pos + off, idx + off, 0))) return st;
        s->dev_next += m;
        if (*left >= 0) *left -= m;
    }
    return RK_OK;
}

static rk_status dev_finish(rk_service *svc, rk_request *r) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    rk_req_state *s = r->state;
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    int max_len = 0;
    for (int k = 0; k < r->n_chunks; k++)
        max_len = r->chunk_lens[k] > max_len ? r->chunk_lens[k] : max_len;
    float *after = malloc((size_t)max_len * 2 * row * sizeof *after);
    unsigned char *raw = malloc((size_t)kv->block_size * rk_dtype_row_bytes(kv->dtype, row));
    dev_tok *toks =
        malloc((size_t)(s->dev_total ? s->dev_total : 1) * sizeof *toks); /* >= chunk tokens */
    rk_status st = after && raw && toks
                       ? RK_OK
                       : rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory for the deviation "
                                                 "repair");
    size_t at = 0;
    int n_toks = 0;
    for (int k = 0; k < r->n_chunks && !st; k++) {
        int n = r->chunk_lens[k];
        const float *bk = s->dev_before + at * 2 * row, *bv = s->dev_before + (at * 2 + n) * row;
        if ((st = read_kv(svc, &s->kv, DEVIATION_LAYER, s->layout.index[k], n, after,
                          after + n * row, raw)))
            break;
        for (int t = 0; t < n; t++) {
            double d = 0;
            for (size_t e = 0; e < row; e++) {
                double dk = after[t * row + e] - bk[t * row + e];
                double dv = after[(n + t) * row + e] - bv[t * row + e];
                d += dk * dk + dv * dv;
            }
            /* A chunk's first token ranks first (by_score_desc): computed
             * alone it was its sequence's first, whose KV the model treats
             * as no other (docs/fidelity.md, "first tokens first"); among
             * first tokens the deviation decides too. */
            toks[n_toks++] = (dev_tok){d, k, t};
        }
        at += (size_t)n;
    }
    if (!st && s->q_mass) st = fuse_ranks(toks, s->q_mass, n_toks);
    if (!st) st = queue_chosen(r, toks, n_toks, (unsigned char *)after);
    free(after);
    free(raw);
    free(toks);
    free(s->dev_before);
    free(s->q_mass);
    s->dev_before = NULL;
    s->q_mass = NULL;
    s->scoring = 0;
    return st;
}

/* The deviation policy's first half for the requests of reqs asking for it,
 * in one pass of layers 0..DEVIATION_LAYER (b: empty). */
static rk_status deviation_select(rk_service *svc, rk_request *const *reqs, int n_reqs, batch *b) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    int bs = rk_arena_block_size(svc->arena), all = -1;
    rk_status st = RK_OK;
    for (int i = 0; i < n_reqs && !st; i++)
        if (wants_deviation(reqs[i], hp) && !reqs[i]->state->scoring &&
            !(st = dev_start(svc, reqs[i])))
            st = dev_feed(b, bs, reqs[i], &all);
    b->n_layers = DEVIATION_LAYER + 1;
    if (!st) st = rk_batch_run(svc, b);
    rk_batch_reset(b);
    for (int i = 0; i < n_reqs && !st; i++)
        if (wants_deviation(reqs[i], hp) && !reqs[i]->state->scoring) st = dev_finish(svc, reqs[i]);
    return st;
}

rk_status rk_repair_score_step(rk_service *svc, batch *b, rk_request *const *reqs, int n_reqs,
                               int budget) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    int bs = rk_arena_block_size(svc->arena);
    /* The pass runs DEVIATION_LAYER + 1 of the model's layers: a budget's
     * worth of layer work is that many more tokens. */
    int left = budget > 0 ? budget * (hp->n_layers / (DEVIATION_LAYER + 1)) : -1;
    rk_status st = RK_OK;
    rk_batch_reset(b);
    for (int i = 0; i < n_reqs && !st; i++)
        if (reqs[i]->state->scoring) st = dev_feed(b, bs, reqs[i], &left);
    if (st || b->n_seq == 0) return st;
    b->n_layers = DEVIATION_LAYER + 1;
    double t = rk_time_now();
    st = rk_batch_run(svc, b);
    rk_batch_reset(b);
    double dt = (rk_time_now() - t) * 1e3;
    for (int i = 0; i < n_reqs && !st; i++) {
        rk_req_state *s = reqs[i]->state;
        if (!s->scoring) continue;
        reqs[i]->t.repair_ms += dt;
        if (s->dev_next == s->dev_total) st = dev_finish(svc, reqs[i]);
    }
    return st;
}

/* ---------------------------------------------------------------- query repair */

static int wants_query(const rk_request *r) {
    return r->opt.repair_ratio > 0 && r->opt.repair_query && r->opt.mode == RK_MODE_RAG &&
           r->n_chunks > 0 && !rk_chunk_from_prefix(r, 0);
}

/* The query policy, first half: run every asking request's question over its
 * merged (reused, not yet repaired) cache through its last layer (the
 * question's KV written there is overwritten by the question pass) and
 * score each chunk token by the attention mass the question's rows and
 * heads give it at the last layer (rk_attn_key_mass). The scores wait in
 * the request's state for its deviation pass, which runs after this one
 * (at admission or in the steps) and ranks by both (fuse_ranks): the
 * question finds the sentence it asks about, whose pronoun often moved
 * little by layer 1, and the deviation finds the tokens whose reused KV
 * moved most, which the question's attention at one layer misses (see
 * docs/fidelity.md for the variants measured). On a model without a
 * deviation layer the mass alone ranks, and the runs are recorded here.
 * Sets chunk_reports[].repaired and recomputed_tokens then. */
static rk_status query_select(rk_service *svc, rk_request *const *reqs, int n_reqs, batch *b) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    int bs = kv->block_size, n_q = 0, max_keys = 0, max_q = 0, max_toks = 0;
    for (int i = 0; i < n_reqs; i++) {
        rk_request *r = reqs[i];
        if (!wants_query(r)) continue;
        int keys = r->state->layout.question_index + r->n_question, toks = 0;
        for (int k = 0; k < r->n_chunks; k++) toks += r->chunk_lens[k];
        n_q += r->n_gap_tokens + r->n_question;
        max_q = r->n_question > max_q ? r->n_question : max_q;
        max_keys = keys > max_keys ? keys : max_keys;
        max_toks = toks > max_toks ? toks : max_toks;
    }
    if (max_toks == 0) return RK_OK;
    size_t q_row = (size_t)hp->n_heads * hp->head_dim, row = (size_t)kv->n_kv_heads * kv->head_dim;
    batch qb = {0};
    int layer = hp->n_layers - 1; /* the question's last layer reads the answer */
    float *q = malloc((size_t)(n_q ? n_q : 1) * q_row * sizeof *q);
    float *keys = malloc((size_t)max_keys * 2 * row * sizeof *keys);
    unsigned char *raw = malloc((size_t)bs * row * rk_dtype_size(kv->dtype));
    double *mass = malloc((size_t)max_keys * sizeof *mass);
    int32_t *q_len = malloc((size_t)(max_q ? max_q : 1) * sizeof *q_len);
    dev_tok *toks = malloc((size_t)max_toks * sizeof *toks);
    unsigned char *sel = malloc((size_t)max_toks);
    rk_status st = q && keys && raw && mass && q_len && toks && sel
                       ? RK_OK
                       : rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory for the query repair");
    for (int i = 0; i < n_reqs && !st; i++) {
        rk_request *r = reqs[i];
        const rk_layout *L = &r->state->layout;
        if (!wants_query(r)) continue;
        /* The texts between chunk groups first, in the same pass: the
         * question attends to them, and they are not computed yet. */
        for (int g = 0; g < L->n_gaps && !st; g++)
            if (r->gap_len[g])
                st = rk_batch_add(&qb, bs, &r->state->kv, r->gap[g], r->gap_len[g], L->gap_pos[g],
                                  L->gap_index[g], 0);
        if (!st && r->n_question)
            st = rk_batch_add(&qb, bs, &r->state->kv, r->question, r->n_question, L->question_pos,
                              L->question_index, 0);
    }
    qb.n_layers = layer + 1;
    qb.out_q = q;
    if (!st && qb.n_seq) st = rk_batch_run(svc, &qb);
    size_t qr = 0; /* the request's first question row in q */
    for (int i = 0; i < n_reqs && !st; i++) {
        rk_request *r = reqs[i];
        if (!wants_query(r)) continue;
        const rk_layout *L = &r->state->layout;
        qr += (size_t)r->n_gap_tokens; /* the rows of its texts */
        int n_keys = L->question_index + r->n_question, n_toks = 0;
        memset(mass, 0, (size_t)n_keys * sizeof *mass);
        if (r->n_question) {
            for (int j = 0; j < r->n_question; j++) q_len[j] = L->question_index + j + 1;
            /* the layer's own scores: scale, soft cap, sliding window */
            rk_attn_params ap = rk_model_attn_params(svc->model, layer);
            if (!(st = read_kv(svc, &r->state->kv, layer, 0, n_keys, keys, keys + n_keys * row,
                               raw)))
                st = rk_attn_key_mass(q + qr * q_row, q_len, r->n_question, keys, n_keys,
                                      hp->n_heads, hp->n_kv_heads, hp->head_dim, &ap, mass);
            if (st) break;
            qr += (size_t)r->n_question;
        }
        if (wants_deviation(r, hp)) {
            for (int k = 0; k < r->n_chunks; k++) n_toks += r->chunk_lens[k];
            if (!(r->state->q_mass = malloc((size_t)n_toks * sizeof *r->state->q_mass))) {
                st = rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory for the query repair");
                break;
            }
            for (int k = 0, j = 0; k < r->n_chunks; k++)
                for (int t = 0; t < r->chunk_lens[k]; t++)
                    r->state->q_mass[j++] = (float)mass[L->index[k] + t];
            continue;
        }
        for (int k = 0; k < r->n_chunks; k++)
            for (int t = 0; t < r->chunk_lens[k]; t++)
                toks[n_toks++] = (dev_tok){mass[L->index[k] + t], k, t};
        st = queue_chosen(r, toks, n_toks, sel);
    }
    rk_batch_free(&qb);
    free(q);
    free(keys);
    free(raw);
    free(mass);
    free(q_len);
    free(toks);
    free(sel);
    return st;
}

int rk_repair_stepped(const admission *a, const rk_request *r) {
    return a->defer && !r->state->done;
}

rk_status rk_repair_feed(batch *b, int bs, rk_req_state *s, int *left) {
    rk_status st;
    int skip = s->r_next;
    s->fed_r = 0;
    for (int i = 0; i < s->n_repair && *left != 0; i++) {
        const repair_run *u = &s->repair[i];
        if (skip >= u->n) {
            skip -= u->n;
            continue;
        }
        int m = *left >= 0 && *left < u->n - skip ? *left : u->n - skip;
        if ((st = rk_batch_add_req(b, bs, s, u->tokens + skip, m, u->pos + skip, u->idx + skip, 0)))
            return st;
        skip = 0;
        s->fed_r += m;
        if (*left >= 0) *left -= m;
    }
    return RK_OK;
}

/* Stage 5 (repair, optional): chunk tokens again, now attending to
 * everything before them in the merged table: the runs a policy chose
 * (deviation's and query's after their scoring passes, or the first
 * repair_k tokens of every chunk), recorded in the request's state. They
 * run here in one pass, unless stepped: then the steps' passes feed them,
 * a slice within the budget at a time, after the system tail (rk_run_pass).
 * repair_ms: the scoring and this pass (stepped: the steps add theirs). */
rk_status rk_stage_repair(admission *a) {
    int bs = rk_arena_block_size(a->svc->arena);
    rk_status st;
    double t = rk_time_now();
    rk_batch_reset(a->b);
    for (int i = 0; i < a->n; i++) {
        a->reqs[i]->recomputed_tokens = 0;
        for (int k = 0; k < a->reqs[i]->n_chunks; k++) a->reqs[i]->chunk_reports[k].repaired = 0;
    }
    /* A stepped request's deviation pass goes to the steps too
     * (rk_repair_score_step); its runs are recorded when it ends. */
    const rk_hparams *hp = rk_model_hparams(a->svc->model);
    for (int i = 0; i < a->n; i++)
        if (wants_deviation(a->reqs[i], hp) && rk_repair_stepped(a, a->reqs[i])) {
            if ((st = dev_start(a->svc, a->reqs[i]))) return st;
            a->reqs[i]->state->scoring = 1;
        }
    /* The question's pass first: it reads the chunks' KV as reused. */
    if ((st = query_select(a->svc, a->reqs, a->n, a->b)) ||
        (st = deviation_select(a->svc, a->reqs, a->n, a->b)))
        return st;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        if (r->opt.mode == RK_MODE_PLAIN || r->opt.repair_k <= 0 || r->opt.repair_ratio > 0)
            continue; /* one policy a request: a ratio policy's choice is recorded already */
        if (r->n_chunks && rk_chunk_from_prefix(r, 0)) continue; /* repaired when first computed */
        for (int k = 0; k < r->n_chunks; k++)
            if ((st = add_run(r, k, 0,
                              r->chunk_lens[k] < r->opt.repair_k ? r->chunk_lens[k]
                                                                 : r->opt.repair_k)))
                return st;
    }
    for (int i = 0; i < a->n; i++)
        if (a->reqs[i]->opt.mode == RK_MODE_RAG && a->reqs[i]->n_groups > 1 &&
            (st = add_gap_runs(a->reqs[i])))
            return st;
    for (int i = 0; i < a->n; i++) {
        int all = -1;
        if (!rk_repair_stepped(a, a->reqs[i]) &&
            (st = rk_repair_feed(a->b, bs, a->reqs[i]->state, &all)))
            return st;
    }
    if ((st = rk_batch_run(a->svc, a->b))) return st;
    double dt = rk_time_now() - t;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        r->state->r_next += r->state->fed_r;
        r->state->fed_r = 0;
        if (r->recomputed_tokens || r->state->scoring) r->t.repair_ms = dt * 1e3;
    }
    return RK_OK;
}
