/* tests/test_faults.c — allocation failure at every point of a request, a
 * model load and a store open, in the manner of SQLite's malloc tests.
 *
 * Each case first runs the operation normally, counting the allocations it
 * makes (tests/faultinject.h: malloc, calloc, realloc, strdup and
 * aligned_alloc called from the ragkv_core objects, wrapped by the linker for
 * this executable only; the count must be non-zero and the same on two
 * runs, which shows the wrapping took effect). Then, for every N from 1 to
 * that count, it runs the operation again with the Nth allocation failing and
 * requires, with that allocation failing alone (transient) and with it and
 * every later one failing (persistent: error paths that allocate are
 * exercised too):
 *   - a clear error: RK_ERR_NOMEM with a message, or
 *     success with exactly the normal result where the code can do without
 *     the allocation;
 *   - nothing leaked (the sanitizer pass runs this suite under LeakSanitizer);
 *   - the object still usable: after a failed request the same service runs
 *     the request again to the same tokens, and every arena block is back in
 *     its pool once the caches are flushed; after a failed model load or
 *     store open, a normal one succeeds (and the store still has its rows).
 *
 * Scope: allocations inside shared libraries (libc itself, jansson, SQLite,
 * OpenBLAS, xxHash, hiredis, Criterion) are not wrapped, so SQLite running
 * out of memory is not simulated here. libcrypto is the exception: this
 * executable hands it allocation functions of its own (CRYPTO_set_mem_functions,
 * before anything uses it) that call the wrapped ones, so the HMAC of the
 * Redis tier runs out of memory too. Requests run on one compute thread, so the
 * order of allocations, and so N, is deterministic (loads start three: the
 * workers do not allocate).
 *
 * The optimised build covers every N (about 45 s in all; but see the last
 * paragraph). The light
 * (sanitizer) pass (RAGKV_TEST_LIGHT), where each run is ten times slower,
 * steps N by LIGHT_REQUEST_STRIDE for requests (each N costs three runs of
 * the pipeline) and LIGHT_LOAD_STRIDE for model loads (over 1500 allocations),
 * always taking N = 1 and the last N; store opens cover every N there too.
 *
 * Loading a model with the 151k-token Qwen3 vocabulary makes some 300,000
 * allocations, nearly all from a few per-token loops: there each call site's
 * first and last allocation fails instead of every one (rk_fault_alloc_sites),
 * transient failures only in the light pass. */
#include <criterion/criterion.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <openssl/crypto.h>
#include <signal.h>

#include "gateway/tenants.h"
#include "pipeline/pipeline.h"
#include "store/redis.h"
#include "store/store.h"
#include "tests/faultinject.h"
#include "tests/testutil.h"

#define MAX_NEW 6 /* tokens generated per request */

/* Loads making more allocations than this (per-token loops over a large
 * vocabulary) fail the first and the last allocation of each call site
 * instead of every one. */
#define MAX_EVERY_N 5000
#define MAX_SITES   256

/* Strides of N in the light (sanitizer) pass; see the header comment. */
#define LIGHT_REQUEST_STRIDE 3
#define LIGHT_LOAD_STRIDE    7

/* The N after n, up to count: every one, or in the light pass every
 * light_stride-th one, always ending with count itself. */
static long next_n(long n, long count, long light_stride) {
    long step = rk_test_light() ? light_stride : 1;
    return n < count && n + step > count ? count : n + step;
}

/* Fail the nth allocation from now: that one only (transient), or that one
 * and every later one until rk_fault_alloc_stop() (persistent). */
static void fail_at(long n, int persistent) {
    if (persistent)
        rk_fault_alloc_fail_from(n);
    else
        rk_fault_alloc_fail_at(n);
}

static const char *const KIND[] = {"transient", "persistent"};

/* Assert a failure under injected allocation failure is a clear one. */
static void expect_nomem(rk_status st, int persistent, long n, const char *what) {
    cr_assert(rk_fault_alloc_fired(), "%s: allocation %ld was never made", what, n);
    cr_assert_eq(st, RK_ERR_NOMEM, "%s, %s failure at allocation %ld: status %s (%s)", what,
                 KIND[persistent], n, rk_status_str(st), rk_error_message());
    cr_assert_neq(rk_error_message()[0], '\0', "%s, %s failure at allocation %ld: no message", what,
                  KIND[persistent], n);
}

