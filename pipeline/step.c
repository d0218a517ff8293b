/* pipeline/step.c — the running requests (see pipeline.h), stage 7
 * (decode) of docs/architecture.md's numbering: admitted
 * requests run in rk_pipeline_step, each step one pass of one token for
 * every running request, whenever it was admitted, plus the joined
 * requests' prompt work within step_tokens (run_pass: stepped chunks,
 * system tail, repair runs, question); the
 * finished leave. A request takes live blocks as it decodes (make_room);
 * when none is left the youngest is preempted (preempt) and resumes through
 * a later admission (resume_one). Also the sampling of a request's next
 * token (take_token) and its report. The admission stages are pipeline.c's
 * and repair.c's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"
#include "pipeline/persist.h"

/* ---------------------------------------------------------------- reports and tokens */

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
            /* min_bytes may be INT32_MAX (a grammar whose shortest output
             * is longer than that): the margin is taken from left, never
             * added to it. */
            if (rk_grammar_state_min_bytes(r->grammar_state) >= left - RK_GRAMMAR_BUDGET_MARGIN)
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
    chunk_feed feed; /* the chunk entries of the pass under construction */
};

rk_status rk_pipeline_create(rk_service *svc, rk_pipeline **out) {
    *out = calloc(1, sizeof **out);
    if (!*out) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    (*out)->svc = svc;
    return RK_OK;
}

int rk_pipeline_n_running(const rk_pipeline *p) { return p->n_running; }

