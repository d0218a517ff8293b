/* tests/test_pipeline.c — the request pipeline over the position-independent
 * chunk cache: content keys, exactness of the reindex against the oracle in
 * every mode, reuse under movement, single flight, pool pressure, bad input,
 * repair. Every test runs on the embedded model, so in every checkout; the
 * exactness invariants run again on stories260K and the synthetic Qwen3
 * models when ../shared has them. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline.h"
#include "tests/testutil.h"

#define STEPS 12

/* model NULL: the embedded tiny model. dtype NULL: f32, whose rounding the
 * exactness bounds are set for; the default f16 is checked on its own. */
static rk_service *open_svc_dtype(const char *model, int chunk_blocks, const char *dtype,
                                  const char *reindex) {
    rk_config cfg = rk_test_config(2, 256, dtype ? dtype : "f32");
    if (reindex) snprintf(cfg.reindex, sizeof cfg.reindex, "%s", reindex);
    if (chunk_blocks) cfg.chunk_blocks = chunk_blocks;
    return rk_test_service_open(&cfg, model);
}

static rk_service *open_svc(const char *model, int chunk_blocks) {
    return open_svc_dtype(model, chunk_blocks, NULL, NULL);
}

static rk_req_options greedy_opts(void) {
    rk_req_options o;
    rk_test_oracle_options(&o, STEPS);
    return o;
}

/* Prepare a request from prompt text; returns the status of prepare. */
static rk_status prepare(rk_service *svc, const char *prompt, const rk_req_options *o,
                         rk_request *r) {
    rk_split sp;
    memset(r, 0, sizeof *r);
    r->opt = *o;
    rk_status st = rk_split_prompt(prompt, strlen(prompt), NULL, svc->cfg.max_chunks, &sp);
    if (st) return st;
    st = rk_request_prepare(svc, &sp, r);
    rk_split_free(&sp);
    return st;
}

/* Run one prompt; keep its report in *r (caller frees) and logits in *log. */
static void run(rk_service *svc, const char *prompt, const rk_req_options *o, rk_request *r,
                rk_test_log *log) {
    rk_split sp;
    cr_assert_eq(rk_split_prompt(prompt, strlen(prompt), NULL, svc->cfg.max_chunks, &sp), RK_OK);
    rk_test_run_split(svc, &sp, o, r, log);
    rk_split_free(&sp);
}

/* ---------------------------------------------------------------- exactness */

static const char *STORY =
    "You are a storyteller.##Lily had a red ball. She liked to play with it in the garden every "
    "day.##Tom had a big dog named Max. Max liked to run and bark at the birds.##The sun was warm "
    "and the sky was blue. The children sang a happy song.##One day";

/* Cached (second run) against the oracle in every context and position mode,
 * with base's repair options: the same greedy tokens and logits within tol
 * (f32 KV: 1e-4). dtype and reindex NULL: the defaults. */
