/* tests/test_zerocopy.c — zero-copy reindex: cached chunks attended in place
 * (position-shifted runs over the chunk pool's blocks) give what copying them
 * into live blocks gives, in every mode; the shared blocks stay put while a
 * request holds them; every reference comes back. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/report.h"
#include "pipeline/pipeline.h"
#include "tests/testutil.h"

#define MAX_REQS 4

typedef struct svc_opts {
    const char *reindex;
    int block_size, chunk_blocks, poison;
} svc_opts;

static rk_service *open_svc(const char *model, svc_opts so) {
    /* The exactness bounds are f32's; f16 (the default) is checked on its own. */
    rk_config cfg = rk_test_config(2, 64, "f32");
    snprintf(cfg.reindex, sizeof cfg.reindex, "%s", so.reindex);
    if (so.block_size) cfg.block_size = so.block_size;
    if (so.chunk_blocks) cfg.chunk_blocks = so.chunk_blocks;
    cfg.kv_poison = so.poison;
    return rk_test_service_open(&cfg, model);
}

static rk_req_options greedy_opts(int max_tokens) {
    rk_req_options o;
    rk_req_options_default(&o);
    o.max_tokens = max_tokens;
    o.sampling.temperature = 0;
    o.stop_at_eog = 0;
    /* Compare the reindex paths themselves: a repeat served whole from the
     * radix tree would skip them. */
    o.reuse_sequences = 0;
    return o;
}

static void prepare(rk_service *svc, const char *prompt, const rk_req_options *o, rk_request *r) {
    rk_split sp;
    memset(r, 0, sizeof *r);
    r->opt = *o;
    cr_assert_eq(rk_split_prompt(prompt, strlen(prompt), NULL, svc->cfg.max_chunks, &sp), RK_OK);
    rk_status st = rk_request_prepare(svc, &sp, r);
    rk_split_free(&sp);
    cr_assert_eq(st, RK_OK, "%s", rk_error_message());
}

/* Run prompts[0..n) admitted together; reports in r[], logits in log[]. */
static void run_together(rk_service *svc, const char *const *prompts, int n,
                         const rk_req_options *o, rk_request *r, rk_test_log *log) {
    rk_request *reqs[MAX_REQS];
    for (int i = 0; i < n; i++) {
        prepare(svc, prompts[i], o, &r[i]);
        reqs[i] = &r[i];
    }
    rk_pipeline_hooks h = {.ctx = log, .on_logits = rk_test_keep_logits};
    cr_assert_eq(rk_pipeline_run(svc, reqs, n, &h), RK_OK, "%s", rk_error_message());
}

/* Every live block free, the chunk pool holding exactly the entries' blocks,
 * no entry referenced. */
static void check_counts_back(rk_service *svc) {
    int entries = rk_test_check_pools_back(svc);
    cr_assert_eq(rk_chunk_index_flush(svc->chunks), entries, "no entry is referenced");
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_CHUNK),
                 rk_arena_pool_total(svc->arena, RK_POOL_CHUNK));
}

/* The same prompts through a zero-copy and a copy service, twice (the first
 * time the chunks are computed, the second they hit): same tokens, logits
 * within 1e-4, and the zero-copy service reports each chunk's path. */
static void check_same(const char *model, svc_opts so, const char *const *prompts, int n,
                       const rk_req_options *o) {
    so.reindex = "zero-copy";
    rk_service *zc = open_svc(model, so);
    so.reindex = "copy";
    rk_service *cp = open_svc(model, so);
    int bs = rk_arena_block_size(zc->arena);
    for (int pass = 0; pass < 2; pass++) {
        rk_request rz[MAX_REQS], rc[MAX_REQS];
        rk_test_log lz[MAX_REQS] = {0}, lc[MAX_REQS] = {0};
        run_together(zc, prompts, n, o, rz, lz);
        run_together(cp, prompts, n, o, rc, lc);
        for (int i = 0; i < n; i++) {
            int shared = 0;
            for (int k = 0; k < rz[i].n_chunks; k++) {
                const rk_chunk_report *c = &rz[i].chunk_reports[k];
                /* Private: the blocks a first_k repair writes; deviation copies all. */
                int len = c->tokens, m = 0;
                if (o->repair_ratio > 0) {
                    m = len;
                } else if (o->repair_k > 0) {
                    m = ((o->repair_k < len ? o->repair_k : len) + bs - 1) / bs * bs;
                    m = m < len ? m : len;
                }
                cr_assert_eq(c->zero_copy, m < len, "request %d chunk %d", i, k);
                cr_assert_eq(rc[i].chunk_reports[k].zero_copy, 0);
                if (pass) cr_assert_eq(c->status, RK_CHUNK_STATUS_HIT);
                if (m == 0) cr_assert_eq(c->reindex_us, 0);
                shared += m < len ? (len + bs - 1) / bs - m / bs : 0;
            }
            cr_assert_eq(rz[i].shared_blocks, shared);
            cr_assert_eq(rc[i].shared_blocks, 0);
            cr_assert_eq(rz[i].recomputed_tokens, rc[i].recomputed_tokens);
            cr_assert_eq(rz[i].n_out, rc[i].n_out);
            cr_assert_eq(
                memcmp(rz[i].out_tokens, rc[i].out_tokens, (size_t)rz[i].n_out * sizeof(int32_t)),
                0, "pass %d request %d: zero-copy tokens differ from copy", pass, i);
            double d = rk_test_max_logit_diff(&lz[i], &lc[i]);
            cr_assert_leq(d, 1e-4, "pass %d request %d: logits differ by %g", pass, i, d);
            rk_request_free(&rz[i]);
            rk_request_free(&rc[i]);
            rk_test_log_free(&lz[i], 1);
            rk_test_log_free(&lc[i], 1);
        }
    }
    check_counts_back(zc);
    check_counts_back(cp);
    rk_service_close(zc);
    rk_service_close(cp);
}

