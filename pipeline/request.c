/* pipeline/request.c — stage 1, request preparation (see pipeline.h): a
 * request's pieces tokenized, its context and max_tokens checked, its result
 * buffers allocated; its options' defaults and cache scope; rk_request_free;
 * on the engine thread, its state for an admission (rk_init_request).
 * Also the small facts about a request that the later stages share without
 * calling each other: whether a chunk came with the radix prefix, an
 * uncached entry's blocks, and the report kept across preemption. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "pipeline/internal.h"

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
    for (int g = 0; r->gap && g + 1 < r->n_groups; g++) free(r->gap[g]);
    free(r->gap);
    free(r->gap_len);
    free(r->group_end);
    r->gap = NULL;
    r->gap_len = r->group_end = NULL;
    r->n_groups = r->n_gap_tokens = 0;
    free(r->out_tokens);
    free(r->top_ids);
    free(r->top_logprobs);
    free(r->logprobs);
    free(r->prompt_logprobs);
    free(r->prompt_top_ids);
    free(r->prompt_top_logprobs);
    r->prompt_logprobs = r->prompt_top_logprobs = NULL;
    r->prompt_top_ids = NULL;
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

/* The prompt's log-probability entries (opt.prompt_logprobs): the prompt
 * is then computed whole, so it may have no chunks, and no repair runs on
 * it; entry 0 has nothing before it (NaN, ids -1). */
static rk_status alloc_prompt_logprobs(rk_request *r) {
    int k = r->opt.n_logprobs, n = r->n_sys + r->n_question;
    if (k < 1)
        return rk_errorf(RK_ERR_INVALID, "the prompt's log-probabilities need logprobs 1 to 20");
    if (r->n_chunks > 0 || r->n_groups > 1)
        return rk_errorf(RK_ERR_INVALID,
                         "the prompt's log-probabilities need a prompt without chunks");
    r->opt.repair_k = 0;
    r->opt.repair_ratio = 0;
    r->opt.repair_query = 0;
    r->prompt_logprobs = malloc((size_t)(n ? n : 1) * sizeof *r->prompt_logprobs);
    r->prompt_top_ids = malloc((size_t)(n ? n : 1) * k * sizeof *r->prompt_top_ids);
    r->prompt_top_logprobs = malloc((size_t)(n ? n : 1) * k * sizeof *r->prompt_top_logprobs);
    if (!r->prompt_logprobs || !r->prompt_top_ids || !r->prompt_top_logprobs)
        return rk_errorf(RK_ERR_NOMEM, "request: out of memory");
    for (int i = 0; i < n; i++) r->prompt_logprobs[i] = NAN;
    for (size_t i = 0; i < (size_t)n * k; i++) {
        r->prompt_top_ids[i] = -1;
        r->prompt_top_logprobs[i] = NAN;
    }
    return RK_OK;
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
    return r->opt.prompt_logprobs ? alloc_prompt_logprobs(r) : RK_OK;
}

static rk_status check_context(rk_service *svc, rk_request *r) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    long prompt = r->n_sys + r->n_gap_tokens + r->n_question;
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

rk_status rk_request_encode(const rk_tokenizer *tok, const rk_text *t, int special, int32_t **ids,
                            int *n) {
    size_t k = 0;
    *ids = NULL;
    *n = 0;
    if (t->len == 0) return RK_OK;
    rk_status st = rk_tokenizer_encode(tok, t->s, t->len, special, ids, &k);
    *n = (int)k;
    return st;
}

/* The chunk groups of pieces into r: where each group ends among r's
 * chunks (kept_upto[i]: r's chunks among the first i pieces, those that
 * tokenized to nothing left out) and the texts between groups, tokenized
 * like the question. */
static rk_status prepare_groups(rk_service *svc, const rk_split *pieces, const int *kept_upto,
                                rk_request *r) {
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int n = pieces->n_groups;
    r->group_end = malloc((size_t)n * sizeof *r->group_end);
    r->gap = calloc((size_t)n, sizeof *r->gap);
    r->gap_len = calloc((size_t)n, sizeof *r->gap_len);
    if (!r->group_end || !r->gap || !r->gap_len)
        return rk_errorf(RK_ERR_NOMEM, "request: out of memory");
    r->n_groups = n;
    for (int g = 0; g < n; g++) {
        r->group_end[g] = kept_upto[pieces->group_end[g]];
        if (g + 1 == n) break;
        rk_status st = rk_request_encode(tok, &pieces->texts[g], 1, &r->gap[g], &r->gap_len[g]);
        if (st) return st;
        r->n_gap_tokens += r->gap_len[g];
    }
    return RK_OK;
}