static void check_modes_kv(const char *model, const char *prompt, const rk_req_options *base,
                           const char *dtype, double tol, const char *reindex) {
    rk_service *svc = open_svc_dtype(model, 0, dtype, reindex);
    int zc = !reindex || strcmp(reindex, "copy") != 0;
    for (int ctx = 0; ctx < 3; ctx++)
        for (int par = 0; par < 2; par++) {
            rk_chunk_index_flush(svc->chunks); /* isolated chunks would hit across modes */
            rk_req_options o = *base;
            o.chunk_context = (rk_chunk_context)ctx /* isolated, system, anchor */;
            o.positions = par ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
            rk_request first, second, oracle;
            rk_test_log lf = {0}, ls = {0}, lo = {0};
            run(svc, prompt, &o, &first, &lf);
            run(svc, prompt, &o, &second, &ls);
            for (int k = 0; k < second.n_chunks; k++) {
                cr_assert_eq(first.chunk_reports[k].status, RK_CHUNK_STATUS_MISS);
                cr_assert_eq(second.chunk_reports[k].status, RK_CHUNK_STATUS_HIT,
                             "ctx %d par %d chunk %d", ctx, par, k);
                cr_assert_eq(second.chunk_reports[k].zero_copy, zc && !(o.repair_ratio > 0),
                             "the default reindex is in place (copied for a ratio repair)");
            }
            rk_req_options off = o;
            off.chunk_cache = 0;
            run(svc, prompt, &off, &oracle, &lo);
            cr_assert_eq(memcmp(second.out_tokens, oracle.out_tokens, STEPS * sizeof(int32_t)), 0,
                         "context %d parallel %d: cached tokens differ from the oracle", ctx, par);
            double d = rk_test_max_logit_diff(&ls, &lo);
            cr_assert_leq(d, tol, "context %d parallel %d: logits differ by %g", ctx, par, d);
            cr_assert_eq(memcmp(first.out_tokens, second.out_tokens, STEPS * sizeof(int32_t)), 0);
            rk_request_free(&first);
            rk_request_free(&second);
            rk_request_free(&oracle);
            rk_test_log_free(&lf, 1);
            rk_test_log_free(&ls, 1);
            rk_test_log_free(&lo, 1);
        }
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

static void check_modes(const char *model, const char *prompt) {
    rk_req_options o = greedy_opts();
    check_modes_kv(model, prompt, &o, NULL, 1e-4, NULL);
}

Test(pipeline, cached_path_equals_the_oracle_in_every_mode) { check_modes(NULL, STORY); }

/* Sliding windows (gemma3-micro: 5 layers of window 16, local RoPE, then a global one; gemma2-tiny:
 * window 16 on even layers, soft caps; gemma4-tiny: window 16, 3 of 6 layers reading others' KV):
 * chunks longer than the window, cached and reused in every context and position mode, with each
 * repair policy, on both reindex paths, give the oracle's tokens and logits within 1e-4. */
Test(pipeline, gemma_cached_path_equals_the_oracle_in_every_mode, .timeout = 600) {
    const char *presets[3] = {"gemma3-micro", "gemma2-tiny", "gemma4-tiny"};
    for (int p = 0; p < 3; p++) {
        char *model = rk_test_model(presets[p], "f32", 6);
        rk_service *svc = open_svc_dtype(model, 0, NULL, NULL);
        int32_t *ids;
        size_t n;
        const char *chunk =
            "Lily had a red ball. She liked to play with it in the garden every day.";
        cr_assert_eq(
            rk_tokenizer_encode(rk_model_tokenizer(svc->model), chunk, strlen(chunk), 0, &ids, &n),
            RK_OK);
        cr_assert_gt((int)n, rk_model_hparams(svc->model)->sliding_window,
                     "a chunk longer than the window");
        free(ids);
        rk_service_close(svc);
        for (int rep = 0; rep < 3; rep++) {
            rk_req_options o = greedy_opts();
            if (rep == 1) o.repair_k = 3;
            if (rep == 2) o.repair_ratio = 0.25f;
            check_modes_kv(model, STORY, &o, NULL, 1e-4, NULL);
            check_modes_kv(model, STORY, &o, NULL, 1e-4, "copy");
        }
        free(model);
    }
}

/* The query policy chooses from the question's attention over the reused
 * KV; the oracle's chunks are that KV computed fresh, so it chooses the same
 * tokens and gives the same result, in every mode. */
Test(pipeline, query_repaired_cached_path_equals_the_oracle_in_every_mode) {
    char *model;
    rk_req_options o = greedy_opts();
    o.repair_ratio = 0.3f;
    o.repair_query = 1;
    check_modes_kv(NULL, STORY, &o, NULL, 1e-4, NULL);
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_modes_kv(model, STORY, &o, NULL, 1e-4, NULL);
    free(model);
}

/* phi3 rotates only 24 of each head's 32 dimensions, with LongRoPE factors
 * and an attention factor: reindexing a cached chunk rotates the same
 * dimensions by the same frequencies, so cached equals the oracle in every
 * mode, plain and query-repaired. */
Test(pipeline, phi3_cached_path_equals_the_oracle_in_every_mode) {
    char *model = rk_test_model("phi3-tiny", "f32", 7);
    check_modes(model, STORY);
    rk_req_options o = greedy_opts();
    o.repair_ratio = 0.3f;
    o.repair_query = 1;
    check_modes_kv(model, STORY, &o, NULL, 1e-4, NULL);
    free(model);
}

/* f16 KV rounds a cached key at its base position and the oracle's at its
 * live one: the tokens agree, the logits within f16's rounding. */
Test(pipeline, cached_path_equals_the_oracle_in_every_mode_with_f16_kv) {
    rk_req_options o = greedy_opts();
    check_modes_kv(NULL, STORY, &o, "f16", 2e-2, NULL);
}

/* Q8_0 KV (32 int8 and a scale per block) quantizes a cached key at its base
 * position, rotated there, and the oracle's at its live one, so the two
 * round differently: the first token's logits of the cached path (a miss,
 * then a hit) agree with the oracle's within Q8_0_LOGIT_TOL in every mode
 * on both reindex paths. Greedy continuations are not compared: on the
 * embedded model's random weights any rounding may flip a near tie. f16
 * and f32 (above) compare whole continuations. (stories260K's heads are 8
 * wide: Q8_0 needs whole blocks.) */
#define Q8_0_LOGIT_TOL 0.1 /* seen: 0.044 */
static void check_q8_0(const char *model, const char *prompt, const char *reindex) {
    rk_service *svc = open_svc_dtype(model, 0, "q8_0", reindex);
    double worst = 0;
    for (int ctx = 0; ctx < 3; ctx++)
        for (int par = 0; par < 2; par++) {
            rk_chunk_index_flush(svc->chunks);
            rk_req_options o = greedy_opts();
            o.max_tokens = 1;
            o.chunk_context = (rk_chunk_context)ctx;
            o.positions = par ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
            rk_request first, second, oracle;
            rk_test_log lf = {0}, ls = {0}, lo = {0};
            run(svc, prompt, &o, &first, &lf);
            run(svc, prompt, &o, &second, &ls);
            for (int k = 0; k < second.n_chunks; k++)
                cr_assert_eq(second.chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
            rk_req_options off = o;
            off.chunk_cache = 0;
            run(svc, prompt, &off, &oracle, &lo);
            for (int i = 0; i < lo.n_vocab; i++) {
                double d1 = fabs((double)lf.logits[0][i] - lo.logits[0][i]);
                double d2 = fabs((double)ls.logits[0][i] - lo.logits[0][i]);
                worst = fmax(worst, fmax(d1, d2));
            }
            cr_assert_leq(worst, Q8_0_LOGIT_TOL, "%s context %d parallel %d: logits differ by %g",
                          reindex, ctx, par, worst);
            /* In the `system` context the miss computes the system prompt in
             * pass 1 beside its chunks (they attend to it), the hit in the
             * question pass: other rows beside it, another kernel path, so
             * its Q8_0 rows may round apart. Elsewhere the hit reads exactly
             * what the miss wrote. */
            if (ctx != RK_CONTEXT_SYSTEM)
                cr_assert_eq(memcmp(lf.logits[0], ls.logits[0], (size_t)lo.n_vocab * sizeof(float)),
                             0, "%s context %d parallel %d: a hit reads what the miss wrote",
                             reindex, ctx, par);
            rk_request_free(&first);
            rk_request_free(&second);
            rk_request_free(&oracle);
            rk_test_log_free(&lf, 1);
            rk_test_log_free(&ls, 1);
            rk_test_log_free(&lo, 1);
        }
    cr_log_info("q8_0 KV, %s: first-token logits within %g of the oracle's", reindex, worst);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

Test(pipeline, cached_path_equals_the_oracle_in_every_mode_with_q8_0_kv) {
    check_q8_0(NULL, STORY, "zero-copy");
    check_q8_0(NULL, STORY, "copy");
}

Test(pipeline, q8_0_kv_is_refused_where_heads_are_not_whole_blocks) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = 16;
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "q8_0");
    rk_service *svc = NULL;
    cr_assert_eq(rk_service_open(&cfg, model, &svc), RK_ERR_UNSUPPORTED);
    cr_assert(strstr(rk_error_message(), "multiple of 32"), "%s", rk_error_message());
    cr_assert_null(svc);
    free(model);
}

Test(pipeline, stories260k_cached_path_equals_the_oracle_in_every_mode_with_f16_kv) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    rk_req_options o = greedy_opts();
    check_modes_kv(model, STORY, &o, "f16", 2e-2, NULL);
    free(model);
}

Test(pipeline, stories260k_cached_path_equals_the_oracle_in_every_mode) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_modes(model, STORY);
    free(model);
}

Test(pipeline, qwen3_tiny_cached_path_equals_the_oracle_in_every_mode) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    check_modes(model, "<|im_start|>system\nAnswer from the documents.<|im_end|>\n##"
                       "文档一：缓存的键由内容决定。##Document two: the KV of a chunk is "
                       "rotated to its live offset.##<|im_start|>user\nWhat decides the key?"
                       "<|im_end|>\n<|im_start|>assistant\n");
    free(model);
}

/* qwen3moe: a reused chunk's tokens are routed as the oracle routes them
 * (routing reads only the token's own activations, which reuse leaves
 * within f32 rounding), in every context and position mode, with and
 * without a query repair, and with every chunk token repaired. */
#define MOE_PROMPT                                                                                 \
    "<|im_start|>system\nAnswer from the documents.<|im_end|>\n##"                                 \
    "文档一：缓存的键由内容决定。##Document two: the KV of a chunk is "              \
    "rotated to its live offset.##<|im_start|>user\nWhat decides the key?"                         \
    "<|im_end|>\n<|im_start|>assistant\n"

Test(pipeline, qwen3moe_tiny_cached_path_equals_the_oracle_in_every_mode) {
    char *model = rk_test_model("qwen3moe-tiny", "f32", 1);
    check_modes(model, MOE_PROMPT);
    rk_req_options o = greedy_opts();
    o.repair_ratio = 0.3f;
    o.repair_query = 1;
    check_modes_kv(model, MOE_PROMPT, &o, NULL, 1e-4, NULL);
    check_modes_kv(model, MOE_PROMPT, &o, NULL, 1e-4, "copy");
    free(model);
}

Test(pipeline, qwen3_0_6b_cached_path_equals_the_oracle_in_every_mode, .timeout = 1500) {
    RK_SKIP_IF_LIGHT();
    char *model = rk_test_model("qwen3-0.6b", "f32", 3);
    check_modes(model, "You answer from documents.##The chunk cache keys KV by content.##"
                       "RoPE rotations compose, so keys can be moved.##Why can keys move?");
    free(model);
}

