/* tests/test_preempt.c — blocks on demand and preemption: with a live pool
 * too small for the load, running requests take live blocks as they decode,
 * the youngest is preempted when the pool runs dry and resumes later, every
 * request ends with the greedy tokens it gets alone, the streamed tokens
 * are never repeated or lost, and every block goes back to its pool. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pipeline/pipeline.h"
#include "pipeline/scheduler.h"
#include "tests/testutil.h"

#define N_REQS     4
#define MAX_TOKENS 60

static const char *PROMPTS[N_REQS] = {
    "A system prompt long enough to fill a block of sixteen tokens or more.##Tom had a red "
    "ball.##What did Tom have?",
    "Another system prompt.##The cat slept on the mat all day long.##Lily saw a bird.##Where "
    "did the cat sleep?",
    "Be brief.##Sam ran to the park with his dog.##Who ran?",
    "A story teller.##The sun was hot and the sea was blue.##The boat was small.##What was "
    "blue?",
};

static rk_config config(int live_blocks) {
    /* The exactness bounds are f32's; f16 (the default) is checked on its own. */
    rk_config cfg = rk_test_config(2, 64, "f32");
    cfg.live_blocks = live_blocks;
    return cfg;
}

static rk_service *open_svc(const char *model, int live_blocks) {
    rk_config cfg = config(live_blocks);
    return rk_test_service_open(&cfg, model);
}

/* Set by a test: requests sample with penalties over their generated tokens. */
static int g_penalties;

static void prepare_into(rk_service *svc, const char *prompt, int max_tokens, rk_req_mode mode,
                         rk_request *r) {
    rk_req_options_default(&r->opt);
    r->opt.mode = mode;
    r->opt.max_tokens = max_tokens;
    r->opt.sampling.temperature = 0;
    if (g_penalties) {
        r->opt.sampling.presence_penalty = 0.4f;
        r->opt.sampling.frequency_penalty = 0.6f;
        r->opt.sampling.repetition_penalty = 1.3f;
    }
    r->opt.stop_at_eog = 0;
    r->opt.n_logprobs = 2;
    rk_split sp;
    cr_assert_eq(rk_split_prompt(prompt, strlen(prompt), NULL, svc->cfg.max_chunks, &sp), RK_OK);
    cr_assert_eq(rk_request_prepare(svc, &sp, r), RK_OK, "%s", rk_error_message());
    rk_split_free(&sp);
}

static rk_request *prepare(rk_service *svc, const char *prompt, int max_tokens, rk_req_mode mode) {
    rk_request *r = calloc(1, sizeof *r);
    prepare_into(svc, prompt, max_tokens, mode, r);
    return r;
}

static void request_free(rk_request *r) {
    rk_request_free(r);
    free(r);
}

/* Tokens seen by on_token, per hook index: what a streaming client gets. */
typedef struct stream_log {
    int32_t tokens[N_REQS][MAX_TOKENS];
    int n[N_REQS];
    /* When set: the requests, and what each reported at its first token
     * (its first admission): the cached system and conversation tokens
     * and each chunk's status and source. */
    rk_request **reqs;
    int first_cached[N_REQS];
    rk_chunk_report first_chunks[N_REQS][4];
} stream_log;

static void on_token(void *ctx, int req, int32_t token) {
    stream_log *l = ctx;
    cr_assert(req >= 0 && req < N_REQS && l->n[req] < MAX_TOKENS);
    if (l->reqs && l->n[req] == 0) {
        const rk_request *r = l->reqs[req];
        cr_assert_leq(r->n_chunks, 4);
        l->first_cached[req] = r->sys_cached + r->conv_cached;
        memcpy(l->first_chunks[req], r->chunk_reports,
               (size_t)r->n_chunks * sizeof(rk_chunk_report));
    }
    l->tokens[req][l->n[req]++] = token;
}

static int chunk_refs(void *ctx, const rk_chunk_entry *e) {
    *(int *)ctx += e->refs > 0;
    return 0;
}

/* Nothing is held: no chunk entry is referenced, no radix path is locked,
 * every live block is free; with the caches flushed, every block of every
 * pool is. */
static void check_all_released(rk_service *svc) {
    int refs = 0;
    rk_chunk_index_foreach(svc->chunks, chunk_refs, &refs);
    cr_assert_eq(refs, 0, "no chunk entry is referenced");
    rk_test_check_all_released(svc);
}