rk_status rk_request_prepare(rk_service *svc, const rk_split *pieces, rk_request *r) {
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    rk_status st;
    r->n_chunks = 0;
    r->n_empty_chunks = pieces->n_empty_chunks;
    int *kept_upto = NULL;
    int32_t *ids = NULL;
    int n = 0;
    if ((st = rk_request_encode(tok, &pieces->system, 1, &ids, &n))) goto fail;
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
    if (pieces->n_groups > 1 &&
        (kept_upto = calloc((size_t)pieces->n_chunks + 1, sizeof *kept_upto)) == NULL) {
        st = rk_errorf(RK_ERR_NOMEM, "request: out of memory");
        goto fail;
    }
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
        if ((st =
                 rk_request_encode(tok, &pieces->chunks[i], 0, &r->chunks[i], &r->chunk_lens[i]))) {
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
    /* Compact out chunks that tokenized to nothing (a group's end moves
     * down with them). */
    int kept = 0;
    for (int i = 0; i < pieces->n_chunks; i++) {
        if (r->chunks[i]) {
            r->chunks[kept] = r->chunks[i];
            r->chunk_lens[kept++] = r->chunk_lens[i];
        }
        if (kept_upto) kept_upto[i + 1] = kept;
    }
    r->n_chunks = kept;
    if (pieces->n_groups > 1 && (st = prepare_groups(svc, pieces, kept_upto, r))) goto fail;
    free(kept_upto);
    kept_upto = NULL;
    if ((st = rk_request_encode(tok, &pieces->question, 1, &r->question, &r->n_question)))
        goto fail;
    if (r->n_question == 0 && (r->n_chunks > 0 || pieces->system.len > 0)) {
        st = rk_errorf(RK_ERR_INVALID, "the question is empty");
        goto fail;
    }
    if ((st = check_context(svc, r)) || (st = alloc_results(svc, r))) goto fail;
    return RK_OK;
fail:
    free(kept_upto);
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

/* ---------------------------------------------------------------- its layout, blocks and report */

/* A RAG chunk that lies in the prefix taken from the tree. */
int rk_chunk_group(const rk_request *r, int k) {
    int g = 0;
    while (g + 1 < r->n_groups && r->group_end[g] <= k) g++;
    return g;
}

int rk_chunk_from_prefix(const rk_request *r, int k) {
    return r->state->layout.index[k] + r->chunk_lens[k] <= r->state->reused;
}

/* Give an uncached entry's live blocks back (once). */
void rk_drop_uncached_blocks(rk_service *svc, rk_chunk_entry *e) {
    if (e->n_blocks) rk_arena_release(svc->arena, e->blocks, e->n_blocks);
    e->n_blocks = 0;
}

/* Keep what a resumed request's first admission reported. */
rk_status rk_save_report(rk_request *r) {
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
void rk_restore_report(rk_request *r) {
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

/* A resumed request's prompt goes on with the tokens it generated but the
 * last, which its next decode step feeds. */
static void append_generated(rk_request *r) {
    rk_req_state *s = r->state;
    if (s->n_gen > 0)
        memcpy(s->qtok + s->n_qtok, r->out_tokens, (size_t)s->n_gen * sizeof *s->qtok);
    s->n_qtok += s->n_gen;
}

/* r's layout: its chunk groups and the texts between them. */
static rk_status plan_layout(const rk_request *r, rk_position_mode mode, rk_layout *out) {
    rk_layout_groups gr = {r->n_groups, r->group_end, r->gap_len};
    return rk_layout_plan(mode, r->n_sys, r->chunk_lens, r->n_chunks, r->n_groups > 1 ? &gr : NULL,
                          out);
}

rk_status rk_init_request(rk_service *svc, rk_request *r) {
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
    /* Nothing to generate: the prompt is still cached, but no step samples
     * (its question is computed only for the prompt's log-probabilities). */
    s->done = r->opt.max_tokens == 0 && !r->opt.prompt_logprobs;
    rk_status st = rk_sampler_init(&s->sampler, &r->opt.sampling, hp->n_vocab);
    if (st) return st;
    /* A fresh run starts its grammar again (from the state the HTTP worker
     * made, or the one an earlier run left: what its automaton learnt is
     * kept); a resumed one goes on. */
    if (!r->resume && r->grammar_state) rk_grammar_state_reset(r->grammar_state);
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
        if ((st = rk_save_report(r))) return st;
    }
    if (r->opt.mode == RK_MODE_PLAIN) {
        /* One ordinary sequence: the chunks (and the texts between their
         * groups) and the question follow the system. */
        int n = r->n_question + r->n_gap_tokens;
        for (int k = 0; k < r->n_chunks; k++) n += r->chunk_lens[k];
        s->qtok = malloc((size_t)(n + s->n_gen + 1) * sizeof *s->qtok);
        if (!s->qtok) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        int o = 0;
        for (int k = 0, g = 0; k <= r->n_chunks; k++) {
            for (; g + 1 < r->n_groups && r->group_end[g] == k; g++) { /* text after group g */
                if (r->gap_len[g])
                    memcpy(s->qtok + o, r->gap[g], (size_t)r->gap_len[g] * sizeof *s->qtok);
                o += r->gap_len[g];
            }
            if (k == r->n_chunks) break;
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
                                                    .source = RK_CHUNK_SOURCE_COMPUTED,
                                                    .group = rk_chunk_group(r, k)};
        }
        return plan_layout(r, RK_POSITIONS_SEQUENTIAL, &s->layout);
    }
    if (r->opt.chunk_context == RK_CONTEXT_ANCHOR &&
        rk_tokenizer_bos(rk_model_tokenizer(svc->model)) < 0)
        return rk_errorf(RK_ERR_INVALID,
                         "chunk_context anchor needs a model with a BOS token (the anchor)");
    if ((st = plan_layout(r, r->opt.positions, &s->layout))) return st;
    s->qtok = malloc((size_t)(r->n_question + s->n_gen + 1) * sizeof *s->qtok);
    if (!s->qtok) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    if (r->n_question) memcpy(s->qtok, r->question, (size_t)r->n_question * sizeof *s->qtok);
    s->n_qtok = r->n_question;
    append_generated(r);
    s->q_index = s->layout.question_index;
    s->q_pos = s->layout.question_pos;
    return RK_OK;
}