/* One chunk right after the system prompt, in the system context, is
 * computed exactly where plain attention puts it: cached or not, the same
 * logits as mode plain. */
static void check_one_chunk_equals_plain(const char *model) {
    rk_service *svc = open_svc(model, 0);
    const char *p =
        "Once upon a time there was a girl.##Lily had a red ball in the garden.##One day";
    rk_req_options o = greedy_opts();
    o.chunk_context = RK_CONTEXT_SYSTEM;
    rk_req_options plain = greedy_opts();
    plain.mode = RK_MODE_PLAIN;
    plain.prefix_cache = 0;
    rk_request a, b, c;
    rk_test_log la = {0}, lb = {0}, lc = {0};
    run(svc, p, &o, &a, &la);
    run(svc, p, &o, &b, &lb); /* cached */
    run(svc, p, &plain, &c, &lc);
    cr_assert_eq(b.chunk_reports[0].status, RK_CHUNK_STATUS_HIT);
    cr_assert_eq(memcmp(b.out_tokens, c.out_tokens, STEPS * sizeof(int32_t)), 0);
    cr_assert_leq(rk_test_max_logit_diff(&lb, &lc), 1e-4);
    cr_assert_leq(rk_test_max_logit_diff(&la, &lc), 1e-4);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_request_free(&c);
    rk_test_log_free(&la, 1);
    rk_test_log_free(&lb, 1);
    rk_test_log_free(&lc, 1);
    rk_service_close(svc);
}

Test(pipeline, one_chunk_after_its_system_prompt_equals_plain) {
    check_one_chunk_equals_plain(NULL);
}

Test(pipeline, stories260k_one_chunk_after_its_system_prompt_equals_plain) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_one_chunk_equals_plain(model);
    free(model);
}

/* ---------------------------------------------------------------- reuse */

static rk_chunk_status status_of(rk_service *svc, const char *prompt, rk_req_options o, int k) {
    rk_request r;
    o.max_tokens = 1;
    run(svc, prompt, &o, &r, NULL);
    rk_chunk_status s = r.chunk_reports[k].status;
    rk_request_free(&r);
    return s;
}

Test(pipeline, a_chunk_moves_between_positions_and_system_prompts) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options iso = greedy_opts(), sys = greedy_opts();
    sys.chunk_context = RK_CONTEXT_SYSTEM;
    const char *doc = "Max the dog ran to the park and found a stick.";
    char a[512], b[512], c[512];
    snprintf(a, sizeof a, "Sys A.##%s##Q", doc);
    snprintf(b, sizeof b, "A different system prompt.##Tom was sad.##The cat slept.##%s##Q", doc);
    cr_assert_eq(status_of(svc, a, iso, 0), RK_CHUNK_STATUS_MISS);
    cr_assert_eq(status_of(svc, b, iso, 2), RK_CHUNK_STATUS_HIT,
                 "chunk 1 under A is a hit as chunk 3 under B");
    cr_assert_eq(status_of(svc, a, sys, 0), RK_CHUNK_STATUS_MISS);
    cr_assert_eq(status_of(svc, b, sys, 2), RK_CHUNK_STATUS_MISS,
                 "the system context keys by system prompt");
    /* Reordered: all hits. */
    snprintf(c, sizeof c, "Sys A.##The cat slept.##%s##Tom was sad.##Q", doc);
    rk_request r;
    run(svc, c, &iso, &r, NULL);
    for (int k = 0; k < 3; k++) cr_assert_eq(r.chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
    rk_request_free(&r);
    /* One token different: a miss. */
    cr_assert_eq(status_of(svc, "Sys A.##Max the dog ran to the park and found a ball.##Q", iso, 0),
                 RK_CHUNK_STATUS_MISS);
    rk_service_close(svc);
}

Test(pipeline, keys_depend_on_every_token_and_the_policy) {
    int32_t t[6] = {5, 6, 7, 8, 9, 10}, u[6] = {5, 6, 7, 8, 9, 11};
    rk_chunk_policy p = {
        .fingerprint = "00112233445566778899aabbccddeeff", .rope_theta = 10000, .rope_n_rot = 64};
    rk_chunk_key k1 = rk_chunk_key_compute(&p, t, 6), k2 = rk_chunk_key_compute(&p, t, 6);
    cr_assert(k1.hi == k2.hi && k1.lo == k2.lo, "same tokens, same key");
    rk_chunk_key k3 = rk_chunk_key_compute(&p, u, 6);
    cr_assert(k1.hi != k3.hi || k1.lo != k3.lo, "one token changed, another key");
    rk_chunk_policy q = p;
    q.context_system = 1;
    rk_chunk_key k4 = rk_chunk_key_compute(&q, t, 6);
    cr_assert(k1.hi != k4.hi || k1.lo != k4.lo, "the context is part of the key");
    q = p;
    q.fingerprint = "ffeeddccbbaa99887766554433221100";
    rk_chunk_key k5 = rk_chunk_key_compute(&q, t, 6);
    cr_assert(k1.hi != k5.hi || k1.lo != k5.lo, "the model is part of the key");
    char hex[33];
    rk_chunk_key_hex(k1, hex);
    rk_chunk_key back;
    cr_assert_eq(rk_chunk_key_parse(hex, &back), RK_OK);
    cr_assert(back.hi == k1.hi && back.lo == k1.lo);
    cr_assert_eq(rk_chunk_key_parse("../../etc/passwd", &back), RK_ERR_INVALID);
}

Test(pipeline, an_unsalted_chunk_key_is_the_one_existing_stores_hold) {
    /* Computed by the code before salts existed: stores and Redis keys
     * written then stay valid. */
    int32_t t[6] = {1, 2, 3, 4, 5, 6};
    rk_chunk_policy p = {
        .fingerprint = "00112233445566778899aabbccddeeff", .rope_theta = 10000, .rope_n_rot = 64};
    char hex[33];
    rk_chunk_key_hex(rk_chunk_key_compute(&p, t, 6), hex);
    cr_assert_str_eq(hex, "e14be9b43988059f703b0b5786d133c9");
    p.context_system = 1;
    p.system_key = rk_tokens_hash(t, 3);
    rk_chunk_key_hex(rk_chunk_key_compute(&p, t, 6), hex);
    cr_assert_str_eq(hex, "e2e4e0f88724006a68ef300669cbc4ab");
    rk_chunk_key none = rk_cache_scope(NULL, ""), also = rk_cache_scope("", NULL);
    cr_assert(!none.hi && !none.lo && !also.hi && !also.lo, "no salt is no scope");
}

static int same_key(rk_chunk_key a, rk_chunk_key b) { return a.hi == b.hi && a.lo == b.lo; }

