/* tests/test_scheduler.c — continuous batching: a request admitted while
 * others decode gets the tokens and logits it gets alone; a request that
 * finishes or is cancelled releases everything in the step it leaves; the
 * engine thread answers a short request while a long one generates, and a
 * request the live pool cannot hold next to the running ones waits instead
 * of failing. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pipeline/loader.h"
#include "pipeline/pipeline.h"
#include "pipeline/scheduler.h"
#include "tests/testutil.h"

#define MAX_STEPS 32

/* Logits of every step of up to two requests, by hook index. */
typedef struct logit_log {
    rk_test_log req[2];
} logit_log;

static void keep_logits(void *ctx, int req, int step, const float *logits, int n_vocab) {
    cr_assert(req >= 0 && req < 2 && step < MAX_STEPS);
    rk_test_keep_logits(((logit_log *)ctx)->req, req, step, logits, n_vocab);
}

static rk_config small_config(void) { return rk_test_config(2, 64, NULL); }

static rk_service *open_svc_steps(const char *model, int step_tokens) {
    rk_config cfg = small_config();
    cfg.step_tokens = step_tokens;
    return rk_test_service_open(&cfg, model);
}

static rk_service *open_svc(const char *model) { return open_svc_steps(model, 0); }

static rk_request *prepare(rk_service *svc, const char *prompt, int max_tokens) {
    rk_request *r = calloc(1, sizeof *r);
    rk_req_options_default(&r->opt);
    r->opt.max_tokens = max_tokens;
    r->opt.sampling.temperature = 0;
    r->opt.stop_at_eog = 0;
    rk_split sp;
    cr_assert_eq(rk_split_prompt(prompt, strlen(prompt), NULL, svc->cfg.max_chunks, &sp), RK_OK);
    cr_assert_eq(rk_request_prepare(svc, &sp, r), RK_OK, "%s", rk_error_message());
    rk_split_free(&sp);
    return r;
}

static void request_free(rk_request *r) {
    rk_request_free(r);
    free(r);
}

static const char *LONG_PROMPT = "A system prompt long enough to fill a block of sixteen tokens "
                                 "or more.##Tom had a red ball.##What did Tom have?";
static const char *SHORT_PROMPT = "Another system prompt.##The cat slept on the mat all day "
                                  "long.##Lily saw a bird.##Where did the cat sleep?";

/* The largest difference between two steps' logits, relative to their scale. */
static double rel_diff(const float *a, const float *b, int n) {
    double worst = 0, scale = 0;
    for (int i = 0; i < n; i++) {
        worst = fmax(worst, fabs((double)a[i] - b[i]));
        scale = fmax(scale, fabs((double)a[i]));
    }
    return worst / (scale > 0 ? scale : 1);
}

/* join: b joins through rk_pipeline_join, its question pass merged with a's
 * decode steps (step_tokens prompt tokens a step; 0 = all); else through
 * rk_pipeline_admit, its question pass alone. */
static void check_joining_matches_alone(const char *model, int join, int step_tokens) {
    enum { LONG_TOKENS = 24, SHORT_TOKENS = 10, JOIN_AFTER = 5 };
    /* Alone, each on its own pipeline call. */
    rk_service *alone = open_svc(model);
    logit_log la = {0}, lb = {0};
    rk_request *a = prepare(alone, LONG_PROMPT, LONG_TOKENS);
    rk_request *b = prepare(alone, SHORT_PROMPT, SHORT_TOKENS);
    rk_pipeline_hooks ha = {.ctx = &la, .on_logits = keep_logits};
    rk_pipeline_hooks hb = {.ctx = &lb, .on_logits = keep_logits};
    cr_assert_eq(rk_pipeline_run(alone, &a, 1, &ha), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_run(alone, &b, 1, &hb), RK_OK, "%s", rk_error_message());

    /* Together: b joins after a decoded JOIN_AFTER steps (fresh caches, so b's
     * chunks are computed in both runs). */
    rk_service *svc = open_svc_steps(model, step_tokens);
    logit_log lj = {0};
    rk_request *ja = prepare(svc, LONG_PROMPT, LONG_TOKENS);
    rk_request *jb = prepare(svc, SHORT_PROMPT, SHORT_TOKENS);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_pipeline_hooks hj = {.ctx = &lj, .on_logits = keep_logits};
    cr_assert_eq(rk_pipeline_admit(p, &ja, 1, &hj), RK_OK, "%s", rk_error_message());
    for (int s = 0; s < JOIN_AFTER; s++) cr_assert_eq(rk_pipeline_step(p, &hj), RK_OK);
    cr_assert_eq(ja->n_out, 1 + JOIN_AFTER);
    if (join) {
        cr_assert_eq(rk_pipeline_join(p, &jb, 1), RK_OK, "%s", rk_error_message());
        cr_assert_eq(jb->n_out, 0, "b's question waits for the step");
    } else {
        cr_assert_eq(rk_pipeline_admit(p, &jb, 1, &hj), RK_OK, "%s", rk_error_message());
    }
    cr_assert_eq(rk_pipeline_n_running(p), 2, "b joined the running batch");
    cr_assert_eq(ja->n_out, 1 + JOIN_AFTER, "admitting b decoded nothing for a");
    /* With the question pass merged: every step decodes a token for a (until
     * it is done) and feeds at most step_tokens of b's prompt work (with a
     * step budget, its chunk misses too); b's first token comes with the
     * step that feeds the last of it. */
    int left = jb->n_question, steps = 0;
    while (join && jb->n_out == 0) {
        cr_assert_eq(rk_pipeline_step(p, &hj), RK_OK);
        steps++;
        int want = 1 + JOIN_AFTER + steps < LONG_TOKENS ? 1 + JOIN_AFTER + steps : LONG_TOKENS;
        cr_assert_eq(ja->n_out, want, "a decoded in the same step");
    }
    for (int k = 0; join && step_tokens > 0 && k < jb->n_chunks; k++) left += jb->chunk_lens[k];
    if (join && step_tokens > 0)
        cr_assert_geq(steps, (left + step_tokens - 1) / step_tokens, "b's prompt took %d steps",
                      steps);
    if (join && step_tokens == 0) cr_assert_eq(steps, 1, "b's prompt went in one step");
    while (rk_pipeline_n_running(p) > 0) cr_assert_eq(rk_pipeline_step(p, &hj), RK_OK);
    cr_assert(ja->finished && jb->finished);

    cr_assert_eq(ja->n_out, LONG_TOKENS);
    cr_assert_eq(jb->n_out, SHORT_TOKENS);
    cr_assert_arr_eq(ja->out_tokens, a->out_tokens, LONG_TOKENS * sizeof(int32_t));
    cr_assert_arr_eq(jb->out_tokens, b->out_tokens, SHORT_TOKENS * sizeof(int32_t),
                     "the joining request's greedy tokens are its tokens alone");
    int n = la.req[0].n_vocab;
    for (int s = 0; s < LONG_TOKENS; s++)
        cr_assert_leq(rel_diff(lj.req[0].logits[s], la.req[0].logits[s], n), 1e-4, "a, step %d", s);
    for (int s = 0; s < SHORT_TOKENS; s++)
        cr_assert_leq(rel_diff(lj.req[1].logits[s], lb.req[0].logits[s], n), 1e-4, "b, step %d", s);
    cr_assert_eq(jb->chunk_reports[0].status, RK_CHUNK_STATUS_MISS);
    cr_assert_eq(jb->t.prefill_ms > 0, 1);

    rk_pipeline_free(p);
    request_free(a);
    request_free(b);
    request_free(ja);
    request_free(jb);
    rk_test_log_free(la.req, 2);
    rk_test_log_free(lb.req, 2);
    rk_test_log_free(lj.req, 2);
    rk_service_close(alone);
    rk_service_close(svc);
}

Test(pipeline, a_request_joining_a_running_batch_gets_its_tokens_alone) {
    check_joining_matches_alone(NULL, 0, 0); /* the embedded model */
}

Test(pipeline, a_request_joining_a_running_batch_gets_its_tokens_alone_stories260k) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_joining_matches_alone(model, 0, 0);
    free(model);
}

Test(pipeline, a_question_pass_merged_with_decode_steps_gets_the_tokens_alone) {
    check_joining_matches_alone(NULL, 1, 0);
}

Test(pipeline, a_question_fed_a_few_tokens_a_step_gets_the_tokens_alone) {
    check_joining_matches_alone(NULL, 1, 3);
}

Test(pipeline, a_question_pass_merged_with_decode_steps_gets_the_tokens_alone_stories260k) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_joining_matches_alone(model, 1, 3);
    free(model);
}

/* BF16 weights: decode rows and question rows share passes of every size,
 * all on the BF16 tile (the weights packed at load). */
Test(pipeline, a_question_pass_merged_with_decode_steps_gets_the_tokens_alone_bf16) {
    char *model = rk_test_model("qwen2-tiny", "bf16", 2);
    check_joining_matches_alone(model, 1, 3);
    check_joining_matches_alone(model, 1, 0);
    free(model);
}

/* A request whose chunks are all cached: its system tail waits for the
 * question pass, and both go in the one forward pass of the next step. */
