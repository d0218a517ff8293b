/* tests/test_bench.c — `ragkv bench` run as a child process: the JSON it
 * prints holds the invariants (hits + misses = lookups = requests x k,
 * computed + reused = prompt tokens), every mode asked for is there, and a
 * speedup is reported. No timing is asserted: the speedup's size is a
 * benchmark's figure. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench/httpclient.h"
#include "tests/testutil.h"

#define SMALL "--corpus 20 --k 3 --requests 30 --chunk-tokens 32:64 --threads 2"
/* The embedded model's forward pass has a fixed cost per pass that dominates
 * short prompts in the unoptimised sanitizer build, where rag (two passes)
 * then barely beats plain (one): its runs use longer chunks. */
#define EMB                                                                                        \
    "--corpus 20 --k 3 --requests 30 --chunk-tokens 128:192 --question-tokens 16 --threads 2"

/* Run `ragkv bench ARGS --json`; returns the parsed object (asserts on failure). */
static json_t *run_bench(const char *args, int want_rc) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s bench %s --json", RK_BIN, args);
    char *out = NULL;
    int rc = rk_test_run(cmd, &out);
    cr_assert_eq(rc, want_rc, "`%s` exited %d, wanted %d; stdout:\n%s", cmd, rc, want_rc,
                 out ? out : "");
    json_error_t err;
    json_t *root = json_loads(out, 0, &err);
    cr_assert_not_null(root, "bench printed no JSON (%s):\n%s", err.text, out);
    free(out);
    return root;
}

static json_int_t geti(json_t *o, const char *a, const char *b) {
    json_t *v = json_object_get(o, a);
    if (b) v = json_object_get(v, b);
    cr_assert(json_is_integer(v), "%s%s%s is not an integer", a, b ? "." : "", b ? b : "");
    return json_integer_value(v);
}

static double getf(json_t *o, const char *a, const char *b) {
    json_t *v = json_object_get(json_object_get(o, a), b);
    cr_assert(json_is_number(v), "%s.%s is not a number", a, b);
    return json_number_value(v);
}

/* The checks every full four-mode run must pass; in_process adds the chunk
 * index counters, which only an in-process run reports. */
static void check_run_modes(json_t *root, int requests, int k, int in_process) {
    cr_assert(json_is_true(json_object_get(root, "invariants_ok")));
    json_t *modes = json_object_get(root, "modes");
    const char *names[] = {"plain", "prefix", "rag", "oracle"};
    for (int i = 0; i < 4; i++) {
        json_t *m = json_object_get(modes, names[i]);
        cr_assert_not_null(m, "mode %s is missing", names[i]);
        cr_expect_eq(geti(m, "requests", NULL), requests, "%s", names[i]);
        cr_expect_eq(geti(m, "ok", NULL), requests, "%s", names[i]);
        json_int_t prompt = geti(m, "prompt_tokens", NULL);
        cr_expect_gt(prompt, (json_int_t)requests * k, "%s", names[i]);
        cr_expect_eq(geti(m, "computed_tokens", NULL) + geti(m, "reused_tokens", NULL), prompt,
                     "%s: computed + reused != prompt tokens", names[i]);
        cr_expect(json_is_true(json_object_get(json_object_get(m, "invariants"), "ok")), "%s",
                  names[i]);
        /* Every mode sees the same request list, so the same prompt tokens. */
        cr_expect_eq(prompt, geti(json_object_get(modes, "plain"), "prompt_tokens", NULL), "%s",
                     names[i]);
    }
    json_t *plain = json_object_get(modes, "plain"), *prefix = json_object_get(modes, "prefix"),
           *rag = json_object_get(modes, "rag"), *oracle = json_object_get(modes, "oracle");
    /* plain: no reuse at all; prefix and oracle: the system prompt only; rag: more. */
    cr_expect_eq(geti(plain, "reused_tokens", NULL), 0);
    cr_expect_eq(geti(plain, "chunks", "lookups"), 0);
    cr_expect_gt(geti(prefix, "reused_tokens", NULL), 0);
    cr_expect_eq(geti(prefix, "chunks", "lookups"), 0);
    cr_expect_eq(geti(oracle, "reused_tokens", NULL), geti(prefix, "reused_tokens", NULL));
    cr_expect_gt(geti(rag, "reused_tokens", NULL), geti(prefix, "reused_tokens", NULL));
    /* rag: hits + misses = lookups = requests x k, in the responses and in the index. */
    json_int_t hits = geti(rag, "chunks", "hits"), misses = geti(rag, "chunks", "misses");
    cr_expect_eq(hits + misses, geti(rag, "chunks", "lookups"));
    cr_expect_eq(geti(rag, "chunks", "lookups"), (json_int_t)requests * k);
    if (in_process) {
        cr_expect_eq(geti(rag, "index", "lookups"), (json_int_t)requests * k);
        cr_expect_eq(geti(rag, "index", "hits"), hits);
        cr_expect_eq(geti(rag, "index", "evictions"), 0);
    }
    /* The pools fit the corpus and requests run one at a time: a chunk misses exactly once. */
    cr_expect_float_eq(getf(rag, "chunks", "hit_rate"),
                       getf(rag, "chunks", "unbounded_cache_hit_rate"), 1e-9);
    cr_expect_gt(hits, 0);
    cr_expect_gt(misses, 0);
    /* The speedup is reported; its size is the benchmark's to judge
     * (docs/benchmarks.md), not a unit test's on a loaded machine. */
    double speedup = getf(json_object_get(root, "speedup"), "rag_over_plain", "ttft_p50");
    cr_expect_gt(speedup, 0.0, "rag over plain TTFT p50 speedup %.3f", speedup);
}