static const char *STORY =
    "You are a storyteller.##Lily had a red ball. She liked to play with it in the garden every "
    "day.##Tom had a big dog named Max. Max liked to run and bark at the birds.##The sun was warm "
    "and the sky was blue. The children sang a happy song.##One day";

/* Every chunk context (isolated, system, anchor) x position mode x repair policy. */
static void check_every_mode(const char *model) {
    for (int ctx = 0; ctx < 3; ctx++)
        for (int par = 0; par < 2; par++)
            for (int rep = 0; rep < 3; rep++) {
                rk_req_options o = greedy_opts(12);
                o.chunk_context = (rk_chunk_context)ctx /* isolated, system, anchor */;
                o.positions = par ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
                if (rep == 1) o.repair_k = 3;
                if (rep == 2) o.repair_ratio = 0.25f;
                check_same(model, (svc_opts){0}, &STORY, 1, &o);
            }
}

Test(zerocopy, tiny_zero_copy_equals_copy_in_every_mode) { check_every_mode(NULL); }

Test(zerocopy, stories260k_zero_copy_equals_copy_in_every_mode) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    check_every_mode(model);
    free(model);
}

/* Gemma 3's local and global RoPE and sliding windows: the runs are read
 * with each layer's RoPE, as the copy rotates them; Gemma 4's layers that
 * reuse KV read the runs of the layer that owns it. */
Test(zerocopy, gemma_zero_copy_equals_copy_in_every_mode, .timeout = 600) {
    const char *presets[3] = {"gemma3-micro", "gemma2-tiny", "gemma4-tiny"};
    for (int p = 0; p < 3; p++) {
        char *model = rk_test_model(presets[p], "f32", 6);
        check_every_mode(model);
        free(model);
    }
}

/* 8-token blocks and 40 generated tokens: the shared runs end mid-block and
 * decoding crosses five live block boundaries behind them. */
Test(zerocopy, decode_crosses_block_boundaries_behind_shared_runs) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    for (int par = 0; par < 2; par++) {
        rk_req_options o = greedy_opts(40);
        o.positions = par ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
        check_same(model, (svc_opts){.block_size = 8}, &STORY, 1, &o);
        check_same(NULL, (svc_opts){.block_size = 8}, &STORY, 1, &o);
        o.repair_k = 11; /* copy on write of two 8-token blocks a chunk, the rest shared */
        check_same(model, (svc_opts){.block_size = 8}, &STORY, 1, &o);
    }
    free(model);
}

Test(zerocopy, sixty_four_chunks_in_one_request) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    static char prompt[8192];
    int at = snprintf(prompt, sizeof prompt, "Read the notes.");
    const char *things[4] = {"a cat", "the sea", "a red ball", "two birds"};
    for (int i = 0; i < 64; i++)
        at += snprintf(prompt + at, sizeof prompt - (size_t)at, "##Note %d is about %s.", i,
                       things[i % 4]);
    snprintf(prompt + at, sizeof prompt - (size_t)at, "##What is note 7 about?");
    const char *p = prompt;
    rk_req_options o = greedy_opts(8);
    check_same(model, (svc_opts){0}, &p, 1, &o);
    o.positions = RK_POSITIONS_PARALLEL;
    check_same(model, (svc_opts){0}, &p, 1, &o);
    free(model);
}

/* One chunk at three live offsets in requests admitted together: each run
 * gets its own shift over the same blocks. */