/* Remove a scratch directory made by rk_test_tmpdir and free its path. */
static void remove_tree(char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_expect_eq(rk_test_run(cmd, NULL), 0);
    free(dir);
}

/* ---------------------------------------------------------------- requests */

/* Two prompts sharing their system prompt and chunks. */
static const char *const PROMPTS[2] = {
    "You are a storyteller.##Lily had a red ball. She liked to play with it in the garden every "
    "day.##Tom had a big dog named Max. Max liked to run and bark at the birds.##One day",
    "You are a storyteller.##Lily had a red ball. She liked to play with it in the garden every "
    "day.##Tom had a big dog named Max. Max liked to run and bark at the birds.##Then"};

/* One way of running the request, each taking other paths of the pipeline. */
typedef struct req_case {
    const char *name;
    int store;       /* with a disk tier */
    int empty_store; /* emptied before the run: computed chunks are written through */
    int warm;        /* run once just before: prefix match, chunk hits, reindex */
    int n_reqs;      /* requests run together in one batch (1 or 2) */
    int qwen3;       /* a qwen3 model (byte-level BPE, QK-norm) instead of the embedded one */
    int plain, context_system, parallel, repair_k;
    float repair_ratio;
} req_case;

/* model_path NULL: the embedded model. */
static rk_service *open_service(const char *model_path, const char *store_dir) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = 1;
    cfg.kv_memory_mb = 16;
    if (store_dir) snprintf(cfg.store_dir, sizeof cfg.store_dir, "%s", store_dir);
    rk_service *svc;
    cr_assert_eq(rk_service_open(&cfg, model_path, &svc), RK_OK, "%s", rk_error_message());
    return svc;
}

/* Split, prepare and run the case's requests greedily, with top
 * log-probabilities; their tokens go to out (every stage of the pipeline
 * allocates). */
static rk_status run_requests(rk_service *svc, const req_case *c, int32_t out[2][MAX_NEW]) {
    rk_request r[2];
    rk_request *batch[2] = {&r[0], &r[1]};
    memset(r, 0, sizeof r);
    rk_status st = RK_OK;
    int n_prepared = 0;
    for (int i = 0; i < c->n_reqs && !st; i++) {
        rk_req_options *o = &r[i].opt;
        rk_req_options_default(o);
        o->max_tokens = MAX_NEW;
        o->sampling.temperature = 0;
        o->stop_at_eog = 0;
        o->n_logprobs = 2;
        o->mode = c->plain ? RK_MODE_PLAIN : RK_MODE_RAG;
        o->chunk_context = c->context_system ? RK_CONTEXT_SYSTEM : RK_CONTEXT_ISOLATED;
        o->positions = c->parallel ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
        o->repair_k = c->repair_k;
        o->repair_ratio = c->repair_ratio;
        rk_split sp;
        st = rk_split_prompt(PROMPTS[i], strlen(PROMPTS[i]), NULL, svc->cfg.max_chunks, &sp);
        if (st) break;
        st = rk_request_prepare(svc, &sp, &r[i]);
        rk_split_free(&sp);
        if (!st) n_prepared++;
    }
    if (!st) st = rk_pipeline_run(svc, batch, c->n_reqs, NULL);
    for (int i = 0; i < n_prepared; i++) {
        if (!st) {
            cr_assert_eq(r[i].n_out, MAX_NEW);
            memcpy(out[i], r[i].out_tokens, sizeof out[i]);
        }
        rk_request_free(&r[i]);
    }
    return st;
}

static void flush_caches(rk_service *svc) {
    rk_chunk_index_flush(svc->chunks);
    if (svc->prefix) rk_radix_flush(svc->prefix);
}

/* No request holds anything: no radix lock, no chunk reference, every live
 * block free; once the caches are flushed, every block of every pool free. */
