/* tests/test_prefix.c — the prefix cache inside generation: with the system
 * prompt cached, `system + question` gives the same tokens and logits as with
 * the cache disabled; the cache is hit the second time; every block and lock
 * is accounted for afterwards. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline.h"
#include "tests/testutil.h"

static rk_service *open_svc(const char *model, int prefix_cache) {
    /* The exactness bounds are f32's; f16 (the default) is checked on its own. */
    rk_config cfg = rk_test_config(2, 256, "f32");
    cfg.prefix_cache = prefix_cache;
    return rk_test_service_open(&cfg, model);
}

/* BOS (when the model wants one) + system tokens + question tokens. */
static int build_prompt(rk_service *svc, const char *sys, const char *question, int32_t *out,
                        int *n_system) {
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int n = 0;
    if (rk_tokenizer_add_bos(tok)) out[n++] = rk_tokenizer_bos(tok);
    const char *parts[2] = {sys, question};
    for (int p = 0; p < 2; p++) {
        int32_t *ids;
        size_t k;
        cr_assert_eq(rk_tokenizer_encode(tok, parts[p], strlen(parts[p]), 1, &ids, &k), RK_OK);
        memcpy(out + n, ids, k * sizeof *ids);
        n += (int)k;
        free(ids);
        if (p == 0) *n_system = n;
    }
    return n;
}

static void generate(rk_service *svc, const int32_t *prompt, int n, int n_system, int32_t *out,
                     rk_test_log *log, int *n_cached) {
    rk_request *r = rk_test_request(svc, prompt, n, n_system, 16);
    rk_pipeline_hooks h = {.ctx = log, .on_logits = rk_test_keep_logits};
    cr_assert_eq(rk_pipeline_run(svc, &r, 1, &h), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->n_out, 16);
    memcpy(out, r->out_tokens, 16 * sizeof *out);
    *n_cached = r->sys_cached;
    rk_test_request_free(r);
}

static void check_cached_equals_uncached(const char *model, const char *sys, const char *question) {
    rk_service *on = open_svc(model, 1), *off = open_svc(model, 0);
    static int32_t prompt[4096];
    int n_system, n = build_prompt(on, sys, question, prompt, &n_system);
    int bs = rk_arena_block_size(on->arena);
    cr_assert_gt(n_system, 2 * bs, "the system prompt should span several blocks");

    int32_t ref[16], first[16], second[16];
    rk_test_log lref = {0}, l1 = {0}, l2 = {0};
    int cached;
    generate(off, prompt, n, n_system, ref, &lref, &cached);
    cr_assert_eq(cached, 0);
    generate(on, prompt, n, n_system, first, &l1, &cached);
    cr_assert_eq(cached, 0, "a cold cache has nothing");
    generate(on, prompt, n, n_system, second, &l2, &cached);
    cr_assert_eq(cached, n_system, "the whole system prompt is reused, its partial page copied");

    cr_assert_eq(memcmp(ref, first, sizeof ref), 0);
    cr_assert_eq(memcmp(ref, second, sizeof ref), 0);
    /* Within 1e-5 of the logits' scale (the largest |logit| of the step): the
     * cached run prefills fewer rows, so OpenBLAS may block its matmuls
     * differently and round differently than the full prefill; the two agree
     * to about 1e-6 of the scale. */
    double worst = 0;
    for (int s = 0; s < 16; s++) {
        double scale = 0, d = 0;
        for (int i = 0; i < lref.n_vocab; i++) scale = fmax(scale, fabs(lref.logits[s][i]));
        for (int i = 0; i < lref.n_vocab; i++)
            d = fmax(d, fabs((double)lref.logits[s][i] - l2.logits[s][i]));
        worst = fmax(worst, d / fmax(1.0, scale));
    }
    cr_assert_leq(worst, 1e-5, "logits differ by %g of their scale with the prefix cache", worst);
    rk_radix_stats st;
    rk_radix_get_stats(on->prefix, &st);
    cr_assert_eq(st.queries, 2);
    cr_assert_eq(st.hits, 1);
    cr_assert_eq(st.protected_tokens, 0, "no lock outlives a request");
    /* The tree holds the first run's whole sequence (the prompt and the 15
     * generated tokens fed back); the repeat added nothing. */
    cr_assert_geq(st.cached_tokens, (uint64_t)(n + 15));
    /* Live blocks all came back; the prefix pool holds exactly the tree's pages. */
    cr_assert_eq(rk_arena_pool_free(on->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(on->arena, RK_POOL_LIVE));
    cr_assert_eq(rk_arena_pool_total(on->arena, RK_POOL_PREFIX) -
                     rk_arena_pool_free(on->arena, RK_POOL_PREFIX),
                 (n + 15 + bs - 1) / bs);
    /* Flushing gives every prefix block back. */
    rk_radix_flush(on->prefix);
    cr_assert_eq(rk_arena_pool_free(on->arena, RK_POOL_PREFIX),
                 rk_arena_pool_total(on->arena, RK_POOL_PREFIX));
    rk_test_log_free(&lref, 1);
    rk_test_log_free(&l1, 1);
    rk_test_log_free(&l2, 1);
    rk_service_close(on);
    rk_service_close(off);
}

static const char *SYS_EN =
    "Lily and her brother Tom lived in a small house near the big green park. Every morning "
    "they walked to the park with their dog Max, who loved to chase the red ball. Their mom "
    "always told them to be kind to the other children and to share their toys.";

Test(prefix, stories260k_cached_system_prompt_gives_the_uncached_result) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_cached_equals_uncached(model, SYS_EN, " One day, Lily saw a little bird.");
    free(model);
}

