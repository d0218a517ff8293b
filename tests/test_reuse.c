/* tests/test_reuse.c — whole-sequence prefix reuse: a finished request's
 * merged sequence (system, chunks as they sit in the live sequence, question,
 * generated tokens) goes into the radix tree, and a later request sharing a
 * prefix of it computes only what follows; blocks move from the live pool to
 * the prefix pool on the way. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/report.h"
#include "pipeline/pipeline.h"
#include "tests/testutil.h"

/* ---------------------------------------------------------------- retagging */

Test(reuse, retag_moves_blocks_between_pools_and_keeps_their_sizes) {
    rk_backend *be;
    rk_arena *a;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_arena_params p = {.n_layers = 1,
                         .n_kv_heads = 1,
                         .head_dim = 4,
                         .block_size = 8,
                         .dtype = RK_DTYPE_F32,
                         .pool_blocks = {4, 2, 1}};
    cr_assert_eq(rk_arena_create(be, &p, &a), RK_OK);
    int32_t live[4], pre;
    cr_assert_eq(rk_arena_alloc(a, RK_POOL_LIVE, 4, live), RK_OK);
    /* Three to move, two free prefix blocks: nothing moves. */
    cr_assert_eq(rk_arena_retag(a, live, 3, RK_POOL_PREFIX), RK_ERR_EXHAUSTED);
    for (int i = 0; i < 4; i++) cr_assert_eq(rk_arena_block_pool(a, live[i]), RK_POOL_LIVE);
    cr_assert_eq(rk_arena_pool_free(a, RK_POOL_PREFIX), 2);
    cr_assert_eq(rk_arena_retag(a, live, 2, RK_POOL_PREFIX), RK_OK);
    cr_assert_eq(rk_arena_block_pool(a, live[0]), RK_POOL_PREFIX);
    cr_assert_eq(rk_arena_block_pool(a, live[1]), RK_POOL_PREFIX);
    cr_assert_eq(rk_arena_refcount(a, live[0]), 1, "references are kept");
    /* The prefix pool's spare blocks joined the live pool, free. */
    cr_assert_eq(rk_arena_pool_free(a, RK_POOL_PREFIX), 0);
    cr_assert_eq(rk_arena_pool_free(a, RK_POOL_LIVE), 2);
    int32_t two[2];
    cr_assert_eq(rk_arena_alloc(a, RK_POOL_LIVE, 2, two), RK_OK);
    for (int i = 0; i < 2; i++) cr_assert_eq(rk_arena_block_pool(a, two[i]), RK_POOL_LIVE);
    cr_assert_eq(rk_arena_alloc(a, RK_POOL_PREFIX, 1, &pre), RK_ERR_EXHAUSTED);
    /* Already there: no move needed, nothing free needed. */
    cr_assert_eq(rk_arena_retag(a, live, 2, RK_POOL_PREFIX), RK_OK);
    /* A retagged block returns to its new pool. */
    cr_assert_eq(rk_arena_release(a, live, 4), RK_OK);
    cr_assert_eq(rk_arena_release(a, two, 2), RK_OK);
    for (int i = 0; i < RK_POOL_COUNT; i++)
        cr_assert_eq(rk_arena_pool_free(a, (rk_pool_tag)i), p.pool_blocks[i]);
    cr_assert_eq(rk_arena_retag(a, live, 1, RK_POOL_PREFIX), RK_ERR_INTERNAL,
                 "a free block cannot move");
    rk_arena_free(a);
    rk_backend_free(be);
}

/* ---------------------------------------------------------------- requests */

#define STEPS 8

/* Max |a - b| over every step's logits, relative to the step's largest |logit|. */
static double logit_error(const rk_test_log *a, const rk_test_log *b) {
    double worst = 0;
    for (int s = 0; s < STEPS; s++) {
        double scale = 0, d = 0;
        for (int i = 0; i < a->n_vocab; i++) scale = fmax(scale, fabs(a->logits[s][i]));
        for (int i = 0; i < a->n_vocab; i++)
            d = fmax(d, fabs((double)a->logits[s][i] - b->logits[s][i]));
        worst = fmax(worst, d / fmax(1.0, scale));
    }
    return worst;
}

/* reindex: "copy" or "zero-copy" (a zero-copy sequence goes into the tree
 * as a copy of its runs, and a match that reaches the question takes the
 * copy path with every chunk in the prefix). */
static rk_service *open_svc(const char *model, int prefix_cache, const char *reindex) {
    /* The exactness bounds are f32's; f16 (the default) is checked on its own. */
    rk_config cfg = rk_test_config(2, 64, "f32");
    cfg.prefix_cache = prefix_cache;
    snprintf(cfg.reindex, sizeof cfg.reindex, "%s", reindex);
    return rk_test_service_open(&cfg, model);
}