static void check_nothing_held(rk_service *svc, long n) {
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(svc->arena, RK_POOL_LIVE), "allocation %ld: live blocks kept",
                 n);
    if (svc->prefix) {
        rk_radix_stats rs;
        rk_radix_get_stats(svc->prefix, &rs);
        cr_assert_eq(rs.protected_tokens, 0, "allocation %ld: a radix lock was kept", n);
    }
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(rk_arena_pool_total(svc->arena, RK_POOL_CHUNK) -
                     rk_arena_pool_free(svc->arena, RK_POOL_CHUNK),
                 (int)cs.blocks, "allocation %ld: chunk blocks held outside the index", n);
    if (svc->store) {
        /* A failed allocation never costs the disk tier a good row. */
        rk_store_counters sc;
        cr_assert_eq(rk_store_stats(svc->store, &sc), RK_OK);
        cr_assert_eq(sc.dropped_on_load, 0, "allocation %ld: a stored chunk was dropped", n);
    }
    flush_caches(svc);
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(cs.entries, 0, "allocation %ld: a chunk entry is still referenced", n);
    for (int p = 0; p < RK_POOL_COUNT; p++)
        cr_assert_eq(rk_arena_pool_free(svc->arena, (rk_pool_tag)p),
                     rk_arena_pool_total(svc->arena, (rk_pool_tag)p),
                     "allocation %ld: pool %d did not get every block back", n, p);
}

/* Bring the service to the state the case's failing run starts from. */
static void set_up(rk_service *svc, const req_case *c) {
    int32_t got[2][MAX_NEW];
    flush_caches(svc);
    if (c->warm) cr_assert_eq(run_requests(svc, c, got), RK_OK, "%s", rk_error_message());
    if (c->empty_store) cr_assert_eq(rk_store_flush(svc->store, NULL), RK_OK);
}

static void request_case(const req_case *c) {
    char *dir = c->store ? rk_test_tmpdir("faults-req") : NULL;
    char *model = c->qwen3 ? rk_test_model("qwen3-tiny", "f32", 1) : NULL;
    rk_service *svc = open_service(model, dir);
    free(model);
    int32_t want[2][MAX_NEW], got[2][MAX_NEW];
    size_t n_cmp = (size_t)c->n_reqs * sizeof want[0];
    /* The first run sizes the model's scratch (and fills the store); from
     * then on every run from the same state allocates the same way. */
    cr_assert_eq(run_requests(svc, c, want), RK_OK, "%s", rk_error_message());
    long counts[2];
    for (int k = 0; k < 2; k++) {
        set_up(svc, c);
        rk_fault_alloc_fail_at(0);
        cr_assert_eq(run_requests(svc, c, got), RK_OK, "%s", rk_error_message());
        rk_fault_alloc_stop();
        counts[k] = rk_fault_alloc_count();
        cr_assert_arr_eq(got, want, n_cmp);
    }
    cr_assert_gt(counts[0], 0, "the allocation wrappers are not in effect");
    cr_assert_eq(counts[0], counts[1], "allocation counts differ between runs: %ld, %ld", counts[0],
                 counts[1]);
    long n_absorbed[2] = {0, 0};
    for (int persistent = 0; persistent < 2; persistent++)
        for (long n = 1; n <= counts[0]; n = next_n(n, counts[0], LIGHT_REQUEST_STRIDE)) {
            set_up(svc, c);
            rk_error_clear();
            fail_at(n, persistent);
            memset(got, 0, sizeof got);
            rk_status st = run_requests(svc, c, got);
            rk_fault_alloc_stop();
            if (st == RK_OK) {
                /* The code did without the allocation: the answer must not change. */
                n_absorbed[persistent]++;
                cr_assert(rk_fault_alloc_fired());
                cr_assert_arr_eq(got, want, n_cmp, "%s failure at allocation %ld went unnoticed",
                                 KIND[persistent], n);
            } else {
                expect_nomem(st, persistent, n, c->name);
            }
            check_nothing_held(svc, n);
            /* The same service answers the next request, exactly. */
            memset(got, 0, sizeof got);
            cr_assert_eq(run_requests(svc, c, got), RK_OK, "after allocation %ld: %s", n,
                         rk_error_message());
            cr_assert_arr_eq(got, want, n_cmp, "after allocation %ld failed", n);
            check_nothing_held(svc, n);
        }
    cr_log_info("%s: %ld allocations; failures absorbed: %ld transient, %ld persistent", c->name,
                counts[0], n_absorbed[0], n_absorbed[1]);
    rk_service_close(svc);
    if (dir) remove_tree(dir);
}

Test(faults, every_allocation_of_a_request_with_cold_caches) {
    request_case(&(req_case){.name = "request, cold caches", .n_reqs = 1});
}

Test(faults, every_allocation_of_a_request_with_warm_caches) {
    request_case(&(req_case){.name = "request, warm caches", .n_reqs = 1, .warm = 1});
}