static void check_run(json_t *root, int requests, int k) { check_run_modes(root, requests, k, 1); }

Test(bench, stories260k_run_holds_the_invariants, .timeout = 300) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    char args[1024];
    snprintf(args, sizeof args, "--model %s " SMALL " --modes plain,prefix,rag,oracle", model);
    json_t *root = run_bench(args, 0);
    check_run(root, 30, 3);
    json_t *w = json_object_get(root, "workload");
    cr_expect_eq(geti(w, "corpus", NULL), 20);
    cr_expect_eq(geti(w, "k", NULL), 3);
    json_decref(root);
    free(model);
}

Test(bench, embedded_model_run_holds_the_invariants, .timeout = 300) {
    json_t *root = run_bench(EMB " --modes plain,prefix,rag,oracle", 0);
    check_run(root, 30, 3);
    cr_expect_str_eq(json_string_value(json_object_get(root, "model")), "embedded");
    json_decref(root);
}

Test(bench, same_seed_gives_the_same_workload_and_another_seed_does_not, .timeout = 300) {
    json_t *a = run_bench(SMALL " --modes rag --seed 7", 0);
    json_t *b = run_bench(SMALL " --modes rag --seed 7", 0);
    json_t *c = run_bench(SMALL " --modes rag --seed 8", 0);
    json_t *ra = json_object_get(json_object_get(a, "modes"), "rag");
    json_t *rb = json_object_get(json_object_get(b, "modes"), "rag");
    json_t *rc = json_object_get(json_object_get(c, "modes"), "rag");
    cr_expect_eq(geti(ra, "prompt_tokens", NULL), geti(rb, "prompt_tokens", NULL));
    cr_expect_eq(geti(ra, "reused_tokens", NULL), geti(rb, "reused_tokens", NULL));
    cr_expect_eq(geti(ra, "chunks", "hits"), geti(rb, "chunks", "hits"));
    cr_expect_eq(geti(json_object_get(a, "workload"), "corpus_tokens", NULL),
                 geti(json_object_get(b, "workload"), "corpus_tokens", NULL));
    cr_expect_neq(geti(json_object_get(a, "workload"), "corpus_tokens", NULL),
                  geti(json_object_get(c, "workload"), "corpus_tokens", NULL));
    cr_expect_neq(geti(ra, "prompt_tokens", NULL), geti(rc, "prompt_tokens", NULL));
    json_decref(a);
    json_decref(b);
    json_decref(c);
}

