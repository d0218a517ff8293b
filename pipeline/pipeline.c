/* pipeline/pipeline.c — see pipeline.h.
 *
 * Requests admitted together go through up to three prefill passes (one
 * function per stage, top to bottom under "admission stages"):
 *   pass 1: every system-prompt tail the prefix cache did not have that
 *           pass 2 or a repair attends to (the others wait for pass 3);
 *           every missing chunk of the `isolated` context, alone at positions
 *           0..n-1 into its entry's chunk-pool blocks; every oracle chunk
 *           (cache off), fresh at its live positions in a scratch sequence;
 *   pass 2: missing chunks of the `system` context, in a scratch sequence
 *           that shares the request's system KV, copied into their entries;
 *   reindex: zero-copy (the default, where the backend can): the request's
 *           table is assembled from runs, the cached chunks' own blocks
 *           among them, each attended with its shift live offset - base;
 *           copy: one rope_shift_copy moves every chunk's KV into the
 *           request's live blocks (cached ones rotated by that shift);
 *   repair: chunk tokens recomputed over the merged cache (optional);
 *   pass 3: the rest of each prompt (deferred system tail, question), with
 *           logits for the last token: each request's first token. With
 *           rk_pipeline_join it is part of the steps' passes (run_pass).
 * Then they run: each rk_pipeline_step is one pass of one token for every
 * running request, whenever it was admitted, plus the joined requests'
 * pass-3 tokens within step_tokens, and the finished leave. A request takes
 * live blocks as it decodes (make_room); when none is left the youngest is
 * preempted (preempt) and resumes through a later admission. */
#include "pipeline/pipeline.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "chunkcache/chunk_index.h"
#include "pipeline/persist.h"

/* A scratch sequence: KV computed somewhere other than the request's own
 * table, then copied into place. */
typedef struct scratch {
    rk_seq kv;
    int used;      /* kv holds references of its own */
    int borrowed;  /* kv.blocks are a chunk entry's: never released through kv */
    int src_first; /* table index of the chunk's first token in kv */
    int pass2;     /* computed in pass 2 (after the system prompt) */
    int anchored;  /* computed in pass 1 after the anchor, then copied into its entry */
    /* The chunk pool had no room: its entry is the request's own, not in the
     * index, its blocks from the live pool (see acquire_uncached). */
    int uncached;
    int32_t *tokens; /* oracle with system context: system + chunk tokens */

    /* The fleet-wide compute lock on its chunk, held when rlocked. */
    rk_redis_lock rlock;
    int rlocked;
} scratch;

struct rk_req_state {
    rk_seq kv;           /* the merged sequence (zero-copy: its system and live blocks) */
    int zc;              /* zero-copy: the merged sequence's table is `runs` */
    rk_runs runs;        /* zero-copy: system, each chunk's cached blocks, live blocks */
    rk_seq own;          /* zero-copy: private copies of the chunk blocks a repair writes */
    rk_radix_node *lock; /* radix path held for the request */
    int sys_first;       /* first system token to compute */
    int n_insert;        /* system tokens to insert into the radix tree after pass 1 */
    int32_t partial_src; /* radix page the match continues into (referenced), -1 = none */
    int n_partial;       /* its first rows to copy, at table index reused - n_partial */
    uint64_t ns;         /* the request's radix namespace */
    int32_t *key;        /* (layout + max_tokens) radix key of the merged sequence */
    int n_prompt;        /* table entries of the prompt */
    int reused;          /* table entries taken from the radix tree */
    int n_valid;         /* table entries whose KV is written */
    rk_layout layout;
    rk_chunk_entry **entries; /* (n_chunks) references held, NULL for oracle chunks */
    rk_chunk_lookup *kinds;   /* (n_chunks) */
    scratch *scratch;         /* (n_chunks) used ones have kv.n_blocks > 0 */
    int32_t *qtok;            /* tokens fed in pass 3: the question (plain: chunks + question),
                                 then, resuming, the tokens generated before but the last */
    int n_qtok;
    int n_gen; /* those generated tokens */
    /* Resuming: the report of its first admission, put back once admitted
     * (the resumed prompt finds its chunks cached, and so on). */
    rk_request *first_report;
    int q_index, q_pos; /* table index and position of the first of them */
    int next_pos;       /* position of the next token to feed */
    /* The prompt work left to the question pass (its last pass, merged with
     * decode steps, see run_pass): the system tail from sys_next (== n_sys
     * when pass 1 computed it), then ptok[p_next .. n_ptok) at table index
     * p_idx and position p_pos on; the last of it gives the first token. */
    int prefilling;
    int sys_next;
    const int32_t *ptok;
    int n_ptok, p_idx, p_pos, p_next;
    int row, fed_sys, fed_p; /* in the current pass: its logits row (-1: none), tokens fed */
    rk_sampler sampler;
    int done;
    int hook_index; /* the hooks' req: its rank in admission order */
    double t_start;
};

static int chunk_from_prefix(const rk_request *r, int k);
static int private_tokens(const rk_request *r, int n, int bs);

void rk_req_options_default(rk_req_options *o) {
    memset(o, 0, sizeof *o);
    o->chunk_cache = 1;
    o->prefix_cache = 1;
    o->reuse_sequences = 1;
    o->positions = RK_POSITIONS_SEQUENTIAL;
    o->max_tokens = 128;
    o->sampling = (rk_sampler_params){.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 0};
    o->stop_at_eog = 1;
}

rk_chunk_key rk_cache_scope(const char *tenant_salt, const char *request_salt) {
    size_t nt = tenant_salt ? strnlen(tenant_salt, RK_CACHE_SALT_MAX) : 0;
    size_t nr = request_salt ? strnlen(request_salt, RK_CACHE_SALT_MAX) : 0;
    if (!nt && !nr) return (rk_chunk_key){0, 0};
    char buf[2 * RK_CACHE_SALT_MAX + 16];
    size_t n = 0;
    if (nt) {
        memcpy(buf, "\0tenant\0", 8), n = 8;
        memcpy(buf + n, tenant_salt, nt), n += nt;
        buf[n++] = '\0';
    }
    if (nr) memcpy(buf + n, request_salt, nr), n += nr;
    XXH128_hash_t h = XXH3_128bits(buf, n);
    if (!h.high64 && !h.low64) h.low64 = 1; /* {0, 0} means no salt */
    return (rk_chunk_key){h.high64, h.low64};
}

/* ---------------------------------------------------------------- requests */

void rk_request_free(rk_request *r) {
    if (!r) return;
    free(r->sys);
    for (int i = 0; i < r->n_chunks; i++) free(r->chunks ? r->chunks[i] : NULL);
    free(r->chunks);
    free(r->chunk_lens);
    free(r->question);
    free(r->out_tokens);
    free(r->top_ids);
    free(r->top_logprobs);
    free(r->logprobs);
    free(r->chunk_reports);
    rk_grammar_state_free(r->grammar_state);
    r->grammar_state = NULL;
    r->sys = r->question = r->out_tokens = r->top_ids = NULL;
    r->chunks = NULL;
    r->chunk_lens = NULL;
    r->top_logprobs = r->logprobs = NULL;
    r->chunk_reports = NULL;
    r->n_chunks = 0;
}

static rk_status alloc_results(rk_service *svc, rk_request *r) {
    int n = r->opt.max_tokens > 0 ? r->opt.max_tokens : 1, k = r->opt.n_logprobs;
    if (r->opt.max_tokens < 0 || r->opt.max_tokens > svc->cfg.max_tokens)
        return rk_errorf(RK_ERR_LIMIT, "max_tokens %d is outside 0..%d", r->opt.max_tokens,
                         svc->cfg.max_tokens);
    if (k < 0 || k > 20) return rk_errorf(RK_ERR_INVALID, "logprobs must be 0 to 20, got %d", k);
    r->out_tokens = malloc((size_t)n * sizeof *r->out_tokens);
    r->logprobs = malloc((size_t)n * sizeof *r->logprobs);
    r->chunk_reports = calloc((size_t)(r->n_chunks ? r->n_chunks : 1), sizeof *r->chunk_reports);
    if (k) {
        r->top_ids = malloc((size_t)n * k * sizeof *r->top_ids);
        r->top_logprobs = malloc((size_t)n * k * sizeof *r->top_logprobs);
    }
    if (!r->out_tokens || !r->logprobs || !r->chunk_reports ||
        (k && (!r->top_ids || !r->top_logprobs)))
        return rk_errorf(RK_ERR_NOMEM, "request: out of memory");
    return RK_OK;
}

static rk_status check_context(rk_service *svc, rk_request *r) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    long prompt = r->n_sys + r->n_question;
    for (int i = 0; i < r->n_chunks; i++) prompt += r->chunk_lens[i];
    long limit = svc->cfg.max_context > 0 ? svc->cfg.max_context : hp->n_ctx;
    /* A default max_tokens shrinks to the room left; the prompt must leave
     * room for one token. */
    if (r->opt.max_tokens_fit && prompt < limit && prompt + r->opt.max_tokens > limit)
        r->opt.max_tokens = (int)(limit - prompt);
    long total = prompt + (long)r->opt.max_tokens;
    if (total > limit || (r->opt.max_tokens_fit && prompt >= limit)) {
        r->context_exceeded = 1;
        return rk_errorf(RK_ERR_LIMIT,
                         "the request needs %ld tokens of context (a %ld-token prompt + "
                         "max_tokens %d); the limit is %ld",
                         total, prompt, r->opt.max_tokens, limit);
    }
    if (r->n_sys + r->n_question == 0)
        return rk_errorf(RK_ERR_INVALID, "the prompt is empty and the model has no BOS token");
    return RK_OK;
}

static rk_status encode(const rk_tokenizer *tok, const rk_text *t, int special, int32_t **ids,
                        int *n) {
    size_t k = 0;
    *ids = NULL;
    *n = 0;
    if (t->len == 0) return RK_OK;
    rk_status st = rk_tokenizer_encode(tok, t->s, t->len, special, ids, &k);
    *n = (int)k;
    return st;
}

rk_status rk_request_prepare(rk_service *svc, const rk_split *pieces, rk_request *r) {
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    rk_status st;
    r->n_chunks = 0;
    r->n_empty_chunks = pieces->n_empty_chunks;
    int32_t *ids = NULL;
    int n = 0;
    if ((st = encode(tok, &pieces->system, 1, &ids, &n))) goto fail;
    int bos = rk_tokenizer_add_bos(tok) && rk_tokenizer_bos(tok) >= 0;
    r->sys = malloc((size_t)(n + bos + 1) * sizeof *r->sys);
    if (!r->sys) {
        free(ids);
        st = rk_errorf(RK_ERR_NOMEM, "request: out of memory");
        goto fail;
    }
    if (bos) r->sys[0] = rk_tokenizer_bos(tok);
    if (n) memcpy(r->sys + bos, ids, (size_t)n * sizeof *ids);
    free(ids);
    r->n_sys = n + bos;
    r->chunks = calloc((size_t)(pieces->n_chunks ? pieces->n_chunks : 1), sizeof *r->chunks);
    r->chunk_lens =
        calloc((size_t)(pieces->n_chunks ? pieces->n_chunks : 1), sizeof *r->chunk_lens);
    if (!r->chunks || !r->chunk_lens) {
        st = rk_errorf(RK_ERR_NOMEM, "request: out of memory");
        goto fail;
    }
    if (pieces->n_chunks > svc->cfg.max_chunks) {
        st = rk_errorf(RK_ERR_LIMIT, "the request has %d chunks; at most %d are allowed",
                       pieces->n_chunks, svc->cfg.max_chunks);
        goto fail;
    }
    for (int i = 0; i < pieces->n_chunks; i++) {
        /* Document text never carries control tokens: special tokens off. */
        if ((st = encode(tok, &pieces->chunks[i], 0, &r->chunks[i], &r->chunk_lens[i]))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", rk_error_message());
            st = rk_errorf(st, "chunk %d: %s", i, msg);
            goto fail;
        }
        r->n_chunks = i + 1;
        if (r->chunk_lens[i] > svc->cfg.max_chunk_tokens) {
            st = rk_errorf(RK_ERR_LIMIT, "chunk %d has %d tokens; at most %d are allowed", i,
                           r->chunk_lens[i], svc->cfg.max_chunk_tokens);
            goto fail;
        }
        if (r->chunk_lens[i] == 0) { /* text that tokenizes to nothing: skipped like an empty one */
            free(r->chunks[i]);
            r->chunks[i] = NULL;
            r->n_chunks = i;
            r->n_empty_chunks++;
        }
    }
    /* Compact out chunks that tokenized to nothing. */
    int kept = 0;
    for (int i = 0; i < pieces->n_chunks; i++)
        if (r->chunks[i]) {
            r->chunks[kept] = r->chunks[i];
            r->chunk_lens[kept++] = r->chunk_lens[i];
        }
    r->n_chunks = kept;
    if ((st = encode(tok, &pieces->question, 1, &r->question, &r->n_question))) goto fail;
    if (r->n_question == 0 && (r->n_chunks > 0 || pieces->system.len > 0)) {
        st = rk_errorf(RK_ERR_INVALID, "the question is empty");
        goto fail;
    }
    if ((st = check_context(svc, r)) || (st = alloc_results(svc, r))) goto fail;
    return RK_OK;
fail:
    for (int i = r->n_chunks; i < pieces->n_chunks && r->chunks; i++) {
        free(r->chunks[i]);
        r->chunks[i] = NULL;
    }
    r->n_chunks = pieces->n_chunks < r->n_chunks ? r->n_chunks : pieces->n_chunks;
    rk_request_free(r);
    return st;
}