static void check_preempted_run_matches_alone(const char *model, rk_req_mode mode) {
    /* Alone, with room to spare. */
    rk_service *alone = open_svc(model, 0);
    rk_request *ref[N_REQS];
    for (int i = 0; i < N_REQS; i++) {
        ref[i] = prepare(alone, PROMPTS[i], MAX_TOKENS, mode);
        cr_assert_eq(rk_pipeline_run(alone, &ref[i], 1, NULL), RK_OK, "%s", rk_error_message());
        cr_assert_eq(ref[i]->preemptions, 0);
    }
    /* Together in a live pool that holds the prompts, not the generations. */
    rk_service *svc = open_svc(model, 10);
    rk_request *reqs[N_REQS];
    for (int i = 0; i < N_REQS; i++) reqs[i] = prepare(svc, PROMPTS[i], MAX_TOKENS, mode);
    stream_log log = {.reqs = reqs};
    rk_pipeline_hooks h = {.ctx = &log, .on_token = on_token};
    cr_assert_eq(rk_pipeline_run(svc, reqs, N_REQS, &h), RK_OK, "%s", rk_error_message());
    int preempted = 0;
    for (int i = 0; i < N_REQS; i++) {
        rk_request *r = reqs[i];
        preempted += r->preemptions;
        cr_assert(r->finished);
        cr_assert_eq(r->n_out, MAX_TOKENS);
        cr_assert_arr_eq(r->out_tokens, ref[i]->out_tokens, MAX_TOKENS * sizeof(int32_t),
                         "request %d (preempted %d times) has its greedy tokens alone", i,
                         r->preemptions);
        cr_assert_eq(r->prompt_tokens, ref[i]->prompt_tokens);
        /* A resumed request comes back from the caches: its report is still
         * its first admission's, not the resumption's. */
        cr_assert_eq(r->sys_cached + r->conv_cached, log.first_cached[i], "request %d", i);
        for (int k = 0; k < r->n_chunks; k++) {
            cr_assert_eq(r->chunk_reports[k].status, log.first_chunks[i][k].status, "%d/%d", i, k);
            cr_assert_eq(r->chunk_reports[k].source, log.first_chunks[i][k].source, "%d/%d", i, k);
        }
        cr_assert_eq(r->computed_tokens + r->cached_tokens, r->prompt_tokens);
        cr_assert_gt(r->computed_tokens, 0, "request %d computed its question at least", i);
        cr_assert_eq(log.n[i], MAX_TOKENS, "each token was streamed once");
        cr_assert_arr_eq(log.tokens[i], r->out_tokens, MAX_TOKENS * sizeof(int32_t));
        for (int t = 0; t < MAX_TOKENS; t++) {
            cr_assert_leq(fabs(r->logprobs[t] - ref[i]->logprobs[t]), 1e-3, "req %d token %d", i,
                          t);
            cr_assert_eq(r->top_ids[t * 2], ref[i]->top_ids[t * 2]);
        }
    }
    cr_log_info("%d preemptions", preempted);
    cr_assert_gt(preempted, 0, "the pool was too small: requests were preempted");
    /* A resumed sequence is matched in the radix tree, not recomputed. */
    rk_radix_stats rs;
    rk_radix_get_stats(svc->prefix, &rs);
    cr_assert_geq(rs.tokens_reused, (uint64_t)preempted * 16, "%d preemptions reused %llu",
                  preempted, (unsigned long long)rs.tokens_reused);
    check_all_released(svc);
    for (int i = 0; i < N_REQS; i++) {
        request_free(ref[i]);
        request_free(reqs[i]);
    }
    rk_service_close(alone);
    rk_service_close(svc);
}

Test(preempt, preempted_rag_requests_resume_with_their_greedy_tokens, .timeout = 300) {
    check_preempted_run_matches_alone(NULL, RK_MODE_RAG); /* zero-copy: chunks in place */
}

Test(preempt, preempted_plain_requests_resume_with_their_greedy_tokens, .timeout = 300) {
    check_preempted_run_matches_alone(NULL, RK_MODE_PLAIN); /* whole-sequence reuse */
}

/* The penalties count the tokens generated before a preemption too: a
 * resumed request's sampler has seen them all. */