Test(zerocopy, concurrent_requests_place_one_chunk_at_different_offsets) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    const char *prompts[3] = {
        "You are a storyteller.##Tom had a big dog named Max.##Lily had a red ball.##One day",
        "You are a storyteller.##Lily had a red ball.##One day",
        "Be brief.##The sun was warm and the sky was blue. The children sang.##Tom had a big dog "
        "named Max.##Lily had a red ball.##Then"};
    rk_req_options o = greedy_opts(16);
    check_same(model, (svc_opts){0}, prompts, 3, &o);
    o.chunk_context = RK_CONTEXT_SYSTEM;
    check_same(model, (svc_opts){0}, prompts, 3, &o);
    free(model);
}

/* While a request attends chunk-pool blocks in place, neither pool pressure
 * nor a DELETE of the entry frees them (freed blocks are poisoned with NaN,
 * so a freed and reused block would show in its logits); once it leaves,
 * every reference is back and the entry can go. */
Test(zerocopy, held_shared_blocks_survive_eviction_and_delete) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    /* Each chunk below is 17..32 tokens: two 16-token blocks; 6 blocks hold three. */
    const char *held = "S##The little red fox ran into the forest.##A big blue whale swam in the "
                       "sea.##Q";
    const char *other[3] = {"S##Three small birds sang in the tree.##Q",
                            "S##An old brown bear slept in a dark cave.##Q",
                            "S##Five green frogs jumped into the pond.##Q"};
    rk_req_options o = greedy_opts(24);
    /* The reference: the same request alone on a copy service. */
    rk_service *cp = open_svc(model, (svc_opts){.reindex = "copy"});
    rk_request ref;
    rk_test_log lref = {0};
    run_together(cp, &held, 1, &o, &ref, &lref);
    rk_service *svc =
        open_svc(model, (svc_opts){.reindex = "zero-copy", .chunk_blocks = 6, .poison = 1});
    int live0 = rk_arena_pool_free(svc->arena, RK_POOL_LIVE);
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    rk_request r;
    rk_test_log lr = {0};
    prepare(svc, held, &o, &r);
    rk_request *one = &r;
    rk_pipeline_hooks h = {.ctx = &lr, .on_logits = rk_test_keep_logits};
    cr_assert_eq(rk_pipeline_admit(p, &one, 1, &h), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r.shared_blocks, 4);
    rk_chunk_key keys[2];
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(r.chunk_reports[k].zero_copy, 1);
        cr_assert_eq(rk_chunk_key_parse(r.chunk_reports[k].key, &keys[k]), RK_OK);
        cr_assert_eq(rk_chunk_index_remove(svc->chunks, keys[k]), RK_ERR_BUSY,
                     "DELETE of a chunk in use is refused");
    }
    cr_assert_eq(rk_chunk_index_evict(svc->chunks, 6), 0, "held entries are not evicted");
    /* Other requests cycle the two free blocks through three more chunks,
     * evicting each other, between the held request's decode steps. */
    rk_pipeline_hooks none = {0};
    rk_req_options once = greedy_opts(1);
    for (int i = 0; i < 3; i++) {
        rk_request x;
        prepare(svc, other[i], &once, &x);
        rk_request *xp = &x;
        cr_assert_eq(rk_pipeline_admit(p, &xp, 1, &none), RK_OK, "%s", rk_error_message());
        cr_assert_eq(x.finished, 1);
        rk_request_free(&x);
        cr_assert_eq(rk_pipeline_step(p, &h), RK_OK);
    }
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(cs.evictions, 2, "the pool was under pressure");
    for (int k = 0; k < 2; k++) {
        rk_chunk_entry *e = rk_chunk_index_find(svc->chunks, keys[k]);
        cr_assert_not_null(e, "a held entry survived the pressure");
        cr_assert_eq(e->refs, 1);
    }
    while (rk_pipeline_n_running(p)) cr_assert_eq(rk_pipeline_step(p, &h), RK_OK);
    cr_assert_eq(r.finished, 1);
    cr_assert_eq(memcmp(r.out_tokens, ref.out_tokens, (size_t)o.max_tokens * sizeof(int32_t)), 0);
    double d = rk_test_max_logit_diff(&lr, &lref);
    cr_assert_leq(d, 1e-4, "logits differ from the copy path by %g", d);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(rk_chunk_index_find(svc->chunks, keys[k])->refs, 0);
        cr_assert_eq(rk_chunk_index_remove(svc->chunks, keys[k]), RK_OK, "DELETE once released");
    }
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE), live0);
    check_counts_back(svc);
    rk_pipeline_free(p);
    rk_request_free(&r);
    rk_request_free(&ref);
    rk_test_log_free(&lr, 1);
    rk_test_log_free(&lref, 1);
    rk_service_close(svc);
    rk_service_close(cp);
    free(model);
}