static void all_hit_request(rk_service *svc, int join, rk_request **out) {
    rk_request *warm = prepare(svc, "First system prompt.##The cat slept on the mat.##Q?", 2);
    cr_assert_eq(rk_pipeline_run(svc, &warm, 1, NULL), RK_OK, "%s", rk_error_message());
    request_free(warm);
    rk_request *r =
        prepare(svc, "A different system prompt.##The cat slept on the mat.##Where?", 6);
    rk_radix_stats before, after;
    rk_radix_get_stats(svc->prefix, &before);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    if (join) {
        cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
        cr_assert_eq(r->chunk_reports[0].status, RK_CHUNK_STATUS_HIT);
        rk_radix_get_stats(svc->prefix, &after);
        cr_assert_eq(after.cached_tokens, before.cached_tokens, "no system token computed yet");
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
        cr_assert_eq(r->n_out, 1, "the first token came from the step");
        rk_radix_get_stats(svc->prefix, &after);
        cr_assert_gt(after.cached_tokens, before.cached_tokens,
                     "the same step computed the system");
    } else {
        cr_assert_eq(rk_pipeline_admit(p, &r, 1, NULL), RK_OK, "%s", rk_error_message());
    }
    while (rk_pipeline_n_running(p) > 0) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    rk_pipeline_free(p);
    *out = r;
}

Test(pipeline, an_all_hit_request_computes_its_system_tail_and_question_in_one_pass) {
    rk_service *alone = open_svc(NULL), *svc = open_svc(NULL);
    rk_request *ref, *r;
    all_hit_request(alone, 0, &ref);
    all_hit_request(svc, 1, &r);
    cr_assert_eq(r->n_out, 6);
    cr_assert_arr_eq(r->out_tokens, ref->out_tokens, 6 * sizeof(int32_t));
    request_free(ref);
    request_free(r);
    rk_service_close(alone);
    rk_service_close(svc);
}

/* What requests hold: live blocks in use, referenced chunk entries, tokens
 * under radix locks. */
typedef struct held {
    int live_used;
    int chunk_refs;
    uint64_t prefix_locked;
} held;

static int count_ref(void *ctx, const rk_chunk_entry *e) {
    *(int *)ctx += e->refs > 0;
    return 0;
}

static held held_now(rk_service *svc) {
    held h = {.live_used = rk_arena_pool_total(svc->arena, RK_POOL_LIVE) -
                           rk_arena_pool_free(svc->arena, RK_POOL_LIVE)};
    rk_chunk_index_foreach(svc->chunks, count_ref, &h.chunk_refs);
    rk_radix_stats rs;
    rk_radix_get_stats(svc->prefix, &rs);
    h.prefix_locked = rs.protected_tokens;
    return h;
}

/* A request that reused its chunks in place leaves beside a decoding
 * stream: its sequence goes into the radix tree a slice a step (at most 4
 * tokens a prompt token of the budget), its blocks held until then; once
 * in, the same prompt finds all of it. */
Test(pipeline, a_left_sequence_goes_into_the_radix_tree_a_slice_a_step_beside_a_stream) {
    rk_service *svc = open_svc_steps(NULL, 2);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *a = prepare(svc, LONG_PROMPT, 100);
    rk_request *b = prepare(svc, SHORT_PROMPT, 2);
    rk_request *c = prepare(svc, SHORT_PROMPT, 2);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < 200 && !b->finished; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(b->finished && !a->finished);
    cr_assert_gt(b->shared_blocks, 0, "b read its chunks in place");
    int left = rk_pipeline_inserting(p);
    cr_assert_gt(left, 2 * 4, "b's copy takes more than one step: %d tokens", left);
    while (left > 0) {
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
        int now = rk_pipeline_inserting(p);
        cr_assert(left - now > 0 && left - now <= 2 * 4, "a step copied %d tokens", left - now);
        left = now;
    }
    cr_assert_eq(rk_pipeline_join(p, &c, 1), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < 200 && !c->finished; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(c->finished);
    cr_assert_eq(c->cached_tokens, c->prompt_tokens - 1, "%d of %d", c->cached_tokens,
                 c->prompt_tokens);
    for (int i = 0; i < 2; i++) cr_assert_eq(c->out_tokens[i], b->out_tokens[i]);
    a->cancel = 1;
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    held end = held_now(svc);
    cr_assert_eq(end.live_used, 0, "every copy gave its blocks back");
    cr_assert_eq(end.prefix_locked, 0, "and its radix lock");
    rk_pipeline_free(p);
    request_free(a);
    request_free(b);
    request_free(c);
    rk_service_close(svc);
}

Test(pipeline, ending_or_cancelling_a_request_releases_everything_the_same_step) {
    rk_service *svc = open_svc(NULL);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *a = prepare(svc, LONG_PROMPT, 100);
    rk_request *b = prepare(svc, SHORT_PROMPT, 3);
    held base = held_now(svc);
    cr_assert_eq(base.live_used, 0);

    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    held with_a = held_now(svc);
    cr_assert_gt(with_a.live_used, 0);
    cr_assert_eq(with_a.chunk_refs, 1);
    cr_assert_gt(with_a.prefix_locked, 0);
    cr_assert_eq(rk_pipeline_admit(p, &b, 1, NULL), RK_OK, "%s", rk_error_message());
    held both = held_now(svc);
    cr_assert_gt(both.live_used, with_a.live_used);
    cr_assert_eq(both.chunk_refs, 3);

    /* b ends at max_tokens in its second step and leaves in that step. */
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(!b->finished);
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(b->finished, "b reached max_tokens in this step");
    cr_assert_eq(b->n_out, 3);
    cr_assert_eq(b->finish_reason, RK_FINISH_LENGTH);
    held after_b = held_now(svc);
    cr_assert_eq(after_b.live_used, with_a.live_used, "b's live blocks came back");
    cr_assert_eq(after_b.chunk_refs, with_a.chunk_refs, "b's chunk references came back");
    cr_assert_eq(after_b.prefix_locked, with_a.prefix_locked, "b's radix lock came back");
    cr_assert_eq(rk_pipeline_n_running(p), 1);

    /* a is cancelled: it leaves in the next step without another token. */
    int n_before = a->n_out;
    a->cancel = 1;
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(a->finished);
    cr_assert_eq(a->n_out, n_before);
    cr_assert_eq(a->finish_reason, RK_FINISH_CANCELLED);
    held end = held_now(svc);
    cr_assert_eq(end.live_used, 0);
    cr_assert_eq(end.chunk_refs, 0);
    cr_assert_eq(end.prefix_locked, 0);
    cr_assert_eq(rk_pipeline_n_running(p), 0);

    rk_pipeline_free(p);
    request_free(a);
    request_free(b);
    rk_service_close(svc);
}

/* ---------------------------------------------------------------- chunks in the step budget */

/* Entries in the chunk index, ready or not. */
static uint64_t entries_now(rk_service *svc) {
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    return cs.entries;
}

static uint64_t computes_now(rk_service *svc) {
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    return cs.computes;
}

/* Step p until r has its first token (at most max_steps steps); returns the
 * steps taken. */
static int steps_to_first_token(rk_pipeline *p, rk_request *r, int max_steps) {
    int n = 0;
    while (r->n_out == 0 && !r->finished && n < max_steps) {
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
        n++;
    }
    return n;
}

/* Step until the tier thread l has nothing pending: its jobs have finished
 * and been taken (a write's row committed, a read's KV placed). Waits for
 * that event, not for a count of steps: steps with nothing to run take no
 * time, so a count would end before a delayed job does. The deadline only
 * bounds a hang. Returns the steps taken. */
static int step_until_tier_done(rk_pipeline *p, rk_loader *l) {
    int steps = 0;
    double deadline = rk_time_now() + 60;
    while (rk_loader_pending(l) > 0) {
        cr_assert_lt(rk_time_now(), deadline, "the tier's jobs did not end in 60 s");
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
        if (rk_pipeline_n_running(p) == 0) rk_loader_wait(l, 0.01);
        steps++;
    }
    return steps;
}

static void step_until_idle(rk_pipeline *p) {
    for (int i = 0; i < 4000 && rk_pipeline_n_running(p) > 0; i++)
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_n_running(p), 0);
}

/* prompt's first n greedy tokens alone, on a service of its own. */
static rk_request *tokens_alone(const char *prompt, int n) {
    rk_service *alone = open_svc(NULL);
    rk_request *ref = prepare(alone, prompt, n);
    cr_assert_eq(rk_pipeline_run(alone, &ref, 1, NULL), RK_OK, "%s", rk_error_message());
    rk_service_close(alone);
    return ref;
}

static void assert_live_pool_back(rk_service *svc) {
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(svc->arena, RK_POOL_LIVE), "every live block came back");
}

static const char *SHARED_PROMPT = "A third system prompt.##The cat slept on the mat all day "
                                   "long.##Where did the cat sleep?";

/* With a step budget a chunk miss is computed a slice a step, beside the
 * running streams: a request that joins while another computes the same
 * chunk waits for that computation (the chunk is computed once) and gets
 * the tokens it gets alone. */