rk_status rk_request_prepare_tokens(rk_service *svc, const int32_t *sys, int n_sys,
                                    const int32_t *question, int n_question, rk_request *r) {
    r->sys = malloc((size_t)(n_sys + 1) * sizeof *r->sys);
    r->question = malloc((size_t)(n_question + 1) * sizeof *r->question);
    r->n_chunks = 0;
    rk_status st;
    if (!r->sys || !r->question) {
        st = rk_errorf(RK_ERR_NOMEM, "request: out of memory");
        goto fail;
    }
    const rk_hparams *hp = rk_model_hparams(svc->model);
    for (int i = 0; i < n_sys + n_question; i++) {
        int32_t t = i < n_sys ? sys[i] : question[i - n_sys];
        if (t < 0 || t >= hp->n_vocab) {
            st = rk_errorf(RK_ERR_INVALID, "token id %d out of range [0, %d)", t, hp->n_vocab);
            goto fail;
        }
    }
    if (n_sys) memcpy(r->sys, sys, (size_t)n_sys * sizeof *sys);
    if (n_question) memcpy(r->question, question, (size_t)n_question * sizeof *question);
    r->n_sys = n_sys;
    r->n_question = n_question;
    if ((st = check_context(svc, r)) || (st = alloc_results(svc, r))) goto fail;
    return RK_OK;
fail:
    rk_request_free(r);
    return st;
}

/* ---------------------------------------------------------------- batches */

/* One forward pass under construction: sequences with their tokens, slots and
 * block tables. */
typedef struct batch {
    int n_tok, cap_tok;
    int32_t *tokens, *pos, *slots;
    int n_seq, cap_seq;
    int32_t *q_start, *kv_len, *logit_rows;
    const rk_seq **tables;                    /* (n_seq) the sequence whose blocks are its table */
    const rk_runs **runs;                     /* (n_seq) its run table instead, or NULL */
    int32_t *seg_start, *seg_end, *seg_delta; /* the runs, when some sequence has them */
    int cap_segs;
    int max_blocks;
    int32_t *table; /* (n_seq, max_blocks) built at run time */
    int n_logits;
    float *logits; /* (n_logits, n_vocab) */
    int cap_logits;
    int n_layers; /* run only the first n_layers (0 = all) */
    float *out_q; /* not NULL: the last layer run's queries, (n_tok, n_heads * head_dim) */
} batch;

static void batch_reset(batch *b) {
    b->n_tok = b->n_seq = b->n_logits = 0;
    b->max_blocks = 0;
    b->n_layers = 0;
}

static void batch_free(batch *b) {
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
        if ((st = grow32(&b->q_start, cap + 1)) || (st = grow32(&b->kv_len, cap)) ||
            (st = grow32(&b->logit_rows, cap)))
            return st;
        b->cap_seq = cap;
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
    if (want_logits) b->logit_rows[b->n_logits++] = b->n_tok - 1;
    int nb = (idx0 + n + bs - 1) / bs;
    if (runs) rk_runs_cover(runs, bs, idx0 + n, NULL, NULL, &nb);
    b->max_blocks = nb > b->max_blocks ? nb : b->max_blocks;
    b->n_seq++;
    return RK_OK;
}

static rk_status batch_add(batch *b, int bs, const rk_seq *seq, const int32_t *tokens, int n,
                           int pos0, int idx0, int want_logits) {
    return batch_add_seq(b, bs, seq, NULL, tokens, n, pos0, idx0, want_logits);
}

/* Add tokens of a request's merged sequence, addressed through its run
 * table when it reuses chunks in place. */
static rk_status batch_add_req(batch *b, int bs, const rk_req_state *s, const int32_t *tokens,
                               int n, int pos0, int idx0, int want_logits) {
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

static rk_status batch_run(rk_service *svc, batch *b) {
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
                            .rope = segments ? rk_model_rope(svc->model) : NULL},
                   .n_logits = b->n_logits,
                   .logit_rows = b->logit_rows,
                   .n_layers = b->n_layers,
                   .out_q = b->out_q};
    return rk_model_forward(svc->model, rk_arena_kv(svc->arena), &fb, b->logits);
}

/* ---------------------------------------------------------------- deviation repair */

/* Layer 0's K/V depend only on a token and its position, so a reused chunk's
 * are exact once reindexed; layer 1 is the first that sees the rest of the
 * prompt, and where a token's reused K/V is measured against fresh ones. */
#define DEVIATION_LAYER 1

/* K and V at layer of table entries idx0 .. idx0 + n - 1 of seq, as f32 rows
 * of n_kv_heads * head_dim: k (n rows), v (n rows). raw: block_size rows of
 * scratch in the cache dtype. Reads a block's run of entries per download. */
static rk_status read_kv(rk_service *svc, const rk_seq *seq, int layer, int idx0, int n, float *k,
                         float *v, unsigned char *raw) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    int bs = kv->block_size;
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim, rb = rk_dtype_row_bytes(kv->dtype, row);
    rk_status st;
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

typedef struct dev_tok {
    float score; /* squared distance of its layer-1 K and V, reused to fresh */
    int chunk, off;
} dev_tok;

static int by_score_desc(const void *a, const void *b) {
    const dev_tok *x = a, *y = b;
    if (x->score != y->score) return x->score < y->score ? 1 : -1;
    return x->chunk != y->chunk ? x->chunk - y->chunk : x->off - y->off; /* stable */
}

/* Both ratio policies, second half: sort r's n_toks scored chunk tokens,
 * take the repair_ratio of them that score highest, and queue their runs in b
 * (one sequence per run of consecutive chosen tokens of a chunk) for the full
 * recompute. sel: scratch of the longest chunk's length. Sets
 * chunk_reports[].repaired and recomputed_tokens. */
static rk_status queue_chosen(batch *b, int bs, rk_request *r, dev_tok *toks, int n_toks,
                              unsigned char *sel) {
    rk_status st = RK_OK;
    int n_sel = (int)ceil(r->opt.repair_ratio * n_toks - 1e-9);
    n_sel = n_sel < n_toks ? n_sel : n_toks;
    qsort(toks, (size_t)n_toks, sizeof *toks, by_score_desc);
    for (int k = 0; k < r->n_chunks && !st; k++) {
        memset(sel, 0, (size_t)r->chunk_lens[k]);
        int marked = 0;
        for (int j = 0; j < n_sel; j++)
            if (toks[j].chunk == k) sel[toks[j].off] = 1, marked++;
        r->chunk_reports[k].repaired = marked;
        r->recomputed_tokens += marked;
        for (int t = 0; t < r->chunk_lens[k] && !st;) { /* one sequence per run */
            if (!sel[t]) {
                t++;
                continue;
            }
            int t1 = t;
            while (t1 < r->chunk_lens[k] && sel[t1]) t1++;
            st = batch_add(b, bs, &r->state->kv, r->chunks[k] + t, t1 - t,
                           r->state->layout.pos[k] + t, r->state->layout.index[k] + t, 0);
            t = t1;
        }
    }
    return st;
}

static int wants_deviation(const rk_request *r, const rk_hparams *hp) {
    return r->opt.repair_ratio > 0 && !r->opt.repair_query && r->opt.mode == RK_MODE_RAG &&
           r->n_chunks > 0 && hp->n_layers > DEVIATION_LAYER && !chunk_from_prefix(r, 0);
}

/* The deviation policy, first half: recompute layers 0..DEVIATION_LAYER for
 * every chunk token of the requests asking for it (their KV then replaces the
 * reused one in the live blocks), score each token by how far its layer-1 K/V
 * moved, and leave in *b (empty on entry) the runs of the repair_ratio of
 * each request's chunk tokens that moved most, for the full recompute.
 * Sets chunk_reports[].repaired and recomputed_tokens. */
static rk_status deviation_select(rk_service *svc, rk_request *const *reqs, int n_reqs, batch *b) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    int bs = kv->block_size, max_len = 0;
    long total = 0;
    for (int i = 0; i < n_reqs; i++)
        for (int k = 0; wants_deviation(reqs[i], hp) && k < reqs[i]->n_chunks; k++) {
            total += reqs[i]->chunk_lens[k];
            max_len = reqs[i]->chunk_lens[k] > max_len ? reqs[i]->chunk_lens[k] : max_len;
        }
    if (total == 0) return RK_OK;
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    float *before = malloc((size_t)total * 2 * row * sizeof *before);
    float *after = malloc((size_t)max_len * 2 * row * sizeof *after);
    unsigned char *raw = malloc((size_t)bs * rk_dtype_row_bytes(kv->dtype, row));
    dev_tok *toks = malloc((size_t)total * sizeof *toks);
    rk_status st =
        before && after && raw && toks
            ? RK_OK
            : rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory for the deviation repair");
    /* The reused K/V at the deviation layer, then layers 0..1 again over the merged cache. */
    size_t at = 0;
    for (int i = 0; i < n_reqs && !st; i++) {
        rk_request *r = reqs[i];
        for (int k = 0; wants_deviation(r, hp) && k < r->n_chunks && !st; k++) {
            int n = r->chunk_lens[k], idx = r->state->layout.index[k];
            st = read_kv(svc, &r->state->kv, DEVIATION_LAYER, idx, n, before + at * 2 * row,
                         before + (at * 2 + n) * row, raw);
            if (!st)
                st = batch_add(b, bs, &r->state->kv, r->chunks[k], n, r->state->layout.pos[k], idx,
                               0);
            at += (size_t)n;
        }
    }
    b->n_layers = DEVIATION_LAYER + 1;
    if (!st) st = batch_run(svc, b);
    batch_reset(b);
    /* Score, select per request, and queue the selected runs. */
    at = 0;
    for (int i = 0; i < n_reqs && !st; i++) {
        rk_request *r = reqs[i];
        if (!wants_deviation(r, hp)) continue;
        int n_toks = 0;
        for (int k = 0; k < r->n_chunks && !st; k++) {
            int n = r->chunk_lens[k], idx = r->state->layout.index[k];
            const float *bk = before + at * 2 * row, *bv = before + (at * 2 + n) * row;
            if ((st = read_kv(svc, &r->state->kv, DEVIATION_LAYER, idx, n, after, after + n * row,
                              raw)))
                break;
            for (int t = 0; t < n; t++) {
                double d = 0;
                for (size_t e = 0; e < row; e++) {
                    double dk = after[t * row + e] - bk[t * row + e];
                    double dv = after[(n + t) * row + e] - bv[t * row + e];
                    d += dk * dk + dv * dv;
                }
                toks[n_toks++] = (dev_tok){(float)d, k, t};
            }
            at += (size_t)n;
        }
        if (!st) st = queue_chosen(b, bs, r, toks, n_toks, (unsigned char *)after);
    }
    free(before);
    free(after);
    free(raw);
    free(toks);
    return st;
}

/* ---------------------------------------------------------------- query repair */

static int wants_query(const rk_request *r) {
    return r->opt.repair_ratio > 0 && r->opt.repair_query && r->opt.mode == RK_MODE_RAG &&
           r->n_chunks > 0 && !chunk_from_prefix(r, 0);
}

/* The query policy, first half: run every asking request's question over its
 * merged (reused, not yet repaired) cache through its last layer (the
 * question's KV written there is overwritten by the question pass), score
 * each chunk token by the attention mass the question's rows and heads give
 * it at the last layer (rk_attn_key_mass), and queue in *b the runs of the
 * repair_ratio of each request's chunk tokens that score highest. A chunk's
 * first token ranks before the chunk tokens that are not first: computed
 * alone it was position 0, the chunk's attention sink, and its reused KV is
 * the furthest from full attention (on ragqa first_k:1 alone recovers most
 * of the loss; see docs/fidelity.md for the variants measured). Among first
 * tokens, and among the rest, the question's attention decides. Sets
 * chunk_reports[].repaired and recomputed_tokens. */