static rk_req_options greedy(rk_req_mode mode) {
    rk_req_options o;
    rk_req_options_default(&o);
    o.mode = mode;
    o.max_tokens = STEPS;
    o.sampling.temperature = 0;
    o.stop_at_eog = 0;
    return o;
}

static void prepare(rk_service *svc, const char *prompt, const rk_req_options *o, rk_request *r) {
    rk_split sp;
    memset(r, 0, sizeof *r);
    r->opt = *o;
    cr_assert_eq(rk_split_prompt(prompt, strlen(prompt), NULL, svc->cfg.max_chunks, &sp), RK_OK);
    cr_assert_eq(rk_request_prepare(svc, &sp, r), RK_OK, "%s", rk_error_message());
    rk_split_free(&sp);
}

/* Chunk tokens the chunk cache gave (reindexed), less what repair recomputed. */
static int chunk_hit_tokens(const rk_request *r) {
    int n = 0;
    for (int k = 0; k < r->n_chunks; k++)
        if (r->chunk_reports[k].status == RK_CHUNK_STATUS_HIT &&
            r->chunk_reports[k].source != RK_CHUNK_SOURCE_PREFIX)
            n += r->chunk_lens[k] - r->chunk_reports[k].repaired;
    return n;
}

/* Run r; check the usage invariants and that the report's ragkv.reused
 * splits usage's cached_tokens. */
static void run(rk_service *svc, rk_request *r, rk_test_log *log) {
    rk_pipeline_hooks h = {.ctx = log, .on_logits = log ? rk_test_keep_logits : NULL};
    cr_assert_eq(rk_pipeline_run(svc, &r, 1, &h), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->n_out, STEPS);
    cr_assert_eq(r->cached_tokens + r->computed_tokens, r->prompt_tokens);
    json_t *usage = rk_report_usage(r), *rag = rk_report_ragkv(r);
    cr_assert_not_null(usage);
    cr_assert_not_null(rag);
    json_t *reused = json_object_get(rag, "reused");
    long long prefix = json_integer_value(json_object_get(reused, "prefix"));
    long long chunks = json_integer_value(json_object_get(reused, "chunks"));
    long long conv = json_integer_value(json_object_get(reused, "conversation"));
    cr_assert_eq(prefix, r->sys_cached);
    cr_assert_eq(chunks, chunk_hit_tokens(r));
    cr_assert_eq(conv, r->conv_cached);
    cr_assert_eq(prefix + chunks + conv,
                 json_integer_value(json_object_get(json_object_get(usage, "prompt_tokens_details"),
                                                    "cached_tokens")));
    json_decref(usage);
    json_decref(rag);
}

static const char *STORY =
    "You are a storyteller.##Lily had a red ball. She liked to play with it in the garden every "
    "day.##Tom had a big dog named Max. Max liked to run and bark at the birds.##The sun was warm "
    "and the sky was blue.##Tell me what Lily did one day";

/* The request configurations whose KV differs. */
static rk_req_options config(int i) {
    rk_req_options o = greedy(i == 4 ? RK_MODE_PLAIN : RK_MODE_RAG);
    if (i == 1) {
        o.chunk_context = RK_CONTEXT_SYSTEM;
        o.positions = RK_POSITIONS_PARALLEL;
    }
    if (i == 2) o.repair_k = 3;
    if (i == 3) o.chunk_cache = 0; /* the oracle */
    return o;
}
#define N_CONFIGS 5

/* Run a check on the copy path and on the zero-copy path. */
static void on_both_paths(void (*check)(const char *model, const char *reindex),
                          const char *model) {
    check(model, "copy");
    check(model, "zero-copy");
}

/* An exact repeat computes its last prompt token only, and gives what a
 * service without the prefix cache gives. */