Test(pipeline, a_salt_changes_every_key_and_tenants_and_request_salts_never_meet) {
    int32_t t[6] = {1, 2, 3, 4, 5, 6};
    rk_chunk_policy p = {
        .fingerprint = "00112233445566778899aabbccddeeff", .rope_theta = 10000, .rope_n_rot = 64};
    rk_chunk_key plain = rk_chunk_key_compute(&p, t, 6);
    rk_chunk_key sa = rk_cache_scope(NULL, "a"), sb = rk_cache_scope(NULL, "b");
    rk_chunk_key ta = rk_cache_scope("a", NULL), tab = rk_cache_scope("a", "b");
    cr_assert(!same_key(sa, sb) && !same_key(sa, ta) && !same_key(ta, tab) && !same_key(sb, tab),
              "a request's salt never reaches a tenant's scope, nor another salt's");
    cr_assert(same_key(ta, rk_cache_scope("a", "")), "a tenant without a request salt");
    p.salt = sa;
    rk_chunk_key ka = rk_chunk_key_compute(&p, t, 6);
    p.salt = sb;
    rk_chunk_key kb = rk_chunk_key_compute(&p, t, 6);
    cr_assert(!same_key(plain, ka) && !same_key(ka, kb), "the salt is part of the key");
    p.salt = sa;
    cr_assert(same_key(ka, rk_chunk_key_compute(&p, t, 6)), "one salt, one key");
}

Test(pipeline, salted_requests_share_chunks_and_sequences_only_within_their_salt) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options a = greedy_opts(), b = greedy_opts();
    a.salt = rk_cache_scope("tenant-a", NULL);
    a.owner = 1;
    b.salt = rk_cache_scope("tenant-b", NULL);
    b.owner = 2;
    const char *prompt = "Sys.##The merger memo puts the price at ten dollars a share.##Q";
    cr_assert_eq(status_of(svc, prompt, a, 0), RK_CHUNK_STATUS_MISS);
    cr_assert_eq(status_of(svc, prompt, a, 0), RK_CHUNK_STATUS_HIT);
    cr_assert_eq(status_of(svc, prompt, b, 0), RK_CHUNK_STATUS_MISS, "B never hits A's chunk");
    rk_req_options unsalted = greedy_opts();
    cr_assert_eq(status_of(svc, prompt, unsalted, 0), RK_CHUNK_STATUS_MISS);
    /* Whole sequences through the radix tree: A's is reused by A alone. */
    a.prefix_cache = b.prefix_cache = 1;
    const char *conv = "Sys.##A second document about the merger.##Q";
    rk_request r;
    run(svc, conv, &a, &r, NULL);
    rk_request_free(&r);
    run(svc, conv, &a, &r, NULL);
    cr_assert_gt(r.conv_cached, 0, "A reuses its own sequence");
    rk_request_free(&r);
    run(svc, conv, &b, &r, NULL);
    cr_assert_eq(r.conv_cached, 0, "B reuses none of A's sequence");
    cr_assert_eq(r.sys_cached, 0, "nor A's system prompt");
    cr_assert_eq(r.chunk_reports[0].status, RK_CHUNK_STATUS_MISS);
    rk_request_free(&r);
    rk_service_close(svc);
}

Test(pipeline, cache_control_shows_a_viewer_only_its_own_chunks) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options a = greedy_opts(), b = greedy_opts();
    a.salt = rk_cache_scope("tenant-a", NULL);
    a.owner = 1;
    b.salt = rk_cache_scope("tenant-b", NULL);
    b.owner = 2;
    rk_request r;
    run(svc, "Sys.##Only tenant A sent this document.##Q", &a, &r, NULL);
    rk_chunk_key ka;
    cr_assert_eq(rk_chunk_key_parse(r.chunk_reports[0].key, &ka), RK_OK);
    rk_request_free(&r);
    run(svc, "Sys.##Tenant B sent this one.##Q", &b, &r, NULL);
    rk_request_free(&r);
    rk_cache_viewer all = {.all = 1}, va = {.owner = 1}, vb = {.owner = 2}, v0 = {.owner = 0};
    rk_chunk_listing l;
    cr_assert_eq(rk_service_chunk_list(svc, &all, 0, 0, 0, 100, &l), RK_OK);
    cr_assert_eq(l.total, 2);
    rk_chunk_listing_free(&l);
    cr_assert_eq(rk_service_chunk_list(svc, &vb, 0, 1, 0, 100, &l), RK_OK);
    cr_assert_eq(l.total, 1);
    cr_assert_eq(l.n, 1);
    cr_assert_eq(l.v[0].owner, 2);
    rk_chunk_listing_free(&l);
    cr_assert_eq(rk_service_chunk_list(svc, &v0, 0, 0, 0, 100, &l), RK_OK);
    cr_assert_eq(l.total, 0);
    rk_chunk_listing_free(&l);
    rk_chunk_info info;
    cr_assert_eq(rk_service_chunk_get(svc, &vb, ka, &info), RK_ERR_NOT_FOUND);
    cr_assert_eq(rk_service_chunk_get(svc, &va, ka, &info), RK_OK);
    cr_assert_eq(info.owner, 1);
    int in_arena, on_disk;
    cr_assert_eq(rk_service_chunk_delete(svc, &vb, ka, &in_arena, &on_disk, NULL, 0),
                 RK_ERR_NOT_FOUND);
    cr_assert_eq(rk_service_chunk_get(svc, &all, ka, &info), RK_OK, "B's delete removed nothing");
    cr_assert_eq(rk_service_chunk_delete(svc, &va, ka, &in_arena, &on_disk, NULL, 0), RK_OK);
    cr_assert(in_arena && !on_disk);
    cr_assert_eq(rk_service_chunk_list(svc, &vb, 1, 0, 0, 10, &l), RK_ERR_INVALID,
                 "no store, and the disk tier is for viewers of everything");
    rk_flush_counts fc;
    cr_assert_eq(rk_service_flush(svc, 1, 1, 0, &fc), RK_OK);
    cr_assert_eq(fc.chunks, 1);
    rk_service_close(svc);
}

Test(pipeline, cached_entries_are_never_modified_by_reindexing) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options o = greedy_opts();
    rk_request r;
    run(svc, "S##The bird sang a song in the tree.##Q", &o, &r, NULL);
    rk_chunk_key key;
    cr_assert_eq(rk_chunk_key_parse(r.chunk_reports[0].key, &key), RK_OK);
    rk_request_free(&r);
    rk_chunk_entry *e = rk_chunk_index_find(svc->chunks, key);
    cr_assert_not_null(e);
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    size_t block_bytes = (size_t)kv->block_size * kv->n_kv_heads * kv->head_dim * sizeof(float);
    char *before = malloc(block_bytes * (size_t)e->n_blocks * kv->n_layers * 2), *p = before;
    for (int l = 0; l < kv->n_layers; l++)
        for (int b = 0; b < e->n_blocks; b++) {
            memcpy(p, (char *)kv->k[l] + (size_t)e->blocks[b] * block_bytes, block_bytes),
                p += block_bytes;
            memcpy(p, (char *)kv->v[l] + (size_t)e->blocks[b] * block_bytes, block_bytes),
                p += block_bytes;
        }
    /* Reuse it at live offset 1 and at a live offset past 1000. */
    run(svc, "S##The bird sang a song in the tree.##Q", &o, &r, NULL);
    rk_request_free(&r);
    static char big[16384];
    int n = snprintf(big, sizeof big, "%s", "A long system prompt:");
    for (int i = 0; i < 600; i++) n += snprintf(big + n, sizeof big - (size_t)n, " and then");
    snprintf(big + n, sizeof big - (size_t)n, "##The bird sang a song in the tree.##Q");
    run(svc, big, &o, &r, NULL);
    cr_assert_gt(r.chunk_reports[0].live_offset, 1000);
    cr_assert_eq(r.chunk_reports[0].status, RK_CHUNK_STATUS_HIT);
    rk_request_free(&r);
    p = before;
    for (int l = 0; l < kv->n_layers; l++)
        for (int b = 0; b < e->n_blocks; b++) {
            cr_assert_eq(
                memcmp(p, (char *)kv->k[l] + (size_t)e->blocks[b] * block_bytes, block_bytes), 0);
            p += block_bytes;
            cr_assert_eq(
                memcmp(p, (char *)kv->v[l] + (size_t)e->blocks[b] * block_bytes, block_bytes), 0);
            p += block_bytes;
        }
    free(before);
    rk_service_close(svc);
}