Test(pipeline, a_request_joining_a_chunk_in_progress_shares_it_and_gets_its_tokens_alone) {
    rk_service *svc = open_svc_steps(NULL, 3);
    rk_request *ref = tokens_alone(SHARED_PROMPT, 8);

    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *a = prepare(svc, LONG_PROMPT, 40);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    rk_request *b = prepare(svc, SHORT_PROMPT, 8);
    uint64_t computes_before = computes_now(svc);
    cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(b->n_out, 0, "b's chunks take more than one step of 3 tokens");
    int a_out = a->n_out;
    cr_assert_eq(a_out, 2, "a decoded beside b's chunk work");

    rk_request *c = prepare(svc, SHARED_PROMPT, 8);
    cr_assert_eq(rk_pipeline_join(p, &c, 1), RK_OK, "%s", rk_error_message());
    steps_to_first_token(p, c, 400);
    cr_assert_gt(c->n_out, 0);
    step_until_idle(p);
    cr_assert_eq(computes_now(svc) - computes_before, 2, "b's two chunks were computed once each");
    cr_assert_eq(c->chunk_reports[0].status, RK_CHUNK_STATUS_MISS,
                 "c waited for b's computation: not a hit");
    cr_assert_eq(c->n_out, 8);
    cr_assert_arr_eq(c->out_tokens, ref->out_tokens, 8 * sizeof(int32_t),
                     "the request that shared the chunk gets its tokens alone");
    cr_assert_eq(a->n_out, 40);
    rk_pipeline_free(p);
    request_free(ref);
    request_free(a);
    request_free(b);
    request_free(c);
    rk_service_close(svc);
}

/* In the `system` and `anchor` contexts too, a chunk miss is fed a slice
 * a step beside the running stream, straight into its entry after its
 * context (the request's system pages, fed by the steps first, or its
 * anchor token): joining computes nothing, the chunk and the system tail
 * take a step per 3 of their tokens, the stream decodes in every one, a
 * second request needing it waits for that computation (computed once),
 * and both get the tokens the request gets run alone. */
Test(pipeline, a_context_chunk_miss_is_fed_a_slice_a_step_and_shared_in_progress, .timeout = 120) {
    static const rk_chunk_context contexts[] = {RK_CONTEXT_SYSTEM, RK_CONTEXT_ANCHOR};
    for (int ci = 0; ci < 2; ci++) {
        rk_service *alone = open_svc(NULL);
        rk_request *ref = prepare(alone, SHARED_PROMPT, 8);
        ref->opt.chunk_context = contexts[ci];
        cr_assert_eq(rk_pipeline_run(alone, &ref, 1, NULL), RK_OK, "%s", rk_error_message());
        rk_service_close(alone);

        rk_service *svc = open_svc_steps(NULL, 3);
        rk_pipeline *p;
        cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
        rk_request *a = prepare(svc, LONG_PROMPT, 4000);
        cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
        uint64_t computes_before = computes_now(svc);
        rk_request *b = prepare(svc, SHARED_PROMPT, 8);
        b->opt.chunk_context = contexts[ci];
        rk_radix_stats before, after;
        rk_radix_get_stats(svc->prefix, &before);
        cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
        rk_radix_get_stats(svc->prefix, &after);
        cr_assert_eq(after.cached_tokens, before.cached_tokens,
                     "context %d: joining computed no system prompt (the steps do)", ci);
        int a_out = a->n_out;
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
        cr_assert_eq(b->n_out, 0);
        cr_assert_eq(a->n_out, a_out + 1, "a decoded in the same step");

        rk_request *c = prepare(svc, SHARED_PROMPT, 8);
        c->opt.chunk_context = contexts[ci];
        cr_assert_eq(rk_pipeline_join(p, &c, 1), RK_OK, "%s", rk_error_message());
        int steps = 1 + steps_to_first_token(p, b, 400);
        int fed = b->chunk_lens[0] + b->n_sys - b->sys_cached; /* chunk, system tail */
        cr_assert_geq(steps, (fed + 2) / 3,
                      "context %d: %d chunk and system tokens took %d steps of 3", ci, fed, steps);
        cr_assert_eq(a->n_out, a_out + steps, "context %d: a decoded in every step", ci);
        steps_to_first_token(p, c, 400);
        for (int i = 0; i < 400 && !(b->finished && c->finished); i++)
            cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
        cr_assert_eq(computes_now(svc) - computes_before, 1, "context %d: computed once", ci);
        rk_request *both[] = {b, c};
        for (int i = 0; i < 2; i++)
            cr_assert_arr_eq(both[i]->out_tokens, ref->out_tokens, 8 * sizeof(int32_t),
                             "context %d, request %d: the tokens alone", ci, i);
        a->cancel = 1;
        step_until_idle(p);
        assert_live_pool_back(svc);
        rk_pipeline_free(p);
        request_free(ref);
        request_free(a);
        request_free(b);
        request_free(c);
        rk_service_close(svc);
    }
}

static const char *TWO_CHUNK_PROMPT = "Yet another system prompt.##Ben flew a kite in the "
                                      "park.##Mia baked bread with her mother.##Who baked bread?";

/* A service whose disk tier sleeps delay_ms before every payload read (a
 * testing aid: a slow disk), with SHARED_PROMPT's and TWO_CHUNK_PROMPT's
 * chunks on disk and not in the arena. */
static rk_service *open_svc_slow_disk(int delay_ms) {
    rk_config cfg = small_config();
    cfg.step_tokens = 3;
    cfg.store_read_delay_ms = delay_ms;
    char *dir = rk_test_tmpdir("tier-load");
    snprintf(cfg.store_dir, sizeof cfg.store_dir, "%s", dir);
    free(dir);
    rk_service *svc = rk_test_service_open(&cfg, NULL);
    const char *prompts[] = {SHARED_PROMPT, TWO_CHUNK_PROMPT};
    for (int i = 0; i < 2; i++) { /* computed, so written through to the disk */
        rk_request *w = prepare(svc, prompts[i], 1);
        cr_assert_eq(rk_pipeline_run(svc, &w, 1, NULL), RK_OK, "%s", rk_error_message());
        request_free(w);
    }
    cr_assert_eq(rk_chunk_index_flush(svc->chunks), 3, "the arena forgot the three chunks");
    return svc;
}

/* Disk-tier reads run on the loader thread, not the engine thread: joining
 * returns before a delayed read ends, the running stream decodes while it
 * lasts, and the waiting request then gets the chunk from the disk (a hit,
 * nothing computed) with its tokens alone. A queued read whose request left
 * is cancelled before it runs, and every block comes back. */