Test(faults, every_allocation_of_a_request_writing_a_store) {
    request_case(
        &(req_case){.name = "request writing a store", .n_reqs = 1, .store = 1, .empty_store = 1});
}

Test(faults, every_allocation_of_a_request_reading_a_store) {
    request_case(&(req_case){.name = "request reading a store", .n_reqs = 1, .store = 1});
}

Test(faults, every_allocation_of_two_requests_batched_together) {
    request_case(&(req_case){.name = "two requests in one batch", .n_reqs = 2});
}

Test(faults, every_allocation_of_a_request_in_system_context_with_repair) {
    request_case(&(req_case){.name = "request, system context, parallel, first-k repair",
                             .n_reqs = 1,
                             .context_system = 1,
                             .parallel = 1,
                             .repair_k = 2});
}

Test(faults, every_allocation_of_a_request_with_deviation_repair) {
    request_case(&(req_case){
        .name = "request, warm, deviation repair", .n_reqs = 1, .warm = 1, .repair_ratio = 0.5f});
}

Test(faults, every_allocation_of_a_request_to_a_qwen3_model) {
    request_case(&(req_case){.name = "request to a qwen3 model", .n_reqs = 1, .qwen3 = 1});
}

Test(faults, every_allocation_of_a_plain_request) {
    request_case(&(req_case){.name = "plain request", .n_reqs = 1, .plain = 1});
}

/* ---------------------------------------------------------------- model loads */

static void load_fails_cleanly(const rk_config *cfg, const char *model_path, int persistent,
                               long n) {
    rk_service *svc = (rk_service *)0x1;
    rk_error_clear();
    fail_at(n, persistent);
    rk_status st = rk_service_open(cfg, model_path, &svc);
    rk_fault_alloc_stop();
    expect_nomem(st, persistent, n, model_path ? model_path : "embedded model");
    cr_assert_null(svc, "allocation %ld: a service was returned with an error", n);
}

static int cmp_long(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

static void load_case(const char *model_path) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = 3; /* the thread pool starts two workers: failing between them too */
    cfg.kv_memory_mb = 16;
    const char *what = model_path ? model_path : "embedded model";
    rk_service *svc;
    long counts[2];
    char fp[33];
    for (int k = 0; k < 2; k++) {
        rk_fault_alloc_fail_at(0);
        rk_status st = rk_service_open(&cfg, model_path, &svc);
        rk_fault_alloc_stop();
        cr_assert_eq(st, RK_OK, "%s", rk_error_message());
        counts[k] = rk_fault_alloc_count();
        snprintf(fp, sizeof fp, "%s", rk_model_fingerprint(svc->model));
        rk_service_close(svc);
    }
    cr_assert_gt(counts[0], 0, "the allocation wrappers are not in effect");
    cr_assert_eq(counts[0], counts[1], "allocation counts differ between loads: %ld, %ld",
                 counts[0], counts[1]);
    cr_log_info("load of %s: %ld allocations", what, counts[0]);

    if (counts[0] <= MAX_EVERY_N) {
        for (int persistent = 0; persistent < 2; persistent++)
            for (long n = 1; n <= counts[0]; n = next_n(n, counts[0], LIGHT_LOAD_STRIDE))
                load_fails_cleanly(&cfg, model_path, persistent, n);
    } else {
        /* Per-token loops: fail the first and the last allocation of each site. */
        long first[MAX_SITES], last[MAX_SITES], ns[2 * MAX_SITES];
        int n_sites = rk_fault_alloc_sites(first, last, MAX_SITES);
        cr_assert_leq(n_sites, MAX_SITES);
        int n_ns = 0;
        for (int i = 0; i < n_sites; i++) {
            ns[n_ns++] = first[i];
            if (last[i] != first[i]) ns[n_ns++] = last[i];
        }
        qsort(ns, (size_t)n_ns, sizeof *ns, cmp_long);
        cr_log_info("load of %s: %d sites, %d allocations to fail", what, n_sites, n_ns);
        for (int persistent = 0; persistent < (rk_test_light() ? 1 : 2); persistent++)
            for (int i = 0; i < n_ns; i++) load_fails_cleanly(&cfg, model_path, persistent, ns[i]);
    }
    /* Nothing the failed loads did stands in the way of a normal one. */
    cr_assert_eq(rk_service_open(&cfg, model_path, &svc), RK_OK, "%s", rk_error_message());
    cr_assert_str_eq(rk_model_fingerprint(svc->model), fp);
    rk_service_close(svc);
}