static rk_status query_select(rk_service *svc, rk_request *const *reqs, int n_reqs, batch *b) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    int bs = kv->block_size, n_q = 0, max_keys = 0, max_q = 0, max_toks = 0;
    for (int i = 0; i < n_reqs; i++) {
        rk_request *r = reqs[i];
        if (!wants_query(r)) continue;
        int keys = r->state->layout.question_index + r->n_question, toks = 0;
        for (int k = 0; k < r->n_chunks; k++) toks += r->chunk_lens[k];
        n_q += r->n_question;
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
        if (wants_query(r) && r->n_question)
            st = batch_add(&qb, bs, &r->state->kv, r->question, r->n_question,
                           r->state->layout.question_pos, r->state->layout.question_index, 0);
    }
    qb.n_layers = layer + 1;
    qb.out_q = q;
    if (!st && qb.n_seq) st = batch_run(svc, &qb);
    size_t qr = 0; /* the request's first question row in q */
    for (int i = 0; i < n_reqs && !st; i++) {
        rk_request *r = reqs[i];
        if (!wants_query(r)) continue;
        const rk_layout *L = &r->state->layout;
        int n_keys = L->question_index + r->n_question, n_toks = 0;
        memset(mass, 0, (size_t)n_keys * sizeof *mass);
        if (r->n_question) {
            for (int j = 0; j < r->n_question; j++) q_len[j] = L->question_index + j + 1;
            if (!(st = read_kv(svc, &r->state->kv, layer, 0, n_keys, keys, keys + n_keys * row,
                               raw)))
                st = rk_attn_key_mass(q + qr * q_row, q_len, r->n_question, keys, n_keys,
                                      hp->n_heads, hp->n_kv_heads, hp->head_dim,
                                      1.0f / sqrtf((float)hp->head_dim), mass);
            if (st) break;
            qr += (size_t)r->n_question;
        }
        double first = (double)r->n_question * hp->n_heads + 1; /* above any mass */
        for (int k = 0; k < r->n_chunks; k++)
            for (int t = 0; t < r->chunk_lens[k]; t++)
                toks[n_toks++] =
                    (dev_tok){(float)(mass[L->index[k] + t] + (t == 0 ? first : 0)), k, t};
        st = queue_chosen(b, bs, r, toks, n_toks, sel);
    }
    batch_free(&qb);
    free(q);
    free(keys);
    free(raw);
    free(mass);
    free(q_len);
    free(toks);
    free(sel);
    return st;
}

/* ---------------------------------------------------------------- stages */

/* Write a freshly computed entry through to the disk and Redis tiers; the
 * Redis write releases the chunk's compute lock when sc holds it. A failed
 * write is logged and counted by its tier; serving goes on from the arena. */
static void persist(rk_service *svc, const rk_chunk_entry *e, rk_chunk_context context,
                    scratch *sc) {
    const rk_redis_lock *lk = sc->rlocked ? &sc->rlock : NULL;
    sc->rlocked = 0;
    static const char *const names[] = {"isolated", "system", "anchor"};
    if (rk_persist_write_tiers(svc, e, names[context], NULL, 1, lk))
        RK_LOG_WARN("chunk not persisted: %s", rk_error_message());
}

/* A chunk the disk tier missed: try the Redis tier (which also takes the
 * fleet-wide compute lock on a miss). Reports the source on a load. */
static rk_status load_shared(rk_service *svc, rk_request *r, int k, int *out_loaded) {
    rk_req_state *s = r->state;
    rk_chunk_entry *e = s->entries[k];
    scratch *sc = &s->scratch[k];
    rk_status st = rk_persist_load_redis(svc, e, out_loaded, &sc->rlock, &sc->rlocked);
    if (st || !*out_loaded) return st;
    rk_chunk_index_loaded(svc->chunks, e);
    snprintf(e->source, sizeof e->source, "redis");
    s->kinds[k] = RK_CHUNK_HIT;
    r->chunk_reports[k].status = RK_CHUNK_STATUS_HIT;
    r->chunk_reports[k].source = RK_CHUNK_SOURCE_REDIS;
    return RK_OK;
}

/* Set on the first token of every chunk and of the question in a radix key,
 * so the same tokens segmented differently never match (token ids are below
 * 2^24, checked when the key is built). */
#define SEGMENT_MARK (1 << 30)

/* The radix namespace of a request: everything besides the key's tokens that
 * changes the KV of its merged sequence. A plain sequence depends on its
 * tokens alone. */
static uint64_t request_ns(const rk_service *svc, const rk_request *r) {
    int32_t v[8] = {(int32_t)r->opt.mode, (int32_t)rk_arena_kv(svc->arena)->dtype};
    if (r->opt.mode == RK_MODE_RAG) {
        v[2] = r->opt.chunk_cache;
        v[3] = (int32_t)r->opt.chunk_context;
        v[4] = (int32_t)r->opt.positions;
        v[5] = r->opt.repair_k;
        memcpy(&v[6], &r->opt.repair_ratio, sizeof(float));
        v[7] = r->opt.repair_query;
    }
    uint64_t ns = XXH3_64bits_withSeed(v, sizeof v, svc->prefix_ns);
    if (r->opt.salt.hi || r->opt.salt.lo) { /* a salted request's tree of its own */
        uint64_t salt[2] = {r->opt.salt.hi, r->opt.salt.lo};
        ns = XXH3_64bits_withSeed(salt, sizeof salt, ns);
    }
    return ns;
}

/* The radix key of the prompt's layout (room for the generated tokens
 * after it). */
static rk_status build_key(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    if (rk_model_hparams(svc->model)->n_vocab > SEGMENT_MARK >> 6)
        return rk_errorf(RK_ERR_INTERNAL,
                         "pipeline: a vocabulary of %d tokens leaves no room "
                         "for segment marks in radix keys",
                         rk_model_hparams(svc->model)->n_vocab);
    /* The key follows the layout (a zero-copy table maps the same entries to
     * blocks through its runs). */
    int n_seq = s->q_index + s->n_qtok;
    s->key = malloc((size_t)(n_seq + r->opt.max_tokens + 1) * sizeof *s->key);
    if (!s->key) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    if (r->n_sys) memcpy(s->key, r->sys, (size_t)r->n_sys * sizeof *s->key);
    if (s->n_qtok) memcpy(s->key + s->q_index, s->qtok, (size_t)s->n_qtok * sizeof *s->key);
    if (r->opt.mode != RK_MODE_RAG) return RK_OK;
    for (int k = 0; k < r->n_chunks; k++) {
        memcpy(s->key + s->layout.index[k], r->chunks[k],
               (size_t)r->chunk_lens[k] * sizeof *s->key);
        s->key[s->layout.index[k]] |= SEGMENT_MARK;
    }
    /* Generated tokens resumed as prompt carry no mark, as when inserted. */
    if (s->n_qtok > s->n_gen) s->key[s->q_index] |= SEGMENT_MARK;
    return RK_OK;
}

/* How much of a matched prefix of n tokens a RAG request may take: never part
 * of a chunk (cut back to its start); with repair on, all chunks or none, so
 * the repair policy sees the chunks it would have seen (with the query
 * policy, all chunks only with the whole question after them). */
static int usable_prefix(const rk_request *r, int n) {
    const rk_req_state *s = r->state;
    if (r->opt.mode != RK_MODE_RAG) return n;
    for (int k = 0; k < r->n_chunks; k++)
        if (s->layout.index[k] < n && n < s->layout.index[k] + r->chunk_lens[k])
            n = s->layout.index[k];
    int repair = r->opt.repair_k > 0 || r->opt.repair_ratio > 0;
    if (repair && r->n_chunks && n < s->layout.question_index && n > s->layout.index[0])
        n = s->layout.index[0];
    /* The query policy's choice depends on the question: the whole of it too. */
    if (repair && r->opt.repair_query && r->n_chunks && n > s->layout.index[0] &&
        n < s->layout.question_index + r->n_question)
        n = s->layout.index[0];
    return n;
}

/* A RAG chunk that lies in the prefix taken from the tree. */
static int chunk_from_prefix(const rk_request *r, int k) {
    return r->state->layout.index[k] + r->chunk_lens[k] <= r->state->reused;
}

/* Table entries of the prompt: the layout's, or for a zero-copy table the
 * system prompt padded to a block and the question (the chunks are runs of
 * the chunk pool's blocks). */
static int prompt_table_entries(const rk_request *r, int bs) {
    const rk_req_state *s = r->state;
    if (!s->zc) return s->q_index + s->n_qtok;
    return (r->n_sys + bs - 1) / bs * bs + s->n_qtok;
}

/* Match the request's prompt key (all but its last token) in the radix tree,
 * share the whole pages of the usable prefix, take a reference on the page
 * that continues it for less than a page (its rows are copied before pass 1),
 * reserve blocks for the rest of the system (prefix pool for the pages that
 * will be inserted, the partial last one included, live pool after) and for
 * the chunks, question and generated tokens. The question tokens inside the
 * prefix are dropped from those to feed.
 *
 * A zero-copy request whose match reaches its question has every chunk in
 * the prefix: it takes the copy path, with nothing left to copy. Otherwise
 * it takes the system prompt alone from the match. */
static rk_status start_request(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    /* The key: the whole prompt, or the system prompt alone (whose last token
     * is left for its logits when nothing follows). */
    int whole_seq = r->opt.reuse_sequences;
    int n_key = whole_seq ? s->q_index + s->n_qtok : r->n_sys;
    int leave_one = whole_seq || s->n_qtok == 0;
    int use_prefix = svc->prefix && r->opt.prefix_cache && n_key > 0;
    if (use_prefix) {
        if ((st = build_key(svc, r))) return st;
        s->ns = request_ns(svc, r);
        int32_t *pages = malloc((size_t)(n_key / bs + 1) * sizeof *pages);
        if (!pages) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        rk_radix_result m;
        st = rk_radix_match(svc->prefix, s->ns, s->key, n_key,
                            RK_RADIX_PARTIAL | (leave_one ? RK_RADIX_LEAVE_ONE : 0), pages, &m);
        s->lock = m.node;
        int use = usable_prefix(r, m.n_matched + m.n_partial);
        if (s->zc && use >= s->q_index)
            s->zc = 0;
        else if (s->zc && use > r->n_sys)
            use = r->n_sys;
        int whole = use / bs;
        int32_t src = use < m.n_matched ? pages[whole] : m.partial_page;
        /* The partial page is not locked: reference it before anything can evict it. */
        if (!st && use % bs && !(st = rk_arena_ref(svc->arena, &src, 1))) {
            s->partial_src = src;
            s->n_partial = use % bs;
        }
        if (!st) st = rk_seq_share(&s->kv, svc->arena, pages, whole);
        free(pages);
        if (st) return st;
        s->reused = use;
        s->sys_first = use < r->n_sys ? use : r->n_sys;
        int n_new = r->n_sys - whole * bs;
        if (use < r->n_sys) {
            st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_PREFIX, n_new, NULL);
            if (st == RK_ERR_EXHAUSTED) {
                rk_radix_evict(svc->prefix, n_new, NULL);
                st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_PREFIX, n_new, NULL);
            }
            if (st == RK_OK) {
                s->kv.n_tokens += n_new;
                s->n_insert = r->n_sys;
            } else if (st != RK_ERR_EXHAUSTED) {
                return st;
            } /* else the prefix pool is all locked: compute in live blocks, cache nothing */
        }
    }
    r->sys_cached = s->sys_first;
    r->conv_cached = s->reused - s->sys_first;
    s->n_prompt = prompt_table_entries(r, bs);
    /* Blocks come as decoding needs them; the whole generation must fit
     * the live pool alone, or waiting never helps. */
    long life = (s->n_prompt + (long)r->opt.max_tokens - s->n_gen + bs - 1) / bs - s->kv.n_blocks;
    for (int k = 0; s->zc && k < r->n_chunks; k++)
        life += (private_tokens(r, r->chunk_lens[k], bs) + bs - 1) / bs;
    if (life > rk_arena_pool_total(svc->arena, RK_POOL_LIVE))
        return rk_errorf(RK_ERR_CONTEXT,
                         "the request needs more KV memory than the server has: %ld live "
                         "blocks for its prompt and max_tokens, the live pool has %d",
                         life, rk_arena_pool_total(svc->arena, RK_POOL_LIVE));
    /* The prompt and the first token a decode step feeds. */
    int rest = s->n_prompt + (r->opt.max_tokens > 0) - s->kv.n_tokens;
    if ((st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_LIVE, rest, NULL))) return st;
    /* A zero-copy table's entries count in the layout's terms: the runs map
     * them to blocks. */
    s->kv.n_tokens = s->zc ? s->q_index + s->n_qtok : s->n_prompt;
    int skip = s->reused - s->q_index;
    if (skip > 0) { /* never all of them: the last prompt token is always computed */
        memmove(s->qtok, s->qtok + skip, (size_t)(s->n_qtok - skip) * sizeof *s->qtok);
        s->n_qtok -= skip;
        s->q_index += skip;
        s->q_pos += skip;
    }
    return RK_OK;
}

/* Whether request r reuses its cached chunks in place. Recomputed tokens
 * must be private: `first_k` repair copies the blocks it writes (copy on
 * write, see build_runs), but the deviation policy recomputes layers 0-1 of
 * every chunk token and the query policy chooses its tokens after the
 * reindex, so their requests copy whole chunks (the copy path), as do
 * the oracle and plain modes and every request on a backend without
 * position-shifted attention. */
static int zero_copy_for(const rk_service *svc, const rk_request *r, int tell) {
    static _Atomic int told; /* the fallback is logged once */
    if (r->opt.mode != RK_MODE_RAG || !r->opt.chunk_cache || r->n_chunks == 0 ||
        r->opt.repair_ratio > 0 || strcmp(svc->cfg.reindex, "copy") == 0)
        return 0;
    if (strcmp(svc->be->name, "cpu") != 0) {
        if (tell && !told++)
            RK_LOG_WARN("zero-copy reindex is not available on the %s backend: chunks are copied",
                        svc->be->name);
        return 0;
    }
    return 1;
}