Test(pipeline, a_disk_load_runs_off_the_engine_thread_while_a_stream_keeps_stepping,
     .timeout = 120) {
    rk_request *ref = tokens_alone(SHARED_PROMPT, 8);
    rk_service *svc = open_svc_slow_disk(500);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *a = prepare(svc, LONG_PROMPT, 4000);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    uint64_t computes_before = computes_now(svc);

    rk_request *r = prepare(svc, SHARED_PROMPT, 8);
    r->opt.reuse_sequences = 0;
    cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_loader_pending(svc->loader), 1, "joining returned with the read in flight");
    int a_before = a->n_out;
    step_until_tier_done(p, svc->loader);
    cr_assert_geq(a->n_out - a_before, 2, "a decoded %d tokens during the 500 ms read",
                  a->n_out - a_before);
    steps_to_first_token(p, r, 100);
    for (int i = 0; i < 100 && !r->finished; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(r->chunk_reports[0].status, RK_CHUNK_STATUS_HIT);
    cr_assert_eq(r->chunk_reports[0].source, RK_CHUNK_SOURCE_DISK);
    cr_assert_eq(computes_now(svc), computes_before, "the chunk was read, not computed");
    cr_assert_eq(r->n_out, 8);
    cr_assert_arr_eq(r->out_tokens, ref->out_tokens, 8 * sizeof(int32_t),
                     "the chunk read from the disk gives the tokens computed alone");

    /* Two reads queued, the request cancelled: the read under way finishes
     * (and caches its chunk), the queued one is dropped unread. */
    rk_request *c = prepare(svc, TWO_CHUNK_PROMPT, 8);
    c->opt.reuse_sequences = 0;
    cr_assert_eq(rk_pipeline_join(p, &c, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_loader_pending(svc->loader), 2);
    rk_loader_stats ls;
    for (int i = 0; i < 5000; i++) { /* until the first read is under way */
        rk_loader_stats_get(svc->loader, &ls);
        if (ls.queued == 1) break;
        rk_test_sleep(0.001);
    }
    cr_assert_eq(ls.queued, 1);
    c->cancel = 1;
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    step_until_tier_done(p, svc->loader);
    rk_loader_stats_get(svc->loader, &ls);
    cr_assert_eq(ls.cancelled, 1, "the queued read was dropped");
    cr_assert_eq(ls.loads, 2, "two reads ran: r's and c's first");
    cr_assert_eq(ls.bytes_in_flight, 0);
    a->cancel = 1;
    step_until_idle(p);
    assert_live_pool_back(svc);
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(cs.entries, 3, "a's chunk, r's and c's first are cached; c's second is gone: %d",
                 (int)cs.entries);
    rk_pipeline_free(p);
    request_free(ref);
    request_free(a);
    request_free(r);
    request_free(c);
    rk_service_close(svc);
}

/* Disk-tier writes run on the writer thread, not the engine thread: a
 * chunk the steps computed is written while the running stream decodes,
 * its row commits once the file is on disk, and a flush of the store waits
 * for the write under way instead of letting it bring the chunk back. */
Test(pipeline, a_disk_write_runs_off_the_engine_thread_while_a_stream_keeps_stepping,
     .timeout = 120) {
    rk_config cfg = small_config();
    cfg.step_tokens = 3;
    cfg.store_write_delay_ms = 500;
    char *dir = rk_test_tmpdir("tier-write");
    snprintf(cfg.store_dir, sizeof cfg.store_dir, "%s", dir);
    free(dir);
    rk_service *svc = rk_test_service_open(&cfg, NULL);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *a = prepare(svc, LONG_PROMPT, 4000);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    step_until_tier_done(p, svc->writer);

    rk_request *r = prepare(svc, SHARED_PROMPT, 2);
    r->opt.reuse_sequences = 0;
    cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
    steps_to_first_token(p, r, 1000);
    cr_assert_eq(r->chunk_reports[0].status, RK_CHUNK_STATUS_MISS);
    const char *key = r->chunk_reports[0].key;
    cr_assert_eq(rk_loader_pending(svc->writer), 1,
                 "the first token came with the chunk's write under way");
    int present = 1;
    cr_assert_eq(rk_store_contains(svc->store, key, &present), RK_OK);
    cr_assert_eq(present, 0, "no row before the file is on disk");
    int a_before = a->n_out;
    step_until_tier_done(p, svc->writer);
    cr_assert_geq(a->n_out - a_before, 2, "a decoded %d tokens during the 500 ms write",
                  a->n_out - a_before);
    cr_assert_eq(rk_store_contains(svc->store, key, &present), RK_OK);
    cr_assert_eq(present, 1, "the row committed once the write ended");

    /* A flush while a write is under way: the write is waited for, then
     * flushed with the rest; it does not bring its chunk back. */
    rk_request *c = prepare(svc, TWO_CHUNK_PROMPT, 2);
    c->opt.reuse_sequences = 0;
    cr_assert_eq(rk_pipeline_join(p, &c, 1), RK_OK, "%s", rk_error_message());
    steps_to_first_token(p, c, 1000);
    cr_assert_gt(rk_loader_pending(svc->writer), 0);
    rk_flush_counts fc;
    cr_assert_eq(rk_service_flush(svc, 0, 0, 1, &fc), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_loader_pending(svc->writer), 0);
    cr_assert_geq(fc.disk_rows, 4, "a's, r's and c's two chunks were flushed: %d",
                  (int)fc.disk_rows);
    for (int i = 0; i < 10; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    rk_store_counters sc;
    cr_assert_eq(rk_store_stats(svc->store, &sc), RK_OK);
    cr_assert_eq(sc.rows, 0);
    a->cancel = 1;
    step_until_idle(p);
    assert_live_pool_back(svc);
    rk_pipeline_free(p);
    request_free(a);
    request_free(r);
    request_free(c);
    rk_service_close(svc);
}

/* A request that generates nothing (max_tokens 0: it only caches its
 * prompt) leaves when it is admitted: its chunks are computed then, even
 * with a step budget, and stay cached. */
Test(pipeline, a_request_with_nothing_to_generate_still_caches_its_chunks) {
    rk_service *svc = open_svc_steps(NULL, 3);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *a = prepare(svc, LONG_PROMPT, 1000);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    rk_request *w = prepare(svc, SHARED_PROMPT, 0);
    w->opt.max_tokens = 0;
    cr_assert_eq(rk_pipeline_join(p, &w, 1), RK_OK, "%s", rk_error_message());
    cr_assert(w->finished);
    rk_request *r = prepare(svc, SHARED_PROMPT, 4);
    r->opt.reuse_sequences = 0;
    cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->chunk_reports[0].status, RK_CHUNK_STATUS_HIT, "w's chunk was cached");
    a->cancel = 1;
    step_until_idle(p);
    rk_pipeline_free(p);
    request_free(a);
    request_free(w);
    request_free(r);
    rk_service_close(svc);
}

/* A request cancelled in the middle of its chunk leaves no half-computed
 * entry: alone, the entry goes with it and every block comes back; with a
 * request waiting for the same chunk, that one carries the computation on
 * and gets its tokens alone. */
Test(pipeline, a_chunk_owner_cancelled_mid_chunk_leaves_nothing_half_computed) {
    rk_service *svc = open_svc_steps(NULL, 3);
    rk_request *ref = tokens_alone(SHARED_PROMPT, 8);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    /* a decodes throughout: the step budget applies while a stream runs. */
    rk_request *a = prepare(svc, LONG_PROMPT, 1000);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    int chunk_free = rk_arena_pool_free(svc->arena, RK_POOL_CHUNK);
    int live_free = rk_arena_pool_free(svc->arena, RK_POOL_LIVE);
    uint64_t entries = entries_now(svc);

    /* Alone: cancelled after one slice of its chunks. */
    rk_request *b = prepare(svc, SHORT_PROMPT, 8);
    cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(b->n_out, 0);
    cr_assert_gt(entries_now(svc), entries, "b's entries are pending");
    b->cancel = 1;
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(b->finished);
    cr_assert_eq(b->finish_reason, RK_FINISH_CANCELLED);
    cr_assert_eq(entries_now(svc), entries, "no half-computed entry is left");
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_CHUNK), chunk_free,
                 "every chunk block came back");
    cr_assert_leq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE), live_free);
    cr_assert_geq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE), live_free - 1,
                  "b's live blocks came back (a took at most one more)");

    /* With a waiter: b2 starts the chunk, c joins and waits, b2 is
     * cancelled, c finishes the chunk and gets its tokens alone. */
    rk_request *b2 = prepare(svc, SHORT_PROMPT, 8);
    cr_assert_eq(rk_pipeline_join(p, &b2, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    rk_request *c = prepare(svc, SHARED_PROMPT, 8);
    cr_assert_eq(rk_pipeline_join(p, &c, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(c->n_out, 0);
    b2->cancel = 1;
    for (int i = 0; i < 400 && !c->finished; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(b2->finished && c->finished);
    cr_assert_eq(c->n_out, 8);
    cr_assert_arr_eq(c->out_tokens, ref->out_tokens, 8 * sizeof(int32_t),
                     "the waiter that carried the chunk on gets its tokens alone");
    /* What is left is ready entries only: a repeat of c hits them. */
    rk_request *d = prepare(svc, SHARED_PROMPT, 8);
    d->opt.reuse_sequences = 0;
    cr_assert_eq(rk_pipeline_join(p, &d, 1), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < 400 && !d->finished; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    a->cancel = 1;
    step_until_idle(p);
    cr_assert_eq(d->chunk_reports[0].status, RK_CHUNK_STATUS_HIT);
    cr_assert_arr_eq(d->out_tokens, ref->out_tokens, 8 * sizeof(int32_t));
    assert_live_pool_back(svc);
    rk_pipeline_free(p);
    request_free(ref);
    request_free(a);
    request_free(b);
    request_free(b2);
    request_free(c);
    request_free(d);
    rk_service_close(svc);
}

/* A request preempted while its chunks are computed (the live pool ran dry
 * for a decoding request) leaves no half-computed entry either, and
 * resumes from the start of its chunks with its tokens alone. */
Test(pipeline, a_chunk_owner_preempted_mid_chunk_leaves_nothing_half_computed) {
    rk_service *svc = open_svc_steps(NULL, 1);
    rk_request *ref = tokens_alone(SHORT_PROMPT, 8);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    uint64_t entries = entries_now(svc);
    int chunk_free = rk_arena_pool_free(svc->arena, RK_POOL_CHUNK);
    rk_request *a = prepare(svc, LONG_PROMPT, 200);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    uint64_t entries_a = entries_now(svc);
    rk_request *b = prepare(svc, SHORT_PROMPT, 8);
    cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(b->n_out, 0, "b computes its chunks a token a step");
    /* Take what is left of the live pool: a's next block preempts b. */
    int n_free = rk_arena_pool_free(svc->arena, RK_POOL_LIVE);
    int32_t *taken = malloc((size_t)(n_free ? n_free : 1) * sizeof *taken);
    cr_assert_eq(rk_arena_alloc(svc->arena, RK_POOL_LIVE, n_free, taken), RK_OK);
    rk_request *back = NULL;
    for (int i = 0; i < 200 && !back; i++) {
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
        rk_pipeline_take_preempted(p, &back, 1);
    }
    cr_assert_eq(back, b, "b was preempted before its chunks were done");
    cr_assert_eq(b->n_out, 0);
    cr_assert_eq(entries_now(svc), entries_a, "b's half-computed entries are gone");
    cr_assert_eq(rk_arena_release(svc->arena, taken, n_free), RK_OK);
    free(taken);
    /* Resumed, it computes its chunks again and gets its tokens alone. */
    cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
    a->cancel = 1;
    step_until_idle(p);
    cr_assert_eq(b->n_out, 8);
    cr_assert_arr_eq(b->out_tokens, ref->out_tokens, 8 * sizeof(int32_t));
    cr_assert_eq(b->preemptions, 1);
    rk_chunk_index_flush(svc->chunks);
    cr_assert_eq(entries_now(svc), entries);
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_CHUNK), chunk_free,
                 "every chunk block came back");
    assert_live_pool_back(svc);
    rk_pipeline_free(p);
    request_free(ref);
    request_free(a);
    request_free(b);
    rk_service_close(svc);
}

/* keep_logits for the second request admitted (rank 1) only. */
static void keep_second(void *ctx, int req, int step, const float *logits, int n_vocab) {
    if (req == 1) keep_logits(ctx, 0, step, logits, n_vocab);
}

/* Run r through rk_pipeline_join and the steps (the serving path) beside a
 * decoding request (the budget applies while one decodes); r's logits go in
 * log's first row. */
static void run_joined(rk_service *svc, rk_request *r, logit_log *log) {
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_pipeline_hooks h = {.ctx = log, .on_logits = keep_second};
    rk_request *other = prepare(svc, LONG_PROMPT, 1000);
    cr_assert_eq(rk_pipeline_admit(p, &other, 1, &h), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < 4000 && !r->finished; i++)
        cr_assert_eq(rk_pipeline_step(p, &h), RK_OK, "%s", rk_error_message());
    cr_assert(r->finished);
    cr_assert(!other->finished, "r ran beside a decoding request");
    rk_pipeline_free(p);
    request_free(other);
}

static const char *STORY = "You are a storyteller.##Lily had a red ball. She liked to play with "
                           "it in the garden every day.##Tom had a big dog named Max. Max liked "
                           "to run and bark at the birds.##One day";

/* Through the steps, with step budgets of 1, 7, 64 tokens and none, the
 * first run (its chunks computed a slice a step) and the cached second run
 * equal the oracle in every context and position mode: the same greedy
 * tokens, logits within 1e-4 of their scale. */
Test(pipeline, stepped_chunks_equal_the_oracle_at_every_budget_in_every_mode, .timeout = 300) {
    enum { N = 8 };
    static const int budgets[] = {1, 7, 64, 0};
    for (int bi = 0; bi < 4; bi++) {
        /* f32 KV: the oracle's keys are not rounded where the cache's are. */
        rk_config cfg = small_config();
        cfg.step_tokens = budgets[bi];
        snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "f32");
        rk_service *svc = rk_test_service_open(&cfg, NULL);
        for (int ctx = 0; ctx < 3; ctx++)
            for (int par = 0; par < 2; par++) {
                rk_chunk_index_flush(svc->chunks);
                rk_request *r[3];
                logit_log log[3] = {0};
                for (int i = 0; i < 3; i++) {
                    r[i] = prepare(svc, STORY, N);
                    r[i]->opt.chunk_context = (rk_chunk_context)ctx;
                    r[i]->opt.positions = par ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
                    r[i]->opt.prefix_cache = 0; /* the chunk cache alone */
                }
                r[2]->opt.chunk_cache = 0; /* the oracle */
                for (int i = 0; i < 3; i++) run_joined(svc, r[i], &log[i]);
                for (int k = 0; k < r[0]->n_chunks; k++) {
                    cr_assert_eq(r[0]->chunk_reports[k].status, RK_CHUNK_STATUS_MISS);
                    cr_assert_eq(r[1]->chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
                }
                for (int i = 0; i < 2; i++) {
                    cr_assert_arr_eq(r[i]->out_tokens, r[2]->out_tokens, N * sizeof(int32_t),
                                     "budget %d ctx %d par %d run %d: tokens differ from the "
                                     "oracle",
                                     budgets[bi], ctx, par, i);
                    for (int st = 0; st < N; st++) {
                        double d = rel_diff(log[i].req[0].logits[st], log[2].req[0].logits[st],
                                            log[2].req[0].n_vocab);
                        cr_assert_leq(d, 1e-4, "budget %d ctx %d par %d run %d step %d: %g",
                                      budgets[bi], ctx, par, i, st, d);
                    }
                }
                for (int i = 0; i < 3; i++) {
                    request_free(r[i]);
                    rk_test_log_free(log[i].req, 2);
                }
            }
        cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE),
                     rk_arena_pool_total(svc->arena, RK_POOL_LIVE));
        rk_service_close(svc);
    }
}

/* ---------------------------------------------------------------- repair in the step budget */

/* f32 KV: the results compared across budgets are not rounded in the cache. */
static rk_service *open_svc_f32(int step_tokens) {
    rk_config cfg = small_config();
    cfg.step_tokens = step_tokens;
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "f32");
    rk_service *svc = rk_test_service_open(&cfg, NULL);
    return svc;
}