Test(bench, prewarm_makes_every_rag_lookup_a_hit, .timeout = 300) {
    json_t *root = run_bench(EMB " --modes plain,rag --prewarm", 0);
    json_t *rag = json_object_get(json_object_get(root, "modes"), "rag");
    cr_expect_eq(geti(rag, "chunks", "hits"), 90);
    cr_expect_eq(geti(rag, "chunks", "misses"), 0);
    cr_expect_eq(geti(rag, "prewarm", "chunks"), 20);
    cr_expect_eq(geti(rag, "prewarm", "tokens"),
                 geti(json_object_get(root, "workload"), "corpus_tokens", NULL));
    cr_expect_float_eq(getf(rag, "chunks", "predicted_hit_rate"), 1.0, 1e-12);
    json_decref(root);
}

Test(bench, batches_share_one_computation_of_a_chunk_and_count_it_as_a_miss, .timeout = 300) {
    json_t *root = run_bench(SMALL " --modes rag --concurrency 5", 0);
    json_t *rag = json_object_get(json_object_get(root, "modes"), "rag");
    cr_expect_eq(geti(rag, "chunks", "lookups"), 90);
    cr_expect_float_eq(getf(rag, "chunks", "hit_rate"),
                       getf(rag, "chunks", "unbounded_cache_hit_rate"), 1e-9);
    cr_expect(json_is_true(json_object_get(root, "invariants_ok")));
    json_decref(root);
}

Test(bench, a_small_chunk_pool_warns_and_evicts_but_keeps_the_invariants, .timeout = 300) {
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "%s bench --corpus 60 --k 4 --requests 40 --chunk-tokens 48:64 --kv-memory-mb 4 "
             "--modes rag --json 2>&1 >/dev/null",
             RK_BIN);
    char *err = NULL;
    cr_assert_eq(rk_test_run(cmd, &err), 0, "%s", err ? err : "");
    cr_expect(strstr(err, "warning: the chunk pool holds") != NULL, "stderr: %s", err);
    free(err);
    json_t *root = run_bench("--corpus 60 --k 4 --requests 40 --chunk-tokens 48:64 "
                             "--kv-memory-mb 4 --modes rag",
                             0);
    json_t *rag = json_object_get(json_object_get(root, "modes"), "rag");
    cr_expect_gt(geti(rag, "index", "evictions"), 0);
    cr_expect_eq(geti(rag, "chunks", "hits") + geti(rag, "chunks", "misses"), 160);
    cr_expect_lt(getf(rag, "chunks", "hit_rate"), getf(rag, "chunks", "unbounded_cache_hit_rate"));
    json_decref(root);
}

Test(bench, baseline_every_samples_plain_and_prefix_over_the_same_list, .timeout = 300) {
    json_t *root = run_bench(EMB " --modes plain,prefix,rag --baseline-every 4 --kv-dtype bf16", 0);
    cr_expect(json_is_true(json_object_get(root, "invariants_ok")));
    cr_expect_eq(geti(json_object_get(root, "workload"), "baseline_every", NULL), 4);
    json_t *modes = json_object_get(root, "modes");
    /* Requests 0, 4, ..., 28 of the 30: eight; rag runs every one. */
    for (int i = 0; i < 2; i++) {
        json_t *m = json_object_get(modes, i ? "prefix" : "plain");
        cr_expect_eq(geti(m, "requests", NULL), 8);
        cr_expect_eq(geti(m, "ok", NULL), 8);
        json_t *each = json_object_get(json_object_get(m, "each"), "ttft_ms");
        for (size_t j = 0; j < json_array_size(each); j++)
            cr_expect_eq(json_is_null(json_array_get(each, j)), j % 4 != 0, "request %zu", j);
    }
    json_t *rag = json_object_get(modes, "rag");
    cr_expect_eq(geti(rag, "requests", NULL), 30);
    cr_expect_eq(geti(rag, "chunks", "lookups"), 90);
    json_decref(root);
}