static void check_exact_repeat(const char *model, const char *reindex) {
    rk_service *svc = open_svc(model, 1, reindex), *off = open_svc(model, 0, reindex);
    for (int c = 0; c < N_CONFIGS; c++) {
        rk_req_options o = config(c);
        rk_request ref, first, second;
        rk_test_log lref = {0}, l1 = {0}, l2 = {0};
        prepare(off, STORY, &o, &ref);
        prepare(svc, STORY, &o, &first);
        prepare(svc, STORY, &o, &second);
        run(off, &ref, &lref);
        run(svc, &first, &l1);
        run(svc, &second, &l2);
        cr_assert_eq(first.conv_cached, 0, "config %d", c);
        cr_assert_eq(second.computed_tokens, 1, "config %d: %d computed", c,
                     second.computed_tokens);
        cr_assert_eq(second.sys_cached, second.n_sys);
        cr_assert_eq(second.conv_cached, second.prompt_tokens - 1 - second.n_sys);
        for (int k = 0; k < second.n_chunks && o.mode == RK_MODE_RAG; k++) {
            cr_assert_eq(second.chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
            cr_assert_eq(second.chunk_reports[k].source, RK_CHUNK_SOURCE_PREFIX);
        }
        cr_assert_eq(memcmp(ref.out_tokens, second.out_tokens, STEPS * sizeof(int32_t)), 0,
                     "config %d", c);
        cr_assert_eq(memcmp(ref.out_tokens, first.out_tokens, STEPS * sizeof(int32_t)), 0);
        double d = logit_error(&lref, &l2);
        cr_assert_leq(d, 1e-4, "config %d: logits differ by %g of their scale", c, d);
        rk_request_free(&ref);
        rk_request_free(&first);
        rk_request_free(&second);
        rk_test_log_free(&lref, 1);
        rk_test_log_free(&l1, 1);
        rk_test_log_free(&l2, 1);
    }
    rk_test_check_all_released(svc);
    rk_service_close(svc);
    rk_service_close(off);
}

Test(reuse, tiny_an_exact_repeat_computes_one_token) { on_both_paths(check_exact_repeat, NULL); }

Test(reuse, stories260k_an_exact_repeat_computes_one_token) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    on_both_paths(check_exact_repeat, model);
    free(model);
}

/* Two questions that differ only in their last word: the second reuses
 * everything before the first token where they differ. */
static void check_last_word(const char *model, const char *reindex) {
    rk_service *svc = open_svc(model, 1, reindex), *off = open_svc(model, 0, reindex);
    const char *other = "You are a storyteller.##Lily had a red ball. She liked to play with it "
                        "in the garden every day.##Tom had a big dog named Max. Max liked to run "
                        "and bark at the birds.##The sun was warm and the sky was blue.##Tell me "
                        "what Lily did one night";
    for (int c = 0; c < N_CONFIGS; c++) {
        rk_req_options o = config(c);
        rk_request ref, first, second;
        rk_test_log lref = {0}, l1 = {0}, l2 = {0};
        prepare(off, other, &o, &ref);
        prepare(svc, STORY, &o, &first);
        prepare(svc, other, &o, &second);
        run(off, &ref, &lref);
        run(svc, &first, &l1);
        run(svc, &second, &l2);
        int same = 0;
        while (same < first.n_question && same < second.n_question &&
               first.question[same] == second.question[same])
            same++;
        cr_assert_lt(same, second.n_question);
        cr_assert_eq(second.computed_tokens, second.n_question - same, "config %d", c);
        cr_assert_eq(memcmp(ref.out_tokens, second.out_tokens, STEPS * sizeof(int32_t)), 0,
                     "config %d", c);
        double d = logit_error(&lref, &l2);
        cr_assert_leq(d, 1e-4, "config %d: logits differ by %g of their scale", c, d);
        rk_request_free(&ref);
        rk_request_free(&first);
        rk_request_free(&second);
        rk_test_log_free(&lref, 1);
        rk_test_log_free(&l1, 1);
        rk_test_log_free(&l2, 1);
    }
    rk_test_check_all_released(svc);
    rk_service_close(svc);
    rk_service_close(off);
}

Test(reuse, tiny_a_question_differing_in_its_last_word_reuses_the_rest) {
    on_both_paths(check_last_word, NULL);
}

Test(reuse, stories260k_a_question_differing_in_its_last_word_reuses_the_rest) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    on_both_paths(check_last_word, model);
    free(model);
}

/* Replace r's question by q + the answer of an earlier request + extra. */
static void extend_question(rk_request *r, const rk_request *earlier, const int32_t *extra,
                            int n_extra) {
    int n = earlier->n_question + earlier->n_out + n_extra;
    int32_t *q = malloc((size_t)n * sizeof *q);
    cr_assert_not_null(q);
    memcpy(q, earlier->question, (size_t)earlier->n_question * sizeof *q);
    memcpy(q + earlier->n_question, earlier->out_tokens, (size_t)earlier->n_out * sizeof *q);
    memcpy(q + earlier->n_question + earlier->n_out, extra, (size_t)n_extra * sizeof *q);
    free(r->question);
    r->question = q;
    r->n_question = n;
}

/* A follow-up whose prompt is the first request's prompt, its answer and new
 * tokens computes only the new tokens (and the answer's last one, which the
 * first request sampled but never fed). */