/* STORY with a repair policy: first_k with repair_k 2 (0), deviation at
 * ratio 0.3 (1), query at ratio 0.3 (2); the chunk cache alone. */
static rk_request *repair_request(rk_service *svc, int policy, int par, int max_tokens) {
    rk_request *r = prepare(svc, STORY, max_tokens);
    r->opt.positions = par ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
    r->opt.prefix_cache = 0;
    if (policy == 0)
        r->opt.repair_k = 2;
    else
        r->opt.repair_ratio = 0.3f;
    r->opt.repair_query = policy == 2;
    return r;
}

/* Through the steps at step budgets of 1, 7, 64 tokens and none, a
 * repairing request, its chunks computed by the steps (a miss) or found
 * (a hit), gets what it gets alone through the unbudgeted path: the same
 * greedy tokens, logits within 1e-4, the same tokens recomputed. */
Test(pipeline, stepped_repair_equals_unbudgeted_repair_at_every_budget, .timeout = 600) {
    enum { N = 8 };
    static const int budgets[] = {1, 7, 64, 0};
    rk_request *ref[3][2];
    logit_log ref_log[3][2] = {0};
    rk_service *alone = open_svc_f32(0);
    for (int pol = 0; pol < 3; pol++)
        for (int par = 0; par < 2; par++) {
            rk_chunk_index_flush(alone->chunks);
            ref[pol][par] = repair_request(alone, pol, par, N);
            rk_pipeline_hooks h = {.ctx = &ref_log[pol][par], .on_logits = keep_logits};
            cr_assert_eq(rk_pipeline_run(alone, &ref[pol][par], 1, &h), RK_OK, "%s",
                         rk_error_message());
            cr_assert_gt(ref[pol][par]->recomputed_tokens, 0);
        }
    rk_service_close(alone);
    for (int bi = 0; bi < 4; bi++) {
        rk_service *svc = open_svc_f32(budgets[bi]);
        for (int pol = 0; pol < 3; pol++)
            for (int par = 0; par < 2; par++) {
                rk_chunk_index_flush(svc->chunks);
                const rk_request *want = ref[pol][par];
                for (int hit = 0; hit < 2; hit++) {
                    rk_request *r = repair_request(svc, pol, par, N);
                    logit_log log = {0};
                    run_joined(svc, r, &log);
                    for (int k = 0; k < r->n_chunks; k++) {
                        cr_assert_eq(r->chunk_reports[k].status,
                                     hit ? RK_CHUNK_STATUS_HIT : RK_CHUNK_STATUS_MISS);
                        cr_assert_eq(r->chunk_reports[k].repaired, want->chunk_reports[k].repaired,
                                     "budget %d policy %d par %d hit %d chunk %d", budgets[bi], pol,
                                     par, hit, k);
                    }
                    cr_assert_eq(r->recomputed_tokens, want->recomputed_tokens,
                                 "budget %d policy %d par %d hit %d", budgets[bi], pol, par, hit);
                    cr_assert_gt(r->t.repair_ms, 0);
                    cr_assert_arr_eq(r->out_tokens, want->out_tokens, N * sizeof(int32_t),
                                     "budget %d policy %d par %d hit %d: tokens differ from "
                                     "the unbudgeted repair",
                                     budgets[bi], pol, par, hit);
                    for (int st = 0; st < N; st++) {
                        double d =
                            rel_diff(log.req[0].logits[st], ref_log[pol][par].req[0].logits[st],
                                     log.req[0].n_vocab);
                        cr_assert_leq(d, 1e-4, "budget %d policy %d par %d hit %d step %d: %g",
                                      budgets[bi], pol, par, hit, st, d);
                    }
                    request_free(r);
                    rk_test_log_free(log.req, 2);
                }
            }
        assert_live_pool_back(svc);
        rk_service_close(svc);
    }
    for (int pol = 0; pol < 3; pol++)
        for (int par = 0; par < 2; par++) {
            request_free(ref[pol][par]);
            rk_test_log_free(ref_log[pol][par].req, 2);
        }
}

/* Deviation repair of every chunk token, fed by the steps 7 tokens at a
 * time, gives the full-attention result (plain mode, alone). */