/* start_request for either reindex path. Zero-copy: the merged sequence's
 * own blocks are the system's (its partial last block a run of its own) and
 * the live ones for the question and generated tokens; the chunks' blocks are
 * the cache entries'. kv.n_tokens then counts table entries of the run table. */
static rk_status start_request_reindexed(rk_service *svc, rk_request *r) {
    r->state->zc = zero_copy_for(svc, r, 1);
    return start_request(svc, r);
}

/* Drop the reference on the partial page a match continued into. */
static void drop_partial(rk_service *svc, rk_req_state *s) {
    if (s->n_partial) rk_arena_release(svc->arena, &s->partial_src, 1);
    s->n_partial = 0;
    s->partial_src = -1;
}

/* The tokens a chunk's cached KV is computed after: none (isolated), the
 * system prompt, or the anchor (*anchor receives the BOS token). Their count. */
static int chunk_context_tokens(const rk_service *svc, const rk_request *r, int32_t *anchor,
                                const int32_t **out) {
    *out = NULL;
    if (r->opt.chunk_context == RK_CONTEXT_SYSTEM) {
        *out = r->sys;
        return r->n_sys;
    }
    if (r->opt.chunk_context != RK_CONTEXT_ANCHOR) return 0;
    *anchor = rk_tokenizer_bos(rk_model_tokenizer(svc->model));
    *out = anchor;
    return 1;
}

static void chunk_policy(rk_service *svc, const rk_request *r, rk_chunk_policy *p) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    *p = (rk_chunk_policy){.fingerprint = rk_model_fingerprint(svc->model),
                           .context_system = (int)r->opt.chunk_context,
                           .kv_dtype = rk_arena_kv(svc->arena)->dtype,
                           .rope_theta = hp->rope.theta,
                           .rope_factor = hp->rope.factor,
                           .rope_n_rot = hp->rope.n_rot,
                           .rope_pairing = (int)hp->rope.pairing,
                           .rope_scaling = (int)hp->rope.scaling,
                           .salt = r->opt.salt};
    int32_t anchor;
    const int32_t *ctx;
    int n_ctx = chunk_context_tokens(svc, r, &anchor, &ctx);
    if (p->context_system) p->system_key = rk_tokens_hash(ctx, n_ctx);
}

/* Chunk k computed after its n_ctx context tokens ctx in a scratch sequence
 * of its own, the context's first token at position pos0: the oracle (at
 * the live position) or an anchored miss (at 0). */
static rk_status plan_after_context(rk_service *svc, rk_request *r, int k, const int32_t *ctx,
                                    int n_ctx, int pos0, batch *pass1) {
    scratch *sc = &r->state->scratch[k];
    int bs = rk_arena_block_size(svc->arena), n = n_ctx + r->chunk_lens[k];
    const int32_t *toks = r->chunks[k];
    rk_status st;
    if (n_ctx) {
        if (!(sc->tokens = malloc((size_t)n * sizeof *sc->tokens)))
            return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        memcpy(sc->tokens, ctx, (size_t)n_ctx * sizeof *sc->tokens);
        memcpy(sc->tokens + n_ctx, r->chunks[k], (size_t)r->chunk_lens[k] * sizeof *sc->tokens);
        toks = sc->tokens;
    }
    sc->used = 1;
    if ((st = rk_seq_reserve(&sc->kv, svc->arena, RK_POOL_LIVE, n, NULL))) return st;
    sc->kv.n_tokens = n;
    sc->src_first = n_ctx;
    return batch_add(pass1, bs, &sc->kv, toks, n, pos0, 0, 0);
}

/* Chunk k of r when the chunk pool cannot take it (after evicting every
 * entry no request holds): an entry of the request's own, outside the index,
 * over live-pool blocks, computed at its base like a miss and reindexed like
 * any entry, then given back with the request (the copy path gives its
 * blocks back once copied). RK_ERR_EXHAUSTED when the live pool has no room
 * now: the request waits while others run, and alone never fits. */
static rk_status acquire_uncached(rk_service *svc, rk_request *r, int k, int base) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), n = r->chunk_lens[k], nb = (n + bs - 1) / bs;
    rk_chunk_entry *e = calloc(1, sizeof *e);
    int32_t *blocks = malloc((size_t)nb * sizeof *blocks);
    if (!e || !blocks) {
        free(e);
        free(blocks);
        return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    }
    if (rk_arena_alloc(svc->arena, RK_POOL_LIVE, nb, blocks)) {
        free(e);
        free(blocks);
        return rk_errorf(RK_ERR_EXHAUSTED,
                         "neither the chunk pool nor the live pool has room for chunk %d (%d "
                         "blocks)",
                         k, nb);
    }
    *e = (rk_chunk_entry){.tokens = r->chunks[k],
                          .n_tokens = n,
                          .blocks = blocks,
                          .n_blocks = nb,
                          .base_pos = base,
                          .state = RK_CHUNK_PENDING,
                          .refs = 1};
    snprintf(e->source, sizeof e->source, "uncached");
    rk_error_clear();
    s->entries[k] = e;
    s->kinds[k] = RK_CHUNK_MISS;
    s->scratch[k].uncached = 1;
    return RK_OK;
}

/* Give an uncached entry's live blocks back (once). */
static void drop_uncached_blocks(rk_service *svc, rk_chunk_entry *e) {
    if (e->n_blocks) rk_arena_release(svc->arena, e->blocks, e->n_blocks);
    e->n_blocks = 0;
}

/* Look up every chunk; queue the work each needs for pass 1. */
static rk_status plan_chunks(rk_service *svc, rk_request *r, batch *pass1) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena);
    rk_chunk_policy policy;
    chunk_policy(svc, r, &policy);
    rk_status st;
    int after_system = r->opt.chunk_context == RK_CONTEXT_SYSTEM;
    int32_t anchor;
    const int32_t *ctx;
    int n_ctx = chunk_context_tokens(svc, r, &anchor, &ctx);
    for (int k = 0; k < r->n_chunks; k++) {
        rk_chunk_report *rep = &r->chunk_reports[k];
        rep->tokens = r->chunk_lens[k];
        rep->live_offset = s->layout.pos[k];
        if (chunk_from_prefix(r, k)) { /* in place already, as an earlier request left it */
            rep->status = RK_CHUNK_STATUS_HIT;
            rep->source = RK_CHUNK_SOURCE_PREFIX;
            if (r->opt.chunk_cache)
                rk_chunk_key_hex(rk_chunk_key_compute(&policy, r->chunks[k], r->chunk_lens[k]),
                                 rep->key);
            continue;
        }
        if (!r->opt.chunk_cache) {
            /* The oracle: fresh at the live position, seeing what a cached chunk sees. */
            rep->status = RK_CHUNK_STATUS_OFF;
            rep->source = RK_CHUNK_SOURCE_COMPUTED;
            if ((st = plan_after_context(svc, r, k, ctx, n_ctx, s->layout.pos[k] - n_ctx, pass1)))
                return st;
            continue;
        }
        rk_chunk_key key = rk_chunk_key_compute(&policy, r->chunks[k], r->chunk_lens[k]);
        rk_chunk_key_hex(key, rep->key);
        int base = n_ctx;
        st = rk_chunk_index_acquire(svc->chunks, key, r->chunks[k], r->chunk_lens[k], base,
                                    &s->entries[k], &s->kinds[k]);
        if (st == RK_ERR_EXHAUSTED || st == RK_ERR_LIMIT) /* no room even after eviction */
            st = acquire_uncached(svc, r, k, base);
        if (st) return st;
        rk_chunk_entry *e = s->entries[k];
        if (s->kinds[k] == RK_CHUNK_MISS) e->owner = r->opt.owner; /* reserved for it */
        if (s->kinds[k] == RK_CHUNK_MISS &&
            !s->scratch[k].uncached) { /* the disk tier may have it */
            int loaded;
            if ((st = rk_persist_load(svc, e, &loaded))) return st;
            if (loaded) {
                rk_chunk_index_loaded(svc->chunks, e);
                s->kinds[k] = RK_CHUNK_HIT;
                rep->status = RK_CHUNK_STATUS_HIT;
                rep->source = RK_CHUNK_SOURCE_DISK;
                continue;
            }
            if ((st = load_shared(svc, r, k, &loaded))) return st;
            if (loaded) continue;
        }
        rep->status = s->scratch[k].uncached        ? RK_CHUNK_STATUS_UNCACHED
                      : s->kinds[k] == RK_CHUNK_HIT ? RK_CHUNK_STATUS_HIT
                                                    : RK_CHUNK_STATUS_MISS;
        rep->source =
            s->kinds[k] == RK_CHUNK_HIT ? RK_CHUNK_SOURCE_ARENA : RK_CHUNK_SOURCE_COMPUTED;
        if (s->kinds[k] != RK_CHUNK_MISS) continue;
        if (n_ctx && !after_system) {
            /* After the anchor in a scratch sequence; copied into the entry
             * after pass 1. */
            if ((st = plan_after_context(svc, r, k, ctx, n_ctx, 0, pass1))) return st;
            s->scratch[k].anchored = 1;
        } else if (!after_system) {
            /* Alone at positions 0..n-1, straight into the entry's blocks. */
            scratch *sc = &s->scratch[k];
            sc->kv.blocks = e->blocks; /* borrowed: released with the entry, not the scratch */
            sc->kv.n_blocks = e->n_blocks;
            sc->kv.n_tokens = e->n_tokens;
            sc->borrowed = 1;
            if ((st = batch_add(pass1, bs, &sc->kv, e->tokens, e->n_tokens, 0, 0, 0))) return st;
        } else {
            s->scratch[k].pass2 = 1; /* needs the system KV: after pass 1 */
        }
    }
    return RK_OK;
}

/* Pass 2 set-up for a `system`-context miss: a scratch sequence sharing the
 * request's whole system blocks, a copy of its partial last block, then the
 * chunk at positions n_sys.. . */
static rk_status plan_system_chunk(rk_service *svc, rk_request *r, int k, batch *pass2,
                                   rk_copy_plan *pre) {
    rk_req_state *s = r->state;
    scratch *sc = &s->scratch[k];
    int bs = rk_arena_block_size(svc->arena), full = r->n_sys / bs;
    rk_status st;
    sc->used = 1;
    if ((st = rk_seq_share(&sc->kv, svc->arena, s->kv.blocks, full))) return st;
    int tail = r->n_sys - full * bs;
    if ((st = rk_seq_reserve(&sc->kv, svc->arena, RK_POOL_LIVE, tail + r->chunk_lens[k], NULL)))
        return st;
    if (tail &&
        (st = rk_copy_plan_add(pre, bs, s->kv.blocks, full * bs, &sc->kv, full * bs, tail, 0)))
        return st;
    sc->kv.n_tokens = r->n_sys + r->chunk_lens[k];
    sc->src_first = r->n_sys;
    return batch_add(pass2, bs, &sc->kv, r->chunks[k], r->chunk_lens[k], r->n_sys, r->n_sys, 0);
}

/* After the radix-bound system pages are computed: insert them, the partial
 * last page as the tail it is (the request goes on writing its later rows,
 * which a match never copies). The tree takes a reference on the pages it
 * keeps; its locked path replaces ours. */
static rk_status insert_system(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), present;
    rk_radix_node *node;
    /* The tree owns the partial page from the call on, even when it fails. */
    rk_status st =
        s->n_insert % bs ? rk_arena_ref(svc->arena, &s->kv.blocks[s->n_insert / bs], 1) : RK_OK;
    if (st) return st;
    st = rk_radix_insert_partial(svc->prefix, s->ns, s->key, s->n_insert, s->kv.blocks, 0, &present,
                                 &node);
    if (st) return st;
    st = rk_arena_ref(svc->arena, s->kv.blocks + present / bs,
                      (s->n_insert / bs * bs - present) / bs);
    if (st) return st;
    if (s->lock) rk_radix_unlock(svc->prefix, s->lock);
    s->lock = node;
    s->n_insert = 0;
    return RK_OK;
}

/* Pages blocks[0 .. ceil(n / bs)) of the sequence keyed s->key[0 .. n) into
 * the tree, which takes a reference on the pages it keeps. */
static rk_status insert_pages(rk_service *svc, rk_req_state *s, int n, int32_t *blocks) {
    int bs = rk_arena_block_size(svc->arena), present;
    /* The tree owns the partial page from the call on, even when it fails. */
    rk_status st = n % bs ? rk_arena_ref(svc->arena, &blocks[n / bs], 1) : RK_OK;
    if (!st) st = rk_radix_insert_partial(svc->prefix, s->ns, s->key, n, blocks, 0, &present, NULL);
    if (!st) st = rk_arena_ref(svc->arena, blocks + present / bs, (n / bs * bs - present) / bs);
    return st;
}