Test(faults, every_allocation_of_loading_the_embedded_model) { load_case(NULL); }

Test(faults, every_allocation_of_loading_stories260k) {
    char *path;
    RK_REQUIRE_SHARED(path, "models/stories260K.gguf");
    load_case(path);
    free(path);
}

/* The byte-level BPE tokenizer and qwen3's QK-norm tensors. */
Test(faults, every_call_site_of_loading_a_qwen3_model) {
    char *path = rk_test_model("qwen3-tiny", "bf16", 1);
    load_case(path);
    free(path);
}

/* ---------------------------------------------------------------- store opens */

#define FP      "0123456789abcdef0123456789abcdef"
#define N_ROWS  3 /* good rows; row N_ROWS is the damaged one, ORPHAN names a file without a row */
#define ORPHAN  9
#define REBUILT 4 /* row whose payload stays but whose row is deleted: rebuilt at open */

static void row_key(int i, char key[RK_STORE_KEY_LEN + 1]) {
    snprintf(key, RK_STORE_KEY_LEN + 1, "%032x", 0xabc00 + i);
}

/* Put row i: 16 tokens and 256 bytes of body that follow from i. */
static void put_row(rk_store *s, int i) {
    char key[RK_STORE_KEY_LEN + 1];
    row_key(i, key);
    int32_t tokens[16];
    uint8_t body[256];
    for (int j = 0; j < 16; j++) tokens[j] = i * 100 + j;
    for (int j = 0; j < 256; j++) body[j] = (uint8_t)(i + j);
    rk_store_put_args a = {
        .key = key,
        .policy = "isolated",
        .doc_id = "doc",
        .layout = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 8, .block_size = 16},
        .tokens = tokens,
        .n_tokens = 16,
        .body = body,
        .body_size = sizeof body};
    cr_assert_eq(rk_store_put(s, &a), RK_OK, "%s", rk_error_message());
}

static void write_file(const char *path, size_t n_bytes) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    for (size_t i = 0; i < n_bytes; i++) fputc((int)(i & 0xff), f);
    cr_assert_eq(fclose(f), 0);
}

/* Leave what a crash or a disk fault leaves for the next open to recover: a
 * row whose payload is cut short, a payload file without a row that explains
 * nothing (both quarantined), a good payload whose row is lost (rebuilt) and a
 * temporary file (removed). */