/* ---------------------------------------------------------------- concurrency, pressure */

Test(pipeline, eight_requests_missing_one_chunk_compute_it_once) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options o = greedy_opts();
    rk_request reqs[8], *ptrs[8];
    char p[256];
    for (int i = 0; i < 8; i++) {
        snprintf(p, sizeof p, "System.##A shared document about a small red fox.##Question %d", i);
        cr_assert_eq(prepare(svc, p, &o, &reqs[i]), RK_OK);
        ptrs[i] = &reqs[i];
    }
    cr_assert_eq(rk_pipeline_run(svc, ptrs, 8, NULL), RK_OK, "%s", rk_error_message());
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(cs.computes, 1, "the chunk was computed %llu times",
                 (unsigned long long)cs.computes);
    cr_assert_eq(cs.lookups, 8);
    cr_assert_eq(cs.entries, 1);
    for (int i = 0; i < 8; i++) {
        cr_assert_eq(reqs[i].chunk_reports[0].status, RK_CHUNK_STATUS_MISS);
        cr_assert_str_eq(reqs[i].chunk_reports[0].key, reqs[0].chunk_reports[0].key);
    }
    for (int i = 0; i < 8; i++) rk_request_free(&reqs[i]);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

Test(pipeline, a_small_chunk_pool_evicts_lru_and_gives_every_block_back) {
    rk_service *svc = open_svc(NULL, 4); /* 4 blocks of 16 tokens */
    rk_req_options o = greedy_opts();
    o.max_tokens = 1;
    rk_request r;
    /* Each chunk is 17..32 tokens: two blocks. Three such chunks cannot all stay. */
    const char *docs[3] = {"The little red fox ran into the forest.",
                           "A big blue whale swam in the sea.",
                           "Three small birds sang in the tree."};
    char p[512];
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "S##%s##Q", docs[i]);
        run(svc, p, &o, &r, NULL);
        cr_assert_eq(r.chunk_reports[0].tokens > 16 && r.chunk_reports[0].tokens <= 32, 1);
        rk_request_free(&r);
    }
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(cs.evictions, 1);
    cr_assert_eq(cs.entries, 2);
    snprintf(p, sizeof p, "S##%s##Q", docs[0]); /* the least recently used went */
    cr_assert_eq(status_of(svc, p, o, 0), RK_CHUNK_STATUS_MISS);
    snprintf(p, sizeof p, "S##%s##Q", docs[2]);
    cr_assert_eq(status_of(svc, p, o, 0), RK_CHUNK_STATUS_HIT);
    /* A request whose chunks alone need more than the pool is served: what
     * the pool cannot hold after eviction is computed uncached. */
    snprintf(p, sizeof p, "S##%s##%s##%s##Q", docs[0], docs[1], docs[2]);
    rk_request big;
    run(svc, p, &o, &big, NULL);
    cr_assert_eq(big.chunk_reports[0].status, RK_CHUNK_STATUS_HIT);
    cr_assert_eq(big.chunk_reports[1].status, RK_CHUNK_STATUS_MISS, "docs[2] evicted for it");
    cr_assert_eq(big.chunk_reports[2].status, RK_CHUNK_STATUS_UNCACHED, "both others are held");
    cr_assert_eq(big.chunk_reports[2].zero_copy, 0, "read from the request's own blocks");
    cr_assert_eq(big.cached_tokens, big.chunk_lens[0]);
    rk_request_free(&big);
    rk_test_check_pools_back(svc);
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(rk_chunk_index_flush(svc->chunks), (int)cs.entries);
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_CHUNK), 4, "every chunk block came back");
    rk_service_close(svc);
}

/* A request with more chunk tokens than the chunk pool holds, on both
 * reindex paths and every chunk context: the chunks that do not fit are
 * uncached, the tokens and logits equal the oracle's (chunk cache off) as a
 * cached request's do, and a repeat hits what was cached. */
static void check_uncached(const char *model, const char *reindex) {
    rk_config cfg = rk_test_config(2, 64, "f32");
    cfg.chunk_blocks = 5; /* 80 tokens: two of the four chunks */
    snprintf(cfg.reindex, sizeof cfg.reindex, "%s", reindex);
    rk_service *svc = rk_test_service_open(&cfg, model);
    const char *prompt =
        "You are a storyteller.##Lily had a red ball. She liked to play with it in the garden "
        "every day and her mother watched.##Tom had a big dog named Max. Max liked to run and "
        "bark at the birds in the park.##The sun was warm and the sky was blue. The children "
        "sang a happy song together.##Then the rain came and everyone ran home to have soup "
        "and bread.##One day";
    for (int ctx = 0; ctx < 3; ctx++) {
        rk_chunk_index_flush(svc->chunks);
        rk_req_options o = greedy_opts();
        o.chunk_context = (rk_chunk_context)ctx;
        rk_request first, second, oracle;
        rk_test_log lf = {0}, ls = {0}, lo = {0};
        run(svc, prompt, &o, &first, &lf);
        int n_uncached = 0, chunk_tokens = 0;
        for (int k = 0; k < first.n_chunks; k++) {
            chunk_tokens += first.chunk_lens[k];
            n_uncached += first.chunk_reports[k].status == RK_CHUNK_STATUS_UNCACHED;
        }
        cr_assert_gt(chunk_tokens, 80, "the chunks need more than the pool: %d", chunk_tokens);
        cr_assert_geq(n_uncached, 1, "%s ctx %d", reindex, ctx);
        cr_assert_lt(n_uncached, first.n_chunks, "the pool took what it could");
        run(svc, prompt, &o, &second, &ls);
        int hits = 0;
        for (int k = 0; k < second.n_chunks; k++)
            hits += second.chunk_reports[k].status == RK_CHUNK_STATUS_HIT;
        cr_assert_geq(hits, 1, "the cached chunks hit on a repeat");
        rk_req_options off = o;
        off.chunk_cache = 0;
        run(svc, prompt, &off, &oracle, &lo);
        cr_assert_eq(memcmp(first.out_tokens, oracle.out_tokens, STEPS * sizeof(int32_t)), 0,
                     "%s ctx %d: tokens differ from the oracle", reindex, ctx);
        cr_assert_eq(memcmp(second.out_tokens, oracle.out_tokens, STEPS * sizeof(int32_t)), 0);
        double d1 = rk_test_max_logit_diff(&lf, &lo), d2 = rk_test_max_logit_diff(&ls, &lo);
        cr_assert_leq(d1, 1e-4, "%s ctx %d: logits differ by %g", reindex, ctx, d1);
        cr_assert_leq(d2, 1e-4, "%s ctx %d: logits differ by %g", reindex, ctx, d2);
        rk_request_free(&first);
        rk_request_free(&second);
        rk_request_free(&oracle);
        rk_test_log_free(&lf, 1);
        rk_test_log_free(&ls, 1);
        rk_test_log_free(&lo, 1);
    }
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

Test(pipeline, chunks_beyond_the_chunk_pool_are_uncached_and_equal_the_oracle) {
    check_uncached(NULL, "zero-copy");
    check_uncached(NULL, "copy");
}

Test(pipeline, stories260k_chunks_beyond_the_chunk_pool_are_uncached_and_equal_the_oracle) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_uncached(model, "zero-copy");
    check_uncached(model, "copy");
    free(model);
}