/* A zero-copy request's sequence into the tree. Its table is not 1:1 with
 * the key (each chunk is a shifted run of the chunk pool's blocks), so the
 * tree gets a copy: the pages it has already are shared, the rest is copied
 * from the runs, rotated to their live positions, into prefix-pool blocks.
 * That copy is what the copy path pays at admission; here it is paid once,
 * when the request leaves, and only for what the tree did not have. */
static rk_status insert_runs(rk_service *svc, rk_req_state *s, int n) {
    int bs = rk_arena_block_size(svc->arena);
    rk_seq seq = {0};
    rk_copy_plan copies = {0};
    rk_radix_result m = {0};
    int32_t *pages = malloc((size_t)(n / bs + 1) * sizeof *pages);
    rk_status st =
        pages ? rk_radix_match(svc->prefix, s->ns, s->key, n, RK_RADIX_UNCOUNTED, pages, &m)
              : rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    if (!st && m.n_matched < n) {
        int fresh = n - m.n_matched;
        st = rk_seq_share(&seq, svc->arena, pages, m.n_matched / bs);
        if (!st) st = rk_seq_reserve(&seq, svc->arena, RK_POOL_PREFIX, fresh, NULL);
        if (st == RK_ERR_EXHAUSTED) {
            rk_radix_evict(svc->prefix, fresh, NULL);
            st = rk_seq_reserve(&seq, svc->arena, RK_POOL_PREFIX, fresh, NULL);
        }
        for (int i = 0, start = 0; !st && i < s->runs.n_runs && start < n; i++) {
            int end = s->runs.end[i] < n ? s->runs.end[i] : n;
            int from = start > m.n_matched ? start : m.n_matched;
            if (from < end)
                st = rk_copy_plan_add(&copies, bs, s->runs.blocks + s->runs.first[i], from - start,
                                      &seq, from, end - from, s->runs.delta[i]);
            start = s->runs.end[i];
        }
        if (!st) st = rk_copy_plan_run(&copies, svc->be, svc->arena, rk_model_rope(svc->model));
        if (!st) st = insert_pages(svc, s, n, seq.blocks);
    }
    if (m.node) rk_radix_unlock(svc->prefix, m.node);
    rk_seq_release(&seq, svc->arena);
    rk_copy_plan_free(&copies);
    free(pages);
    return st;
}

/* A finished request's whole sequence into the tree: its prompt key and the
 * generated tokens that have KV. Its live blocks move to the prefix pool
 * (evicting for room when needed; when there is none, nothing is inserted),
 * or for a zero-copy table a copy of them (insert_runs). The tree takes a
 * reference on the pages it keeps. Failures only lose the caching. */
static void insert_sequence(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), n = s->n_valid, n_layout = s->q_index + s->n_qtok;
    if (!r->opt.reuse_sequences || !s->key || n < n_layout)
        return; /* n_valid is 0 or covers the prompt */
    memcpy(s->key + n_layout, r->out_tokens + s->n_gen, (size_t)(n - n_layout) * sizeof *s->key);
    rk_status st;
    if (s->zc) {
        st = insert_runs(svc, s, n);
    } else {
        /* A chunk entry's block in the table stays the chunk cache's: the
         * sequence is inserted up to it. */
        for (int i = 0; i < (n + bs - 1) / bs; i++)
            if (rk_arena_block_pool(svc->arena, s->kv.blocks[i]) == RK_POOL_CHUNK) {
                n = i * bs;
                break;
            }
        if (n == 0) return;
        int n_pages = (n + bs - 1) / bs, to_move = 0;
        for (int i = 0; i < n_pages; i++)
            to_move += rk_arena_block_pool(svc->arena, s->kv.blocks[i]) != RK_POOL_PREFIX;
        st = rk_arena_retag(svc->arena, s->kv.blocks, n_pages, RK_POOL_PREFIX);
        if (st == RK_ERR_EXHAUSTED) {
            rk_radix_evict(svc->prefix,
                           (to_move - rk_arena_pool_free(svc->arena, RK_POOL_PREFIX)) * bs, NULL);
            st = rk_arena_retag(svc->arena, s->kv.blocks, n_pages, RK_POOL_PREFIX);
        }
        if (!st) st = insert_pages(svc, s, n, s->kv.blocks);
    }
    if (st == RK_ERR_EXHAUSTED) return; /* the prefix pool is all locked */
    if (st) RK_LOG_WARN("request sequence not cached: %s", rk_error_message());
}

/* Keep what a resumed request's first admission reported. */
static rk_status save_report(rk_request *r) {
    rk_req_state *s = r->state;
    int nc = r->n_chunks ? r->n_chunks : 1;
    s->first_report = malloc(sizeof *s->first_report);
    rk_chunk_report *c = malloc((size_t)nc * sizeof *c);
    if (!s->first_report || !c) {
        free(s->first_report);
        free(c);
        s->first_report = NULL;
        return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    }
    memcpy(c, r->chunk_reports, (size_t)nc * sizeof *c);
    *s->first_report = (rk_request){.chunk_reports = c,
                                    .sys_cached = r->sys_cached,
                                    .conv_cached = r->conv_cached,
                                    .recomputed_tokens = r->recomputed_tokens,
                                    .shared_blocks = r->shared_blocks,
                                    .t = r->t};
    return RK_OK;
}

/* Put it back; the prefill time of the resumed prompt counts. */
static void restore_report(rk_request *r) {
    rk_req_state *s = r->state;
    rk_request *f = s->first_report;
    if (!f) return;
    memcpy(r->chunk_reports, f->chunk_reports,
           (size_t)(r->n_chunks ? r->n_chunks : 1) * sizeof *f->chunk_reports);
    r->sys_cached = f->sys_cached;
    r->conv_cached = f->conv_cached;
    r->recomputed_tokens = f->recomputed_tokens;
    r->shared_blocks = f->shared_blocks;
    double prefill_ms = r->t.prefill_ms;
    r->t = f->t;
    r->t.prefill_ms = prefill_ms;
    free(f->chunk_reports);
    free(f);
    s->first_report = NULL;
}

static void release_request(rk_service *svc, rk_request *r, int failed) {
    rk_req_state *s = r->state;
    if (!s) return;
    restore_report(r);
    if (!failed) insert_sequence(svc, r);
    for (int k = 0; s->entries && s->scratch && k < r->n_chunks; k++) {
        scratch *sc = &s->scratch[k];
        if (sc->used) rk_seq_release(&sc->kv, svc->arena);
        if (sc->rlocked) (void)rk_redis_unlock(svc->redis, &sc->rlock); /* never computed */
        free(sc->tokens);
        if (s->entries[k] && sc->uncached) {
            drop_uncached_blocks(svc, s->entries[k]);
            free(s->entries[k]->blocks);
            free(s->entries[k]);
        } else if (s->entries[k]) {
            rk_chunk_index_release(svc->chunks, s->entries[k], failed);
        }
    }
    if (s->lock) rk_radix_unlock(svc->prefix, s->lock);
    drop_partial(svc, s);
    rk_seq_release(&s->kv, svc->arena);
    rk_runs_free(&s->runs);
    rk_seq_release(&s->own, svc->arena);
    rk_sampler_free(&s->sampler);
    rk_layout_free(&s->layout);
    free(s->entries);
    free(s->kinds);
    free(s->scratch);
    free(s->qtok);
    free(s->key);
    free(s);
    r->state = NULL;
}

/* A resumed request's prompt goes on with the tokens it generated but the
 * last, which its next decode step feeds. */
static void append_generated(rk_request *r) {
    rk_req_state *s = r->state;
    if (s->n_gen > 0)
        memcpy(s->qtok + s->n_qtok, r->out_tokens, (size_t)s->n_gen * sizeof *s->qtok);
    s->n_qtok += s->n_gen;
}

static rk_status init_request(rk_service *svc, rk_request *r) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    rk_req_state *s = calloc(1, sizeof *s);
    if (!s) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    r->state = s;
    s->partial_src = -1;
    int nc = r->n_chunks ? r->n_chunks : 1;
    s->entries = calloc((size_t)nc, sizeof *s->entries);
    s->kinds = calloc((size_t)nc, sizeof *s->kinds);
    s->scratch = calloc((size_t)nc, sizeof *s->scratch);
    if (!s->entries || !s->kinds || !s->scratch)
        return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    r->finished = 0;
    if (r->resume) { /* preempted: its tokens, timings and clock go on */
        s->t_start = r->t_admitted;
        s->n_gen = r->n_out > 0 ? r->n_out - 1 : 0; /* none when preempted before its first */
    } else {
        s->t_start = r->t_admitted = rk_time_now();
        r->n_out = 0;
        r->preemptions = 0;
        r->finish_reason = RK_FINISH_LENGTH;
        double queue_ms = r->t.queue_ms; /* set by whoever queued it */
        memset(&r->t, 0, sizeof r->t);
        r->t.queue_ms = queue_ms;
    }
    /* Nothing to generate: the prompt is still cached, but no step samples. */
    s->done = r->opt.max_tokens == 0;
    rk_status st = rk_sampler_init(&s->sampler, &r->opt.sampling, hp->n_vocab);
    if (st) return st;
    if (!r->resume) {
        /* A fresh run starts its grammar again; a resumed one goes on. */
        rk_grammar_state_free(r->grammar_state);
        r->grammar_state = NULL;
    }
    if (r->opt.grammar && !r->grammar_state) {
        const rk_grammar_vocab *gv;
        if ((st = rk_service_grammar_vocab(svc, &gv))) return st;
        if (rk_grammar_vocab_n(gv) != hp->n_vocab)
            return rk_errorf(RK_ERR_UNSUPPORTED,
                             "constrained sampling needs the tokenizer's %d ids to be the "
                             "model's %d",
                             (int)rk_grammar_vocab_n(gv), hp->n_vocab);
        if ((st = rk_grammar_state_create(r->opt.grammar, gv, &r->grammar_state))) return st;
    }
    if (r->resume) {
        memcpy(s->sampler.rng, r->rng, sizeof r->rng);
        for (int i = 0; i < r->n_out; i++) rk_sampler_accept(&s->sampler, r->out_tokens[i]);
        if ((st = save_report(r))) return st;
    }
    if (r->opt.mode == RK_MODE_PLAIN) {
        /* One ordinary sequence: the chunks and the question follow the system. */
        int n = r->n_question;
        for (int k = 0; k < r->n_chunks; k++) n += r->chunk_lens[k];
        s->qtok = malloc((size_t)(n + s->n_gen + 1) * sizeof *s->qtok);
        if (!s->qtok) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        int o = 0;
        for (int k = 0; k < r->n_chunks; k++) {
            memcpy(s->qtok + o, r->chunks[k], (size_t)r->chunk_lens[k] * sizeof *s->qtok);
            o += r->chunk_lens[k];
        }
        if (r->n_question)
            memcpy(s->qtok + o, r->question, (size_t)r->n_question * sizeof *s->qtok);
        s->n_qtok = n;
        append_generated(r);
        s->q_index = s->q_pos = r->n_sys;
        for (int k = 0; k < r->n_chunks; k++) {
            r->chunk_reports[k] = (rk_chunk_report){.tokens = r->chunk_lens[k],
                                                    .status = RK_CHUNK_STATUS_OFF,
                                                    .source = RK_CHUNK_SOURCE_COMPUTED};
        }
        return rk_layout_plan(RK_POSITIONS_SEQUENTIAL, r->n_sys, r->chunk_lens, r->n_chunks,
                              &s->layout);
    }
    if (r->opt.chunk_context == RK_CONTEXT_ANCHOR &&
        rk_tokenizer_bos(rk_model_tokenizer(svc->model)) < 0)
        return rk_errorf(RK_ERR_INVALID,
                         "chunk_context anchor needs a model with a BOS token (the anchor)");
    if ((st = rk_layout_plan(r->opt.positions, r->n_sys, r->chunk_lens, r->n_chunks, &s->layout)))
        return st;
    s->qtok = malloc((size_t)(r->n_question + s->n_gen + 1) * sizeof *s->qtok);
    if (!s->qtok) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    if (r->n_question) memcpy(s->qtok, r->question, (size_t)r->n_question * sizeof *s->qtok);
    s->n_qtok = r->n_question;
    append_generated(r);
    s->q_index = s->layout.question_index;
    s->q_pos = s->layout.question_pos;
    return RK_OK;
}

/* How many tokens before a constrained request would run out of room to
 * close its output it starts sampling only tokens that keep room. */
#define RK_GRAMMAR_BUDGET_MARGIN 64

/* Sample request r's next token from its logits (or take the forced one) and
 * decide whether it is done. A row with a NaN or infinite logit (KV that is
 * not finite, from a bad payload or an overflow) fails the request instead:
 * sampling it would answer garbage. Only the sampled rows are checked. */