int rk_request_live_blocks(const rk_service *svc, const rk_request *r) {
    int bs = rk_arena_block_size(svc->arena), zc = rk_zero_copy_for(svc, r, 0);
    long tokens = (long)r->n_sys + r->n_question + 1 + (r->resume && r->n_out ? r->n_out - 1 : 0);
    long extra = 0;
    for (int k = 0; k < r->n_chunks; k++) {
        tokens += zc ? rk_private_tokens(r, r->chunk_lens[k], bs) : r->chunk_lens[k];
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

/* A finished request leaves: its report is completed and all it holds
 * released (a failed one's sequence is not kept). */
static void leave(rk_pipeline *p, rk_request *r) {
    finish_report(r);
    rk_release_request(p->svc, r, r->failure != RK_OK);
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
    rk_release_request(p->svc, r, 0);
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
 * system tail, its stepped repair runs, then the rest (table order: each
 * slice attends to what the earlier ones wrote); logits for the last token
 * when it has no token yet. */
static rk_status feed_prompt(batch *b, int bs, rk_request *r, int *left) {
    rk_req_state *s = r->state;
    rk_status st;
    int n = r->n_sys - s->sys_next < *left ? r->n_sys - s->sys_next : *left;
    if (n > 0) {
        int last = s->sys_next + n == r->n_sys && s->n_ptok == 0 && r->n_out == 0;
        if ((st = rk_batch_add_req(b, bs, s, r->sys + s->sys_next, n, s->sys_next, s->sys_next,
                                   last)))
            return st;
        if (last) s->row = b->n_logits - 1;
        s->fed_sys = n;
        *left -= n;
    }
    if (s->sys_next + s->fed_sys < r->n_sys) return RK_OK;
    if ((st = rk_repair_feed(b, bs, s, left))) return st;
    if (s->r_next + s->fed_r < s->n_rtok) return RK_OK;
    int m = s->n_ptok - s->p_next < *left ? s->n_ptok - s->p_next : *left;
    if (m <= 0) return RK_OK;
    int last = s->p_next + m == s->n_ptok && r->n_out == 0;
    if ((st = rk_batch_add_req(b, bs, s, s->ptok + s->p_next, m, s->p_pos + s->p_next,
                               s->p_idx + s->p_next, last)))
        return st;
    if (last) s->row = b->n_logits - 1;
    s->fed_p = m;
    *left -= m;
    return RK_OK;
}

/* Feed r's stepped chunks that are still being computed into b, at most
 * *left tokens, each entry once a pass whoever else needs it. In the
 * `system` context, r's system tail first: its chunks attend to its system
 * pages (a slice that ends the tail may share the pass with chunk slices:
 * every token's KV is written before a layer's attention reads it). */
static rk_status feed_chunks(rk_pipeline *p, rk_request *r, int *left) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(p->svc->arena);
    rk_status st;
    if (r->opt.chunk_context == RK_CONTEXT_SYSTEM && s->sys_next < r->n_sys) {
        int n = r->n_sys - s->sys_next < *left ? r->n_sys - s->sys_next : *left;
        if (n <= 0) return RK_OK;
        /* The system pages lead the request's own blocks (its run table
         * comes with the reindex, after the chunks). */
        if ((st = rk_batch_add(&p->b, bs, &s->kv, r->sys + s->sys_next, n, s->sys_next, s->sys_next,
                               0)))
            return st;
        s->fed_sys = n;
        *left -= n;
        if (s->sys_next + n < r->n_sys) return RK_OK;
    }
    for (int k = 0; k<r->n_chunks && * left> 0; k++) {
        scratch *sc = &s->scratch[k];
        if (sc->stepped && (st = rk_feed_chunk(&p->b, bs, &p->feed, s->entries[k], &sc->kv,
                                               sc->ctx_runs.n_runs ? &sc->ctx_runs : NULL, left)))
            return st;
    }
    return RK_OK;
}

/* One forward pass: the next token of every request in dec (their tables
 * have room for it), then the prompt work of the requests in pre, in their
 * order, at most budget tokens of it (<= 0: all of it): the chunks a
 * request waits for, or what is left of its prompt. A request whose
 * prompt ends in the pass takes its first token from it (a resumed one has
 * its next token already) and decodes from the next pass on; its system
 * prompt goes into the radix tree once computed. */
static rk_status run_pass(rk_pipeline *p, rk_request *const *dec, int n_dec, rk_request *const *pre,
                          int n_pre, int budget, const rk_pipeline_hooks *hooks) {
    rk_service *svc = p->svc;
    int bs = rk_arena_block_size(svc->arena), n_vocab = rk_model_hparams(svc->model)->n_vocab;
    rk_status st;
    rk_batch_reset(&p->b);
    for (int i = 0; i < n_dec; i++) {
        rk_request *r = dec[i];
        rk_req_state *s = r->state;
        int idx = s->kv.n_tokens++;
        if ((st = rk_batch_add_req(&p->b, bs, s, &r->out_tokens[r->n_out - 1], 1, s->next_pos++,
                                   idx, 1)))
            return st;
    }
    int left = budget > 0 ? budget : 1 << 30;
    for (int i = 0; i < n_pre; i++) {
        rk_req_state *s = pre[i]->state;
        s->row = -1;
        s->fed_sys = s->fed_p = s->fed_r = 0;
        st = s->chunk_wait ? feed_chunks(p, pre[i], &left)
             : s->scoring  ? RK_OK /* its deviation pass first: rk_repair_score_step */
                           : feed_prompt(&p->b, bs, pre[i], &left);
        if (st) {
            p->feed.n = 0;
            return st;
        }
    }
    if (p->b.n_seq == 0) return RK_OK;
    double t = rk_time_now();
    st = rk_batch_run(svc, &p->b);
    if (st) {
        p->feed.n = 0;
        return st;
    }
    rk_feed_done(&p->feed);
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
        if (s->chunk_wait) r->t.chunk_compute_ms += dt;
        if (s->fed_r) r->t.repair_ms += dt;
        if (s->fed_sys || s->fed_p) r->t.prefill_ms += dt;
        if (!s->fed_sys && !s->fed_r && !s->fed_p) continue;
        s->sys_next += s->fed_sys;
        s->r_next += s->fed_r;
        s->p_next += s->fed_p;
        if (s->fed_sys && s->sys_next == r->n_sys && s->n_insert && (st = rk_insert_system(svc, r)))
            return st;
        if (s->chunk_wait || s->sys_next < r->n_sys || s->r_next < s->n_rtok ||
            s->p_next < s->n_ptok)
            continue;
        s->prefilling = 0;
        s->n_valid = s->kv.n_tokens;
        if (s->row >= 0) take_token(svc, r, p->b.logits + (size_t)s->row * n_vocab, hooks);
    }
    return RK_OK;
}

/* The stages after the chunks' first part (docs/architecture.md's
 * numbering: 3 chunks' pass 2, 4 reindex, 5 repair, 6 question set-up) of
 * the requests in a. */
static rk_status stages_after_chunks(admission *a) {
    rk_status st = rk_stage_system_chunks(a);
    if (!st) st = rk_stage_reindex(a);
    if (!st) st = rk_stage_repair(a);
    if (!st) rk_queue_prompt(a);
    return st;
}

/* The prompt stages of an admission (2-6, docs/architecture.md) up to the
 * question pass itself (defer: up to the chunks the steps' passes compute,
 * for the requests that wait for them); on failure every one of reqs has
 * released what it took. */
static rk_status admit_stages(rk_pipeline *p, rk_request *const *reqs, int n_reqs, int defer,
                              int *n_fresh) {
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
        st = rk_init_request(p->svc, reqs[i]);
        if (reqs[i]->state) reqs[i]->state->hook_index = reqs[i]->rank;
    }
    admission a = {.svc = p->svc,
                   .reqs = reqs,
                   .n = n_reqs,
                   .b = &p->b,
                   .copies = &p->copies,
                   .defer = defer,
                   .feed = &p->feed};
    if (!st) st = rk_stage_system_and_chunks(&a);
    p->feed.n = 0;
    /* The requests that wait for chunks go on in the steps (chunks_done). */
    rk_request *go[n_reqs > 0 ? n_reqs : 1];
    int n_go = 0;
    for (int i = 0; !st && i < n_reqs; i++)
        if (!reqs[i]->state->chunk_wait) go[n_go++] = reqs[i];
    a.reqs = go;
    a.n = n_go;
    if (!st && n_go) st = stages_after_chunks(&a);
    if (st) {
        for (int i = 0; i < n_reqs; i++) rk_release_request(p->svc, reqs[i], 1);
        rk_copy_plan_free(&p->copies);
    }
    return st;
}