/* The setting: zero-copy by default, copy on request, nothing else. */
Test(zerocopy, the_reindex_setting_defaults_to_zero_copy_and_is_checked) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cr_assert_str_eq(cfg.reindex, "zero-copy");
    cr_assert_eq(rk_config_validate(&cfg), RK_OK);
    snprintf(cfg.reindex, sizeof cfg.reindex, "copy");
    cr_assert_eq(rk_config_validate(&cfg), RK_OK);
    snprintf(cfg.reindex, sizeof cfg.reindex, "zerocopy");
    cr_assert_eq(rk_config_validate(&cfg), RK_ERR_INVALID);
    cr_assert(strstr(rk_error_message(), "reindex") != NULL, "%s", rk_error_message());
}

/* The report's words for each chunk's path, and the shared block count. */
static void check_report(rk_service *svc, const rk_req_options *o, const char *want,
                         int want_shared) {
    rk_request r;
    rk_test_log l[1] = {0};
    run_together(svc, &STORY, 1, o, &r, l);
    json_t *j = rk_report_ragkv(&r);
    cr_assert_not_null(j);
    json_t *chunks = json_object_get(j, "chunks");
    cr_assert_eq(json_array_size(chunks), (size_t)r.n_chunks);
    for (int k = 0; k < r.n_chunks; k++) {
        json_t *c = json_array_get(chunks, (size_t)k);
        cr_assert_str_eq(json_string_value(json_object_get(c, "reindex")), want, "chunk %d", k);
        if (!strcmp(want, "zero-copy"))
            cr_assert_eq(json_real_value(json_object_get(c, "reindex_us")), 0.0);
    }
    json_int_t shared = json_integer_value(json_object_get(j, "shared_blocks"));
    cr_assert_eq(shared, (json_int_t)r.shared_blocks);
    cr_assert_eq(want_shared, shared > 0, "shared_blocks %d", (int)shared);
    json_decref(j);
    rk_request_free(&r);
    rk_test_log_free(l, 1);
}

Test(zerocopy, the_report_names_each_chunks_path_and_the_shared_blocks) {
    rk_service *svc = open_svc(NULL, (svc_opts){.reindex = "zero-copy"});
    rk_req_options o = greedy_opts(2);
    check_report(svc, &o, "zero-copy", 1);
    rk_req_options dev = o;
    dev.repair_ratio = 0.5f;
    check_report(svc, &dev, "copy", 0);
    rk_req_options plain = o;
    plain.mode = RK_MODE_PLAIN;
    check_report(svc, &plain, "none", 0);
    rk_service_close(svc);
    svc = open_svc(NULL, (svc_opts){.reindex = "copy"});
    check_report(svc, &o, "copy", 0);
    check_counts_back(svc);
    rk_service_close(svc);
}

/* Blocks of the live pool one admitted request holds. */
static int live_held(rk_service *svc, const rk_req_options *o, rk_request *r) {
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(svc, &p), RK_OK);
    prepare(svc, STORY, o, r);
    rk_request *one = r;
    cr_assert_eq(rk_pipeline_admit(p, &one, 1, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_n_running(p), 1);
    int used = rk_arena_pool_total(svc->arena, RK_POOL_LIVE) -
               rk_arena_pool_free(svc->arena, RK_POOL_LIVE);
    rk_pipeline_free(p);
    return used;
}

/* The point of it: a zero-copy request's live blocks are its system tail,
 * question and answer only; the chunks stay in the chunk pool. */
Test(zerocopy, a_zero_copy_request_holds_no_live_blocks_for_its_chunks) {
    rk_service *zc = open_svc(NULL, (svc_opts){.reindex = "zero-copy"});
    rk_service *cp = open_svc(NULL, (svc_opts){.reindex = "copy"});
    rk_req_options o = greedy_opts(8);
    rk_request rz, rc;
    int used_zc = live_held(zc, &o, &rz), used_cp = live_held(cp, &o, &rc);
    int bs = rk_arena_block_size(zc->arena), chunk_tokens = 0;
    for (int k = 0; k < rz.n_chunks; k++) chunk_tokens += rz.chunk_lens[k];
    cr_assert_gt(rz.shared_blocks, 0);
    cr_assert_leq(used_zc, (rz.n_question + o.max_tokens + bs - 1) / bs + 1,
                  "zero-copy holds %d live blocks", used_zc);
    cr_assert_geq(used_cp - used_zc, chunk_tokens / bs - 1, "copy %d, zero-copy %d", used_cp,
                  used_zc);
    rk_request_free(&rz);
    rk_request_free(&rc);
    check_counts_back(zc);
    check_counts_back(cp);
    rk_service_close(zc);
    rk_service_close(cp);
}
