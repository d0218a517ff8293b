/* tests/test_groups.c — layouts of several chunk groups (rk_split_segments):
 * documents that arrive later in a conversation sit where they stand, a
 * text between two groups. The cached path equals the oracle (the same
 * layout, every chunk computed fresh) in every chunk context and position
 * mode, with and without a repair (`first_k`, `deviation`, `query`);
 * repairing every chunk token gives full attention over the same tokens; a
 * follow-up that adds a group reuses the earlier sequence and finds its new
 * chunk where it stands. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline.h"
#include "tests/testutil.h"

#define STEPS 10

static rk_req_options greedy_opts(void) {
    rk_req_options o;
    rk_test_oracle_options(&o, STEPS);
    return o;
}

static const char *GROUP0[] = {"Lily had a red ball. She liked to play with it every day.",
                               "Tom had a big dog named Max."};
static const char *GROUP1[] = {"The sun was warm and the sky was blue.",
                               "Max liked to run and bark at the birds."};
static const char *GROUP2[] = {"One day the ball rolled into the pond."};

/* system, group 0, a turn, group 1 (empty when !with1), a turn, group 2,
 * the question: n_segs segments of it (7: all of it). */
static int layout(rk_segment *segs, int with1, int n_groups) {
    int n = 0;
    segs[n++] = (rk_segment){.text = "You are a storyteller."};
    segs[n++] = (rk_segment){.chunks = GROUP0, .n_chunks = 2};
    segs[n++] = (rk_segment){.text = "Who had a ball? Lily did. What next?"};
    segs[n++] = (rk_segment){.chunks = GROUP1, .n_chunks = with1 ? 2 : 0};
    if (n_groups > 2) {
        segs[n++] = (rk_segment){.text = "And then?"};
        segs[n++] = (rk_segment){.chunks = GROUP2, .n_chunks = 1};
    }
    segs[n++] = (rk_segment){.text = "Tell me the story."};
    return n;
}

static void run(rk_service *svc, const rk_segment *segs, int n_segs, const rk_req_options *o,
                rk_request *r, rk_test_log *log) {
    rk_split sp;
    cr_assert_eq(rk_split_segments(segs, n_segs, svc->cfg.max_chunks, &sp), RK_OK, "%s",
                 rk_error_message());
    rk_test_run_split(svc, &sp, o, r, log);
    rk_split_free(&sp);
}

static rk_service *open_svc(const char *model) {
    rk_config cfg = rk_test_config(2, 256, "f32");
    return rk_test_service_open(&cfg, model);
}

Test(groups, segments_make_the_layout_and_join_adjacent_texts) {
    const char *one[] = {"a chunk", ""};
    rk_segment segs[] = {{.text = "sys "},    {.text = "tem"},  {.chunks = one, .n_chunks = 2},
                         {.text = "between"}, {.chunks = NULL}, {.chunks = one, .n_chunks = 1},
                         {.text = "question"}};
    rk_split sp;
    cr_assert_eq(rk_split_segments(segs, 7, 8, &sp), RK_OK);
    cr_expect_str_eq(sp.system.s, "sys tem");
    cr_expect_eq(sp.n_groups, 3);
    cr_expect_eq(sp.n_chunks, 2);
    cr_expect_eq(sp.n_empty_chunks, 1);
    cr_expect_eq(sp.group_end[0], 1);
    cr_expect_eq(sp.group_end[1], 1);
    cr_expect_eq(sp.group_end[2], 2);
    cr_expect_str_eq(sp.texts[0].s, "between");
    cr_expect_str_eq(sp.texts[1].s, "");
    cr_expect_str_eq(sp.question.s, "question");
    rk_split_free(&sp);
    /* One group: the classic layout. */
    cr_assert_eq(rk_split_segments(segs + 1, 3, 8, &sp), RK_OK);
    cr_expect_eq(sp.n_groups, 0);
    cr_expect_eq(sp.n_chunks, 1);
    cr_expect_str_eq(sp.system.s, "tem");
    cr_expect_str_eq(sp.question.s, "between");
    rk_split_free(&sp);
    /* No group: a plain prompt; a group with no question after it: an error. */
    cr_assert_eq(rk_split_segments(segs, 2, 8, &sp), RK_OK);
    cr_expect_str_eq(sp.question.s, "sys tem");
    cr_expect_eq(sp.n_chunks, 0);
    rk_split_free(&sp);
    cr_expect_eq(rk_split_segments(segs, 3, 8, &sp), RK_ERR_INVALID);
    cr_expect_eq(rk_split_segments(segs, 7, 1, &sp), RK_ERR_LIMIT);
}

