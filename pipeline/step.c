/* pipeline/step.c — the scheduler's per-step policy (see pipeline.h): it
 * decides, and calls the stages (pipeline.c), the KV planner and the runner
 * (decode.c), which never call it back. Admitted requests run in
 * rk_pipeline_step, each step one pass of one token for every running
 * request, whenever it was admitted, plus the joined requests' prompt work
 * within step_tokens (rk_run_pass: stepped chunks, system tail, repair
 * runs, question); the finished leave. A request takes live blocks as it
 * decodes (make_room); when none is left the youngest is preempted
 * (preempt) and resumes through a later admission (resume_one). Embedding
 * work (rk_pipeline_embed_join) takes what the step budget left, in a pass
 * of its own after the step's (embed_work). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"
#include "pipeline/persist.h"

/* Tokens of a left request's sequence copied into the radix tree per
 * prompt token of the step budget, while others decode. A copied token
 * (every layer's K rotated, V moved) costs about a twentieth of a computed
 * one on qwen3-0.6b (docs/benchmarks.md, "Cold arrival"): at 4, a step's
 * copy slice costs a fifth of its prompt budget. */
#define INSERT_TOKENS_PER_BUDGET_TOKEN 4

/* ---------------------------------------------------------------- running requests */

rk_status rk_pipeline_create(rk_service *svc, rk_pipeline **out) {
    *out = calloc(1, sizeof **out);
    if (!*out) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    (*out)->svc = svc;
    return RK_OK;
}

int rk_pipeline_n_running(const rk_pipeline *p) { return p->n_running; }