Test(prefix, qwen3_tiny_cached_system_prompt_gives_the_uncached_result) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    check_cached_equals_uncached(model, SYS_EN,
                                 "<|im_start|>user\nWhat did Max chase?<|im_end|>\n");
    free(model);
}

Test(prefix, qwen3moe_tiny_cached_system_prompt_gives_the_uncached_result) {
    char *model = rk_test_model("qwen3moe-tiny", "f32", 1);
    check_cached_equals_uncached(model, SYS_EN,
                                 "<|im_start|>user\nWhat did Max chase?<|im_end|>\n");
    free(model);
}

Test(prefix, qwen3_0_6b_cached_system_prompt_gives_the_uncached_result, .timeout = 1200) {
    RK_SKIP_IF_LIGHT();
    char *model = rk_test_model("qwen3-0.6b", "f32", 3);
    check_cached_equals_uncached(model, SYS_EN,
                                 "<|im_start|>user\nWhat did Max chase?<|im_end|>\n");
    free(model);
}

Test(prefix, concurrent_sequences_with_one_system_prompt_share_and_release) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    rk_service *svc = open_svc(model, 1);
    static int32_t p[4][512];
    int n[4], n_sys[4];
    const char *qs[4] = {" One day", " The dog ran", " Tom said", " Mom smiled"};
    rk_request *reqs[4];
    for (int i = 0; i < 4; i++) {
        n[i] = build_prompt(svc, SYS_EN, qs[i], p[i], &n_sys[i]);
        reqs[i] = rk_test_request(svc, p[i], n[i], n_sys[i], 8);
    }
    /* All four miss together; each inserts; the duplicates stay private and are released. */
    cr_assert_eq(rk_pipeline_run(svc, reqs, 4, NULL), RK_OK, "%s", rk_error_message());
    rk_radix_stats st;
    rk_radix_get_stats(svc->prefix, &st);
    int bs = rk_arena_block_size(svc->arena);
    /* The system pages once (a whole number of them here); each request's
     * rest is less than a page, a tail of the system's node, which keeps one:
     * the last inserted. */
    cr_assert_eq(n_sys[0] % bs, 0);
    for (int i = 0; i < 4; i++) cr_assert_lt(n[i] + 7, n_sys[0] + bs);
    cr_assert_eq(rk_arena_pool_total(svc->arena, RK_POOL_PREFIX) -
                     rk_arena_pool_free(svc->arena, RK_POOL_PREFIX),
                 n_sys[0] / bs + 1);
    cr_assert_eq(st.protected_tokens, 0);
    cr_assert_eq(rk_pipeline_run(svc, reqs, 4, NULL), RK_OK);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(reqs[i]->sys_cached, n_sys[0]);
        rk_test_request_free(reqs[i]);
    }
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(svc->arena, RK_POOL_LIVE));
    rk_service_close(svc);
    free(model);
}