/* The output lengths of a run: each in [lo, hi], their sum the mode's
 * output_tokens; returns how many distinct lengths there were. */
static int check_output_lengths(json_t *m, int lo, int hi) {
    json_t *each = json_object_get(json_object_get(m, "each"), "output_tokens");
    json_int_t sum = 0;
    int seen[64] = {0}, distinct = 0;
    cr_assert(json_array_size(each) > 0);
    for (size_t j = 0; j < json_array_size(each); j++) {
        json_t *v = json_array_get(each, j);
        cr_assert(json_is_integer(v), "request %zu has no output length", j);
        json_int_t n = json_integer_value(v);
        cr_expect(n >= lo && n <= hi, "request %zu generated %lld tokens", j, (long long)n);
        if (n >= 0 && n < 64 && !seen[n]++) distinct++;
        sum += n;
    }
    cr_expect_eq(geti(m, "output_tokens", NULL), sum);
    return distinct;
}

Test(bench, max_tokens_range_draws_lengths_in_range_and_reports_tpot, .timeout = 300) {
    /* Not plain: the check that rag beats it needs longer prompts than these. */
    json_t *root = run_bench(SMALL " --modes prefix,rag --max-tokens 2:5", 0);
    cr_expect(json_is_true(json_object_get(root, "invariants_ok")));
    json_t *modes = json_object_get(root, "modes");
    for (int i = 0; i < 2; i++) {
        json_t *m = json_object_get(modes, i ? "rag" : "prefix");
        cr_expect_gt(check_output_lengths(m, 2, 5), 1, "every request got the same length");
        double p50 = getf(m, "tpot_ms", "p50"), p99 = getf(m, "tpot_ms", "p99");
        cr_expect(p50 > 0 && p99 >= p50, "TPOT p50 %.3f p99 %.3f", p50, p99);
        json_t *tps = json_object_get(m, "output_tokens_per_s");
        cr_expect(json_is_number(tps) && json_number_value(tps) > 0, "no output tokens/s");
    }
    /* Both modes ran the same lengths: the draw is part of the seeded workload. */
    cr_expect_eq(geti(json_object_get(modes, "prefix"), "output_tokens", NULL),
                 geti(json_object_get(modes, "rag"), "output_tokens", NULL));
    json_decref(root);
    /* One length: every request generates it; with one token there is no TPOT. */
    root = run_bench(SMALL " --modes rag --max-tokens 3", 0);
    json_t *rag = json_object_get(json_object_get(root, "modes"), "rag");
    cr_expect_eq(check_output_lengths(rag, 3, 3), 1);
    json_decref(root);
    root = run_bench(SMALL " --modes rag", 0);
    rag = json_object_get(json_object_get(root, "modes"), "rag");
    cr_expect(json_is_null(json_object_get(json_object_get(rag, "tpot_ms"), "p50")));
    json_decref(root);
}

Test(bench, arrival_rate_in_process_submits_every_request_through_the_engine, .timeout = 300) {
    json_t *root = run_bench(SMALL " --modes prefix,rag --max-tokens 2:4 --arrival-rate 50", 0);
    cr_expect(json_is_true(json_object_get(root, "invariants_ok")));
    cr_expect_float_eq(getf(root, "workload", "arrival_rate"), 50.0, 1e-9);
    json_t *modes = json_object_get(root, "modes");
    for (int i = 0; i < 2; i++) {
        json_t *m = json_object_get(modes, i ? "rag" : "prefix");
        cr_expect_eq(geti(m, "ok", NULL), 30);
        json_int_t late = geti(m, "open_loop", "late");
        cr_expect(late >= 0 && late <= 30, "late %lld", (long long)late);
        check_output_lengths(m, 2, 4);
        cr_expect_gt(getf(m, "tpot_ms", "p50"), 0);
    }
    json_t *rag = json_object_get(modes, "rag");
    cr_expect_eq(geti(rag, "chunks", "hits") + geti(rag, "chunks", "misses"), 90);
    cr_expect_eq(geti(rag, "chunks", "lookups"), 90);
    json_decref(root);
}