Test(preempt, preempted_requests_with_penalties_resume_with_their_tokens, .timeout = 300) {
    g_penalties = 1;
    check_preempted_run_matches_alone(NULL, RK_MODE_RAG);
}

Test(preempt, preempted_requests_resume_with_their_greedy_tokens_stories260k, .timeout = 300) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_preempted_run_matches_alone(model, RK_MODE_RAG);
    free(model);
}

Test(preempt, a_request_takes_blocks_as_it_decodes_not_at_admission) {
    rk_service *svc = open_svc(NULL, 0);
    int bs = rk_arena_block_size(svc->arena);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *r = prepare(svc, PROMPTS[0], 8 * bs, RK_MODE_RAG);
    int total = rk_arena_pool_total(svc->arena, RK_POOL_LIVE);
    cr_assert_eq(rk_pipeline_admit(p, &r, 1, NULL), RK_OK, "%s", rk_error_message());
    int at_admission = total - rk_arena_pool_free(svc->arena, RK_POOL_LIVE);
    cr_assert_leq(at_admission, 3, "the prompt and its first token, not max_tokens");
    while (rk_pipeline_n_running(p) > 0) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(r->n_out, 8 * bs);
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE), total);
    rk_pipeline_free(p);
    request_free(r);
    rk_service_close(svc);
}

Test(preempt, a_request_that_cannot_fit_alone_is_refused_as_too_large) {
    rk_service *svc = open_svc(NULL, 8);
    int bs = rk_arena_block_size(svc->arena);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *r = prepare(svc, PROMPTS[1], 8 * bs, RK_MODE_RAG);
    cr_assert_eq(rk_pipeline_admit(p, &r, 1, NULL), RK_ERR_CONTEXT);
    cr_assert(!r->finished);
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE), 8, "it took nothing");
    rk_pipeline_free(p);
    request_free(r);
    rk_service_close(svc);
}

/* ---------------------------------------------------------------- the engine thread */

typedef struct snap_log {
    pthread_mutex_t mu;
    uint64_t preemptions;
} snap_log;

static void keep_snapshot(void *ctx, const rk_cache_snapshot *s) {
    snap_log *l = ctx;
    pthread_mutex_lock(&l->mu);
    l->preemptions = s->preemptions;
    pthread_mutex_unlock(&l->mu);
}