static void take_token(rk_service *svc, rk_request *r, const float *logits,
                       const rk_pipeline_hooks *hooks) {
    rk_req_state *s = r->state;
    int ri = s->hook_index;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    int64_t bad = rk_dtype_first_nonfinite(RK_DTYPE_F32, logits, (size_t)hp->n_vocab);
    if (bad >= 0) {
        r->failure = RK_ERR_INTERNAL;
        snprintf(r->failure_msg, sizeof r->failure_msg,
                 "the model produced a non-finite logit (token id %lld is %s) at output token "
                 "%d: the KV it attended to is not finite (a corrupt cached chunk or an overflow)",
                 (long long)bad, isnan(logits[bad]) ? "NaN" : "infinite", r->n_out);
        RK_LOG_ERROR("request failed: %s", r->failure_msg);
        svc->nonfinite_logits++;
        s->done = 1;
        return;
    }
    if (hooks && hooks->on_logits) hooks->on_logits(hooks->ctx, ri, r->n_out, logits, hp->n_vocab);
    int32_t t = hooks && hooks->force_token ? hooks->force_token(hooks->ctx, ri, r->n_out) : -1;
    if (r->grammar_state) {
        /* Constrained: draw from the tokens the grammar allows, then move
         * its state on by the one drawn (a forced token must be allowed too). */
        const uint64_t *mask = NULL;
        rk_status st = RK_OK;
        if (t < 0 || t >= hp->n_vocab) {
            /* Near max_tokens, only tokens after which what is left still
             * fits the tokens left: the output closes rather than being cut
             * (where it can no longer fit, the plain mask, and it is cut). */
            int left = r->opt.max_tokens - r->n_out - 1, n_ok = 0;
            if (rk_grammar_state_min_bytes(r->grammar_state) + RK_GRAMMAR_BUDGET_MARGIN >= left)
                st = rk_grammar_state_mask_budget(r->grammar_state, left, &mask, &n_ok);
            if (!st && !n_ok) st = rk_grammar_state_mask(r->grammar_state, &mask);
            if (!st) t = rk_sampler_sample_masked(&s->sampler, logits, mask);
            if (!st && t < 0) st = rk_errorf(RK_ERR_INTERNAL, "grammar: no token is allowed");
        }
        if (!st) st = rk_grammar_state_accept(r->grammar_state, t);
        if (st) {
            r->failure = st;
            snprintf(r->failure_msg, sizeof r->failure_msg, "constrained sampling failed: %s",
                     rk_error_message());
            RK_LOG_ERROR("request failed: %s", r->failure_msg);
            s->done = 1;
            return;
        }
    } else if (t < 0 || t >= hp->n_vocab) {
        t = rk_sampler_sample(&s->sampler, logits);
    }
    rk_sampler_accept(&s->sampler, t);
    /* Log-probabilities only where the request asks for them: the sum is a
     * pass of exp over the whole vocabulary, taken once for both. */
    if (r->opt.n_logprobs > 0) {
        float lse = rk_log_sum_exp(logits, hp->n_vocab);
        rk_logprobs_top(logits, hp->n_vocab, lse, r->opt.n_logprobs,
                        r->top_ids + (size_t)r->n_out * r->opt.n_logprobs,
                        r->top_logprobs + (size_t)r->n_out * r->opt.n_logprobs);
        r->logprobs[r->n_out] = logits[t] - lse;
    }
    if (r->n_out == 0) r->t.ttft_ms = (rk_time_now() - s->t_start) * 1e3;
    r->out_tokens[r->n_out++] = t;
    if (hooks && hooks->on_token) hooks->on_token(hooks->ctx, ri, t);
    if ((r->opt.stop_at_eog || r->grammar_state) &&
        rk_tokenizer_is_eog(rk_model_tokenizer(svc->model), t)) {
        r->finish_reason = RK_FINISH_STOP;
        s->done = 1;
    } else if (r->grammar_state && rk_grammar_state_must_end(r->grammar_state)) {
        /* The grammar is complete and allows nothing more: stop without
         * spending a step on the end token. */
        r->finish_reason = RK_FINISH_STOP;
        s->done = 1;
    } else if (r->n_out >= r->opt.max_tokens) {
        s->done = 1;
    }
}

static void finish_report(rk_request *r) {
    int chunk_tokens = 0, cached = r->sys_cached + r->conv_cached;
    for (int k = 0; k < r->n_chunks; k++) {
        chunk_tokens += r->chunk_lens[k];
        if (r->chunk_reports[k].status == RK_CHUNK_STATUS_HIT &&
            r->chunk_reports[k].source != RK_CHUNK_SOURCE_PREFIX)
            cached += r->chunk_lens[k] - r->chunk_reports[k].repaired; /* repaired: computed */
    }
    r->prompt_tokens = r->n_sys + chunk_tokens + r->n_question;
    r->cached_tokens = cached;
    r->computed_tokens = r->prompt_tokens - cached;
    r->t.total_ms = (rk_time_now() - r->state->t_start) * 1e3 + r->t.queue_ms;
}

/* ---------------------------------------------------------------- admission stages */

/* The requests admitted together and the buffers their passes share. */
typedef struct admission {
    rk_service *svc;
    rk_request *const *reqs;
    int n;
    batch *b;
    rk_copy_plan *copies;
} admission;

/* Whether something before the question pass attends to r's system KV: a
 * `system`-context chunk computed after it (pass 2), or a repair. */
static int needs_system_first(const rk_request *r) {
    if (r->opt.mode != RK_MODE_RAG) return 0;
    if (r->opt.repair_k > 0 || r->opt.repair_ratio > 0) return 1;
    for (int k = 0; k < r->n_chunks; k++)
        if (r->state->scratch[k].pass2) return 1;
    return 0;
}

/* Stage 1: reserve each request's blocks and match its system prompt in the
 * radix tree, look its chunks up, then pass 1: the system tails the tree did
 * not have, the isolated chunk misses and the oracle chunks. The new system
 * pages go into the tree. */
static rk_status stage_system_and_chunks(admission *a) {
    int bs = rk_arena_block_size(a->svc->arena);
    rk_status st;
    double t = rk_time_now();
    batch_reset(a->b);
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if ((st = start_request_reindexed(a->svc, r))) return st;
        if (s->n_partial && (st = rk_copy_plan_add(a->copies, bs, &s->partial_src, 0, &s->kv,
                                                   s->reused - s->n_partial, s->n_partial, 0)))
            return st;
    }
    rk_persist_begin_lookups(a->svc);
    for (int i = 0; i < a->n; i++)
        if (a->reqs[i]->opt.mode == RK_MODE_RAG && (st = plan_chunks(a->svc, a->reqs[i], a->b)))
            return st;
    /* A system tail nothing before the question pass attends to goes into
     * that pass, with the question. */
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        s->sys_next = r->n_sys;
        if (s->sys_first == r->n_sys) continue;
        if (!needs_system_first(r)) {
            s->sys_next = s->sys_first;
            continue;
        }
        if ((st = batch_add(a->b, bs, &s->kv, r->sys + s->sys_first, r->n_sys - s->sys_first,
                            s->sys_first, s->sys_first, 0)))
            return st;
    }
    double t_lookup = rk_time_now() - t;
    t = rk_time_now();
    /* The partial pages' rows first: the tails computed in pass 1 attend to them. */
    if ((st = rk_copy_plan_run(a->copies, a->svc->be, a->svc->arena, rk_model_rope(a->svc->model))))
        return st;
    for (int i = 0; i < a->n; i++) drop_partial(a->svc, a->reqs[i]->state);
    if ((st = batch_run(a->svc, a->b))) return st;
    rk_persist_note_prefill(a->svc, a->b->n_tok, rk_time_now() - t);
    for (int i = 0; i < a->n; i++) {
        rk_req_state *s = a->reqs[i]->state;
        if (s->n_insert && s->sys_next == a->reqs[i]->n_sys &&
            (st = insert_system(a->svc, a->reqs[i])))
            return st;
    }
    double t_compute = rk_time_now() - t;
    for (int i = 0; i < a->n; i++) {
        a->reqs[i]->t.lookup_ms = t_lookup * 1e3;
        a->reqs[i]->t.chunk_compute_ms = t_compute * 1e3;
    }
    return RK_OK;
}

/* Stage 2: pass 2 computes the `system`-context misses after their system
 * prompt; their KV, and that of the anchored misses of pass 1, is copied
 * into their entries. Then every entry computed by this admission is ready
 * (and written through to the disk tier). */
static rk_status stage_system_chunks(admission *a) {
    rk_service *svc = a->svc;
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    double t = rk_time_now();
    batch_reset(a->b);
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        for (int k = 0; k < r->n_chunks; k++)
            if (r->state->scratch[k].pass2 && r->state->kinds[k] == RK_CHUNK_MISS &&
                (st = plan_system_chunk(svc, r, k, a->b, a->copies)))
                return st;
    }
    if ((st = rk_copy_plan_run(a->copies, svc->be, svc->arena, rk_model_rope(svc->model))) ||
        (st = batch_run(svc, a->b)))
        return st;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        for (int k = 0; k < r->n_chunks; k++) {
            scratch *sc = &s->scratch[k];
            if (s->kinds[k] != RK_CHUNK_MISS || !s->entries[k] || !(sc->pass2 || sc->anchored))
                continue;
            rk_seq dst = {.blocks = s->entries[k]->blocks, .n_blocks = s->entries[k]->n_blocks};
            if ((st = rk_copy_plan_add(a->copies, bs, sc->kv.blocks, sc->src_first, &dst, 0,
                                       r->chunk_lens[k], 0)))
                return st;
        }
    }
    if ((st = rk_copy_plan_run(a->copies, svc->be, svc->arena, rk_model_rope(svc->model))))
        return st;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        for (int k = 0; k < r->n_chunks; k++) {
            rk_chunk_entry *e = r->state->entries[k];
            if (r->state->kinds[k] != RK_CHUNK_MISS || !e) continue;
            if (r->state->scratch[k].uncached) {
                e->state = RK_CHUNK_READY; /* the request's own: neither indexed nor written */
                continue;
            }
            rk_chunk_index_ready(svc->chunks, e);
            persist(svc, e, r->opt.chunk_context, &r->state->scratch[k]);
        }
    }
    double dt = rk_time_now() - t;
    for (int i = 0; i < a->n; i++) a->reqs[i]->t.chunk_compute_ms += dt * 1e3;
    return RK_OK;
}

/* Tokens of a zero-copy request's chunk of n tokens that are copied into
 * private blocks: those of the blocks its `first_k` repair writes. */
static int private_tokens(const rk_request *r, int n, int bs) {
    int k = r->opt.repair_k > 0 ? (r->opt.repair_k < n ? r->opt.repair_k : n) : 0;
    int own = (k + bs - 1) / bs * bs;
    return own < n ? own : n;
}

/* Zero-copy reindex of request r: its run table is its system blocks, each
 * chunk entry's blocks as they are (shifted by live offset - base), then its
 * live blocks; the entries it holds keep those blocks until it leaves. The
 * blocks a `first_k` repair will write are copied first (rotated to the live
 * offset, queued on copies) into private live blocks, a run of their own
 * with delta 0: copy on write at block granularity. */
static rk_status build_runs(rk_service *svc, rk_request *r, rk_copy_plan *copies) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), sys_blocks = (r->n_sys + bs - 1) / bs;
    rk_status st = RK_OK;
    r->shared_blocks = 0;
    if (r->n_sys) st = rk_runs_add(&s->runs, bs, s->kv.blocks, r->n_sys, 0);
    for (int k = 0; k < r->n_chunks && !st; k++) {
        const rk_chunk_entry *e = s->entries[k];
        int n = e->n_tokens, m = private_tokens(r, n, bs), delta = s->layout.pos[k] - e->base_pos;
        if (m) {
            int first = s->own.n_blocks;
            st = rk_seq_reserve(&s->own, svc->arena, RK_POOL_LIVE, (m + bs - 1) / bs * bs, NULL);
            if (!st) {
                s->own.n_tokens = s->own.n_blocks * bs;
                st = rk_copy_plan_add(copies, bs, e->blocks, 0, &s->own, first * bs, m, delta);
            }
            if (!st) st = rk_runs_add(&s->runs, bs, s->own.blocks + first, m, 0);
        }
        int own = s->scratch[k].uncached; /* the request's live blocks: neither shared nor pooled */
        if (!st && m < n) {
            st = rk_runs_add(&s->runs, bs, e->blocks + m / bs, n - m, delta);
            r->shared_blocks += own ? 0 : e->n_blocks - m / bs;
        }
        r->chunk_reports[k].zero_copy = m < n && !own;
    }
    if (!st)
        st = rk_runs_add(&s->runs, bs, s->kv.blocks + sys_blocks,
                         (s->kv.n_blocks - sys_blocks) * bs, 0);
    return st;
}

/* Stage 3: every chunk's KV into its request's live blocks, cached ones
 * rotated from their base to their live offset, in one copy plan; or, for
 * the zero-copy requests, their run tables. */