/* Cached (second run) against the oracle in every context and position
 * mode: the same greedy tokens and logits within 1e-4 (f32 KV). */
static void check_modes_with(const char *model, int repair_k, float ratio, int query) {
    rk_service *svc = open_svc(model);
    rk_segment segs[8];
    int n = layout(segs, 1, 3);
    for (int ctx = 0; ctx < 3; ctx++)
        for (int par = 0; par < 2; par++) {
            rk_chunk_index_flush(svc->chunks);
            rk_req_options o = greedy_opts();
            o.repair_k = repair_k;
            o.repair_ratio = ratio;
            o.repair_query = query;
            o.chunk_context = (rk_chunk_context)ctx;
            o.positions = par ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
            rk_request first, second, oracle;
            rk_test_log lf = {0}, ls = {0}, lo = {0};
            run(svc, segs, n, &o, &first, &lf);
            run(svc, segs, n, &o, &second, &ls);
            cr_assert_eq(second.n_chunks, 5);
            for (int k = 0; k < 5; k++) {
                cr_assert_eq(first.chunk_reports[k].status, RK_CHUNK_STATUS_MISS);
                cr_assert_eq(second.chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
                cr_assert_eq(second.chunk_reports[k].group, k < 2 ? 0 : k < 4 ? 1 : 2);
            }
            /* Group 1 starts after group 0 and the text between them. */
            cr_assert_gt(second.chunk_reports[2].live_offset,
                         second.chunk_reports[1].live_offset + second.chunk_lens[1]);
            rk_req_options off = o;
            off.chunk_cache = 0;
            run(svc, segs, n, &off, &oracle, &lo);
            cr_assert_eq(memcmp(second.out_tokens, oracle.out_tokens, STEPS * sizeof(int32_t)), 0,
                         "context %d parallel %d: cached tokens differ from the oracle", ctx, par);
            double d = rk_test_max_logit_diff(&ls, &lo);
            cr_assert_leq(d, 1e-4, "context %d parallel %d: logits differ by %g", ctx, par, d);
            cr_assert_eq(memcmp(first.out_tokens, second.out_tokens, STEPS * sizeof(int32_t)), 0);
            if (ratio == 0)
                cr_assert_eq(second.recomputed_tokens, repair_k ? 5 * repair_k : 0,
                             "the texts between groups are not repairs");
            int chunk_tokens = 0;
            for (int k = 0; k < 5; k++) chunk_tokens += second.chunk_lens[k];
            cr_assert_leq(second.recomputed_tokens, chunk_tokens);
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

static void check_modes(const char *model, int repair_k) {
    check_modes_with(model, repair_k, 0, 0);
}

Test(groups, cached_path_equals_the_oracle_in_every_mode) { check_modes(NULL, 0); }

Test(groups, deviation_and_query_repaired_cached_path_equals_the_oracle_in_every_mode) {
    check_modes_with(NULL, 0, 0.3f, 0);
    check_modes_with(NULL, 0, 0.3f, 1);
}

Test(groups, first_k_repaired_cached_path_equals_the_oracle_in_every_mode) { check_modes(NULL, 2); }

Test(groups, stories260k_cached_path_equals_the_oracle_in_every_mode) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_modes(model, 0);
    free(model);
}

Test(groups, qwen3_tiny_cached_path_equals_the_oracle_in_every_mode) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    check_modes(model, 2);
    free(model);
}

/* Every chunk token repaired (first_k longer than any chunk, deviation or
 * query at ratio 1): full attention over the same tokens in the same order
 * (plain mode), whatever the groups. */
static void check_full_repair(int policy) {
    rk_service *svc = open_svc(NULL);
    rk_segment segs[8];
    int n = layout(segs, 1, 3);
    rk_req_options o = greedy_opts(), plain = greedy_opts();
    if (policy)
        o.repair_ratio = 1;
    else
        o.repair_k = 4096;
    o.repair_query = policy == 2;
    plain.mode = RK_MODE_PLAIN;
    rk_request warm, a, b;
    rk_test_log la = {0}, lb = {0};
    run(svc, segs, n, &o, &warm, NULL);
    run(svc, segs, n, &o, &a, &la);
    run(svc, segs, n, &plain, &b, &lb);
    cr_assert_eq(a.prompt_tokens, b.prompt_tokens);
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

Test(groups, repairing_every_chunk_token_gives_the_full_attention_result) {
    for (int policy = 0; policy < 3; policy++) check_full_repair(policy);
}

/* A conversation: turn 1 has one group, turn 2 repeats it and adds a turn
 * and a group. With the prefix cache, turn 2 reuses turn 1's sequence (its
 * system prompt, group, text) and computes only what is new; its new
 * chunk, seen before in another layout, is a hit at its live offset in
 * group 1. The same as turn 2 with the caches off. */
Test(groups, a_follow_up_reuses_the_conversation_and_finds_a_later_chunk_where_it_stands) {
    rk_service *svc = open_svc(NULL);
    rk_req_options o = greedy_opts();
    o.prefix_cache = 1;
    rk_segment elsewhere[] = {{.text = "Another system prompt."},
                              {.chunks = GROUP1 + 1, .n_chunks = 1},
                              {.text = "What did Max do?"}};
    rk_request other, t1, t2, cold;
    run(svc, elsewhere, 3, &o, &other, NULL);
    rk_segment turn1[] = {{.text = "You are a storyteller."},
                          {.chunks = GROUP0, .n_chunks = 2},
                          {.text = "Who had a ball?"}};
    run(svc, turn1, 3, &o, &t1, NULL);
    rk_segment turn2[] = {{.text = "You are a storyteller."},
                          {.chunks = GROUP0, .n_chunks = 2},
                          {.text = "Who had a ball?"},
                          {.chunks = GROUP1 + 1, .n_chunks = 1},
                          {.text = "And the dog?"}};
    rk_test_log l2 = {0}, lc = {0};
    run(svc, turn2, 5, &o, &t2, &l2);
    cr_assert_eq(t2.n_groups, 2);
    cr_assert_eq(t2.chunk_reports[0].source, RK_CHUNK_SOURCE_PREFIX);
    cr_assert_eq(t2.chunk_reports[1].source, RK_CHUNK_SOURCE_PREFIX);
    cr_assert_eq(t2.chunk_reports[2].status, RK_CHUNK_STATUS_HIT);
    cr_assert_eq(t2.chunk_reports[2].source, RK_CHUNK_SOURCE_ARENA);
    cr_assert_eq(t2.chunk_reports[2].group, 1);
    int after = t1.prompt_tokens + t2.gap_len[0] - t1.n_question;
    cr_assert_eq(t2.chunk_reports[2].live_offset, after, "%d", t2.chunk_reports[2].live_offset);
    /* Turn 1's prompt is reused but for its last token; the text after it,
     * the dog chunk (a hit) and the question are not computed again. */
    cr_assert_geq(t2.cached_tokens, t1.prompt_tokens - 1 + t2.chunk_lens[2], "%d of %d",
                  t2.cached_tokens, t2.prompt_tokens);
    rk_req_options off = greedy_opts();
    off.chunk_cache = 0;
    run(svc, turn2, 5, &off, &cold, &lc);
    cr_assert_eq(memcmp(t2.out_tokens, cold.out_tokens, STEPS * sizeof(int32_t)), 0);
    double d = rk_test_max_logit_diff(&l2, &lc);
    cr_assert_leq(d, 1e-4, "logits differ by %g", d);
    rk_request_free(&other);
    rk_request_free(&t1);
    rk_request_free(&t2);
    rk_request_free(&cold);
    rk_test_log_free(&l2, 1);
    rk_test_log_free(&lc, 1);
    rk_test_check_pools_back(svc);
    rk_service_close(svc);
}

static void keep_logits_of(void *ctx, int req, int step, const float *logits, int n_vocab) {
    if (req == 1 && step < STEPS) rk_test_keep_logits(ctx, 0, step, logits, n_vocab);
}

static void prepare_segments(rk_service *svc, const rk_segment *segs, int n_segs,
                             const rk_req_options *o, rk_request *r) {
    rk_split sp;
    memset(r, 0, sizeof *r);
    r->opt = *o;
    cr_assert_eq(rk_split_segments(segs, n_segs, svc->cfg.max_chunks, &sp), RK_OK);
    cr_assert_eq(rk_request_prepare(svc, &sp, r), RK_OK, "%s", rk_error_message());
    rk_split_free(&sp);
}

/* Beside a decoding stream, at 3 prompt tokens a step, a request of three
 * groups gets the tokens and logits it gets alone: its chunk misses, the
 * texts between its groups and its question fed a slice a step, in table
 * order, in every chunk context. */
Test(groups, a_layout_of_groups_fed_a_few_tokens_a_step_gets_its_tokens_alone) {
    rk_segment segs[8];
    int n = layout(segs, 1, 3);
    for (int ctx = 0; ctx < 3; ctx++) {
        rk_req_options o = greedy_opts();
        o.chunk_context = (rk_chunk_context)ctx;
        o.repair_k = ctx == 2 ? 2 : 0;
        o.repair_ratio = ctx == 1 ? 0.3f : 0; /* its deviation pass a slice a step too */
        rk_service *alone = open_svc(NULL);
        rk_request b;
        rk_test_log lb = {0};
        run(alone, segs, n, &o, &b, &lb);

        rk_config cfg = rk_test_config(2, 256, "f32");
        cfg.step_tokens = 3;
        rk_service *svc = rk_test_service_open(&cfg, NULL);
        rk_pipeline *p;
        cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
        rk_segment stream[] = {{.text = "A story about a cat and a hat and a bat."}};
        rk_req_options so = greedy_opts();
        so.max_tokens = 200;
        rk_request a, jb;
        prepare_segments(svc, stream, 1, &so, &a);
        prepare_segments(svc, segs, n, &o, &jb);
        rk_test_log lj = {0};
        rk_pipeline_hooks h = {.ctx = &lj, .on_logits = keep_logits_of};
        rk_request *pa = &a, *pb = &jb;
        cr_assert_eq(rk_pipeline_admit(p, &pa, 1, &h), RK_OK, "%s", rk_error_message());
        cr_assert_eq(rk_pipeline_step(p, &h), RK_OK);
        cr_assert_eq(rk_pipeline_join(p, &pb, 1), RK_OK, "%s", rk_error_message());
        int steps = 0;
        while (!jb.finished) {
            cr_assert_eq(rk_pipeline_step(p, &h), RK_OK);
            cr_assert(steps++ < 1000);
        }
        cr_assert_geq(steps, (jb.prompt_tokens - jb.n_sys) / 3, "fed a slice a step: %d steps",
                      steps);
        cr_assert_eq(memcmp(jb.out_tokens, b.out_tokens, STEPS * sizeof(int32_t)), 0, "context %d",
                     ctx);
        double d = rk_test_max_logit_diff(&lj, &lb);
        cr_assert_leq(d, 1e-4, "context %d: logits differ by %g", ctx, d);
        a.cancel = 1;
        while (rk_pipeline_n_running(p) > 0) cr_assert_eq(rk_pipeline_step(p, &h), RK_OK);
        rk_pipeline_free(p);
        rk_test_check_pools_back(svc);
        rk_request_free(&a);
        rk_request_free(&jb);
        rk_request_free(&b);
        rk_test_log_free(&lj, 1);
        rk_test_log_free(&lb, 1);
        rk_service_close(svc);
        rk_service_close(alone);
    }
}