Test(bench, plot_is_a_complete_svg_with_one_curve_per_mode, .timeout = 300) {
    char *dir = rk_test_tmpdir("bench_plot");
    char path[512], args[1024];
    snprintf(path, sizeof path, "%s/b.svg", dir);
    snprintf(args, sizeof args, EMB " --modes plain,rag --plot %s", path);
    json_decref(run_bench(args, 0));
    size_t len;
    char *svg = rk_test_read_file(path, &len);
    cr_assert_not_null(svg);
    cr_expect_eq(strncmp(svg, "<svg ", 5), 0);
    cr_expect(len > 7 && strcmp(svg + len - 7, "</svg>\n") == 0);
    int curves = 0;
    for (const char *p = svg; (p = strstr(p, "<polyline")); p++) curves++;
    cr_expect_eq(curves, 2 + 3, "two CDFs and three hit-rate lines, got %d", curves);
    cr_expect(strstr(svg, "rag (p50 ") != NULL);
    free(svg);
    free(dir);
}

Test(bench, rejects_bad_usage_with_status_2) {
    const char *bad[] = {"--modes plain,bogus",
                         "--modes rag,rag",
                         "--chunk-tokens 64:32",
                         "--chunk-tokens 64",
                         "--k 10 --corpus 5",
                         "--url http://10.1.2.3:80",
                         "--url https://127.0.0.1:80",
                         "--requests 0",
                         "--baseline-every 0",
                         "--kv-dtype f8",
                         "--max-tokens 5:2",
                         "--max-tokens 0",
                         "--max-tokens 2:x",
                         "--arrival-rate 0 --url http://127.0.0.1:9",
                         "--arrival-rate -1 --url http://127.0.0.1:9",
                         "--turns 0 --url http://127.0.0.1:9",
                         "--turns 17 --url http://127.0.0.1:9",
                         "--turns 2 --arrival-rate 5",
                         "--peer-url http://10.1.2.3:80",
                         "extra"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "%s bench %s 2>/dev/null", RK_BIN, bad[i]);
        cr_expect_eq(rk_test_run(cmd, NULL), 2, "`%s`", bad[i]);
    }
}

Test(bench, http_mode_reports_an_unreachable_server) {
    /* A loopback port nobody listens on: bind one, note it, close it. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &al), 0);
    close(fd);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s bench " SMALL " --url http://127.0.0.1:%d 2>&1", RK_BIN,
             ntohs(a.sin_port));
    char *out = NULL;
    cr_expect_eq(rk_test_run(cmd, &out), 1);
    cr_expect(strstr(out, "cannot connect") != NULL, "output: %s", out);
    free(out);
}

/* Start `ragkv serve --port 0 --threads 2`; the port it listens on, or 0
 * when it did not start. */
static int start_server(rk_test_server *s) {
    static const char *const args[] = {"--threads", "2", NULL};
    return rk_test_server_start(s, "bench-serve", NULL, args, NULL) == 0 ? s->port : 0;
}

/* Run `ragkv bench ARGS --json` without asserting (the server must be stopped first). */
static int run_bench_raw(const char *args, char **out) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s bench %s --json", RK_BIN, args);
    return rk_test_run(cmd, out);
}

static json_t *parse_json(const char *what, int rc, char *out) {
    cr_assert_eq(rc, 0, "%s exited %d; stdout:\n%s", what, rc, out ? out : "");
    json_t *root = json_loads(out, 0, NULL);
    cr_assert_not_null(root, "%s printed no JSON:\n%s", what, out);
    free(out);
    return root;
}