static rk_status stage_reindex(admission *a) {
    rk_service *svc = a->svc;
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    double t = rk_time_now();
    int copied_tokens = 0;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if (r->opt.mode == RK_MODE_PLAIN) continue;
        if (s->zc) {
            if ((st = build_runs(svc, r, a->copies))) return st;
            for (int k = 0; k < r->n_chunks; k++)
                copied_tokens += private_tokens(r, r->chunk_lens[k], bs);
            continue;
        }
        for (int k = 0; k < r->n_chunks; k++) {
            rk_chunk_entry *e = s->entries[k];
            if (chunk_from_prefix(r, k)) continue;
            if (e) /* cached: rotate from its base to the live offset */
                st = rk_copy_plan_add(a->copies, bs, e->blocks, 0, &s->kv, s->layout.index[k],
                                      e->n_tokens, s->layout.pos[k] - e->base_pos);
            else /* oracle: computed in place already, delta 0 */
                st = rk_copy_plan_add(a->copies, bs, s->scratch[k].kv.blocks,
                                      s->scratch[k].src_first, &s->kv, s->layout.index[k],
                                      r->chunk_lens[k], 0);
            if (st) return st;
            copied_tokens += r->chunk_lens[k];
        }
    }
    if ((st = rk_copy_plan_run(a->copies, svc->be, svc->arena, rk_model_rope(svc->model))))
        return st;
    /* The scratch sequences' KV is in place now: their live blocks go back
     * before decoding needs them. */
    for (int i = 0; i < a->n; i++)
        for (int k = 0; k < a->reqs[i]->n_chunks; k++) {
            rk_req_state *s = a->reqs[i]->state;
            scratch *sc = &s->scratch[k];
            if (sc->used) rk_seq_release(&sc->kv, svc->arena);
            sc->used = 0;
            if (sc->uncached && !s->zc && a->reqs[i]->opt.mode == RK_MODE_RAG)
                drop_uncached_blocks(svc, s->entries[k]); /* copied: the blocks go back */
        }
    double t_reindex = rk_time_now() - t;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        r->t.reindex_ms = t_reindex * 1e3;
        for (int k = 0; k < r->n_chunks; k++) {
            int n = r->state->zc ? private_tokens(r, r->chunk_lens[k], bs) : r->chunk_lens[k];
            r->chunk_reports[k].reindex_us =
                copied_tokens ? t_reindex * 1e6 * n / copied_tokens : 0;
        }
    }
    return RK_OK;
}

/* Stage 4 (repair, optional): chunk tokens again, now attending to
 * everything before them in the merged table: the deviation policy's
 * choice, then the first repair_k tokens of every chunk. */
static rk_status stage_repair(admission *a) {
    int bs = rk_arena_block_size(a->svc->arena);
    rk_status st;
    double t = rk_time_now();
    batch_reset(a->b);
    for (int i = 0; i < a->n; i++) a->reqs[i]->recomputed_tokens = 0;
    if ((st = deviation_select(a->svc, a->reqs, a->n, a->b)) ||
        (st = query_select(a->svc, a->reqs, a->n, a->b)))
        return st;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if (r->opt.mode == RK_MODE_PLAIN || r->opt.repair_k <= 0 || r->opt.repair_ratio > 0)
            continue; /* one policy a request: deviation's choice is queued already */
        if (r->n_chunks && chunk_from_prefix(r, 0)) continue; /* repaired when first computed */
        for (int k = 0; k < r->n_chunks; k++) {
            int n = r->chunk_lens[k] < r->opt.repair_k ? r->chunk_lens[k] : r->opt.repair_k;
            if ((st = batch_add_req(a->b, bs, s, r->chunks[k], n, s->layout.pos[k],
                                    s->layout.index[k], 0)))
                return st;
            r->chunk_reports[k].repaired = n;
            r->recomputed_tokens += n;
        }
    }
    if ((st = batch_run(a->svc, a->b))) return st;
    double dt = rk_time_now() - t;
    for (int i = 0; i < a->n; i++)
        if (a->reqs[i]->recomputed_tokens) a->reqs[i]->t.repair_ms = dt * 1e3;
    return RK_OK;
}

/* Stage 5: what is left of each request's prompt for the question pass:
 * its deferred system tail and its question (plain: chunks and question;
 * resuming: and its generated tokens but the last). A request whose whole
 * prompt is its computed system prompt feeds the last system token again
 * for its logits. A cancelled request is done. */
static void queue_prompt(admission *a) {
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if (!s->done && r->cancel) {
            r->finish_reason = RK_FINISH_CANCELLED;
            s->done = 1;
        }
        if (s->done) continue;
        s->ptok = s->qtok;
        s->n_ptok = s->n_qtok;
        s->p_idx = s->q_index;
        s->p_pos = s->q_pos;
        s->p_next = 0;
        s->next_pos = s->n_qtok ? s->q_pos + s->n_qtok : r->n_sys;
        if (s->n_qtok == 0 && s->sys_next == r->n_sys && r->n_out == 0) {
            s->ptok = r->sys + r->n_sys - 1;
            s->n_ptok = 1;
            s->p_idx = s->p_pos = r->n_sys - 1;
        }
        s->prefilling = s->sys_next < r->n_sys || s->n_ptok > 0;
        if (!s->prefilling) s->n_valid = s->kv.n_tokens; /* resumed, nothing to feed */
    }
}

/* ---------------------------------------------------------------- running requests */

struct rk_pipeline {
    rk_service *svc;
    rk_request **running; /* (cap) admitted and unfinished, by rank (first admission) */
    int n_running, cap;
    int n_admitted;         /* requests admitted so far: the next one's rank */
    rk_request **work;      /* (2 cap) the current pass's decoding and prefilling requests */
    rk_request **preempted; /* (cap_preempted) waiting to resume, by rank */
    int n_preempted, cap_preempted;
    batch b; /* reused by every pass */
    rk_copy_plan copies;
};

rk_status rk_pipeline_create(rk_service *svc, rk_pipeline **out) {
    *out = calloc(1, sizeof **out);
    if (!*out) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    (*out)->svc = svc;
    return RK_OK;
}

int rk_pipeline_n_running(const rk_pipeline *p) { return p->n_running; }

int rk_request_live_blocks(const rk_service *svc, const rk_request *r) {
    int bs = rk_arena_block_size(svc->arena), zc = zero_copy_for(svc, r, 0);
    long tokens = (long)r->n_sys + r->n_question + 1 + (r->resume && r->n_out ? r->n_out - 1 : 0);
    long extra = 0;
    for (int k = 0; k < r->n_chunks; k++) {
        tokens += zc ? private_tokens(r, r->chunk_lens[k], bs) : r->chunk_lens[k];
        int after_system = r->opt.chunk_context == RK_CONTEXT_SYSTEM;
        int anchored = r->opt.chunk_context == RK_CONTEXT_ANCHOR;
        if (!r->opt.chunk_cache || after_system || anchored)
            extra += r->chunk_lens[k] + (after_system ? r->n_sys : anchored) + bs;
    }
    long blocks = (tokens + extra) / bs + 2;
    return blocks > 1 << 30 ? 1 << 30 : (int)blocks;
}

/* Insert r into list (n entries, room for one more) by rank. */
static void insert_by_rank(rk_request **list, int *n, rk_request *r) {
    int i = *n;
    while (i > 0 && list[i - 1]->rank > r->rank) {
        list[i] = list[i - 1];
        i--;
    }
    list[i] = r;
    (*n)++;
}

/* A finished request leaves: its report is completed and all it holds released. */
static void leave(rk_pipeline *p, rk_request *r) {
    finish_report(r);
    release_request(p->svc, r, 0);
    r->finished = 1;
}

/* The finished leave now; the rest keep their order. */
static void leave_finished(rk_pipeline *p) {
    int kept = 0;
    for (int i = 0; i < p->n_running; i++) {
        rk_request *r = p->running[i];
        if (r->state->done)
            leave(p, r);
        else
            p->running[kept++] = r;
    }
    p->n_running = kept;
}

/* Take running[i] off the live pool: what it computed goes into the radix
 * tree, everything it holds is released, its tokens and its sampler's state
 * stay with it, and it waits among the preempted. */
static rk_status preempt(rk_pipeline *p, int i) {
    rk_request *r = p->running[i];
    if (p->n_preempted == p->cap_preempted) {
        int cap = p->cap_preempted ? p->cap_preempted * 2 : 8;
        rk_request **q = realloc(p->preempted, (size_t)cap * sizeof *q);
        if (!q) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        p->preempted = q;
        p->cap_preempted = cap;
    }
    memcpy(r->rng, r->state->sampler.rng, sizeof r->rng);
    finish_report(r);
    release_request(p->svc, r, 0);
    r->resume = 1;
    r->preemptions++;
    memmove(p->running + i, p->running + i + 1,
            (size_t)(p->n_running - i - 1) * sizeof *p->running);
    p->n_running--;
    insert_by_rank(p->preempted, &p->n_preempted, r);
    return RK_OK;
}

/* The table entries request s can hold now. */
static int table_room(const rk_req_state *s, int bs) {
    return s->zc ? s->runs.end[s->runs.n_runs - 1] : s->kv.n_blocks * bs;
}

/* One more live block at the end of the request's table (of its live run
 * when it has a run table). */
static rk_status grow_live(rk_service *svc, rk_req_state *s) {
    int bs = rk_arena_block_size(svc->arena), n = s->kv.n_tokens;
    s->kv.n_tokens = s->kv.n_blocks * bs; /* a zero-copy table counts other entries */
    rk_status st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_LIVE, 1, NULL);
    s->kv.n_tokens = n;
    if (!st && s->zc) st = rk_runs_add(&s->runs, bs, &s->kv.blocks[s->kv.n_blocks - 1], bs, 0);
    return st;
}

/* Room for every running request's next token, the oldest first: a full
 * table takes a live block; when the pool has none, the youngest running
 * request is preempted (the one asking, when it is the youngest). */
static rk_status make_room(rk_pipeline *p) {
    int bs = rk_arena_block_size(p->svc->arena);
    rk_status st;
    for (int i = 0; i < p->n_running; i++) {
        rk_req_state *s = p->running[i]->state;
        while (!s->prefilling && s->kv.n_tokens >= table_room(s, bs)) {
            st = grow_live(p->svc, s);
            if (st != RK_ERR_EXHAUSTED) {
                if (st) return st;
                continue;
            }
            if (p->n_running == 1) /* admission checked that it fits alone */
                return rk_errorf(RK_ERR_LIMIT, "the live pool cannot hold the request alone");
            if ((st = preempt(p, p->n_running - 1))) return st;
            if (i >= p->n_running) return RK_OK; /* it was the youngest */
        }
    }
    return RK_OK;
}

/* Feed what is left of r's prompt into b, at most *left tokens: its
 * system tail, then the rest; logits for the last token when it has no
 * token yet. */
static rk_status feed_prompt(batch *b, int bs, rk_request *r, int *left) {
    rk_req_state *s = r->state;
    rk_status st;
    int n = r->n_sys - s->sys_next < *left ? r->n_sys - s->sys_next : *left;
    if (n > 0) {
        int last = s->sys_next + n == r->n_sys && s->n_ptok == 0 && r->n_out == 0;
        if ((st = batch_add_req(b, bs, s, r->sys + s->sys_next, n, s->sys_next, s->sys_next, last)))
            return st;
        if (last) s->row = b->n_logits - 1;
        s->fed_sys = n;
        *left -= n;
    }
    if (s->sys_next + s->fed_sys < r->n_sys) return RK_OK;
    int m = s->n_ptok - s->p_next < *left ? s->n_ptok - s->p_next : *left;
    if (m <= 0) return RK_OK;
    int last = s->p_next + m == s->n_ptok && r->n_out == 0;
    if ((st = batch_add_req(b, bs, s, s->ptok + s->p_next, m, s->p_pos + s->p_next,
                            s->p_idx + s->p_next, last)))
        return st;
    if (last) s->row = b->n_logits - 1;
    s->fed_p = m;
    *left -= m;
    return RK_OK;
}

/* One forward pass: the next token of every request in dec (their tables
 * have room for it), then the prompt work of the requests in pre, in their
 * order, at most budget tokens of it (<= 0: all of it). A request whose
 * prompt ends in the pass takes its first token from it (a resumed one has
 * its next token already) and decodes from the next pass on; its system
 * prompt goes into the radix tree once computed. */
static rk_status run_pass(rk_pipeline *p, rk_request *const *dec, int n_dec, rk_request *const *pre,
                          int n_pre, int budget, const rk_pipeline_hooks *hooks) {
    rk_service *svc = p->svc;
    int bs = rk_arena_block_size(svc->arena), n_vocab = rk_model_hparams(svc->model)->n_vocab;
    rk_status st;
    batch_reset(&p->b);
    for (int i = 0; i < n_dec; i++) {
        rk_request *r = dec[i];
        rk_req_state *s = r->state;
        int idx = s->kv.n_tokens++;
        if ((st = batch_add_req(&p->b, bs, s, &r->out_tokens[r->n_out - 1], 1, s->next_pos++, idx,
                                1)))
            return st;
    }
    int left = budget > 0 ? budget : 1 << 30;
    for (int i = 0; i < n_pre; i++) {
        rk_req_state *s = pre[i]->state;
        s->row = -1;
        s->fed_sys = s->fed_p = 0;
        if ((st = feed_prompt(&p->b, bs, pre[i], &left))) return st;
    }
    if (p->b.n_seq == 0) return RK_OK;
    double t = rk_time_now();
    if ((st = batch_run(svc, &p->b))) return st;
    double dt = (rk_time_now() - t) * 1e3;
    for (int i = 0; i < n_dec; i++) {
        rk_request *r = dec[i];
        r->state->n_valid = r->state->kv.n_tokens;
        r->t.decode_ms += dt;
        take_token(svc, r, p->b.logits + (size_t)i * n_vocab, hooks);
    }
    for (int i = 0; i < n_pre; i++) {
        rk_request *r = pre[i];
        rk_req_state *s = r->state;
        if (!s->fed_sys && !s->fed_p) continue;
        r->t.prefill_ms += dt;
        s->sys_next += s->fed_sys;
        s->p_next += s->fed_p;
        if (s->fed_sys && s->sys_next == r->n_sys && s->n_insert && (st = insert_system(svc, r)))
            return st;
        if (s->sys_next < r->n_sys || s->p_next < s->n_ptok) continue;
        s->prefilling = 0;
        s->n_valid = s->kv.n_tokens;
        if (s->row >= 0) take_token(svc, r, p->b.logits + (size_t)s->row * n_vocab, hooks);
    }
    return RK_OK;
}