static void damage_store(const char *dir) {
    rk_store *s;
    cr_assert_eq(rk_store_open(dir, FP, NULL, &s), RK_OK, "%s", rk_error_message());
    put_row(s, N_ROWS);
    char rebuilt[RK_STORE_KEY_LEN + 1];
    row_key(REBUILT, rebuilt);
    int present = 0;
    cr_assert_eq(rk_store_contains(s, rebuilt, &present), RK_OK);
    if (!present) put_row(s, REBUILT);
    char key[RK_STORE_KEY_LEN + 1], cut[4096], orphan[4096], tmp[4200];
    row_key(N_ROWS, key);
    cr_assert_eq(rk_store_payload_path(s, key, cut, sizeof cut), RK_OK);
    row_key(ORPHAN, key);
    cr_assert_eq(rk_store_payload_path(s, key, orphan, sizeof orphan), RK_OK);
    rk_store_close(s);
    cr_assert_eq(truncate(cut, 100), 0, "%s", cut);
    char db_path[4200], sql[128];
    snprintf(db_path, sizeof db_path, "%s/chunks.db", dir);
    snprintf(sql, sizeof sql, "DELETE FROM chunks WHERE key = '%s'", rebuilt);
    sqlite3 *db;
    cr_assert_eq(sqlite3_open(db_path, &db), SQLITE_OK);
    cr_assert_eq(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    cr_assert_eq(sqlite3_changes(db), 1);
    sqlite3_close(db);
    write_file(orphan, 300);
    snprintf(tmp, sizeof tmp, "%s.tmp", orphan);
    write_file(tmp, 10);
}

/* Open normally: every good row is there and loads (with the rebuilt one
 * when the store was damaged), the cut one is gone. */
static void expect_rows(const char *dir, int damaged, long n) {
    rk_store *s;
    cr_assert_eq(rk_store_open(dir, FP, NULL, &s), RK_OK, "after allocation %ld: %s", n,
                 rk_error_message());
    for (int i = 0; i <= REBUILT; i++) {
        if (i == N_ROWS || (i == REBUILT && !damaged)) continue;
        char key[RK_STORE_KEY_LEN + 1];
        row_key(i, key);
        rk_store_payload p;
        cr_assert_eq(rk_store_get(s, key, &p), RK_OK, "after allocation %ld, row %d: %s", n, i,
                     rk_error_message());
        cr_assert_eq(p.meta.n_tokens, 16);
        cr_assert_eq(p.tokens[15], i * 100 + 15);
        rk_store_payload_free(&p);
    }
    rk_store_counters c;
    cr_assert_eq(rk_store_stats(s, &c), RK_OK);
    cr_assert_eq(c.rows, N_ROWS + damaged, "after allocation %ld: %llu rows", n,
                 (unsigned long long)c.rows);
    rk_store_close(s);
}

/* damaged: every open (counted or failing) has recovery work to do. */
static void store_case(int damaged) {
    char *dir = rk_test_tmpdir("faults-store");
    rk_store *s;
    cr_assert_eq(rk_store_open(dir, FP, NULL, &s), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < N_ROWS; i++) put_row(s, i);
    rk_store_close(s);
    rk_store_options o;
    rk_store_options_default(&o);
    o.verify_on_open = 1;
    long counts[2];
    for (int k = 0; k < 2; k++) {
        if (damaged) damage_store(dir);
        rk_fault_alloc_fail_at(0);
        rk_status st = rk_store_open(dir, FP, &o, &s);
        rk_fault_alloc_stop();
        cr_assert_eq(st, RK_OK, "%s", rk_error_message());
        counts[k] = rk_fault_alloc_count();
        if (damaged) {
            rk_store_counters c;
            cr_assert_eq(rk_store_stats(s, &c), RK_OK);
            /* The cut row dropped, its file and the unexplained one quarantined. */
            cr_assert_eq(c.dropped_on_recovery, 1);
            cr_assert_eq(c.quarantined, 2);
            cr_assert_eq(c.orphans_removed, 1);
            cr_assert_eq(c.rows_rebuilt, 1);
        }
        rk_store_close(s);
    }
    cr_assert_gt(counts[0], 0, "the allocation wrappers are not in effect");
    cr_assert_eq(counts[0], counts[1], "allocation counts differ between opens: %ld, %ld",
                 counts[0], counts[1]);
    cr_log_info("store open%s: %ld allocations", damaged ? " with recovery" : "", counts[0]);
    for (int persistent = 0; persistent < 2; persistent++)
        for (long n = 1; n <= counts[0]; n++) {
            if (damaged) damage_store(dir);
            s = (rk_store *)0x1;
            rk_error_clear();
            fail_at(n, persistent);
            rk_status st = rk_store_open(dir, FP, &o, &s);
            rk_fault_alloc_stop();
            expect_nomem(st, persistent, n, "store open");
            cr_assert_null(s, "allocation %ld: a store was returned with an error", n);
            expect_rows(dir, damaged, n);
        }
    remove_tree(dir);
}

Test(faults, every_allocation_of_opening_a_store) { store_case(0); }

Test(faults, every_allocation_of_opening_a_store_that_needs_recovery) { store_case(1); }

/* ---------------------------------------------------------------- the Redis tier's MAC */

/* libcrypto's allocations, through this executable's wrapped allocator. */
static void *crypto_malloc(size_t n, const char *file, int line) {
    (void)file;
    (void)line;
    return malloc(n);
}
static void *crypto_realloc(void *p, size_t n, const char *file, int line) {
    (void)file;
    (void)line;
    return realloc(p, n);
}
static void crypto_free(void *p, const char *file, int line) {
    (void)file;
    (void)line;
    free(p);
}
static int g_crypto_routed;
__attribute__((constructor)) static void route_libcrypto(void) {
    g_crypto_routed = CRYPTO_set_mem_functions(crypto_malloc, crypto_realloc, crypto_free);
}

static const char MAC_FP[] = "00112233445566778899aabbccddeeff";
static const char MAC_KEY[] = "ffeeddccbbaa99887766554433221100";

/* Allocations of one authenticated load with the tier's secret (or none). */
static long count_get(rk_redis *r, const int32_t *tokens, int n_tokens,
                      const rk_store_layout *layout, size_t body_size) {
    rk_store_payload p;
    rk_fault_alloc_fail_at(0);
    rk_status st = rk_redis_get(r, MAC_KEY, tokens, n_tokens, layout, body_size, &p);
    rk_fault_alloc_stop();
    cr_assert_eq(st, RK_OK, "%s", rk_error_message());
    rk_store_payload_free(&p);
    return rk_fault_alloc_count();
}

Test(faults, every_allocation_of_verifying_a_redis_values_mac) {
    cr_assert(g_crypto_routed, "libcrypto's allocator could not be replaced");
    signal(SIGPIPE, SIG_IGN);
    rk_test_redis srv = {0};
    rk_test_redis_start(&srv);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", srv.port);
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.url = url;
    cfg.min_tokens = 1;
    static const char secret[] = "sixteen bytes or more of secret";
    cfg.secret = secret;
    cfg.secret_len = sizeof secret - 1;
    rk_redis *r = NULL, *plain = NULL;
    cr_assert_eq(rk_redis_open(&cfg, MAC_FP, &r), RK_OK, "%s", rk_error_message());
    cfg.secret = NULL;
    cfg.secret_len = 0;
    cfg.prefix = "plain";
    cr_assert_eq(rk_redis_open(&cfg, MAC_FP, &plain), RK_OK, "%s", rk_error_message());
    int32_t tokens[40];
    for (int i = 0; i < 40; i++) tokens[i] = 1000 + i;
    uint8_t body[8192];
    for (size_t i = 0; i < sizeof body; i++) body[i] = (uint8_t)(i * 13);
    rk_store_layout layout = {2, 4, 8, 0, 16, 0};
    rk_store_put_args a = {.key = MAC_KEY,
                           .policy = "isolated",
                           .layout = layout,
                           .tokens = tokens,
                           .n_tokens = 40,
                           .body = body,
                           .body_size = sizeof body};
    int idle = 0;
    cr_assert_eq(rk_redis_put(r, &a, NULL), RK_OK);
    cr_assert_eq(rk_redis_put(plain, &a, NULL), RK_OK);
    cr_assert_eq(rk_redis_wait_idle(r, 5000, &idle), RK_OK);
    cr_assert(idle);
    cr_assert_eq(rk_redis_wait_idle(plain, 5000, &idle), RK_OK);
    cr_assert(idle);
    long count = count_get(r, tokens, 40, &layout, sizeof body);
    cr_assert_eq(count, count_get(r, tokens, 40, &layout, sizeof body));
    long without = count_get(plain, tokens, 40, &layout, sizeof body);
    cr_assert_gt(count, without, "the MAC's allocations are not counted (%ld, without %ld)", count,
                 without);
    cr_log_info("authenticated Redis load: %ld allocations (%ld without a secret)", count, without);
    for (int persistent = 0; persistent < 2; persistent++)
        for (long n = 1; n <= count; n++) {
            rk_store_payload p;
            rk_error_clear();
            fail_at(n, persistent);
            rk_status st = rk_redis_get(r, MAC_KEY, tokens, 40, &layout, sizeof body, &p);
            rk_fault_alloc_stop();
            if (st == RK_OK) {
                cr_assert_eq(memcmp(p.body, body, sizeof body), 0, "allocation %ld", n);
                rk_store_payload_free(&p);
            } else {
                expect_nomem(st, persistent, n, "authenticated Redis load");
            }
            /* Running out of memory is no verdict: the value is neither
             * counted as forged nor deleted, and the next load succeeds. */
            rk_redis_counters c;
            rk_redis_stats(r, &c);
            cr_assert_eq(c.auth_failures, 0, "%s failure at allocation %ld counted as forged",
                         KIND[persistent], n);
            cr_assert_eq(c.dropped_corrupt, 0, "allocation %ld", n);
            cr_assert_eq(rk_redis_get(r, MAC_KEY, tokens, 40, &layout, sizeof body, &p), RK_OK,
                         "after allocation %ld: %s", n, rk_error_message());
            rk_store_payload_free(&p);
        }
    rk_redis_close(r);
    rk_redis_close(plain);
    rk_test_redis_free(&srv);
}

/* ---------------------------------------------------------------- tenants */

#define KEYS_FILE                                                                                  \
    "{\"keys\": [{\"key\": \"k-one\", \"tenant\": \"A\"}, {\"key\": \"k-two\", \"tenant\": "       \
    "\"B\", \"salt\": \"sb\"}, {\"key\": \"k-three\", \"tenant\": \"A\"}]}"

static void expect_tenants(const rk_tenants *t) {
    cr_assert_eq(rk_tenants_count(t), 2);
    cr_assert_eq(rk_tenants_find(t, "k-one"), 1);
    cr_assert_eq(rk_tenants_find(t, "k-two"), 2);
    cr_assert_eq(rk_tenants_find(t, "k-three"), 1);
    cr_assert_eq(rk_tenants_find(t, "k-four"), 0);
    cr_assert_str_eq(rk_tenants_salt(t, 2), "sb");
}

Test(faults, every_allocation_of_loading_a_keys_file_and_none_in_a_tenant_lookup) {
    char *path = rk_test_write_tmp("faults-keys", "keys.json", KEYS_FILE);
    rk_tenants *t = NULL;
    rk_fault_alloc_fail_at(0);
    cr_assert_eq(rk_tenants_load(path, &t), RK_OK, "%s", rk_error_message());
    rk_fault_alloc_stop();
    long count = rk_fault_alloc_count();
    cr_assert_gt(count, 0, "the allocations are counted");
    expect_tenants(t);
    /* Looking a key up allocates nothing, so it cannot fail for memory. */
    rk_fault_alloc_fail_from(1);
    int found = rk_tenants_find(t, "k-two") + rk_tenants_by_name(t, "A");
    rk_chunk_key scope = rk_cache_scope(rk_tenants_salt(t, 1), "request");
    rk_fault_alloc_stop();
    cr_assert_eq(found, 3);
    cr_assert(scope.hi || scope.lo);
    cr_assert_eq(rk_fault_alloc_count(), 0, "a tenant lookup allocates nothing");
    rk_tenants_free(t);
    for (int persistent = 0; persistent < 2; persistent++)
        for (long n = 1; n <= count; n++) {
            t = NULL;
            fail_at(n, persistent);
            rk_status st = rk_tenants_load(path, &t);
            rk_fault_alloc_stop();
            expect_nomem(st, persistent, n, "keys file");
            cr_assert_null(t, "a failed load returns no table");
            cr_assert_eq(rk_tenants_load(path, &t), RK_OK, "a normal load after it");
            expect_tenants(t);
            rk_tenants_free(t);
        }
    free(path);
}

Test(faults, every_allocation_of_listing_a_tenants_chunks) {
    rk_service *svc = open_service(NULL, NULL);
    rk_req_options o;
    rk_req_options_default(&o);
    o.max_tokens = 1;
    o.owner = 1;
    o.salt = rk_cache_scope("A", NULL);
    rk_split sp;
    cr_assert_eq(rk_split_prompt(PROMPTS[0], strlen(PROMPTS[0]), "##", 16, &sp), RK_OK);
    rk_request r = {.opt = o};
    cr_assert_eq(rk_request_prepare(svc, &sp, &r), RK_OK, "%s", rk_error_message());
    rk_request *one = &r;
    cr_assert_eq(rk_pipeline_run(svc, &one, 1, NULL), RK_OK, "%s", rk_error_message());
    rk_request_free(&r);
    rk_split_free(&sp);
    rk_cache_viewer who = {.owner = 1};
    rk_chunk_listing l;
    rk_fault_alloc_fail_at(0);
    cr_assert_eq(rk_service_chunk_list(svc, &who, 0, 1, 0, 10, &l), RK_OK);
    rk_fault_alloc_stop();
    long count = rk_fault_alloc_count();
    int n_listed = l.n;
    cr_assert_gt(n_listed, 0);
    rk_chunk_listing_free(&l);
    for (int persistent = 0; persistent < 2; persistent++)
        for (long n = 1; n <= count; n++) {
            fail_at(n, persistent);
            rk_status st = rk_service_chunk_list(svc, &who, 0, 1, 0, 10, &l);
            rk_fault_alloc_stop();
            expect_nomem(st, persistent, n, "chunk listing");
            cr_assert_null(l.v);
            cr_assert_eq(rk_service_chunk_list(svc, &who, 0, 1, 0, 10, &l), RK_OK);
            cr_assert_eq(l.n, n_listed);
            rk_chunk_listing_free(&l);
        }
    rk_service_close(svc);
}