/* Through the engine thread, step_tokens prompt tokens a step (0 = all). */
static void check_scheduler_preempts(int step_tokens) {
    rk_service *alone = open_svc(NULL, 0);
    rk_request *ref[N_REQS];
    for (int i = 0; i < N_REQS; i++) {
        ref[i] = prepare(alone, PROMPTS[i], MAX_TOKENS, RK_MODE_RAG);
        cr_assert_eq(rk_pipeline_run(alone, &ref[i], 1, NULL), RK_OK, "%s", rk_error_message());
    }
    snap_log sl = {.mu = PTHREAD_MUTEX_INITIALIZER};
    rk_config cfg = config(10);
    cfg.step_tokens = step_tokens;
    rk_scheduler_params sp = {
        .cfg = cfg, .max_queue = 16, .max_batch = 8, .publish = keep_snapshot, .stats_ctx = &sl};
    rk_scheduler *e;
    cr_assert_eq(rk_scheduler_start(&sp, &e), RK_OK);
    for (int i = 0; i < 3000 && rk_scheduler_get_state(e, NULL, 0) == RK_SCHEDULER_LOADING; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    cr_assert_eq(rk_scheduler_get_state(e, NULL, 0), RK_SCHEDULER_READY);
    rk_job jobs[N_REQS];
    for (int i = 0; i < N_REQS; i++) {
        cr_assert_eq(rk_job_init(&jobs[i]), RK_OK);
        prepare_into(rk_scheduler_service(e), PROMPTS[i], MAX_TOKENS, RK_MODE_RAG, &jobs[i].req);
        jobs[i].notify_tokens = 1;
        cr_assert_eq(rk_scheduler_submit(e, &jobs[i]), RK_OK, "%s", rk_error_message());
    }
    /* A streaming client of each: the published prefix only grows and never
     * changes. */
    for (int i = 0; i < N_REQS; i++) {
        int32_t seen[MAX_TOKENS];
        int n_seen = 0, n = 0, done = 0;
        while (!done) {
            rk_job_wait(&jobs[i], n_seen, rk_time_now() + 120, &n, &done);
            cr_assert_geq(n, n_seen, "published tokens never go back");
            pthread_mutex_lock(&jobs[i].mu);
            cr_assert_arr_eq(jobs[i].req.out_tokens, seen, (size_t)n_seen * sizeof(int32_t),
                             "published tokens never change");
            memcpy(seen + n_seen, jobs[i].req.out_tokens + n_seen,
                   (size_t)(n - n_seen) * sizeof(int32_t));
            pthread_mutex_unlock(&jobs[i].mu);
            n_seen = n;
        }
        cr_assert_eq(jobs[i].status, RK_OK, "%s", jobs[i].error);
        cr_assert_eq(n_seen, MAX_TOKENS);
        cr_assert_arr_eq(seen, ref[i]->out_tokens, MAX_TOKENS * sizeof(int32_t), "job %d", i);
    }
    int preempted = 0;
    for (int i = 0; i < N_REQS; i++) preempted += jobs[i].req.preemptions;
    cr_assert_gt(preempted, 0);
    /* The last completion published its snapshot before completing its job. */
    pthread_mutex_lock(&sl.mu);
    cr_assert_eq(sl.preemptions, (uint64_t)preempted, "the snapshot counts the preemptions");
    pthread_mutex_unlock(&sl.mu);
    for (int i = 0; i < N_REQS; i++) {
        rk_job_destroy(&jobs[i]);
        request_free(ref[i]);
    }
    rk_scheduler_free(e);
    rk_service_close(alone);
}

Test(preempt, the_scheduler_requeues_preempted_jobs_and_streams_each_token_once, .timeout = 300) {
    check_scheduler_preempts(0);
}

Test(preempt, preempted_jobs_resume_with_prompts_fed_a_few_tokens_a_step, .timeout = 300) {
    check_scheduler_preempts(5);
}

Test(preempt, cancelling_preempted_jobs_ends_them_with_the_tokens_they_had, .timeout = 300) {
    snap_log sl = {.mu = PTHREAD_MUTEX_INITIALIZER};
    rk_scheduler_params sp = {.cfg = config(10),
                              .max_queue = 16,
                              .max_batch = 8,
                              .token_delay_s = 0.002,
                              .publish = keep_snapshot,
                              .stats_ctx = &sl};
    rk_scheduler *e;
    cr_assert_eq(rk_scheduler_start(&sp, &e), RK_OK);
    for (int i = 0; i < 3000 && rk_scheduler_get_state(e, NULL, 0) == RK_SCHEDULER_LOADING; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    cr_assert_eq(rk_scheduler_get_state(e, NULL, 0), RK_SCHEDULER_READY);
    rk_job jobs[N_REQS];
    for (int i = 0; i < N_REQS; i++) {
        cr_assert_eq(rk_job_init(&jobs[i]), RK_OK);
        prepare_into(rk_scheduler_service(e), PROMPTS[i], MAX_TOKENS, RK_MODE_RAG, &jobs[i].req);
        cr_assert_eq(rk_scheduler_submit(e, &jobs[i]), RK_OK, "%s", rk_error_message());
    }
    /* Once something was preempted, cancel them all, wherever they are. */
    for (int waited = 0;; waited++) {
        pthread_mutex_lock(&sl.mu);
        uint64_t n = sl.preemptions;
        pthread_mutex_unlock(&sl.mu);
        if (n > 0) break;
        cr_assert_lt(waited, 60000, "no preemption");
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < N_REQS; i++) rk_scheduler_cancel(e, &jobs[i]);
    for (int i = 0; i < N_REQS; i++) {
        int n = 0, done = 0;
        while (!done) rk_job_wait(&jobs[i], n, rk_time_now() + 60, &n, &done);
        cr_assert_eq(n, jobs[i].ran ? jobs[i].req.n_out : 0, "what was published is the answer");
        if (jobs[i].status != RK_OK) { /* cancelled before it ever ran */
            cr_assert_eq(jobs[i].ran, 0);
            continue;
        }
        cr_assert(jobs[i].req.finish_reason == RK_FINISH_CANCELLED ||
                      jobs[i].req.n_out == MAX_TOKENS,
                  "job %d: %d tokens", i, jobs[i].req.n_out);
    }
    rk_scheduler_free(e);
    for (int i = 0; i < N_REQS; i++) rk_job_destroy(&jobs[i]);
}