int rk_request_live_blocks(const rk_service *svc, const rk_request *r) {
    int bs = rk_arena_block_size(svc->arena), zc = rk_zero_copy_for(svc, r, 0);
    long tokens = (long)r->n_sys + r->n_gap_tokens + r->n_question + 1 +
                  (r->resume && r->n_out ? r->n_out - 1 : 0);
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

/* The finished leave now; the rest keep their order. */
static void leave_finished(rk_pipeline *p) {
    int kept = 0;
    for (int i = 0; i < p->n_running; i++) {
        rk_request *r = p->running[i];
        if (r->state->done)
            rk_leave(p, r);
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
    rk_finish_report(r);
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
            if (p->n_inserts > 0) { /* the left requests' blocks go back first */
                rk_inserts_step(p, 0);
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
    rk_status st = rk_stages_after_chunks(&a);
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
            rk_leave(p, reqs[i]);
        else
            insert_by_rank(p->running, &p->n_running, reqs[i]);
    }
    if (p->n_running == 0) rk_inserts_step(p, 0); /* no step follows */
}

rk_status rk_pipeline_admit(rk_pipeline *p, rk_request *const *reqs, int n_reqs,
                            const rk_pipeline_hooks *hooks) {
    int n_fresh, n_pre = 0;
    rk_status st = rk_admit_stages(p, reqs, n_reqs, 0, &n_fresh);
    if (st) return st;
    for (int i = 0; i < n_reqs; i++)
        if (reqs[i]->state->prefilling) p->work[n_pre++] = reqs[i];
    if ((st = rk_run_pass(p, NULL, 0, p->work, n_pre, 0, hooks))) {
        for (int i = 0; i < n_reqs; i++) rk_release_request(p->svc, reqs[i], 1);
        return st;
    }
    admitted(p, reqs, n_reqs, n_fresh);
    return RK_OK;
}

rk_status rk_pipeline_join(rk_pipeline *p, rk_request *const *reqs, int n_reqs) {
    int n_fresh;
    double t0 = rk_time_now();
    rk_status st = rk_admit_stages(p, reqs, n_reqs, p->svc->cfg.step_tokens > 0, &n_fresh);
    if (st == RK_ERR_EXHAUSTED && p->n_inserts > 0) { /* blocks the left requests still hold */
        rk_inserts_step(p, 0);
        st = rk_admit_stages(p, reqs, n_reqs, p->svc->cfg.step_tokens > 0, &n_fresh);
    }
    if (!st) admitted(p, reqs, n_reqs, n_fresh);
    if (rk_log_get_level() <= RK_LOG_DEBUG)
        RK_LOG_DEBUG("join: %d requests admitted in %.1f ms", n_reqs, (rk_time_now() - t0) * 1e3);
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

rk_status rk_pipeline_embed_join(rk_pipeline *p, rk_embed_task *t) {
    if (p->n_embeds == p->cap_embeds) {
        int cap = p->cap_embeds ? p->cap_embeds * 2 : 8;
        rk_embed_task **q = realloc(p->embeds, (size_t)cap * sizeof *q);
        if (!q) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        p->embeds = q;
        p->cap_embeds = cap;
    }
    p->embeds[p->n_embeds++] = t;
    return RK_OK;
}

int rk_pipeline_n_embedding(const rk_pipeline *p) { return p->n_embeds; }

/* The step's embedding pass, within budget prompt tokens (<= 0: the pass's
 * own bound); the tasks done leave the list (their owners see them done). */
static void embed_work(rk_pipeline *p, int budget) {
    if (p->n_embeds == 0) return;
    rk_embed_step(p->svc, p->embeds, p->n_embeds, budget, p->n_running > 0);
    int kept = 0;
    for (int i = 0; i < p->n_embeds; i++)
        if (!rk_embed_task_done(p->embeds[i], NULL, NULL, 0)) p->embeds[kept++] = p->embeds[i];
    p->n_embeds = kept;
}

rk_status rk_pipeline_step(rk_pipeline *p, const rk_pipeline_hooks *hooks) {
    rk_status st;
    double t[6];
    t[0] = rk_time_now();
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
    t[1] = rk_time_now();
    /* Decode tokens first, then prompt work in arrival order. */
    int n_dec = 0, n_pre = 0;
    for (int i = 0; i < p->n_running; i++)
        if (!p->running[i]->state->prefilling) p->work[n_dec++] = p->running[i];
    for (int i = 0; i < p->n_running; i++)
        if (p->running[i]->state->prefilling) p->work[n_dec + n_pre++] = p->running[i];
    /* The budget protects decoding streams: with none in the pass, the
     * prompt work goes in whole. */
    int budget = n_dec > 0 ? p->svc->cfg.step_tokens : 0;
    if ((st = rk_run_pass(p, p->work, n_dec, p->work + n_dec, n_pre, budget, hooks))) return st;
    /* Prompt tokens the pass fed: what is left of the budget goes to embeddings. */
    int left = budget > 0 ? budget - (p->b.n_tok - n_dec) : 0, n_prompt = p->b.n_tok - n_dec;
    t[2] = rk_time_now();
    /* Nothing to run but loads to wait for: wait for one, not in a spin. */
    if (p->b.n_seq == 0 && p->n_embeds == 0 && p->svc->loader && rk_loader_pending(p->svc->loader))
        rk_loader_wait(p->svc->loader, 0.01);
    /* A slice of the deviation passes: their own pass, of fewer layers. */
    if ((st = rk_repair_score_step(p->svc, &p->b, p->work + n_dec, n_pre, budget))) return st;
    t[3] = rk_time_now();
    if (budget <= 0 || left > 0) embed_work(p, left); /* unless the prompt work took it all */
    t[4] = rk_time_now();
    if ((st = advance_chunk_waits(p))) return st;
    leave_finished(p);
    /* The sequences of the requests that left go into the radix tree:
     * beside decoding streams a slice a step, else all at once. */
    int copy = p->n_running > 0 && budget > 0 ? INSERT_TOKENS_PER_BUDGET_TOKEN * budget : 0;
    rk_inserts_step(p, copy);
    t[5] = rk_time_now();
    if (rk_log_get_level() <= RK_LOG_DEBUG)
        RK_LOG_DEBUG("step: %d decoding + %d prompt tokens (budget %d); ms: before %.1f, "
                     "pass %.1f, scoring %.1f, embedding %.1f, after %.1f",
                     n_dec, n_prompt, budget, (t[1] - t[0]) * 1e3, (t[2] - t[1]) * 1e3,
                     (t[3] - t[2]) * 1e3, (t[4] - t[3]) * 1e3, (t[5] - t[4]) * 1e3);
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
    rk_inserts_drop(p);
    for (int i = 0; i < p->n_running; i++) rk_release_request(p->svc, p->running[i], 1);
    p->n_running = 0;
    p->n_preempted = 0; /* they hold nothing */
}

void rk_pipeline_free(rk_pipeline *p) {
    if (!p) return;
    rk_pipeline_abort(p);
    for (int i = 0; i < p->n_embeds; i++) rk_embed_task_cancel(p->embeds[i]);
    embed_work(p, 0); /* the cancelled tasks end: their blocks go back */
    free(p->embeds);
    rk_batch_free(&p->b);
    rk_copy_plan_free(&p->copies);
    rk_feed_free(&p->feed);
    free(p->inserts);
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