Test(pipeline, stepped_deviation_repair_of_every_token_gives_the_full_attention_result) {
    enum { N = 8 };
    rk_service *alone = open_svc_f32(0);
    rk_request *plain = prepare(alone, STORY, N);
    plain->opt.mode = RK_MODE_PLAIN;
    plain->opt.prefix_cache = 0;
    logit_log lp = {0};
    rk_pipeline_hooks h = {.ctx = &lp, .on_logits = keep_logits};
    cr_assert_eq(rk_pipeline_run(alone, &plain, 1, &h), RK_OK, "%s", rk_error_message());
    rk_service_close(alone);
    rk_service *svc = open_svc_f32(7);
    for (int hit = 0; hit < 2; hit++) {
        rk_request *r = repair_request(svc, 1, 0, N);
        r->opt.repair_ratio = 1;
        logit_log log = {0};
        run_joined(svc, r, &log);
        int total = 0;
        for (int k = 0; k < r->n_chunks; k++) total += r->chunk_lens[k];
        cr_assert_eq(r->recomputed_tokens, total);
        cr_assert_arr_eq(r->out_tokens, plain->out_tokens, N * sizeof(int32_t), "hit %d", hit);
        for (int st = 0; st < N; st++) {
            double d = rel_diff(log.req[0].logits[st], lp.req[0].logits[st], lp.req[0].n_vocab);
            cr_assert_leq(d, 1e-4, "hit %d step %d: %g", hit, st, d);
        }
        request_free(r);
        rk_test_log_free(log.req, 2);
    }
    assert_live_pool_back(svc);
    rk_service_close(svc);
    request_free(plain);
    rk_test_log_free(lp.req, 2);
}

/* Steps from joining beside a decoding request to r's first token; the
 * decoding request takes a token in each of them. */
static int steps_joined(rk_service *svc, rk_request *r) {
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *other = prepare(svc, LONG_PROMPT, 1000);
    cr_assert_eq(rk_pipeline_admit(p, &other, 1, NULL), RK_OK, "%s", rk_error_message());
    int before = other->n_out;
    cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(other->n_out, before, "joining decoded nothing");
    int steps = steps_to_first_token(p, r, 4000);
    cr_assert_gt(r->n_out, 0);
    cr_assert_eq(other->n_out, before + steps, "the decoding request took a token every step");
    other->cancel = r->cancel = 1;
    step_until_idle(p);
    rk_pipeline_free(p);
    request_free(other);
    return steps;
}

/* At a budget of 7 a step, a ratio policy's deviation pass over every
 * chunk token (of its 2 layers: 7 x n_layers / 2 tokens a step) and then
 * its chosen runs and the question are fed by the steps beside the
 * decoding request: the first token comes in at least as many steps as the
 * two take, with the chunks found (the pass and the runs are all that is
 * left). The query policy (policy 2) has the pass too, after its question
 * pass at admission. */