/* running[i]'s chunks are computed: its stages after the chunks run, and
 * its prompt joins the next step. When the live pool cannot hold what they
 * need while others run, it is preempted, to resume (its chunks cached)
 * when there is room; another failure is its own. */
static rk_status chunks_done(rk_pipeline *p, int i) {
    rk_request *r = p->running[i];
    rk_req_state *s = r->state;
    s->chunk_wait = s->prefilling = 0;
    for (int k = 0; k < r->n_chunks; k++) { /* filled by a tier load meanwhile */
        const char *src = s->entries[k]->source;
        if (!s->scratch[k].stepped || (strcmp(src, "disk") && strcmp(src, "redis"))) continue;
        r->chunk_reports[k].status = RK_CHUNK_STATUS_HIT;
        r->chunk_reports[k].source =
            !strcmp(src, "disk") ? RK_CHUNK_SOURCE_DISK : RK_CHUNK_SOURCE_REDIS;
    }
    /* Its repair runs go to the steps too (their budget applies). */
    admission a = {.svc = p->svc,
                   .reqs = &r,
                   .n = 1,
                   .b = &p->b,
                   .copies = &p->copies,
                   .defer = p->svc->cfg.step_tokens > 0};
    rk_status st = stages_after_chunks(&a);
    if (!st) return RK_OK;
    p->copies.n = 0;
    s->chunk_wait = s->prefilling = 1; /* nothing of its sequence is kept */
    if (st == RK_ERR_EXHAUSTED && p->n_running > 1) return preempt(p, i);
    r->failure = st;
    snprintf(r->failure_msg, sizeof r->failure_msg, "%s", rk_error_message());
    RK_LOG_ERROR("request failed: %s", r->failure_msg);
    s->done = 1;
    return RK_OK;
}

/* The requests whose chunks the last pass completed go on. */
static rk_status advance_chunk_waits(rk_pipeline *p) {
    rk_status st;
    for (int i = p->n_running - 1; i >= 0; i--) {
        rk_request *r = p->running[i];
        if (r->state->chunk_wait && !r->state->done && rk_chunks_computed(r) &&
            (st = chunks_done(p, i)))
            return st;
    }
    return RK_OK;
}