/* The prompt stages of an admission up to the question pass; on failure
 * every one of reqs has released what it took. */
static rk_status admit_stages(rk_pipeline *p, rk_request *const *reqs, int n_reqs, int *n_fresh) {
    rk_status st = RK_OK;
    if (p->n_running + n_reqs > p->cap) {
        int cap = (p->n_running + n_reqs) * 2;
        rk_request **run = realloc(p->running, (size_t)cap * sizeof *run);
        if (run) p->running = run;
        rk_request **work = realloc(p->work, (size_t)cap * 2 * sizeof *work);
        if (work) p->work = work;
        if (!run || !work) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        p->cap = cap;
    }
    *n_fresh = 0;
    for (int i = 0; i < n_reqs; i++) {
        reqs[i]->state = NULL;
        if (!reqs[i]->resume) reqs[i]->rank = p->n_admitted + (*n_fresh)++;
    }
    for (int i = 0; i < n_reqs && !st; i++) {
        st = init_request(p->svc, reqs[i]);
        if (reqs[i]->state) reqs[i]->state->hook_index = reqs[i]->rank;
    }
    admission a = {.svc = p->svc, .reqs = reqs, .n = n_reqs, .b = &p->b, .copies = &p->copies};
    if (!st) st = stage_system_and_chunks(&a);
    if (!st) st = stage_system_chunks(&a);
    if (!st) st = stage_reindex(&a);
    if (!st) st = stage_repair(&a);
    if (!st) queue_prompt(&a);
    if (st) {
        for (int i = 0; i < n_reqs; i++) release_request(p->svc, reqs[i], 1);
        rk_copy_plan_free(&p->copies);
    }
    return st;
}

/* Admitted: done ones leave, the others run. */
static void admitted(rk_pipeline *p, rk_request *const *reqs, int n_reqs, int n_fresh) {
    p->n_admitted += n_fresh;
    for (int i = 0; i < n_reqs; i++) {
        restore_report(reqs[i]);
        reqs[i]->resume = 0;
        if (reqs[i]->state->done)
            leave(p, reqs[i]);
        else
            insert_by_rank(p->running, &p->n_running, reqs[i]);
    }
}

rk_status rk_pipeline_admit(rk_pipeline *p, rk_request *const *reqs, int n_reqs,
                            const rk_pipeline_hooks *hooks) {
    int n_fresh, n_pre = 0;
    rk_status st = admit_stages(p, reqs, n_reqs, &n_fresh);
    if (st) return st;
    for (int i = 0; i < n_reqs; i++)
        if (reqs[i]->state->prefilling) p->work[n_pre++] = reqs[i];
    if ((st = run_pass(p, NULL, 0, p->work, n_pre, 0, hooks))) {
        for (int i = 0; i < n_reqs; i++) release_request(p->svc, reqs[i], 1);
        return st;
    }
    admitted(p, reqs, n_reqs, n_fresh);
    return RK_OK;
}

rk_status rk_pipeline_join(rk_pipeline *p, rk_request *const *reqs, int n_reqs) {
    int n_fresh;
    rk_status st = admit_stages(p, reqs, n_reqs, &n_fresh);
    if (!st) admitted(p, reqs, n_reqs, n_fresh);
    return st;
}

rk_status rk_pipeline_step(rk_pipeline *p, const rk_pipeline_hooks *hooks) {
    rk_status st;
    /* Cancelled requests leave first: their blocks are free for the others. */
    for (int i = 0; i < p->n_running; i++) {
        rk_request *r = p->running[i];
        if (!r->state->done && r->cancel) {
            r->finish_reason = RK_FINISH_CANCELLED;
            r->state->done = 1;
        }
    }
    leave_finished(p);
    if ((st = make_room(p))) return st;
    /* Decode tokens first, then prompt work in arrival order. */
    int n_dec = 0, n_pre = 0;
    for (int i = 0; i < p->n_running; i++)
        if (!p->running[i]->state->prefilling) p->work[n_dec++] = p->running[i];
    for (int i = 0; i < p->n_running; i++)
        if (p->running[i]->state->prefilling) p->work[n_dec + n_pre++] = p->running[i];
    if ((st = run_pass(p, p->work, n_dec, p->work + n_dec, n_pre, p->svc->cfg.step_tokens, hooks)))
        return st;
    leave_finished(p);
    return RK_OK;
}

int rk_pipeline_take_preempted(rk_pipeline *p, rk_request **out, int cap) {
    int n = p->n_preempted < cap ? p->n_preempted : cap;
    if (n == 0) return 0;
    memcpy(out, p->preempted, (size_t)n * sizeof *out);
    memmove(p->preempted, p->preempted + n, (size_t)(p->n_preempted - n) * sizeof *out);
    p->n_preempted -= n;
    return n;
}

void rk_pipeline_abort(rk_pipeline *p) {
    for (int i = 0; i < p->n_running; i++) release_request(p->svc, p->running[i], 1);
    p->n_running = 0;
    p->n_preempted = 0; /* they hold nothing */
}

void rk_pipeline_free(rk_pipeline *p) {
    if (!p) return;
    rk_pipeline_abort(p);
    batch_free(&p->b);
    rk_copy_plan_free(&p->copies);
    free(p->running);
    free(p->work);
    free(p->preempted);
    free(p);
}

/* Admit the oldest preempted request again when the live pool has room for
 * it (or nothing runs); RK_OK while it waits. */
static rk_status resume_one(rk_pipeline *p, const rk_pipeline_hooks *hooks) {
    rk_request *r = p->preempted[0];
    if (p->n_running > 0 &&
        rk_arena_pool_free(p->svc->arena, RK_POOL_LIVE) < rk_request_live_blocks(p->svc, r))
        return RK_OK;
    rk_status st = rk_pipeline_admit(p, &r, 1, hooks);
    if (st == RK_ERR_EXHAUSTED && p->n_running > 0) return RK_OK;
    if (!st) rk_pipeline_take_preempted(p, &r, 1);
    return st;
}

rk_status rk_pipeline_run(rk_service *svc, rk_request *const *reqs, int n_reqs,
                          const rk_pipeline_hooks *hooks) {
    rk_pipeline *p;
    rk_status st = rk_pipeline_create(svc, &p);
    if (st) return st;
    st = rk_pipeline_admit(p, reqs, n_reqs, hooks);
    while (!st && (p->n_running || p->n_preempted)) {
        if (p->n_preempted) st = resume_one(p, hooks);
        if (!st && p->n_running) st = rk_pipeline_step(p, hooks);
    }
    for (int i = 0; !st && i < n_reqs; i++)
        if (reqs[i]->failure) st = rk_errorf(reqs[i]->failure, "%s", reqs[i]->failure_msg);
    rk_pipeline_free(p); /* on failure: releases what still runs */
    return st;
}

/* ---------------------------------------------------------------- pre-warming */

/* Tokens per forward pass while pre-warming: bounds activation memory. */
#define PREWARM_PASS_TOKENS 8192

static void item_fail(rk_prewarm_item *it, const char *why) {
    it->status = "failed";
    snprintf(it->error, sizeof it->error, "%s", why);
}

/* Persist an arena entry unless the store has it already. */
static void persist_if_missing(rk_service *svc, const rk_chunk_entry *e, const char *doc_id) {
    int present = 0;
    char key[33];
    rk_chunk_key_hex(e->key, key);
    if (rk_store_contains(svc->store, key, &present) == RK_OK && !present &&
        rk_persist_write(svc, e, "isolated", doc_id))
        RK_LOG_WARN("chunk %s not persisted: %s", key, rk_error_message());
}

/* A chunk pre-warming computed: to the disk tier with persist (one KV
 * download for both tiers) and to the Redis tier when there is one. */
static void prewarm_write(rk_service *svc, const rk_chunk_entry *e, const char *doc_id,
                          int persist) {
    if (persist && svc->store) {
        persist_if_missing(svc, e, doc_id); /* writes the Redis tier too */
    } else if (svc->redis && rk_persist_write_tiers(svc, e, "isolated", doc_id, 0, NULL)) {
        char key[33];
        rk_chunk_key_hex(e->key, key);
        RK_LOG_WARN("chunk %s not shared: %s", key, rk_error_message());
    }
}

rk_status rk_pipeline_prewarm(rk_service *svc, rk_prewarm_item *items, int n_items, int persist) {
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int bs = rk_arena_block_size(svc->arena);
    rk_request policy_req = {.opt = {.chunk_context = RK_CONTEXT_ISOLATED}};
    rk_chunk_policy policy;
    chunk_policy(svc, &policy_req, &policy);
    rk_chunk_entry **held = calloc((size_t)(n_items ? n_items : 1), sizeof *held);
    rk_seq *views = calloc((size_t)(n_items ? n_items : 1), sizeof *views);
    int *computing = calloc((size_t)(n_items ? n_items : 1), sizeof *computing);
    if (!held || !views || !computing) {
        free(held);
        free(views);
        free(computing);
        return rk_errorf(RK_ERR_NOMEM, "prewarm: out of memory");
    }
    batch b = {0};
    rk_status st = RK_OK;
    int first = 0; /* first item of the current pass */
    for (int i = 0; i <= n_items && !st; i++) {
        /* Run the pass when it is full or at the end. */
        if (i == n_items || b.n_tok >= PREWARM_PASS_TOKENS) {
            if ((st = batch_run(svc, &b))) break;
            for (int j = first; j < i; j++) {
                if (!computing[j]) continue;
                rk_chunk_index_ready(svc->chunks, held[j]);
                items[j].status = "computed";
                prewarm_write(svc, held[j], items[j].doc_id, persist);
            }
            batch_reset(&b);
            first = i;
            if (i == n_items) break;
        }
        rk_prewarm_item *it = &items[i];
        it->status = "failed";
        it->tier = "arena";
        it->key[0] = it->error[0] = '\0';
        rk_text text = {(char *)it->text, it->len};
        int32_t *ids = NULL;
        if (encode(tok, &text, 0, &ids, &it->tokens)) {
            item_fail(it, rk_error_message());
            continue;
        }
        if (it->tokens == 0 || it->tokens > svc->cfg.max_chunk_tokens) {
            char why[160];
            snprintf(why, sizeof why, "the chunk has %d tokens; 1 to %d are allowed", it->tokens,
                     svc->cfg.max_chunk_tokens);
            item_fail(it, why);
            free(ids);
            continue;
        }
        policy.salt = it->salt;
        rk_chunk_key key = rk_chunk_key_compute(&policy, ids, it->tokens);
        rk_chunk_key_hex(key, it->key);
        rk_chunk_entry *e = rk_chunk_index_find(svc->chunks, key);
        int on_disk = 0;
        if (e) {
            it->status = "cached";
            if (persist) prewarm_write(svc, e, it->doc_id, persist);
        } else if (svc->store && rk_store_contains(svc->store, it->key, &on_disk) == RK_OK &&
                   on_disk) {
            it->status = "cached";
            it->tier = "disk";
        } else {
            rk_chunk_lookup kind;
            if (rk_chunk_index_acquire(svc->chunks, key, ids, it->tokens, 0, &e, &kind)) {
                item_fail(it, rk_error_message());
            } else if (kind != RK_CHUNK_MISS) {
                held[i] = e; /* a duplicate within this call: computed once */
                it->status = "cached";
            } else {
                held[i] = e;
                e->owner = it->owner;
                computing[i] = 1;
                views[i] =
                    (rk_seq){.blocks = e->blocks, .n_blocks = e->n_blocks, .n_tokens = e->n_tokens};
                st = batch_add(&b, bs, &views[i], e->tokens, e->n_tokens, 0, 0, 0);
            }
        }
        free(ids);
    }
    for (int i = 0; i < n_items; i++)
        if (held[i]) rk_chunk_index_release(svc->chunks, held[i], st != RK_OK);
    if (st)
        for (int i = 0; i < n_items; i++)
            if (computing[i] && strcmp(items[i].status, "computed") != 0)
                item_fail(&items[i], "the engine failed while computing it");
    batch_free(&b);
    free(held);
    free(views);
    free(computing);
    return st;
}