Test(bench, http_mode_against_ragkv_serve_counts_what_in_process_counts, .timeout = 300) {
    rk_test_server srv;
    int port = start_server(&srv);
    char args[512], *out1 = NULL, *out2 = NULL;
    int rc1 = -1, rc2 = -1;
    if (port > 0) {
        /* The server listens before its model is loaded (/health is 503
         * meanwhile, slower under the sanitizers): the bench waits for it. */
        snprintf(args, sizeof args,
                 EMB " --modes plain,prefix,rag,oracle --url http://127.0.0.1:%d", port);
        rc1 = run_bench_raw(args, &out1);
        snprintf(args, sizeof args,
                 EMB " --modes rag --prewarm --concurrency 3 --url http://localhost:%d", port);
        rc2 = run_bench_raw(args, &out2);
    }
    rk_test_server_stop(&srv);
    cr_assert_gt(port, 0, "ragkv serve printed no port");
    json_t *http = parse_json("bench --url", rc1, out1);
    json_t *warm = parse_json("bench --url --prewarm", rc2, out2);
    json_t *local = run_bench(EMB " --modes plain,prefix,rag,oracle", 0);
    check_run_modes(http, 30, 3, 0);
    cr_expect_str_eq(json_string_value(json_object_get(http, "transport")), "http");
    const char *names[] = {"plain", "prefix", "rag", "oracle"};
    for (int i = 0; i < 4; i++) {
        json_t *h = json_object_get(json_object_get(http, "modes"), names[i]);
        json_t *l = json_object_get(json_object_get(local, "modes"), names[i]);
        cr_expect_eq(geti(h, "prompt_tokens", NULL), geti(l, "prompt_tokens", NULL), "%s",
                     names[i]);
        cr_expect_eq(geti(h, "reused_tokens", NULL), geti(l, "reused_tokens", NULL), "%s",
                     names[i]);
        cr_expect_eq(geti(h, "chunks", "hits"), geti(l, "chunks", "hits"), "%s", names[i]);
    }
    json_t *wr = json_object_get(json_object_get(warm, "modes"), "rag");
    cr_expect_eq(geti(wr, "chunks", "hits"), 90);
    cr_expect_eq(geti(wr, "prewarm", "chunks"), 20);
    json_decref(http);
    json_decref(warm);
    json_decref(local);
}

/* Chunk lookups the server at port counted (from /v1/stats), -1 on failure. */
static long server_lookups(int port) {
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    rk_http_target t;
    int status = 0;
    char *body = NULL;
    long n = -1;
    if (!rk_http_parse_url(url, 30, &t) &&
        !rk_http_request(&t, "GET", "/v1/stats", NULL, 0, &status, &body) && status == 200) {
        json_t *root = json_loads(body, 0, NULL);
        json_t *v = json_object_get(json_object_get(root, "chunks"), "lookups");
        if (json_is_integer(v)) n = (long)json_integer_value(v);
        json_decref(root);
    }
    free(body);
    return n;
}

Test(bench, a_url_list_sends_requests_round_robin_to_its_replicas, .timeout = 300) {
    rk_test_server sa, sb;
    int port_a = start_server(&sa), port_b = start_server(&sb);
    char args[512], *out = NULL;
    int rc = -1;
    long lookups_a = -1, lookups_b = -1;
    if (port_a > 0 && port_b > 0) {
        snprintf(args, sizeof args,
                 EMB " --modes rag --prewarm --url http://127.0.0.1:%d,http://127.0.0.1:%d", port_a,
                 port_b);
        rc = run_bench_raw(args, &out);
        lookups_a = server_lookups(port_a);
        lookups_b = server_lookups(port_b);
    }
    rk_test_server_stop(&sa);
    rk_test_server_stop(&sb);
    cr_assert(port_a > 0 && port_b > 0, "ragkv serve printed no port");
    json_t *root = parse_json("bench --url A,B", rc, out);
    json_t *rag = json_object_get(json_object_get(root, "modes"), "rag");
    /* Each replica was pre-warmed with the whole corpus, so every lookup hits. */
    cr_expect_eq(geti(rag, "prewarm", "chunks"), 2 * 20);
    cr_expect_eq(geti(rag, "chunks", "hits"), 90);
    /* Each served 15 of the 30 requests of k = 3 chunks (its stats count the
     * chunks of requests; pre-warming reports its own). */
    cr_expect_eq(lookups_a, 15 * 3, "replica A counted %ld lookups", lookups_a);
    cr_expect_eq(lookups_b, 15 * 3, "replica B counted %ld lookups", lookups_b);
    json_decref(root);
}