/* Admitted: done ones leave, the others run. */
static void admitted(rk_pipeline *p, rk_request *const *reqs, int n_reqs, int n_fresh) {
    p->n_admitted += n_fresh;
    for (int i = 0; i < n_reqs; i++) {
        rk_restore_report(reqs[i]);
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
    rk_status st = admit_stages(p, reqs, n_reqs, 0, &n_fresh);
    if (st) return st;
    for (int i = 0; i < n_reqs; i++)
        if (reqs[i]->state->prefilling) p->work[n_pre++] = reqs[i];
    if ((st = run_pass(p, NULL, 0, p->work, n_pre, 0, hooks))) {
        for (int i = 0; i < n_reqs; i++) rk_release_request(p->svc, reqs[i], 1);
        return st;
    }
    admitted(p, reqs, n_reqs, n_fresh);
    return RK_OK;
}

rk_status rk_pipeline_join(rk_pipeline *p, rk_request *const *reqs, int n_reqs) {
    int n_fresh;
    rk_status st = admit_stages(p, reqs, n_reqs, p->svc->cfg.step_tokens > 0, &n_fresh);
    if (!st) admitted(p, reqs, n_reqs, n_fresh);
    return st;
}

/* The Redis compute lock a load took for e goes to the first running
 * request that waits to compute e (rk_persist_lock_fn). */
static int keep_lock(void *ctx, rk_chunk_entry *e, const rk_redis_lock *lk) {
    rk_pipeline *p = ctx;
    for (int i = 0; i < p->n_running; i++) {
        rk_request *r = p->running[i];
        rk_req_state *s = r->state;
        for (int k = 0; s->entries && k < r->n_chunks; k++) {
            scratch *sc = &s->scratch[k];
            if (s->entries[k] != e || !sc->stepped || sc->rlocked) continue;
            sc->rlock = *lk;
            sc->rlocked = 1;
            return 1;
        }
    }
    return 0;
}

int rk_pipeline_tier_work(const rk_pipeline *p) {
    const rk_service *svc = p->svc;
    return (svc->loader ? rk_loader_pending(svc->loader) : 0) +
           (svc->writer ? rk_loader_pending(svc->writer) : 0);
}

int rk_pipeline_collect_loads(rk_pipeline *p) {
    return rk_persist_collect_loads(p->svc, keep_lock, p);
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
    rk_pipeline_collect_loads(p); /* the tiers' reads that finished */
    if ((st = make_room(p))) return st;
    /* Decode tokens first, then prompt work in arrival order. */
    int n_dec = 0, n_pre = 0;
    for (int i = 0; i < p->n_running; i++)
        if (!p->running[i]->state->prefilling) p->work[n_dec++] = p->running[i];
    for (int i = 0; i < p->n_running; i++)
        if (p->running[i]->state->prefilling) p->work[n_dec + n_pre++] = p->running[i];
    /* The budget protects decoding streams: with none in the pass, the
     * prompt work goes in whole. */
    int budget = n_dec > 0 ? p->svc->cfg.step_tokens : 0;
    if ((st = run_pass(p, p->work, n_dec, p->work + n_dec, n_pre, budget, hooks))) return st;
    /* Nothing to run but loads to wait for: wait for one, not in a spin. */
    if (p->b.n_seq == 0 && p->svc->loader && rk_loader_pending(p->svc->loader))
        rk_loader_wait(p->svc->loader, 0.01);
    /* A slice of the deviation passes: their own pass, of fewer layers. */
    if ((st = rk_repair_score_step(p->svc, &p->b, p->work + n_dec, n_pre, budget))) return st;
    if ((st = advance_chunk_waits(p))) return st;
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
    for (int i = 0; i < p->n_running; i++) rk_release_request(p->svc, p->running[i], 1);
    p->n_running = 0;
    p->n_preempted = 0; /* they hold nothing */
}

void rk_pipeline_free(rk_pipeline *p) {
    if (!p) return;
    rk_pipeline_abort(p);
    rk_batch_free(&p->b);
    rk_copy_plan_free(&p->copies);
    rk_feed_free(&p->feed);
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
    rk_pipeline_free(p);          /* on failure: releases what still runs */
    rk_persist_drain_writes(svc); /* the chunks it computed are on disk when it returns */
    return st;
}