/* The prefix pool degrades the same way: a system prompt longer than the
 * whole pool is computed in live blocks and not cached, and the request is
 * answered as without the prefix cache. */
Test(pipeline, a_system_prompt_beyond_the_prefix_pool_is_served_uncached) {
    rk_config cfg = rk_test_config(2, 64, "f32");
    cfg.prefix_blocks = 1; /* 16 tokens */
    rk_service *svc = rk_test_service_open(&cfg, NULL);
    const char *prompt = "You are a storyteller who tells long and happy stories about animals "
                         "and children in the garden.##Lily had a red ball.##One day";
    rk_req_options o = greedy_opts(), off = greedy_opts();
    o.prefix_cache = 1;
    rk_request a, b, c;
    rk_test_log la = {0}, lb = {0}, lc = {0};
    run(svc, prompt, &o, &a, &la);
    cr_assert_gt(a.n_sys, 16, "the system prompt is longer than the prefix pool");
    run(svc, prompt, &o, &b, &lb);
    cr_assert_eq(b.sys_cached, 0, "nothing of it could be cached");
    run(svc, prompt, &off, &c, &lc);
    cr_assert_eq(memcmp(a.out_tokens, c.out_tokens, STEPS * sizeof(int32_t)), 0);
    cr_assert_eq(memcmp(b.out_tokens, c.out_tokens, STEPS * sizeof(int32_t)), 0);
    cr_assert_leq(rk_test_max_logit_diff(&la, &lc), 1e-4);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_request_free(&c);
    rk_test_log_free(&la, 1);
    rk_test_log_free(&lb, 1);
    rk_test_log_free(&lc, 1);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

/* A request that cannot fit the whole KV budget fails, leaving every block
 * in its pool: RK_ERR_CONTEXT when its live part alone is too big, else
 * RK_ERR_EXHAUSTED, which the scheduler turns into RK_ERR_CONTEXT when
 * nothing else runs (HTTP 400 context_length_exceeded, test_http). */
Test(pipeline, a_request_beyond_the_whole_budget_fails_with_context_length_exceeded) {
    rk_config cfg = rk_test_config(1, 64, NULL);
    cfg.live_blocks = 6;
    cfg.chunk_blocks = 2;
    rk_service *svc = rk_test_service_open(&cfg, NULL);
    rk_req_options o = greedy_opts();
    o.max_tokens = 2;
    char prompt[2048] = "S", piece[128];
    for (int i = 0; i < 6; i++) {
        snprintf(piece, sizeof piece, "##The little red fox %d ran into the deep forest.", i);
        strcat(prompt, piece);
    }
    strcat(prompt, "##Q");
    rk_request r;
    cr_assert_eq(prepare(svc, prompt, &o, &r), RK_OK, "%s", rk_error_message());
    rk_request *one = &r;
    rk_status st = rk_pipeline_run(svc, &one, 1, NULL);
    cr_assert(st == RK_ERR_EXHAUSTED || st == RK_ERR_CONTEXT, "%s", rk_status_str(st));
    rk_request_free(&r);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

Test(pipeline, referenced_entries_are_never_evicted) {
    rk_service *svc = open_svc(NULL, 4);
    int32_t toks[20];
    for (int i = 0; i < 20; i++) toks[i] = 10 + i;
    rk_chunk_entry *e1, *e2;
    rk_chunk_lookup kind;
    rk_chunk_key k1 = {1, 1}, k2 = {2, 2};
    cr_assert_eq(rk_chunk_index_acquire(svc->chunks, k1, toks, 20, 0, &e1, &kind), RK_OK);
    rk_chunk_index_ready(svc->chunks, e1);
    cr_assert_eq(rk_chunk_index_acquire(svc->chunks, k2, toks, 20, 0, &e2, &kind), RK_OK);
    rk_chunk_index_ready(svc->chunks, e2);
    /* Both referenced: a third cannot get room. */
    rk_chunk_entry *e3;
    rk_chunk_key k3 = {3, 3};
    cr_assert_eq(rk_chunk_index_acquire(svc->chunks, k3, toks, 20, 0, &e3, &kind),
                 RK_ERR_EXHAUSTED);
    cr_assert_eq(rk_chunk_index_remove(svc->chunks, k1), RK_ERR_BUSY);
    rk_chunk_index_release(svc->chunks, e1, 0);
    cr_assert_eq(rk_chunk_index_acquire(svc->chunks, k3, toks, 20, 0, &e3, &kind), RK_OK);
    cr_assert_eq(kind, RK_CHUNK_MISS);
    cr_assert_null(rk_chunk_index_find(svc->chunks, k1), "the unreferenced one was evicted");
    rk_chunk_index_release(svc->chunks, e3, 1); /* failed computation: removed */
    cr_assert_null(rk_chunk_index_find(svc->chunks, k3));
    rk_chunk_index_release(svc->chunks, e2, 0);
    rk_service_close(svc);
}

/* ---------------------------------------------------------------- bad input */

Test(pipeline, bad_input_is_an_error_or_a_defined_result) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options o = greedy_opts();
    o.max_tokens = 2;
    rk_request r;
    cr_assert_eq(prepare(svc, "S##\xff\xfe chunk##Q", &o, &r), RK_ERR_INVALID);
    cr_assert(strstr(rk_error_message(), "chunk 0") != NULL, "%s", rk_error_message());
    cr_assert_eq(prepare(svc, "##", &o, &r), RK_ERR_INVALID);
    cr_assert_eq(prepare(svc, "S##A##", &o, &r), RK_ERR_INVALID);
    /* 10,000 empty chunks: skipped and counted. */
    size_t n = 1 + 10001 * 2 + 1;
    char *p = malloc(n + 1);
    p[0] = 'S';
    memset(p + 1, '#', 10001 * 2);
    strcpy(p + 1 + 10001 * 2, "Q");
    run(svc, p, &o, &r, NULL);
    cr_assert_eq(r.n_chunks, 0);
    cr_assert_eq(r.n_empty_chunks, 10000);
    rk_request_free(&r);
    free(p);
    /* Over the chunk limit. */
    svc->cfg.max_chunks = 2;
    cr_assert_eq(prepare(svc, "S##a##b##c##Q", &o, &r), RK_ERR_LIMIT);
    svc->cfg.max_chunks = 64;
    svc->cfg.max_chunk_tokens = 4;
    cr_assert_eq(prepare(svc, "S##a chunk that is longer than four tokens##Q", &o, &r),
                 RK_ERR_LIMIT);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

/* ---------------------------------------------------------------- repair */

/* A repair that recomputes every chunk token must give the full-attention
 * result: the cached run, repaired, against mode plain. */
static void check_full_repair(const char *model, const rk_req_options *repair) {
    rk_service *svc = open_svc(model, 0);
    rk_req_options o = *repair, plain = greedy_opts();
    plain.mode = RK_MODE_PLAIN;
    plain.prefix_cache = 0;
    rk_request warm, a, b;
    rk_test_log la = {0}, lb = {0};
    run(svc, STORY, &o, &warm, NULL); /* the chunks are cached... */
    run(svc, STORY, &o, &a, &la);     /* ...hit, then repaired */
    run(svc, STORY, &plain, &b, &lb);
    int total = 0;
    for (int k = 0; k < a.n_chunks; k++) {
        cr_assert_eq(a.chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
        total += a.chunk_lens[k];
    }
    cr_assert_eq(a.recomputed_tokens, total);
    cr_assert_eq(a.cached_tokens, a.sys_cached, "repaired tokens count as computed");
    cr_assert_eq(memcmp(a.out_tokens, b.out_tokens, STEPS * sizeof(int32_t)), 0);
    double d = rk_test_max_logit_diff(&la, &lb);
    cr_assert_leq(d, 1e-4, "repaired logits differ from full attention by %g", d);
    rk_request_free(&warm);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_test_log_free(&la, 1);
    rk_test_log_free(&lb, 1);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

/* Repair options that recompute every chunk token: first_k with k longer
 * than any chunk (0), deviation at ratio 1 (1), query at ratio 1 (2). */
static rk_req_options repair_all(int policy) {
    rk_req_options o = greedy_opts();
    if (policy)
        o.repair_ratio = 1;
    else
        o.repair_k = 4096;
    o.repair_query = policy == 2;
    return o;
}

Test(pipeline, repairing_every_chunk_token_gives_the_full_attention_result) {
    rk_req_options o = repair_all(0);
    check_full_repair(NULL, &o);
}

Test(pipeline, deviation_repair_of_every_token_gives_the_full_attention_result) {
    rk_req_options o = repair_all(1);
    check_full_repair(NULL, &o);
}

Test(pipeline, query_repair_of_every_token_gives_the_full_attention_result) {
    rk_req_options o = repair_all(2);
    check_full_repair(NULL, &o);
}

Test(pipeline, ragqa_query_repair_of_every_token_gives_the_full_attention_result) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/ragqa/ragqa.gguf");
    rk_req_options o = repair_all(2);
    check_full_repair(model, &o);
    free(model);
}

Test(pipeline, stories260k_full_repairs_give_the_full_attention_result) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    for (int policy = 0; policy < 3; policy++) {
        rk_req_options o = repair_all(policy);
        check_full_repair(model, &o);
    }
    free(model);
}

Test(pipeline, qwen3moe_tiny_full_repairs_give_the_full_attention_result) {
    char *model = rk_test_model("qwen3moe-tiny", "f32", 1);
    for (int policy = 0; policy < 3; policy++) {
        rk_req_options o = repair_all(policy);
        check_full_repair(model, &o);
    }
    free(model);
}

/* A ratio policy (deviation, or query when query is set) recomputes
 * ceil(ratio x chunk tokens), every chunk's first token among them, changes
 * the result, and leaves the cached entries alone. */
static void check_ratio_repair(int query, float ratio) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options o = greedy_opts(), none = greedy_opts();
    o.repair_ratio = ratio;
    o.repair_query = query;
    rk_request a, b, c;
    rk_test_log la = {0}, lb = {0};
    run(svc, STORY, &none, &a, &la);
    run(svc, STORY, &o, &b, &lb);
    int total = 0, repaired = 0;
    for (int k = 0; k < b.n_chunks; k++) {
        total += b.chunk_lens[k];
        repaired += b.chunk_reports[k].repaired;
        cr_assert_leq(b.chunk_reports[k].repaired, b.chunk_lens[k]);
        cr_assert_geq(b.chunk_reports[k].repaired, 1, "chunk %d: its first token", k);
    }
    cr_assert_eq(b.recomputed_tokens, (int)ceil(ratio * total - 1e-9), "ceil(%g x %d) tokens",
                 ratio, total);
    cr_assert_eq(repaired, b.recomputed_tokens);
    cr_assert_eq(b.cached_tokens, b.sys_cached + total - repaired);
    cr_assert_eq(b.cached_tokens + b.computed_tokens, b.prompt_tokens);
    cr_assert_gt(b.t.repair_ms, 0);
    /* The repair changed the result (deviation: layers 0..1 of every chunk
     * token, and the chosen ones through every layer, now see the other
     * chunks)... */
    cr_assert_gt(rk_test_max_logit_diff(&la, &lb), 0);
    /* ...but not the cached entries: without it, the first run's tokens again. */
    run(svc, STORY, &none, &c, NULL);
    cr_assert_eq(memcmp(a.out_tokens, c.out_tokens, STEPS * sizeof(int32_t)), 0);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_request_free(&c);
    rk_test_log_free(&la, 1);
    rk_test_log_free(&lb, 1);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

Test(pipeline, deviation_repair_recomputes_its_ratio_and_leaves_the_cache_alone) {
    check_ratio_repair(0, 0.25f);
}

/* With room for one token a chunk, deviation recomputes one in every chunk:
 * each chunk's first token ranks above every deviation score. */
Test(pipeline, deviation_repair_takes_every_chunks_first_token_first) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options none = greedy_opts(), o = greedy_opts();
    rk_request a, b;
    run(svc, STORY, &none, &a, NULL);
    int total = 0;
    for (int k = 0; k < a.n_chunks; k++) total += a.chunk_lens[k];
    cr_assert_gt(a.n_chunks, 1);
    o.repair_ratio = (float)a.n_chunks / (float)total;
    run(svc, STORY, &o, &b, NULL);
    cr_assert_eq(b.recomputed_tokens, b.n_chunks);
    for (int k = 0; k < b.n_chunks; k++)
        cr_assert_eq(b.chunk_reports[k].repaired, 1, "chunk %d", k);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

Test(pipeline, query_repair_recomputes_its_ratio_first_tokens_first_and_leaves_the_cache_alone) {
    check_ratio_repair(1, 0.2f);
}

Test(pipeline, first_k_repair_recomputes_k_tokens_per_chunk_and_leaves_the_cache_alone) {
    rk_service *svc = open_svc(NULL, 0);
    rk_req_options o = greedy_opts(), none = greedy_opts();
    o.repair_k = 4;
    rk_request a, b, c;
    run(svc, STORY, &none, &a, NULL);
    run(svc, STORY, &o, &b, NULL);
    cr_assert_eq(b.recomputed_tokens, 4 * b.n_chunks);
    cr_assert_eq(b.cached_tokens + b.computed_tokens, b.prompt_tokens);
    cr_assert_gt(b.t.repair_ms, 0);
    /* The cached entries were not touched by the repair: without it, the same
     * tokens as the first time come back. */
    run(svc, STORY, &none, &c, NULL);
    cr_assert_eq(memcmp(a.out_tokens, c.out_tokens, STEPS * sizeof(int32_t)), 0);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_request_free(&c);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

/* ---------------------------------------------------------------- KV sizing */

/* Qwen3-0.6B's KV shape and context; its F32 weights take 2.4 GB. */
static rk_hparams qwen3_shape(void) {
    rk_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layers = 28;
    hp.n_kv_heads = 8;
    hp.head_dim = 128;
    hp.n_ctx = 40960;
    return hp;
}

static int pool_tokens(const rk_kv_plan *k, int pool) {
    return k->pool_blocks[pool] * k->block_size;
}

Test(kv_plan, auto_holds_a_whole_context_in_the_live_and_chunk_pools_within_the_memory) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    rk_hparams hp = qwen3_shape();
    uint64_t weights = 2390146624ull;
    cfg.memory_limit_mb = 24 * 1024;
    rk_kv_plan k;
    cr_assert_eq(rk_kv_plan_make(&cfg, &hp, weights, "cpu", &k), RK_OK, "%s", rk_error_message());
    cr_expect(k.auto_sized);
    cr_expect_eq(k.dtype, RK_DTYPE_F16, "f16 by default on the CPU");
    cr_expect_eq(k.token_bytes, 28 * 8 * 128 * 2 * 2);
    cr_expect_str_eq(k.memory_source, "memory_limit_mb");
    double left = (double)((24ull << 30) - weights);
    cr_expect_leq((double)k.budget_bytes, RK_KV_AUTO_CAP * left + 1);
    cr_expect_geq(pool_tokens(&k, RK_POOL_LIVE), 40960);
    cr_expect_geq(pool_tokens(&k, RK_POOL_CHUNK), 40960);
    cr_expect(k.fits_context);
    /* Four times today's f32 1024 MiB chunk pool (2,336 tokens) at least. */
    cr_expect_geq(pool_tokens(&k, RK_POOL_CHUNK), 4 * 2336);
    char line[512];
    rk_kv_plan_describe(&k, line, sizeof line);
    cr_expect(strstr(line, "auto") && strstr(line, "memory_limit_mb") && strstr(line, "chunk"),
              "%s", line);

    /* A roomy machine: half of what is left, above the floor. */
    cfg.memory_limit_mb = 64 * 1024;
    cr_assert_eq(rk_kv_plan_make(&cfg, &hp, weights, "cpu", &k), RK_OK);
    left = (double)((64ull << 30) - weights);
    cr_expect_float_eq((double)k.budget_bytes, RK_KV_AUTO_SHARE * left, 1.0);

    /* A laptop with 8 GiB: the cap wins and the plan says the context does not fit. */
    cfg.memory_limit_mb = 8 * 1024;
    cr_assert_eq(rk_kv_plan_make(&cfg, &hp, weights, "cpu", &k), RK_OK);
    left = (double)((8ull << 30) - weights);
    cr_expect_float_eq((double)k.budget_bytes, RK_KV_AUTO_CAP * left, 1.0);
    cr_expect_not(k.fits_context);
    rk_kv_plan_describe(&k, line, sizeof line);
    cr_expect(strstr(line, "does NOT fit"), "%s", line);
    /* ... unless --max-context asks for less. */
    cfg.max_context = 8192;
    cr_assert_eq(rk_kv_plan_make(&cfg, &hp, weights, "cpu", &k), RK_OK);
    cr_expect(k.fits_context);
    cr_expect_eq(k.context, 8192);
    cr_expect_geq(pool_tokens(&k, RK_POOL_CHUNK), 8192);
    cr_expect_leq((double)k.budget_bytes, RK_KV_AUTO_CAP * left + 1);

    /* Less memory than the weights: a clear error. */
    cfg.memory_limit_mb = 2000;
    cr_expect_eq(rk_kv_plan_make(&cfg, &hp, weights, "cpu", &k), RK_ERR_INVALID);
    cr_expect(strstr(rk_error_message(), "kv_memory_mb"), "%s", rk_error_message());
}

Test(kv_plan, explicit_budgets_types_and_small_models_are_sized_as_asked) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    rk_hparams hp = qwen3_shape();
    rk_kv_plan k;
    /* Yesterday's defaults: f32, 1024 MiB, 146 chunk blocks. */
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "f32");
    cfg.kv_memory_mb = 1024;
    cr_assert_eq(rk_kv_plan_make(&cfg, &hp, 0, "cpu", &k), RK_OK);
    cr_expect_not(k.auto_sized);
    cr_expect_eq(k.pool_blocks[RK_POOL_CHUNK], 146);
    cr_expect_eq(pool_tokens(&k, RK_POOL_LIVE), 1872);
    /* f16 at the same budget: twice the tokens. */
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "f16");
    cr_assert_eq(rk_kv_plan_make(&cfg, &hp, 0, "cpu", &k), RK_OK);
    cr_expect_eq(k.pool_blocks[RK_POOL_CHUNK], 292);
    /* A small model needs no more than RK_KV_AUTO_MAX_CONTEXTS contexts. */
    rk_hparams tiny = hp;
    tiny.n_layers = 2;
    tiny.n_kv_heads = 2;
    tiny.head_dim = 32;
    tiny.n_ctx = 512;
    cfg.kv_memory_mb = 0;
    cfg.memory_limit_mb = 64 * 1024;
    cr_assert_eq(rk_kv_plan_make(&cfg, &tiny, 1 << 20, "cpu", &k), RK_OK);
    cr_expect_float_eq((double)k.budget_bytes,
                       RK_KV_AUTO_MAX_CONTEXTS * 512.0 * (double)k.token_bytes, 1.0);
    cr_expect(k.fits_context);
    /* A device backend: the fixed default, whatever the host has. */
    cr_assert_eq(rk_kv_plan_make(&cfg, &hp, 0, "cuda", &k), RK_OK);
    cr_expect_eq(k.budget_bytes, (uint64_t)RK_KV_AUTO_DEVICE_MB << 20);
    /* Q8_0 KV: 34 bytes per 32 values, refused on CUDA with a clear error. */
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "q8_0");
    cr_assert_eq(rk_kv_plan_make(&cfg, &hp, 0, "cpu", &k), RK_OK);
    cr_expect_eq(k.token_bytes, 28 * 2 * (8 * 128 / 32 * 34));
    cr_expect_eq(rk_kv_plan_make(&cfg, &hp, 0, "cuda", &k), RK_ERR_UNSUPPORTED);
    cr_expect(strstr(rk_error_message(), "q8_0") && strstr(rk_error_message(), "cuda"), "%s",
              rk_error_message());
}

Test(kv_plan, a_service_sized_auto_has_the_pools_of_its_plan) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = 1;
    cfg.memory_limit_mb = 1024;
    cfg.max_context = 1024;
    rk_service *svc = rk_test_service_open(&cfg, NULL);
    cr_expect(svc->kv.auto_sized);
    cr_expect(svc->kv.fits_context);
    cr_expect_eq(rk_arena_kv(svc->arena)->dtype, RK_DTYPE_F16);
    for (int p = 0; p < RK_POOL_COUNT; p++)
        cr_expect_eq(rk_arena_pool_total(svc->arena, (rk_pool_tag)p), svc->kv.pool_blocks[p]);
    cr_expect_geq(rk_arena_pool_total(svc->arena, RK_POOL_CHUNK) * 16, 1024);
    json_t *j = rk_kv_plan_json(&svc->kv);
    cr_expect_str_eq(json_string_value(json_object_get(j, "dtype")), "f16");
    cr_expect_eq(json_integer_value(json_object_get(
                     json_object_get(json_object_get(j, "pools"), "chunk"), "tokens")),
                 svc->kv.pool_blocks[RK_POOL_CHUNK] * 16);
    json_decref(j);
    rk_service_close(svc);
}