/* A turn of a mode's "turns" list: computed + cached = prompt tokens. */
static json_t *check_turn(json_t *m, int t, int requests) {
    json_t *x = json_array_get(json_object_get(m, "turns"), (size_t)t);
    cr_assert_not_null(x, "turn %d is missing", t + 1);
    cr_expect_eq(geti(x, "turn", NULL), t + 1);
    cr_expect_eq(geti(x, "ok", NULL), requests, "turn %d", t + 1);
    cr_expect_eq(geti(x, "computed_tokens", NULL) + geti(x, "cached_tokens", NULL),
                 geti(x, "prompt_tokens", NULL), "turn %d: computed + cached != prompt", t + 1);
    cr_expect(json_is_number(json_object_get(json_object_get(x, "ttft_ms"), "p50")));
    return x;
}

#define SCEN "--corpus 12 --k 2 --requests 8 --chunk-tokens 32:48 --question-tokens 8 --threads 2"

Test(bench, serving_scenarios_over_http_with_a_peer_server, .timeout = 240) {
    rk_test_server sa, sb;
    int port_a = start_server(&sa), port_b = start_server(&sb);
    char args[1024], *out[3] = {NULL, NULL, NULL}, *dir = rk_test_tmpdir("bench_peer"),
                     svg_path[512];
    int rc[3] = {-1, -1, -1};
    snprintf(svg_path, sizeof svg_path, "%s/p.svg", dir);
    if (port_a > 0 && port_b > 0) {
        snprintf(args, sizeof args,
                 SCEN " --modes rag --max-tokens 2:5 --url http://127.0.0.1:%d "
                      "--peer-url http://127.0.0.1:%d --plot %s",
                 port_a, port_b, svg_path);
        rc[0] = run_bench_raw(args, &out[0]);
        snprintf(args, sizeof args,
                 SCEN " --modes rag --max-tokens 2:5 --arrival-rate 40 --url http://127.0.0.1:%d",
                 port_a);
        rc[1] = run_bench_raw(args, &out[1]);
        snprintf(args, sizeof args,
                 SCEN " --modes rag --max-tokens 2:4 --turns 2 --url http://127.0.0.1:%d "
                      "--peer-url http://127.0.0.1:%d",
                 port_a, port_b);
        rc[2] = run_bench_raw(args, &out[2]);
    }
    rk_test_server_stop(&sa);
    rk_test_server_stop(&sb);
    cr_assert(port_a > 0 && port_b > 0, "ragkv serve printed no port");

    /* The peer: its own row, the same request list and output lengths. */
    json_t *root = parse_json("bench --peer-url", rc[0], out[0]);
    cr_expect(json_is_true(json_object_get(root, "invariants_ok")));
    json_t *modes = json_object_get(root, "modes");
    json_t *rag = json_object_get(modes, "rag"), *peer = json_object_get(modes, "peer");
    cr_assert_not_null(peer, "no peer row");
    cr_expect_eq(geti(peer, "requests", NULL), 8);
    cr_expect_eq(geti(peer, "ok", NULL), 8);
    check_output_lengths(peer, 2, 5);
    check_output_lengths(rag, 2, 5);
    json_t *pe = json_object_get(json_object_get(peer, "each"), "output_tokens"),
           *re = json_incref(json_object_get(json_object_get(rag, "each"), "output_tokens"));
    for (size_t j = 0; j < 8; j++)
        cr_expect(json_equal(json_array_get(pe, j), json_array_get(re, j)), "request %zu", j);
    json_int_t pp = geti(peer, "prompt_tokens", NULL);
    cr_expect_eq(geti(peer, "computed_tokens", NULL) + geti(peer, "reused_tokens", NULL), pp);
    /* Newlines instead of separators: about the same prompt as ragkv's. */
    json_int_t rp = geti(rag, "prompt_tokens", NULL);
    cr_expect(pp > 0 && llabs(pp - rp) * 10 <= rp, "peer %lld vs rag %lld prompt tokens",
              (long long)pp, (long long)rp);
    cr_expect_eq(geti(peer, "chunks", "lookups"), 0);
    cr_expect_gt(getf(peer, "tpot_ms", "p50"), 0);
    cr_expect_gt(getf(rag, "tpot_ms", "p50"), 0);
    cr_expect_str_eq(json_string_value(json_array_get(json_object_get(root, "order"), 1)), "peer");
    json_decref(root);
    size_t len;
    char *svg = rk_test_read_file(svg_path, &len);
    cr_assert_not_null(svg);
    cr_expect(strstr(svg, "peer (p50 ") != NULL, "the plot has no peer curve");
    free(svg);
    free(dir);

    /* Open loop: every request ran; the late sends are counted. */
    root = parse_json("bench --arrival-rate", rc[1], out[1]);
    cr_expect(json_is_true(json_object_get(root, "invariants_ok")));
    rag = json_object_get(json_object_get(root, "modes"), "rag");
    cr_expect_eq(geti(rag, "ok", NULL), 8);
    /* The arrival times do not change the output lengths. */
    cr_expect(json_equal(json_object_get(json_object_get(rag, "each"), "output_tokens"), re),
              "the open loop drew other output lengths");
    json_decref(re);
    json_int_t late = geti(rag, "open_loop", "late");
    cr_expect(late >= 0 && late <= 8, "late %lld", (long long)late);
    cr_expect_float_eq(getf(root, "workload", "arrival_rate"), 40.0, 1e-9);
    json_decref(root);

    /* Two turns: the second prompt holds the first and the answer; the
     * server's prefix cache reuses part of it. */
    root = parse_json("bench --turns 2", rc[2], out[2]);
    cr_expect(json_is_true(json_object_get(root, "invariants_ok")));
    modes = json_object_get(root, "modes");
    for (int i = 0; i < 2; i++) {
        json_t *m = json_object_get(modes, i ? "peer" : "rag");
        cr_assert_not_null(m);
        cr_expect_eq(json_array_size(json_object_get(m, "turns")), 2);
        json_t *t1 = check_turn(m, 0, 8), *t2 = check_turn(m, 1, 8);
        cr_expect_gt(geti(t2, "prompt_tokens", NULL), geti(t1, "prompt_tokens", NULL));
    }
    json_t *t2 = check_turn(json_object_get(modes, "rag"), 1, 8);
    cr_expect_gt(geti(t2, "cached_tokens", NULL), 0, "turn 2 reused nothing");
    json_decref(root);
}