/* A request asking for no tokens, batched with generating ones: it samples
 * nothing and never reads a token it does not have (a heap overflow once). */
Test(prefix, a_max_tokens_zero_request_in_a_generating_batch_generates_nothing) {
    rk_service *svc = open_svc(NULL, 1);
    int32_t p[3][64];
    int n[3], n_sys[3];
    const char *qs[3] = {" Once", " Hello", " Once upon"};
    int max_new[3] = {6, 0, 3};
    rk_request *reqs[3];
    for (int i = 0; i < 3; i++) {
        n[i] = build_prompt(svc, "A story.", qs[i], p[i], &n_sys[i]);
        reqs[i] = rk_test_request(svc, p[i], n[i], n_sys[i], max_new[i]);
        reqs[i]->opt.stop_at_eog = 0;
    }
    cr_assert_eq(rk_pipeline_run(svc, reqs, 3, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(reqs[0]->n_out, 6);
    cr_assert_eq(reqs[1]->n_out, 0);
    cr_assert_eq(reqs[1]->finish_reason, RK_FINISH_LENGTH);
    cr_assert_eq(reqs[2]->n_out, 3);
    for (int i = 0; i < 3; i++) rk_test_request_free(reqs[i]);
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(svc->arena, RK_POOL_LIVE));
    rk_service_close(svc);
}

/* Max |a - b| over a step's logits, relative to the step's largest |logit|. */
static double worst_logit_error(const rk_test_log *ref, const rk_test_log *got, int steps) {
    double worst = 0;
    for (int s = 0; s < steps; s++) {
        double scale = 0, d = 0;
        for (int i = 0; i < ref->n_vocab; i++) scale = fmax(scale, fabs(ref->logits[s][i]));
        for (int i = 0; i < ref->n_vocab; i++)
            d = fmax(d, fabs((double)ref->logits[s][i] - got->logits[s][i]));
        worst = fmax(worst, d / fmax(1.0, scale));
    }
    return worst;
}

/* A system prompt shorter than one block has no whole page: it is reused by
 * copying its partial page, and gives what the uncached run gives. */
static void check_short_system(int n_question) {
    rk_service *on = open_svc(NULL, 1), *off = open_svc(NULL, 0);
    int bs = rk_arena_block_size(on->arena), n_vocab = rk_model_hparams(on->model)->n_vocab;
    int32_t prompt[32];
    int n_sys = 13, n = n_sys + n_question;
    cr_assert_lt(n_sys, bs);
    for (int i = 0; i < n; i++) prompt[i] = (7 + 31 * i) % n_vocab;
    int32_t ref[16], first[16], second[16];
    rk_test_log lref = {0}, l1 = {0}, l2 = {0};
    int cached;
    generate(off, prompt, n, n_sys, ref, &lref, &cached);
    generate(on, prompt, n, n_sys, first, &l1, &cached);
    cr_assert_eq(cached, 0);
    generate(on, prompt, n, n_sys, second, &l2, &cached);
    /* With no question the last system token is computed for its logits. */
    cr_assert_eq(cached, n_question ? n_sys : n_sys - 1);
    cr_assert_eq(memcmp(ref, second, sizeof ref), 0);
    cr_assert_eq(memcmp(ref, first, sizeof ref), 0);
    double worst = worst_logit_error(&lref, &l2, 16);
    cr_assert_leq(worst, 1e-4, "logits differ by %g of their scale", worst);
    rk_radix_flush(on->prefix);
    cr_assert_eq(rk_arena_pool_free(on->arena, RK_POOL_PREFIX),
                 rk_arena_pool_total(on->arena, RK_POOL_PREFIX));
    cr_assert_eq(rk_arena_pool_free(on->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(on->arena, RK_POOL_LIVE));
    rk_test_log_free(&lref, 1);
    rk_test_log_free(&l1, 1);
    rk_test_log_free(&l2, 1);
    rk_service_close(on);
    rk_service_close(off);
}

Test(prefix, a_system_prompt_shorter_than_a_block_is_reused) { check_short_system(4); }

Test(prefix, a_short_system_prompt_without_question_is_reused_but_its_last_token) {
    check_short_system(0);
}