static void check_follow_up(const char *model, const char *reindex) {
    rk_service *svc = open_svc(model, 1, reindex), *off = open_svc(model, 0, reindex);
    const int32_t extra[3] = {5, 9, 14};
    for (int c = 0; c < N_CONFIGS; c++) {
        rk_req_options o = config(c);
        rk_request ref, first, second;
        rk_test_log lref = {0}, l1 = {0}, l2 = {0};
        prepare(svc, STORY, &o, &first);
        run(svc, &first, &l1);
        prepare(off, STORY, &o, &ref);
        prepare(svc, STORY, &o, &second);
        extend_question(&ref, &first, extra, 3);
        extend_question(&second, &first, extra, 3);
        run(off, &ref, &lref);
        run(svc, &second, &l2);
        cr_assert_eq(second.computed_tokens, 1 + 3, "config %d: %d computed", c,
                     second.computed_tokens);
        cr_assert_eq(second.conv_cached, first.prompt_tokens + STEPS - 1 - first.n_sys);
        cr_assert_eq(memcmp(ref.out_tokens, second.out_tokens, STEPS * sizeof(int32_t)), 0,
                     "config %d", c);
        double d = logit_error(&lref, &l2);
        cr_assert_leq(d, 1e-4, "config %d: logits differ by %g of their scale", c, d);
        rk_request_free(&ref);
        rk_request_free(&first);
        rk_request_free(&second);
        rk_test_log_free(&lref, 1);
        rk_test_log_free(&l1, 1);
        rk_test_log_free(&l2, 1);
    }
    rk_test_check_all_released(svc);
    rk_service_close(svc);
    rk_service_close(off);
}

Test(reuse, tiny_a_follow_up_computes_only_its_new_tokens) { on_both_paths(check_follow_up, NULL); }

Test(reuse, stories260k_a_follow_up_computes_only_its_new_tokens) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    on_both_paths(check_follow_up, model);
    free(model);
}

Test(reuse, qwen3moe_tiny_an_exact_repeat_and_a_follow_up_compute_only_their_new_tokens) {
    char *model = rk_test_model("qwen3moe-tiny", "f32", 1);
    on_both_paths(check_exact_repeat, model);
    on_both_paths(check_follow_up, model);
    free(model);
}

/* Sliding windows (gemma3-micro: window 16 with the local RoPE, a global
 * layer; gemma2-tiny: window 16, soft caps; gemma4-tiny: window 16, layers
 * reusing an earlier layer's KV): a repeat, a changed last word
 * and a follow-up reuse the stored sequence and give what a service without
 * sequence reuse gives, in every configuration, on both reindex paths. */
Test(reuse, gemma_sequences_are_reused_exactly) {
    const char *presets[3] = {"gemma3-micro", "gemma2-tiny", "gemma4-tiny"};
    for (int p = 0; p < 3; p++) {
        char *model = rk_test_model(presets[p], "f32", 8);
        on_both_paths(check_exact_repeat, model);
        on_both_paths(check_last_word, model);
        on_both_paths(check_follow_up, model);
        free(model);
    }
}

/* Segment boundaries and the request's mode are part of what matches: the
 * same text as plain, or with its chunks split differently, shares only the
 * system prompt (plain: nothing, another namespace). */
Test(reuse, the_same_tokens_segmented_differently_never_match) {
    rk_service *svc = open_svc(NULL, 1, "copy");
    rk_req_options rag = greedy(RK_MODE_RAG), plain = greedy(RK_MODE_PLAIN);
    rk_request a, b, p;
    prepare(svc, "A story.##Lily had a ball.##Tom had a dog.##What now", &rag, &a);
    prepare(svc, "A story.##Lily had a ball.Tom had a dog.##What now", &rag, &b);
    prepare(svc, "A story.##Lily had a ball.##Tom had a dog.##What now", &plain, &p);
    run(svc, &a, NULL);
    run(svc, &b, NULL);
    run(svc, &p, NULL);
    cr_assert_eq(b.sys_cached, b.n_sys);
    cr_assert_eq(b.conv_cached, 0, "a chunk boundary moved: nothing past the system matches");
    cr_assert_eq(p.sys_cached + p.conv_cached, 0);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_request_free(&p);
    rk_test_check_all_released(svc);
    rk_service_close(svc);
}

/* With reuse_sequences off the prefix cache holds system prompts alone. */
Test(reuse, without_sequence_reuse_only_the_system_prompt_is_reused) {
    rk_service *svc = open_svc(NULL, 1, "copy");
    rk_req_options o = greedy(RK_MODE_RAG);
    o.reuse_sequences = 0;
    rk_request a, b;
    prepare(svc, STORY, &o, &a);
    prepare(svc, STORY, &o, &b);
    run(svc, &a, NULL);
    run(svc, &b, NULL);
    cr_assert_eq(b.sys_cached, b.n_sys);
    cr_assert_eq(b.conv_cached, 0);
    for (int k = 0; k < b.n_chunks; k++)
        cr_assert_eq(b.chunk_reports[k].source, RK_CHUNK_SOURCE_ARENA);
    rk_radix_stats st;
    rk_radix_get_stats(svc->prefix, &st);
    cr_assert_eq(st.cached_tokens, (uint64_t)a.n_sys);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_test_check_all_released(svc);
    rk_service_close(svc);
}