Test(bench, turns_in_process_continue_each_conversation_with_its_chunks_cached, .timeout = 300) {
    json_t *root = run_bench(SMALL " --modes rag --turns 2 --max-tokens 2:3 --concurrency 3", 0);
    cr_expect(json_is_true(json_object_get(root, "invariants_ok")));
    json_t *rag = json_object_get(json_object_get(root, "modes"), "rag");
    json_t *t1 = check_turn(rag, 0, 30), *t2 = check_turn(rag, 1, 30);
    /* Turn 2 holds turn 1's prompt, its answer and a new question. */
    cr_expect_gt(geti(t2, "prompt_tokens", NULL), geti(t1, "prompt_tokens", NULL));
    /* Its chunks were all computed in turn 1: they and the system prompts are reused. */
    cr_expect_gt(geti(t2, "cached_tokens", NULL), geti(t1, "cached_tokens", NULL));
    json_decref(root);
    /* Without --kv-memory-mb the live pool holds the longest conversation:
     * plain, the whole prompt live, at its third turn. */
    root = run_bench(SMALL " --modes plain --turns 3 --max-tokens 8:16", 0);
    json_t *plain = json_object_get(json_object_get(root, "modes"), "plain");
    check_turn(plain, 2, 30);
    json_decref(root);
}