Test(pipeline, the_deviation_pass_runs_a_slice_a_step_beside_the_decoding_streams) {
    rk_service *svc = open_svc_f32(7);
    rk_request *warm = repair_request(svc, 1, 0, 1);
    cr_assert_eq(rk_pipeline_run(svc, &warm, 1, NULL), RK_OK, "%s", rk_error_message());
    request_free(warm);
    for (int policy = 1; policy <= 2; policy++) {
        rk_request *r = repair_request(svc, policy, 0, 4);
        int steps = steps_joined(svc, r);
        int chunk_tokens = 0;
        for (int k = 0; k < r->n_chunks; k++) {
            cr_assert_eq(r->chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
            chunk_tokens += r->chunk_lens[k];
        }
        int slice = 7 * (rk_model_hparams(svc->model)->n_layers / 2);
        int pass_steps = (chunk_tokens + slice - 1) / slice;
        int feed_steps = (r->recomputed_tokens + r->n_question + 6) / 7;
        cr_assert_gt(pass_steps, 1, "%d chunk tokens, %d a step", chunk_tokens, slice);
        cr_assert_geq(steps, pass_steps + feed_steps,
                      "policy %d, %d steps: %d for the pass, %d for the rest", policy, steps,
                      pass_steps, feed_steps);
        cr_assert_gt(r->t.repair_ms, 0);
        request_free(r);
    }
    assert_live_pool_back(svc);
    rk_service_close(svc);
}

/* At a budget of 7 a step, first_k's 4 tokens in each of STORY's chunks
 * (more than 7 in all) are fed by the steps beside the decoding request,
 * with the system tail and the question: its first token comes in at least
 * ceil((system + repaired + question) / 7) steps, more than without the
 * repair, whether its chunks were computed by the steps or found. */
Test(pipeline, stepped_repair_runs_a_slice_a_step_beside_the_decoding_streams) {
    rk_service *svc = open_svc_f32(7);
    for (int hit = 0; hit < 2; hit++) {
        if (!hit) rk_chunk_index_flush(svc->chunks);
        int steps[2];
        for (int repair = 0; repair < 2; repair++) {
            if (!hit) rk_chunk_index_flush(svc->chunks);
            rk_request *r = repair_request(svc, 0, 0, 4);
            r->opt.repair_k = repair ? 4 : 0;
            steps[repair] = steps_joined(svc, r);
            cr_assert_eq(r->recomputed_tokens, repair ? 4 * r->n_chunks : 0);
            cr_assert_gt(r->n_chunks * 4, 7);
            if (repair) {
                int fed = r->n_sys + r->recomputed_tokens + r->n_question;
                cr_assert_geq(steps[1], (fed + 6) / 7, "hit %d: %d steps for %d tokens", hit,
                              steps[1], fed);
            }
            request_free(r);
        }
        cr_assert_gt(steps[1], steps[0], "hit %d: the repair took steps of its own (%d vs %d)", hit,
                     steps[1], steps[0]);
    }
    assert_live_pool_back(svc);
    rk_service_close(svc);
}

/* STORY with first_k repair of repair_k tokens (prefix cache as given), its
 * first n tokens through the unbudgeted path on a service of its own. */
static rk_request *first_k_alone(int repair_k, int prefix_cache, int n) {
    rk_service *alone = open_svc_f32(0);
    rk_request *ref = repair_request(alone, 0, 0, n);
    ref->opt.repair_k = repair_k;
    ref->opt.prefix_cache = prefix_cache;
    cr_assert_eq(rk_pipeline_run(alone, &ref, 1, NULL), RK_OK, "%s", rk_error_message());
    rk_service_close(alone);
    return ref;
}

/* Cancel r before its first token: the next step finishes it, cancelled,
 * with nothing out. */
static void cancel_unanswered(rk_pipeline *p, rk_request *r) {
    r->cancel = 1;
    cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(r->finished);
    cr_assert_eq(r->finish_reason, RK_FINISH_CANCELLED);
    cr_assert_eq(r->n_out, 0);
}

/* A request cancelled while the steps feed its repair runs (a token a step)
 * leaves nothing: no half-repaired sequence in the radix tree (the same
 * request again reuses none of it and gets its tokens alone), every live
 * block back. */
Test(pipeline, a_request_cancelled_mid_repair_leaves_nothing_half_repaired) {
    enum { N = 6 };
    rk_request *ref = first_k_alone(4, 1, N);

    rk_service *svc = open_svc_f32(1);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *other = prepare(svc, LONG_PROMPT, 1000);
    cr_assert_eq(rk_pipeline_admit(p, &other, 1, NULL), RK_OK, "%s", rk_error_message());
    /* Its chunks found: the steps feed its system tail, then its repair. */
    rk_request *warm = prepare(svc, STORY, 1);
    warm->opt.prefix_cache = 0;
    cr_assert_eq(rk_pipeline_join(p, &warm, 1), RK_OK, "%s", rk_error_message());
    steps_to_first_token(p, warm, 4000);
    rk_request *r = repair_request(svc, 0, 0, N);
    r->opt.repair_k = 4;
    r->opt.prefix_cache = 1;
    cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->chunk_reports[0].status, RK_CHUNK_STATUS_HIT);
    cr_assert_eq(r->sys_cached, 0);
    for (int i = 0; i < r->n_sys + 3; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(r->n_out, 0, "still feeding its repair runs");
    cancel_unanswered(p, r);

    rk_request *again = repair_request(svc, 0, 0, N);
    again->opt.repair_k = 4;
    again->opt.prefix_cache = 1;
    cr_assert_eq(rk_pipeline_join(p, &again, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(again->sys_cached, again->n_sys, "the whole system prompt was cached");
    cr_assert_eq(again->conv_cached, 0, "nothing of the cancelled sequence was inserted");
    for (int i = 0; i < 4000 && !again->finished; i++)
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(again->n_out, N);
    cr_assert_arr_eq(again->out_tokens, ref->out_tokens, N * sizeof(int32_t));
    other->cancel = 1;
    step_until_idle(p);
    assert_live_pool_back(svc);
    rk_pipeline_free(p);
    request_free(ref);
    request_free(other);
    request_free(warm);
    request_free(r);
    request_free(again);
    rk_service_close(svc);
}

/* A query-repaired request cancelled before its deviation pass ends (its
 * question's scores waiting in its state for the pass to end) finishes
 * cancelled, and every live block comes back; what it held is freed (the
 * sanitizer build checks that). */
Test(pipeline, a_query_request_cancelled_mid_scoring_gives_everything_back) {
    rk_service *svc = open_svc_f32(1);
    rk_request *warm = repair_request(svc, 1, 0, 1);
    cr_assert_eq(rk_pipeline_run(svc, &warm, 1, NULL), RK_OK, "%s", rk_error_message());
    request_free(warm);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *other = prepare(svc, LONG_PROMPT, 1000);
    cr_assert_eq(rk_pipeline_admit(p, &other, 1, NULL), RK_OK, "%s", rk_error_message());
    rk_request *r = repair_request(svc, 2, 0, 4);
    cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->chunk_reports[0].status, RK_CHUNK_STATUS_HIT);
    /* At a token a step its system tail and its pass take many steps: its
     * runs are chosen at the pass's end. */
    for (int i = 0; i < 3; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(r->recomputed_tokens, 0, "nothing chosen yet: still scoring");
    cancel_unanswered(p, r);
    other->cancel = 1;
    step_until_idle(p);
    assert_live_pool_back(svc);
    rk_pipeline_free(p);
    request_free(other);
    request_free(r);
    rk_service_close(svc);
}

/* A request preempted while the steps feed its repair runs (the live pool
 * ran dry for a decoding request) leaves nothing half-repaired either: its
 * live blocks come back, and, joined again, it repairs from the start and
 * gets its tokens alone. */
Test(pipeline, a_request_preempted_mid_repair_resumes_with_its_tokens_alone) {
    enum { N = 6 };
    rk_request *ref = first_k_alone(4096, 0, N); /* every chunk token: a long repair */

    rk_service *svc = open_svc_f32(1);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *a = prepare(svc, LONG_PROMPT, 300);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    rk_request *b = repair_request(svc, 0, 0, N);
    b->opt.repair_k = 4096;
    cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
    /* Through its chunks (misses) and its system tail, into its repair. */
    for (int i = 0; i < 400 && b->recomputed_tokens == 0; i++)
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    for (int i = 0; i < b->n_sys + 1; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(b->n_out, 0);
    /* Take what is left of the live pool: a's next block preempts b. */
    int n_free = rk_arena_pool_free(svc->arena, RK_POOL_LIVE);
    int32_t *taken = malloc((size_t)(n_free ? n_free : 1) * sizeof *taken);
    cr_assert_eq(rk_arena_alloc(svc->arena, RK_POOL_LIVE, n_free, taken), RK_OK);
    rk_request *back = NULL;
    int steps = 0;
    for (; steps < 200 && !back; steps++) {
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
        rk_pipeline_take_preempted(p, &back, 1);
    }
    cr_assert_eq(back, b, "b was preempted before its repair was done");
    /* a's next block came within a block of steps: b had fed at most 1 +
     * bs of its repair tokens. */
    int bs = rk_arena_block_size(svc->arena);
    cr_assert_leq(steps, bs);
    cr_assert_gt(b->recomputed_tokens, 1 + bs, "preempted mid-repair");
    cr_assert_eq(b->n_out, 0);
    cr_assert_eq(rk_arena_release(svc->arena, taken, n_free), RK_OK);
    free(taken);
    cr_assert_null(b->state, "b holds nothing while it waits");
    cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < 4000 && !b->finished; i++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(b->n_out, N);
    cr_assert_eq(b->preemptions, 1);
    cr_assert_eq(b->recomputed_tokens, ref->recomputed_tokens);
    cr_assert_arr_eq(b->out_tokens, ref->out_tokens, N * sizeof(int32_t));
    a->cancel = 1;
    step_until_idle(p);
    assert_live_pool_back(svc);
    rk_pipeline_free(p);
    request_free(ref);
    request_free(a);
    request_free(b);
    rk_service_close(svc);
}

Test(pipeline, a_prompt_the_live_pool_cannot_hold_is_refused_and_the_running_ones_go_on) {
    rk_config cfg = small_config();
    cfg.live_blocks = 24;
    rk_service *alone = rk_test_service_open(&cfg, NULL), *svc = rk_test_service_open(&cfg, NULL);
    rk_request *ref = prepare(alone, LONG_PROMPT, 150);
    cr_assert_eq(rk_pipeline_run(alone, &ref, 1, NULL), RK_OK, "%s", rk_error_message());

    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request *a = prepare(svc, LONG_PROMPT, 150);
    cr_assert_eq(rk_pipeline_admit(p, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    /* a takes live blocks as it decodes. */
    for (int s = 0; s < 100; s++) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    held with_a = held_now(svc);
    int bs = rk_arena_block_size(svc->arena);
    int free_blocks = rk_arena_pool_free(svc->arena, RK_POOL_LIVE);
    /* b's prompt alone needs more blocks than are free (but fits the pool). */
    int n_q = (free_blocks + 1) * bs;
    int32_t *q = malloc((size_t)n_q * sizeof *q);
    for (int i = 0; i < n_q; i++) q[i] = 3 + i % 200;
    rk_request *b = calloc(1, sizeof *b);
    rk_req_options_default(&b->opt);
    b->opt.max_tokens = 4;
    b->opt.sampling.temperature = 0;
    cr_assert_eq(rk_request_prepare_tokens(svc, NULL, 0, q, n_q, b), RK_OK, "%s",
                 rk_error_message());
    free(q);
    cr_assert_eq(rk_pipeline_admit(p, &b, 1, NULL), RK_ERR_EXHAUSTED, "%s", rk_error_message());
    cr_assert(!b->finished);
    held after = held_now(svc);
    cr_assert_eq(after.live_used, with_a.live_used, "b took nothing from the live pool");
    cr_assert_eq(after.chunk_refs, with_a.chunk_refs);
    cr_assert_eq(after.prefix_locked, with_a.prefix_locked);
    cr_assert_eq(rk_pipeline_n_running(p), 1);

    while (rk_pipeline_n_running(p) > 0) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert_eq(a->n_out, 150);
    cr_assert_arr_eq(a->out_tokens, ref->out_tokens, 150 * sizeof(int32_t),
                     "the running request went on as if alone");
    /* With a gone, b fits. */
    cr_assert_eq(rk_pipeline_admit(p, &b, 1, NULL), RK_OK, "%s", rk_error_message());
    while (rk_pipeline_n_running(p) > 0) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    cr_assert(b->finished);
    cr_assert_eq(held_now(svc).live_used, 0);

    rk_pipeline_free(p);
    request_free(ref);
    request_free(a);
    request_free(b);
    rk_service_close(alone);
    rk_service_close(svc);
}

/* ---------------------------------------------------------------- the engine thread */

static rk_scheduler *start(const rk_config *cfg, double token_delay_s, int max_batch) {
    rk_scheduler_params sp = {
        .cfg = *cfg, .max_queue = 16, .max_batch = max_batch, .token_delay_s = token_delay_s};
    rk_scheduler *e;
    cr_assert_eq(rk_scheduler_start(&sp, &e), RK_OK);
    for (int i = 0; i < 3000 && rk_scheduler_get_state(e, NULL, 0) == RK_SCHEDULER_LOADING; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    cr_assert_eq(rk_scheduler_get_state(e, NULL, 0), RK_SCHEDULER_READY);
    return e;
}

static void submit(rk_scheduler *e, rk_job *j, const char *prompt, int max_tokens) {
    cr_assert_eq(rk_job_init(j), RK_OK);
    rk_service *svc = rk_scheduler_service(e);
    rk_request *r = prepare(svc, prompt, max_tokens);
    j->req = *r;
    j->notify_tokens = 1; /* wake rk_job_wait at every token */
    free(r);
    cr_assert_eq(rk_scheduler_submit(e, j), RK_OK, "%s", rk_error_message());
}

static void wait_done(rk_job *j) {
    int n = 0, done = 0;
    while (!done) rk_job_wait(j, n, rk_time_now() + 60, &n, &done);
}

Test(scheduler, a_short_request_finishes_while_a_long_one_generates, .timeout = 120) {
    rk_config cfg = small_config();
    rk_scheduler *e = start(&cfg, 0.005, 8);
    rk_job lj, sj;
    submit(e, &lj, LONG_PROMPT, 400); /* 2 s of steps at 5 ms each */
    int n = 0, done = 0;
    rk_job_wait(&lj, 0, rk_time_now() + 60, &n, &done);
    cr_assert(n >= 1 && !done, "the long request is generating");
    submit(e, &sj, SHORT_PROMPT, 1);
    wait_done(&sj);
    cr_assert_eq(sj.status, RK_OK, "%s", sj.error);
    cr_assert_eq(sj.req.n_out, 1);
    pthread_mutex_lock(&lj.mu);
    int long_done = lj.done, long_tokens = lj.n_tokens;
    pthread_mutex_unlock(&lj.mu);
    cr_assert(!long_done && long_tokens < 400,
              "the short request waited for the long one (%d tokens)", long_tokens);
    rk_scheduler_cancel(e, &lj);
    wait_done(&lj);
    cr_assert_eq(lj.req.finish_reason, RK_FINISH_CANCELLED);
    rk_job_destroy(&lj);
    rk_job_destroy(&sj);
    rk_scheduler_free(e);
}

Test(scheduler, a_request_the_live_pool_cannot_hold_yet_waits_instead_of_failing, .timeout = 120) {
    rk_config cfg = small_config();
    /* Room for one request of 200 tokens at a time, not two. */
    cfg.live_blocks = 20;
    rk_scheduler *e = start(&cfg, 0.002, 8);
    rk_job first, second, huge;
    submit(e, &first, LONG_PROMPT, 200);
    int n = 0, done = 0;
    rk_job_wait(&first, 0, rk_time_now() + 60, &n, &done);
    submit(e, &second, SHORT_PROMPT, 200);
    wait_done(&second);
    cr_assert_eq(second.status, RK_OK, "%s", second.error);
    cr_assert_eq(second.req.n_out, 200);
    pthread_mutex_lock(&first.mu);
    cr_assert(first.done, "the second request ran after the first released its blocks");
    pthread_mutex_unlock(&first.mu);
    cr_assert_eq(first.status, RK_OK, "%s", first.error);
    /* One that cannot fit even alone fails: context length exceeded. */
    submit(e, &huge, SHORT_PROMPT, 400);
    wait_done(&huge);
    cr_assert_eq(huge.status, RK_ERR_CONTEXT, "%s", huge.error);
    rk_job_destroy(&first);
    rk_job_destroy(&second);
    rk_job_destroy(&huge);
    rk_scheduler_free(e);
}

/* ================================================================ prompt log-probabilities */

/* A prompt of more tokens than one pass computes log-probability rows for
 * on a model with Qwen3's vocabulary (RK_PROMPT_LOGITS_BYTES: about 55 rows
 * of 151,936 logits), so the prompt goes over several passes. */
static const char *SCORED_PROMPT =
    "Once upon a time there was a little girl named Lily who lived in a small house near the "
    "woods with her mother, her father and a big brown dog called Max. Every morning she walked "
    "to the river to watch the ducks swim, and every evening she told her mother about the "
    "birds, the fish and the frogs she had seen on the way.";

static rk_request *prepare_scored(rk_service *svc, int max_tokens, int k, int scored) {
    rk_request *r = calloc(1, sizeof *r);
    rk_req_options_default(&r->opt);
    r->opt.max_tokens = max_tokens;
    r->opt.sampling.temperature = 0;
    r->opt.n_logprobs = k;
    r->opt.prompt_logprobs = scored;
    rk_split sp;
    cr_assert_eq(rk_split_prompt(SCORED_PROMPT, strlen(SCORED_PROMPT), NULL, 4, &sp), RK_OK);
    cr_assert_eq(rk_request_prepare(svc, &sp, r), RK_OK, "%s", rk_error_message());
    rk_split_free(&sp);
    return r;
}

/* Log-probabilities computed in passes of other shapes agree to rounding:
 * within 1e-4 of their size (at least 1e-4). */
static int lp_close(float a, float b) { return fabsf(a - b) <= 1e-4f * fmaxf(1.0f, fabsf(b)); }

static int32_t forced;
static int32_t force_one(void *ctx, int req, int step) {
    (void)ctx, (void)req, (void)step;
    return forced;
}

/* The oracle of entry j: the prompt's first j tokens as a request of their
 * own whose one token is forced to token j: its reported log-probability
 * and top k (the sampler's) are what entry j must hold. */
static void check_entry_against_one_step(rk_service *svc, const rk_request *r, int j) {
    int k = r->opt.n_logprobs;
    rk_request *o = calloc(1, sizeof *o);
    rk_req_options_default(&o->opt);
    o->opt.max_tokens = 1;
    o->opt.sampling.temperature = 0;
    o->opt.n_logprobs = k;
    o->opt.prefix_cache = 0;
    cr_assert_eq(r->n_sys, 0, "the Qwen3 vocabulary has no BOS");
    cr_assert_eq(rk_request_prepare_tokens(svc, NULL, 0, r->question, j, o), RK_OK, "%s",
                 rk_error_message());
    forced = r->question[j];
    rk_pipeline_hooks h = {.force_token = force_one};
    cr_assert_eq(rk_pipeline_run(svc, &o, 1, &h), RK_OK, "%s", rk_error_message());
    cr_assert_eq(o->out_tokens[0], forced);
    cr_assert(lp_close(r->prompt_logprobs[j], o->logprobs[0]), "entry %d: %g, alone %g", j,
              r->prompt_logprobs[j], o->logprobs[0]);
    for (int t = 0; t < k; t++) {
        cr_assert_eq(r->prompt_top_ids[(size_t)j * k + t], o->top_ids[t], "entry %d, top %d", j, t);
        cr_assert(lp_close(r->prompt_top_logprobs[(size_t)j * k + t], o->top_logprobs[t]));
        if (t)
            cr_assert_leq(r->prompt_top_logprobs[(size_t)j * k + t],
                          r->prompt_top_logprobs[(size_t)j * k + t - 1]);
    }
    request_free(o);
}

/* Every prompt token's log-probability given the tokens before it, over
 * passes of a bounded number of logits rows, is the one a request of those
 * tokens alone reports for it; the first has none; several such prompts in
 * one admission and max_tokens 0 give the same; and the generated tokens
 * are those of the same prompt without the prompt's log-probabilities. */
Test(pipeline, a_prompts_log_probabilities_over_several_passes_equal_each_prefix_alone,
     .timeout = 300) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    enum { K = 3, GEN = 4 };
    rk_service *svc = open_svc(model);
    rk_request *r = prepare_scored(svc, GEN, K, 1);
    int n = r->n_sys + r->n_question;
    cr_assert_gt(n, 60, "the prompt has %d tokens", n);
    cr_assert_eq(rk_pipeline_run(svc, &r, 1, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->n_out, GEN);
    cr_assert(isnan(r->prompt_logprobs[0]), "nothing comes before the first token");
    cr_assert_eq(r->prompt_top_ids[0], -1);
    for (int j = 1; j < n; j++) cr_assert(isfinite(r->prompt_logprobs[j]), "entry %d", j);
    int js[] = {1, 2, 54, 55, 56, n - 1};
    for (size_t i = 0; i < sizeof js / sizeof js[0]; i++)
        check_entry_against_one_step(svc, r, js[i]);

    /* The same prompt without its log-probabilities generates the same tokens. */
    rk_request *plain = prepare_scored(svc, GEN, K, 0);
    cr_assert_eq(rk_pipeline_run(svc, &plain, 1, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_arr_eq(plain->out_tokens, r->out_tokens, GEN * sizeof(int32_t));
    cr_assert_null(plain->prompt_logprobs);

    /* Two in one admission (the second waits for rows the first took) and
     * one with max_tokens 0: the same entries; nothing generated there. */
    rk_request *two[] = {prepare_scored(svc, GEN, K, 1), prepare_scored(svc, 0, K, 1)};
    cr_assert_eq(rk_pipeline_run(svc, two, 2, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(two[1]->n_out, 0);
    cr_assert_eq(two[1]->finish_reason, RK_FINISH_LENGTH);
    for (int q = 0; q < 2; q++)
        for (int j = 1; j < n; j++) {
            cr_assert(lp_close(two[q]->prompt_logprobs[j], r->prompt_logprobs[j]),
                      "request %d, entry %d", q, j);
            cr_assert_eq(two[q]->prompt_top_ids[(size_t)j * K], r->prompt_top_ids[(size_t)j * K]);
        }
    cr_assert_arr_eq(two[0]->out_tokens, r->out_tokens, GEN * sizeof(int32_t));
    request_free(two[0]);
    request_free(two[1]);
    request_free(plain);
    request_free(r);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
    free(model);
}

/* Joined beside a decoding stream with a step budget of a few tokens, the
 * prompt's rows come a slice a step and equal those computed alone. */
Test(pipeline, a_prompts_log_probabilities_fed_a_few_tokens_a_step_equal_them_alone,
     .timeout = 300) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    enum { K = 2, STEP = 7 };
    rk_service *alone = open_svc(model);
    rk_request *a = prepare_scored(alone, 2, K, 1);
    cr_assert_eq(rk_pipeline_run(alone, &a, 1, NULL), RK_OK, "%s", rk_error_message());
    int n = a->n_sys + a->n_question;

    rk_service *svc = open_svc_steps(model, STEP);
    rk_request *stream = prepare(svc, LONG_PROMPT, 60), *b = prepare_scored(svc, 2, K, 1);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    cr_assert_eq(rk_pipeline_admit(p, &stream, 1, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_join(p, &b, 1), RK_OK, "%s", rk_error_message());
    int steps = 0;
    while (b->n_out == 0) {
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
        steps++;
    }
    cr_assert_geq(steps, (n + STEP - 1) / STEP, "the prompt took %d steps", steps);
    while (rk_pipeline_n_running(p) > 0) cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    for (int j = 1; j < n; j++) {
        cr_assert(lp_close(b->prompt_logprobs[j], a->prompt_logprobs[j]), "entry %d: %g, %g", j,
                  b->prompt_logprobs[j], a->prompt_logprobs[j]);
        for (int t = 0; t < K; t++)
            cr_assert_eq(b->prompt_top_ids[(size_t)j * K + t],
                         a->prompt_top_ids[(size_t)j * K + t]);
    }
    cr_assert_arr_eq(b->out_tokens, a->out_tokens, 2 * sizeof(int32_t));
    rk_pipeline_free(p);
    request_free(stream);
    request_free(b);
    request_free(a);
    rk_service_close(alone);
    rk_service_close(svc);
    free(model);
}
