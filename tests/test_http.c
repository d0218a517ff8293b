/* tests/test_http.c — the HTTP service end to end: the real `ragkv serve`
 * binary started on a free loopback port (--port 0), spoken to with the
 * loopback client of bench/httpclient.h, stopped with SIGTERM at the end of
 * every test (and killed with its parent if a test crashes). Most tests use
 * the embedded model. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench/httpclient.h"
#include "tests/testutil.h"

/* ================================================================ the server and the client */

/* The server of the current test (tests/testutil.h starts and stops it).
 * Requests go through the service's own loopback client (bench/httpclient.h),
 * the one `ragkv bench --url` uses. */
static rk_test_server S;

typedef rk_test_resp resp;

/* A whole exchange with the test's server. Returns 0 when an answer was read. */
static int http(const char *method, const char *path, const char *headers, const char *body,
                resp *r) {
    return rk_test_exchange(&S.t, method, path, headers, body, r);
}

/* Start a POST /v1/completions on c without waiting for its answer. */
static void open_completion(const char *body, rk_http_conn *c) {
    cr_assert_eq(rk_http_open(&S.t, "POST", "/v1/completions", NULL, body, strlen(body), c), RK_OK,
                 "%s", rk_error_message());
}

/* Read the rest of c's answer. */
static resp finish(rk_http_conn *c) {
    resp r = {0};
    cr_assert_eq(rk_http_finish(c, NULL, NULL, &r.http), RK_OK, "no answer: %s",
                 rk_error_message());
    rk_test_resp_parse_json(&r);
    return r;
}

/* ---------------------------------------------------------------- raw bytes
 * What no client sends on purpose (a request line with a bad version,
 * garbage, headers that never end, a connection that never sends anything,
 * two requests on one keep-alive connection read as bytes) goes over a plain
 * socket; the answer is parsed by the client's own parser. */

static int connect_port(void) { return rk_test_connect(S.port, NULL, 120); }

/* Parse a whole answer read as bytes (copied). Returns 0, or -1 when buf
 * holds no answer. */
static int parse_response(const char *buf, size_t len, resp *r) {
    memset(r, 0, sizeof *r);
    char *copy = malloc(len + 1);
    cr_assert(copy);
    memcpy(copy, buf, len);
    copy[len] = '\0';
    if (rk_http_parse(copy, len, &r->http)) return -1;
    rk_test_resp_parse_json(r);
    return 0;
}

/* Send raw bytes on a new connection and read the answer until the server
 * closes, for at most timeout_s; *took gets the seconds that took. Returns
 * the bytes read (malloc'ed). */
static char *raw_exchange(const char *req, size_t n, double timeout_s, double *took) {
    int fd = connect_port();
    cr_assert(fd >= 0, "cannot connect");
    struct timeval tv = {(time_t)timeout_s, (long)((timeout_s - (double)(time_t)timeout_s) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    double t0 = rk_test_now();
    cr_assert_eq(rk_test_send_all(fd, req, n), 0);
    size_t len;
    char *buf = rk_test_recv_all(fd, &len, NULL);
    if (took) *took = rk_test_now() - t0;
    close(fd);
    return buf;
}

static void start_default(void) {
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, NULL), 0, "the server did not start");
}

/* Stop the test's server; a sanitizer report in its log or an unclean exit
 * fails the test. */
static void stop_server(void) { rk_test_server_stop_checked(&S); }

static resp get(const char *path) {
    resp r;
    cr_assert_eq(http("GET", path, NULL, NULL, &r), 0, "GET %s: no response", path);
    return r;
}

static resp post(const char *path, const char *body) {
    resp r;
    cr_assert_eq(http("POST", path, NULL, body, &r), 0, "POST %s: no response", path);
    return r;
}

/* OpenAI's error type for an HTTP status. */
static const char *openai_error_type(int status) {
    return status == 401   ? "authentication_error"
           : status == 403 ? "permission_error"
           : status == 429 ? "rate_limit_error"
           : status == 503 ? "service_unavailable_error"
           : status >= 500 ? "server_error"
                           : "invalid_request_error";
}

/* OpenAI's envelope: its type for the status, a message, a code that is a
 * string or null (never the status), param a string or null; the HTTP
 * status in `status`. */
static void expect_envelope(resp *r) {
    cr_assert(r->json, "error body is not JSON: %s", r->http.body);
    cr_assert_eq(rk_test_jint(r->json, "error.status"), r->http.status, "%s", r->http.body);
    cr_assert_str_eq(rk_test_jstr(r->json, "error.type"), openai_error_type(r->http.status), "%s",
                     r->http.body);
    cr_assert(strlen(rk_test_jstr(r->json, "error.message")) > 0);
    json_t *code = rk_test_jget(r->json, "error.code"),
           *param = rk_test_jget(r->json, "error.param");
    cr_assert(json_is_null(code) || json_is_string(code), "error.code: %s", r->http.body);
    cr_assert(json_is_null(param) || json_is_string(param), "error.param: %s", r->http.body);
}

/* An error response: status, and OpenAI's envelope. */
static void expect_error(resp *r, int status) {
    cr_assert_eq(r->http.status, status, "want %d, got %d: %s", status, r->http.status,
                 r->http.body);
    expect_envelope(r);
}

/* The value of one Prometheus sample line ("name{labels}"), or -1. */
static double metric(const char *text, const char *sample) {
    size_t n = strlen(sample);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, sample, n) && p[n] == ' ') return atof(p + n + 1);
    return -1;
}

/* Check the report's token invariants. */
static void check_invariants(json_t *j) {
    long long prompt = rk_test_jint(j, "usage.prompt_tokens");
    long long sum =
        rk_test_jint(j, "ragkv.system.tokens") + rk_test_jint(j, "ragkv.question.tokens");
    json_t *chunks = rk_test_jget(j, "ragkv.chunks");
    for (size_t i = 0; i < json_array_size(chunks); i++)
        sum += json_integer_value(json_object_get(json_array_get(chunks, i), "tokens"));
    json_t *texts = rk_test_jget(j, "ragkv.texts");
    for (size_t i = 0; i < json_array_size(texts); i++)
        sum += json_integer_value(json_object_get(json_array_get(texts, i), "tokens"));
    cr_assert_eq(prompt, sum, "prompt_tokens %lld != system + chunks + texts + question %lld",
                 prompt, sum);
    cr_assert_eq(rk_test_jint(j, "usage.prompt_tokens_details.cached_tokens") +
                     rk_test_jint(j, "ragkv.timings.prompt_tokens_computed"),
                 prompt);
    cr_assert_eq(rk_test_jint(j, "usage.total_tokens"),
                 prompt + rk_test_jint(j, "usage.completion_tokens"));
}

/* ================================================================ basic routes */

TestSuite(http, .init = start_default, .fini = stop_server, .timeout = 300);

Test(http, health_is_ok_without_a_key) {
    resp r = get("/health");
    cr_assert_eq(r.http.status, 200);
    cr_assert_str_eq(rk_test_jstr(r.json, "status"), "ok");
    rk_test_resp_free(&r);
}

Test(http, models_describe_the_served_model) {
    resp r = get("/v1/models");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "object"), "list");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.id"), "ragkv synthetic tiny");
    cr_assert_eq(strlen(rk_test_jstr(r.json, "data.0.ragkv.fingerprint")), 32);
    cr_assert_eq(rk_test_jint(r.json, "data.0.ragkv.n_layers"), 4);
    cr_assert_eq(rk_test_jint(r.json, "data.0.ragkv.dim"), 128);
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.ragkv.chat_template"), "llama2");
    rk_test_resp_free(&r);
}

Test(http, unknown_route_is_404_and_wrong_method_405) {
    resp r = get("/v1/nothing");
    expect_error(&r, 404);
    rk_test_resp_free(&r);
    r = get("/v1/completions");
    expect_error(&r, 405);
    cr_assert_str_eq(rk_test_header(&r, "Allow"), "POST");
    rk_test_resp_free(&r);
    cr_assert_eq(http("DELETE", "/v1/stats", NULL, NULL, &r), 0);
    expect_error(&r, 405);
    rk_test_resp_free(&r);
}

/* ================================================================ completions */

Test(http, head_answers_headers_only_and_keeps_the_connection) {
    /* HEAD then GET on one keep-alive connection: the HEAD answer has the
     * GET's status and Content-Length but no body, so the next bytes are the
     * GET's answer. */
    int fd = connect_port();
    cr_assert(fd >= 0);
    static const char head[] = "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n";
    static const char get_[] = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    cr_assert_eq(rk_test_send_all(fd, head, sizeof head - 1), 0);
    rk_test_sleep(0.2);
    cr_assert_eq(rk_test_send_all(fd, get_, sizeof get_ - 1), 0);
    size_t n;
    char *a = rk_test_recv_all(fd, &n, NULL);
    close(fd);
    const char *end = strstr(a, "\r\n\r\n");
    cr_assert(end, "no answer: %s", a);
    resp h, g;
    cr_assert_eq(parse_response(a, (size_t)(end + 4 - a), &h), 0);
    cr_assert_eq(h.http.status, 200, "%s", a);
    cr_assert(!strncmp(end + 4, "HTTP/1.1 200", 12), "the HEAD answer has a body: %s", end + 4);
    cr_assert_eq(parse_response(end + 4, n - (size_t)(end + 4 - a), &g), 0);
    cr_assert_str_eq(rk_test_jstr(g.json, "status"), "ok");
    char cl[32];
    snprintf(cl, sizeof cl, "%zu", g.http.body_len);
    cr_assert_str_eq(rk_test_header(&h, "Content-Length"), cl);
    cr_assert_str_eq(rk_test_header(&h, "Content-Type"), "application/json");
    rk_test_resp_free(&h);
    rk_test_resp_free(&g);
    free(a);
    /* Every GET route answers HEAD; a POST-only route answers 405, without a body too. */
    static const char *paths[] = {"/v1/models", "/v1/stats", "/metrics", "/v1/chunks"};
    for (size_t i = 0; i < 4; i++) {
        resp r;
        cr_assert_eq(http("HEAD", paths[i], NULL, NULL, &r), 0);
        cr_assert_eq(r.http.status, 200, "HEAD %s: %d", paths[i], r.http.status);
        cr_assert_eq(r.http.body_len, 0, "HEAD %s has a body", paths[i]);
        cr_assert(atoi(rk_test_header(&r, "Content-Length")) > 0);
        rk_test_resp_free(&r);
    }
    resp r;
    cr_assert_eq(http("HEAD", "/v1/completions", NULL, NULL, &r), 0);
    cr_assert_eq(r.http.status, 405);
    cr_assert_eq(r.http.body_len, 0);
    cr_assert_str_eq(rk_test_header(&r, "Allow"), "POST");
    rk_test_resp_free(&r);
    cr_assert_eq(http("POST", "/health", NULL, "", &r), 0);
    expect_error(&r, 405);
    cr_assert_str_eq(rk_test_header(&r, "Allow"), "GET, HEAD");
    rk_test_resp_free(&r);
}

Test(http, a_nul_byte_in_the_path_is_400) {
    static const char *paths[] = {"/v1/stats%00", "/health%00", "/v1/chunks/%00abc"};
    for (size_t i = 0; i < 3; i++) {
        resp r = get(paths[i]);
        expect_error(&r, 400);
        rk_test_resp_free(&r);
    }
    resp r = get("/v1/st%61ts"); /* other escapes are decoded */
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* An error answer from before routing: any status from 400 up, in the JSON
 * error shape. */
static void expect_refused(resp *r, const char *what) {
    cr_assert(r->http.status >= 400, "%s: %d", what, r->http.status);
    cr_assert(r->json, "%s: the body is not JSON: %s", what, r->http.body);
    expect_envelope(r);
    cr_assert_str_eq(rk_test_header(r, "Content-Type"), "application/json");
}

/* What CivetWeb itself refuses is answered in the same JSON error shape. */
Test(http, requests_refused_before_routing_get_the_json_error_shape) {
    resp r;
    cr_assert_eq(http("TRACE", "/", NULL, NULL, &r), 0, "TRACE: %s", rk_error_message());
    expect_refused(&r, "TRACE");
    rk_test_resp_free(&r);
    size_t big = 64 * 1024;
    char *path = malloc(big + 2);
    cr_assert(path);
    path[0] = '/';
    memset(path + 1, 'a', big);
    path[big + 1] = '\0';
    cr_assert_eq(http("GET", path, NULL, NULL, &r), 0, "a 64 KiB path: %s", rk_error_message());
    expect_refused(&r, "a 64 KiB path");
    rk_test_resp_free(&r);
    free(path);
    /* Request lines no client sends. */
    const char *reqs[] = {"GET / HTTP/2.0\r\nHost: x\r\nConnection: close\r\n\r\n",
                          "garbage\r\n\r\n"};
    for (size_t i = 0; i < 2; i++) {
        double took;
        char *a = raw_exchange(reqs[i], strlen(reqs[i]), 10, &took);
        cr_assert_eq(parse_response(a, strlen(a), &r), 0, "%s: no answer", reqs[i]);
        expect_refused(&r, reqs[i]);
        rk_test_resp_free(&r);
        free(a);
    }
    /* An absolute URI naming this server is served. */
    char abs[64];
    snprintf(abs, sizeof abs, "http://127.0.0.1:%d/health", S.port);
    cr_assert_eq(http("GET", abs, NULL, NULL, &r), 0, "no answer to an absolute URI");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

Test(http, completion_report_keeps_the_token_invariants) {
    resp r = post("/v1/completions", "{\"prompt\": \"You are terse.##The cat sat.##The dog ran."
                                     "##Who ran?\", \"max_tokens\": 6, \"temperature\": 0}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "object"), "text_completion");
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 2);
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "miss");
    cr_assert_eq(strlen(rk_test_jstr(r.json, "ragkv.chunks.0.key")), 32);
    cr_assert_eq(rk_test_jint(r.json, "usage.completion_tokens"), 6);
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.finish_reason"), "length");
    check_invariants(r.json);
    rk_test_resp_free(&r);

    /* The same chunks in another order, under another system prompt: both hits. */
    r = post("/v1/completions", "{\"system\": \"Be kind.\", \"chunks\": [\"The dog ran.\", \"The "
                                "cat sat.\"], \"question\": \"Who sat?\", \"max_tokens\": 4}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.1.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.source"), "arena");
    cr_assert(rk_test_jint(r.json, "usage.prompt_tokens_details.cached_tokens") >=
              rk_test_jint(r.json, "ragkv.chunks.0.tokens") +
                  rk_test_jint(r.json, "ragkv.chunks.1.tokens"));
    check_invariants(r.json);
    rk_test_resp_free(&r);
}

/* The segments form: documents anywhere. A passage first sent in another
 * request, under another system prompt, is a hit inside the third group of
 * a conversation, at the live offset after everything before it. */
Test(http, segments_place_documents_where_they_stand_and_a_later_passage_hits_there) {
    resp r = post("/v1/completions", "{\"system\": \"Be brief.\", \"chunks\": [\"The owl "
                                     "hooted at night.\"], \"question\": \"Who hooted?\", "
                                     "\"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    r = post("/v1/completions",
             "{\"segments\": [{\"text\": \"You are terse.\"}, {\"chunks\": [\"The cat sat.\", "
             "{\"id\": \"d2\", \"text\": \"The dog ran.\"}]}, {\"text\": \"Who sat? The cat. "
             "And then?\"}, {\"chunks\": []}, {\"text\": \"More.\"}, {\"chunks\": [\"The owl "
             "hooted at night.\"]}, {\"text\": \"Who hooted?\"}], \"max_tokens\": 3}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 3);
    cr_assert_eq(rk_test_jint(r.json, "ragkv.chunks.0.group"), 0);
    cr_assert_eq(rk_test_jint(r.json, "ragkv.chunks.1.group"), 0);
    cr_assert_eq(rk_test_jint(r.json, "ragkv.chunks.2.group"), 2);
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "miss");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.2.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.2.source"), "arena");
    /* After group 0 and the two texts (at least a token each). */
    int end0 = rk_test_jint(r.json, "ragkv.chunks.1.live_offset") +
               rk_test_jint(r.json, "ragkv.chunks.1.tokens");
    cr_assert_geq(rk_test_jint(r.json, "ragkv.chunks.2.live_offset"), end0 + 2);
    check_invariants(r.json);
    rk_test_resp_free(&r);
    /* Malformed lists are 400s naming what is wrong. */
    const char *bad[] = {
        "{\"segments\": \"x\"}",
        "{\"segments\": []}",
        "{\"segments\": [{\"text\": \"a\", \"chunks\": []}]}",
        "{\"segments\": [{\"text\": 1}]}",
        "{\"segments\": [{\"text\": \"sys\"}, {\"chunks\": [\"c\"]}]}",
        "{\"segments\": [{\"text\": \"q\"}], \"prompt\": \"q\"}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        r = post("/v1/completions", bad[i]);
        expect_error(&r, 400);
        rk_test_resp_free(&r);
    }
}

/* A chat whose turns each bring documents (a `documents` field on each
 * user message): three groups where the turns stand. Turn 3's passage,
 * seen before in another conversation, is a hit inside group 2 at the live
 * offset after the turns before it. */
Test(http, a_chat_turns_documents_are_groups_and_a_passage_seen_elsewhere_hits_in_group_2) {
    resp r = post("/v1/chat/completions",
                  "{\"messages\": [{\"role\": \"user\", \"content\": \"Who hooted?\", "
                  "\"documents\": [\"The owl hooted at night.\"]}], \"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    r = post("/v1/chat/completions",
             "{\"messages\": ["
             "{\"role\": \"system\", \"content\": \"Answer from the documents.\"},"
             "{\"role\": \"user\", \"content\": \"Who sat?\", \"documents\": [\"The cat "
             "sat.\"]},"
             "{\"role\": \"assistant\", \"content\": \"The cat.\"},"
             "{\"role\": \"user\", \"content\": \"Who ran?\", \"documents\": [\"The dog "
             "ran.\", \"The fox hid.\"]},"
             "{\"role\": \"assistant\", \"content\": \"The dog.\"},"
             "{\"role\": \"user\", \"content\": \"Who hooted?\", \"documents\": [\"The owl "
             "hooted at night.\"]}], \"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 4);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.texts")), 2);
    cr_assert_eq(rk_test_jint(r.json, "ragkv.chunks.0.group"), 0);
    cr_assert_eq(rk_test_jint(r.json, "ragkv.chunks.2.group"), 1);
    cr_assert_eq(rk_test_jint(r.json, "ragkv.chunks.3.group"), 2);
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.3.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.3.source"), "arena");
    int after = rk_test_jint(r.json, "ragkv.chunks.2.live_offset") +
                rk_test_jint(r.json, "ragkv.chunks.2.tokens") +
                rk_test_jint(r.json, "ragkv.texts.1.tokens");
    cr_assert_eq(rk_test_jint(r.json, "ragkv.chunks.3.live_offset"), after);
    check_invariants(r.json);
    rk_test_resp_free(&r);
}

Test(http, miss_then_hit_shows_in_stats_and_metrics) {
    resp r = get("/v1/stats");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    long long lookups0 = rk_test_jint(r.json, "chunks.lookups"),
              hits0 = rk_test_jint(r.json, "chunks.hits");
    rk_test_resp_free(&r);
    const char *body = "{\"prompt\": \"S##alpha beta gamma##Q?\", \"max_tokens\": 2}";
    r = post("/v1/completions", body);
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "miss");
    rk_test_resp_free(&r);
    /* Without the prefix cache: a repeat would reuse the first sequence, chunk
     * included, and never look the chunk up. */
    r = post(
        "/v1/completions",
        "{\"prompt\": \"S##alpha beta gamma##Q?\", \"max_tokens\": 2, \"prefix_cache\": false}");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.source"), "arena");
    rk_test_resp_free(&r);
    r = get("/v1/stats");
    cr_assert_eq(rk_test_jint(r.json, "chunks.lookups"), lookups0 + 2);
    cr_assert_eq(rk_test_jint(r.json, "chunks.hits"), hits0 + 1);
    cr_assert_eq(rk_test_jint(r.json, "chunks.misses"), 1);
    cr_assert_eq(rk_test_jint(r.json, "chunks.windows.5m.lookups"), 2);
    cr_assert_eq(rk_test_jint(r.json, "chunks.windows.60m.hits"), 1);
    cr_assert(rk_test_jint(r.json, "chunks.entries") >= 1);
    cr_assert(rk_test_jint(r.json, "tokens.reused") > 0);
    cr_assert(rk_test_jint(r.json, "latency.ttft.count") >= 2);
    cr_assert_eq(rk_test_jint(r.json, "requests.by_status.200"),
                 3); /* two completions, one stats */
    rk_test_resp_free(&r);
    r = get("/metrics");
    cr_assert_eq(r.http.status, 200);
    cr_assert(strstr(rk_test_header(&r, "Content-Type"), "text/plain"));
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_lookups_total"), 2);
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_hits_total{source=\"arena\"}"), 1);
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_hits_total{source=\"prefix\"}"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_misses_total"), 1);
    cr_assert(metric(r.http.body, "ragkv_chunk_hit_tokens_total") > 0);
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_hit_tokens_total"),
                 metric(r.http.body, "ragkv_chunk_computed_tokens_total"));
    cr_assert_eq(metric(r.http.body, "ragkv_prefix_queries_total"), 1);
    cr_assert_eq(metric(r.http.body, "ragkv_requests_total{status=\"200\"}"), 4);
    cr_assert_eq(metric(r.http.body, "ragkv_ttft_seconds_count"), 2);
    cr_assert_eq(metric(r.http.body, "ragkv_ttft_seconds_bucket{le=\"+Inf\"}"), 2);
    cr_assert(metric(r.http.body, "ragkv_reindex_seconds_sum") >= 0);
    cr_assert(metric(r.http.body, "ragkv_pool_blocks{pool=\"chunk\",state=\"used\"}") >= 1);
    cr_assert_eq(metric(r.http.body, "ragkv_pool_blocks{pool=\"live\",state=\"used\"}"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_store_loads_total"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_evictions_total{pool=\"chunk\",reason=\"capacity\"}"),
                 0);
    rk_test_resp_free(&r);
}

Test(http, metrics_have_help_type_and_every_listed_name) {
    resp r = get("/metrics");
    static const char *counters[] = {"ragkv_chunk_lookups_total",
                                     "ragkv_chunk_hits_total",
                                     "ragkv_chunk_misses_total",
                                     "ragkv_chunk_hit_tokens_total",
                                     "ragkv_chunk_computed_tokens_total",
                                     "ragkv_prefix_queries_total",
                                     "ragkv_prefix_hit_tokens_total",
                                     "ragkv_evictions_total",
                                     "ragkv_requests_total",
                                     "ragkv_store_loads_total",
                                     "ragkv_nonfinite_logits_total"};
    char line[256];
    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++) {
        snprintf(line, sizeof line, "# TYPE %s counter\n", counters[i]);
        cr_assert(strstr(r.http.body, line), "missing %s", line);
        snprintf(line, sizeof line, "# HELP %s ", counters[i]);
        cr_assert(strstr(r.http.body, line), "missing %s", line);
    }
    cr_assert(strstr(r.http.body, "# TYPE ragkv_pool_blocks gauge\n"));
    cr_assert(strstr(r.http.body, "# TYPE ragkv_ttft_seconds histogram\n"));
    cr_assert(strstr(r.http.body, "# TYPE ragkv_reindex_seconds histogram\n"));
    cr_assert(strstr(r.http.body, "ragkv_reindex_seconds_bucket{le=\"+Inf\"} "));
    cr_assert(strstr(r.http.body, "ragkv_reindex_seconds_count "));
    cr_assert(strstr(r.http.body, "ragkv_evictions_total{pool=\"prefix\",reason=\"manual\"} "));
    rk_test_resp_free(&r);
}

/* The serving metrics operators know from vLLM, and the whole exposition
 * accepted by Prometheus's own checker. */
Test(http, serving_metrics_follow_a_generation_and_pass_promtool) {
    resp r = post("/v1/completions",
                  "{\"prompt\": \"Sys##A chunk.##Q\", \"max_tokens\": 4, \"temperature\": 0, "
                  "\"ignore_eos\": true}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    r = get("/metrics");
    static const char *gauges[] = {"ragkv_requests_running", "ragkv_requests_waiting",
                                   "ragkv_kv_usage_ratio"};
    static const char *histograms[] = {"ragkv_time_per_output_token_seconds",
                                       "ragkv_queue_time_seconds",
                                       "ragkv_e2e_request_latency_seconds"};
    char line[256];
    for (size_t i = 0; i < 3; i++) {
        snprintf(line, sizeof line, "# TYPE %s gauge\n", gauges[i]);
        cr_assert(strstr(r.http.body, line), "missing %s", line);
        snprintf(line, sizeof line, "# TYPE %s histogram\n", histograms[i]);
        cr_assert(strstr(r.http.body, line), "missing %s", line);
    }
    cr_assert_eq(metric(r.http.body, "ragkv_requests_running"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_kv_usage_ratio"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_preemptions_total"), 0);
    cr_assert_geq(metric(r.http.body, "ragkv_generation_tokens_total"), 4);
    cr_assert_geq(metric(r.http.body, "ragkv_prompt_tokens_total"), 3);
    cr_assert_geq(metric(r.http.body, "ragkv_time_per_output_token_seconds_count"), 1);

    if (rk_test_run("command -v promtool >/dev/null", NULL) != 0) {
        rk_test_resp_free(&r);
        cr_skip_test("promtool is not installed (make deps installs it)");
    }
    char *path = rk_test_write_tmp("promtool", "metrics.txt", r.http.body);
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s 2>&1", path);
    int rc = rk_test_run(cmd, &out);
    cr_assert_eq(rc, 0, "promtool: %s", out ? out : "");
    free(out);
    free(path);
    rk_test_resp_free(&r);
}

/* Greedy text and ids of `ragkv generate --json` for the same prompt. */
static json_t *generate_json(const char *model_flag, const char *prompt, int n) {
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s generate %s --prompt '%s' -n %d --temp 0 --json", RK_BIN,
             model_flag, prompt, n);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s failed", cmd);
    json_t *j = json_loads(out, 0, NULL);
    cr_assert(j, "generate printed no JSON: %s", out);
    free(out);
    return j;
}

static void expect_same_as_generate(const char *model_flag, const char *prompt, int n) {
    json_t *want = generate_json(model_flag, prompt, n);
    json_t *req = json_pack("{s:s, s:i, s:i}", "prompt", prompt, "max_tokens", n, "temperature", 0);
    char *body = json_dumps(req, 0);
    resp r = post("/v1/completions", body);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.text"), rk_test_jstr(want, "choices.0.text"));
    cr_assert(json_equal(rk_test_jget(r.json, "ragkv.completion_ids"),
                         rk_test_jget(want, "ragkv.completion_ids")),
              "completion ids differ");
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.finish_reason"),
                     rk_test_jstr(want, "choices.0.finish_reason"));
    cr_assert_eq(rk_test_jint(r.json, "usage.prompt_tokens"),
                 rk_test_jint(want, "usage.prompt_tokens"));
    rk_test_resp_free(&r);
    free(body);
    json_decref(req);
    json_decref(want);
}

Test(http, greedy_output_equals_generate_on_the_embedded_model) {
    expect_same_as_generate("", "Be brief.##Paris is in France.##Rome is in Italy.##Where?", 24);
    expect_same_as_generate("", "Once upon a time", 16);
}

Test(http_opts, greedy_output_equals_generate_on_stories260K, .fini = stop_server, .timeout = 300) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    const char *args[] = {"--model", model, NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    char flag[4200];
    snprintf(flag, sizeof flag, "--model %s", model);
    expect_same_as_generate(flag, "Once upon a time", 40);
    expect_same_as_generate(flag, "Lily was happy.##Tom had a red ball.##One day", 30);
    resp r = get("/v1/models");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.ragkv.architecture"), "llama");
    /* The file's name, never the path it was loaded from. */
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.ragkv.source"), "stories260K.gguf");
    cr_assert_null(strstr(r.http.body, model), "%s", r.http.body);
    rk_test_resp_free(&r);
    free(model);
}

Test(http, logprobs_give_top_alternatives) {
    resp r =
        post("/v1/completions",
             "{\"prompt\": \"Hello\", \"max_tokens\": 3, \"temperature\": 0, \"logprobs\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    json_t *lp = rk_test_jget(r.json, "choices.0.logprobs");
    cr_assert_eq(json_array_size(json_object_get(lp, "tokens")), 3);
    cr_assert_eq(json_array_size(json_object_get(lp, "token_logprobs")), 3);
    cr_assert(json_object_size(json_array_get(json_object_get(lp, "top_logprobs"), 0)) >= 1);
    cr_assert(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 0)) <= 0);
    rk_test_resp_free(&r);
}

Test(http, stop_string_cuts_the_text) {
    const char *req =
        "{\"prompt\": \"Once upon a time\", \"max_tokens\": 40, \"temperature\": 0%s}";
    resp full = rk_test_postf(&S.t, "/v1/completions", req, "");
    cr_assert_eq(full.http.status, 200, "%s", full.http.body);
    const char *text = rk_test_jstr(full.json, "choices.0.text");
    cr_assert(strlen(text) > 12, "text too short: %s", text);
    /* A stop string from the middle of the greedy text: the first run of 4
     * printable ASCII characters (stop strings match the generated bytes). */
    char stop[8] = "";
    size_t at = 0;
    for (size_t i = 4; text[i + 3] && !stop[0]; i++) {
        int ok = 1;
        for (int k = 0; k < 4; k++) ok &= text[i + k] >= 0x20 && text[i + k] < 0x7f;
        snprintf(stop, sizeof stop, "%.4s", text + i);
        if (!ok || (size_t)(strstr(text, stop) - text) != i)
            stop[0] = '\0';
        else
            at = i;
    }
    cr_assert(stop[0], "no ASCII run in %s", text);
    char extra[64];
    json_t *s = json_string(stop);
    char *stop_json = json_dumps(s, JSON_ENCODE_ANY);
    snprintf(extra, sizeof extra, ", \"stop\": [%s]", stop_json);
    resp cut = rk_test_postf(&S.t, "/v1/completions", req, extra);
    cr_assert_eq(cut.http.status, 200, "%s", cut.http.body);
    cr_assert_str_eq(rk_test_jstr(cut.json, "choices.0.finish_reason"), "stop");
    cr_assert_eq(strlen(rk_test_jstr(cut.json, "choices.0.text")), at);
    cr_assert(!strncmp(rk_test_jstr(cut.json, "choices.0.text"), text, at));
    cr_assert(rk_test_jint(cut.json, "usage.completion_tokens") < 40,
              "generation did not stop early");
    /* The generation ends with the token that completed the stop string:
     * usage, ids and logprobs count no token past it. */
    rk_test_resp_free(&cut);
    snprintf(extra, sizeof extra, ", \"stop\": [%s], \"logprobs\": 1", stop_json);
    cut = rk_test_postf(&S.t, "/v1/completions", req, extra);
    cr_assert_eq(cut.http.status, 200, "%s", cut.http.body);
    json_t *ids = rk_test_jget(cut.json, "ragkv.completion_ids"),
           *all = rk_test_jget(full.json, "ragkv.completion_ids");
    json_t *pieces = rk_test_jget(cut.json, "choices.0.logprobs.tokens");
    size_t n = json_array_size(ids);
    cr_assert_eq(rk_test_jint(cut.json, "usage.completion_tokens"), (long long)n);
    cr_assert_eq(json_array_size(pieces), n);
    for (size_t i = 0; i < n; i++)
        cr_assert(json_equal(json_array_get(ids, i), json_array_get(all, i)), "id %zu", i);
    char joined[4096] = "";
    for (size_t i = 0; i + 1 < n; i++)
        strncat(joined, json_string_value(json_array_get(pieces, i)),
                sizeof joined - strlen(joined) - 1);
    cr_assert_null(strstr(joined, stop), "the stop string was complete before the last token");
    strncat(joined, json_string_value(json_array_get(pieces, n - 1)),
            sizeof joined - strlen(joined) - 1);
    cr_assert_not_null(strstr(joined, stop), "%s does not reach the stop string", joined);
    /* The same through the stream. */
    snprintf(extra, sizeof extra, ", \"stop\": %s, \"stream\": true", stop_json);
    resp st = rk_test_postf(&S.t, "/v1/completions", req, extra);
    cr_assert_eq(st.http.status, 200);
    cr_assert(strstr(st.http.body, "\"finish_reason\":\"stop\""));
    free(stop_json);
    json_decref(s);
    rk_test_resp_free(&full);
    rk_test_resp_free(&cut);
    rk_test_resp_free(&st);
}

/* ================================================================ streaming */

/* Split an SSE body into its data payloads; checks the framing. Returns the
 * number of events; events[] are malloc'ed strings. */
static int sse_events(const char *body, char **events, int cap) {
    int n = 0;
    const char *p = body;
    while (*p && n < cap) {
        cr_assert(!strncmp(p, "data: ", 6), "an event does not start with 'data: ': %.40s", p);
        const char *end = strstr(p, "\n\n");
        cr_assert(end, "an event is not ended by a blank line");
        events[n++] = strndup(p + 6, (size_t)(end - p - 6));
        p = end + 2;
    }
    return n;
}

/* OpenAI's stream: content events (finish_reason null), one event with
 * the finish_reason and no text, then, with with_usage
 * (stream_options.include_usage), one with no choices that carries usage;
 * then [DONE]. The ragkv report is in the usage event, or without it on the
 * finish event. */
static void check_stream(const char *body, int chat, const char *want_text, int with_usage) {
    char *ev[512];
    int n = sse_events(body, ev, 512);
    cr_assert(n >= 2 + with_usage, "want at least a finish event%s and [DONE], got %d",
              with_usage ? ", a usage event" : "", n);
    cr_assert_str_eq(ev[n - 1], "[DONE]");
    char text[8192] = "";
    for (int i = 0; i < n - 1; i++) {
        json_t *j = json_loads(ev[i], 0, NULL);
        cr_assert(j, "event %d is not JSON: %s", i, ev[i]);
        cr_assert_str_eq(rk_test_jstr(j, "object"),
                         chat ? "chat.completion.chunk" : "text_completion");
        json_t *piece =
            chat ? rk_test_jget(j, "choices.0.delta.content") : rk_test_jget(j, "choices.0.text");
        if (piece) strncat(text, json_string_value(piece), sizeof text - strlen(text) - 1);
        int usage = with_usage && i == n - 2, finish = i == n - 2 - with_usage;
        cr_assert_eq(json_is_object(json_object_get(j, "usage")), usage,
                     "usage only in the usage event, when asked: %s", ev[i]);
        cr_assert_eq(json_object_get(j, "ragkv") != NULL, with_usage ? usage : finish, "%s", ev[i]);
        cr_assert_eq(json_is_string(rk_test_jget(j, "choices.0.finish_reason")), finish, "%s",
                     ev[i]);
        if (finish && chat) cr_assert_eq(json_object_size(rk_test_jget(j, "choices.0.delta")), 0);
        if (finish && !chat) cr_assert_str_eq(rk_test_jstr(j, "choices.0.text"), "");
        cr_assert_eq(json_array_size(json_object_get(j, "choices")) == 0, usage, "%s", ev[i]);
        if (usage) check_invariants(j);
        json_decref(j);
    }
    if (want_text) cr_assert_str_eq(text, want_text);
    for (int i = 0; i < n; i++) free(ev[i]);
}

Test(http, stream_frames_events_and_matches_the_whole_text) {
    const char *req = "{\"prompt\": \"Sys##Chunk one.##Chunk two.##What?\", \"max_tokens\": 20, "
                      "\"temperature\": 0%s}";
    resp whole = rk_test_postf(&S.t, "/v1/completions", req, "");
    resp st = rk_test_postf(&S.t, "/v1/completions", req, ", \"stream\": true");
    cr_assert_eq(st.http.status, 200);
    cr_assert(strstr(rk_test_header(&st, "Content-Type"), "text/event-stream"));
    check_stream(st.http.body, 0, rk_test_jstr(whole.json, "choices.0.text"), 0);
    rk_test_resp_free(&st);
    st = rk_test_postf(&S.t, "/v1/completions", req,
                       ", \"stream\": true, \"stream_options\": {\"include_usage\": true}");
    cr_assert_eq(st.http.status, 200);
    check_stream(st.http.body, 0, rk_test_jstr(whole.json, "choices.0.text"), 1);
    rk_test_resp_free(&whole);
    rk_test_resp_free(&st);
}

Test(http, chat_completion_with_chunks_in_the_message_and_as_extension) {
    const char *msgs = "\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
                       "{\"role\": \"user\", \"content\": \"Doc A.##Doc B.##What?\"}], "
                       "\"separator\": \"##\"";
    resp r = rk_test_postf(&S.t, "/v1/chat/completions",
                           "{%s, \"max_tokens\": 5, \"temperature\": 0}", msgs);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "object"), "chat.completion");
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.message.role"), "assistant");
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 2);
    check_invariants(r.json);
    const char *text = rk_test_jstr(r.json, "choices.0.message.content");
    /* The same chunks through the extension field: the same keys, now hits. */
    resp e = post("/v1/chat/completions",
                  "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": "
                  "\"user\", \"content\": \"What?\"}], \"chunks\": [\"Doc A.\", {\"id\": \"b\", "
                  "\"text\": \"Doc B.\"}], \"max_tokens\": 5, \"temperature\": 0}");
    cr_assert_eq(e.http.status, 200, "%s", e.http.body);
    cr_assert_str_eq(rk_test_jstr(e.json, "ragkv.chunks.1.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(e.json, "ragkv.chunks.1.key"),
                     rk_test_jstr(r.json, "ragkv.chunks.1.key"));
    cr_assert_str_eq(rk_test_jstr(e.json, "choices.0.message.content"), text);
    resp st = rk_test_postf(&S.t, "/v1/chat/completions",
                            "{%s, \"max_tokens\": 5, \"temperature\": 0, "
                            "\"stream\": true, \"stream_options\": {\"include_usage\": true}}",
                            msgs);
    check_stream(st.http.body, 1, text, 1);
    rk_test_resp_free(&r);
    rk_test_resp_free(&e);
    rk_test_resp_free(&st);
    resp bad = post("/v1/chat/completions",
                    "{\"messages\": [{\"role\": \"assistant\", \"content\": \"yo\"}]}");
    expect_error(&bad, 400);
    rk_test_resp_free(&bad);
}

/* ================================================================ input errors */

Test(http, malformed_input_is_400) {
    static const char *bodies[] = {
        "{not json",
        "[1, 2]",
        "{\"prompt\": 5}",
        "{\"prompt\": \"x\", \"temperature\": \"hot\"}",
        "{\"prompt\": \"x\", \"max_tokens\": -1}",
        "{\"prompt\": \"x\", \"top_p\": 0}",
        "{\"prompt\": \"x\", \"logprobs\": 21}",
        "{\"prompt\": \"x\", \"stop\": [\"\"]}",
        "{\"prompt\": \"x\", \"stream\": \"yes\"}",
        "{\"prompt\": \"x\", \"mode\": \"fancy\"}",
        "{\"prompt\": \"x\", \"separator\": \"\\\\\"}",
        "{\"prompt\": \"x\", \"repair\": {\"policy\": \"first_k\", \"k\": -1}}",
        "{\"prompt\": \"x\", \"repair\": {\"policy\": \"deviation\", \"ratio\": 1.5}}",
        "{\"prompt\": \"x\", \"repair\": {\"policy\": \"best\"}}",
        "{\"prompt\": \"x\", \"n\": 0}",
        "{\"prompt\": \"S##A##\"}",
        "{\"prompt\": \"x\", \"question\": \"y\"}",
        "{\"chunks\": [\"a\"]}",
        "{\"question\": \"q\", \"chunks\": [1]}",
        "{\"prompt\": "
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
        "{\"prompt\": \"\\ud800\"}",
    };
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        resp r = post("/v1/completions", bodies[i]);
        cr_assert_eq(r.http.status, 400, "%s -> %d %s", bodies[i], r.http.status, r.http.body);
        expect_error(&r, 400);
        rk_test_resp_free(&r);
    }
    /* first_k: the chunks' first k tokens are recomputed and reported. */
    resp r = post("/v1/completions",
                  "{\"prompt\": \"S##a first chunk of text##a second chunk##Q\", "
                  "\"repair\": {\"policy\": \"first_k\", \"k\": 2}, \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert(strstr(r.http.body, "\"recomputed_tokens\":4") != NULL, "%s", r.http.body);
    rk_test_resp_free(&r);
    /* deviation: a ratio of all the chunk tokens, rounded up. */
    r = post("/v1/completions",
             "{\"prompt\": \"S##a first chunk of text##a second chunk##Q\", "
             "\"repair\": {\"policy\": \"deviation\", \"ratio\": 1}, \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    json_int_t all = rk_test_jint(r.json, "ragkv.recomputed_tokens");
    cr_assert_gt(all, 4, "%s", r.http.body);
    rk_test_resp_free(&r);
    r = post("/v1/completions",
             "{\"prompt\": \"S##a first chunk of text##a second chunk##Q\", "
             "\"repair\": {\"policy\": \"deviation\", \"ratio\": 0.5}, \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "ragkv.recomputed_tokens"), (all + 1) / 2, "%s", r.http.body);
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"x\", \"repair\": {\"policy\": \"none\"}, "
                                "\"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* OpenAI's envelope names the field at fault in `param` (its path when it is
 * nested), has a string `code` or null, and OpenAI's type. */
Test(http, errors_name_the_field_and_use_openai_types_and_codes) {
    static const struct {
        const char *path, *body;
        int status;
        const char *param; /* NULL: null */
    } cases[] = {
        {"/v1/completions", "{\"prompt\": \"x\", \"temperature\": \"hot\"}", 400, "temperature"},
        {"/v1/completions", "{\"prompt\": \"x\", \"repair\": {\"policy\": \"best\"}}", 400,
         "repair.policy"},
        {"/v1/completions", "{\"prompt\": [\"a\", 5]}", 400, "prompt[1]"},
        {"/v1/completions", "{\"prompt\": \"x\", \"n\": 33}", 422, "n"},
        {"/v1/completions", "{\"prompt\": \"x\", \"logprobs\": 21}", 400, "logprobs"},
        {"/v1/chat/completions", "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}",
         400, "messages[0].role"},
        {"/v1/completions", "{not json", 400, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        resp r = post(cases[i].path, cases[i].body);
        expect_error(&r, cases[i].status);
        cr_assert(json_is_null(rk_test_jget(r.json, "error.code")), "%s", r.http.body);
        json_t *param = rk_test_jget(r.json, "error.param");
        if (cases[i].param)
            cr_assert_str_eq(json_string_value(param), cases[i].param, "%s -> %s", cases[i].body,
                             r.http.body);
        else
            cr_assert(json_is_null(param), "%s -> %s", cases[i].body, r.http.body);
        rk_test_resp_free(&r);
    }
    resp r = get("/v1/nothing-here");
    expect_error(&r, 404);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.type"), "invalid_request_error");
    cr_assert(json_is_null(rk_test_jget(r.json, "error.code")), "%s", r.http.body);
    cr_assert(json_is_null(rk_test_jget(r.json, "error.param")), "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* Under the default model_name_policy "any" (test_openai.c has "strict"). */
Test(http, an_unknown_model_is_answered_under_the_served_name) {
    resp r =
        post("/v1/completions", "{\"prompt\": \"x\", \"model\": \"gpt-9\", \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "model"), "ragkv synthetic tiny");
    rk_test_resp_free(&r);
    r = post("/v1/completions",
             "{\"prompt\": \"x\", \"model\": \"ragkv synthetic tiny\", \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

Test(http_opts, limits_give_413_422_and_context_length_exceeded, .fini = stop_server,
     .timeout = 300) {
    const char *args[] = {"--max-body-bytes",
                          "2000",
                          "--max-chunks",
                          "2",
                          "--max-chunk-tokens",
                          "40",
                          "--max-context",
                          "60",
                          "--max-tokens",
                          "100",
                          NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    char big[4000];
    memset(big, 'a', sizeof big);
    memcpy(big, "{\"prompt\": \"", 12);
    memcpy(big + sizeof big - 3, "\"}", 3);
    resp r = post("/v1/completions", big);
    expect_error(&r, 413);
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"S##a##b##c##Q\"}");
    expect_error(&r, 422);
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "chunks"));
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"system\": \"S\", \"chunks\": [\"a\", \"b\", \"c\"], "
                                "\"question\": \"Q\"}");
    expect_error(&r, 422);
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"S##a##b##Q\", \"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    /* Over max_tokens (100) and over the context (60) too: the context's 400. */
    r = post("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 101}");
    expect_error(&r, 400);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.code"), "context_length_exceeded");
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 99}");
    cr_assert_eq(r.http.status, 400, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.code"), "context_length_exceeded");
    cr_assert_eq(rk_test_jint(r.json, "error.status"), 400);
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "context"));
    rk_test_resp_free(&r);
    char chunk[600];
    snprintf(chunk, sizeof chunk, "{\"prompt\": \"S##%0400d##Q\"}", 7);
    r = post("/v1/completions", chunk);
    expect_error(&r, 422);
    rk_test_resp_free(&r);
}

/* OpenAI's shape for a request too large for the server: 400, the code a
 * client reads, and the project's type and message. */
static void expect_context_exceeded(resp *r) {
    cr_assert_eq(r->http.status, 400, "%s", r->http.body);
    cr_assert(r->json, "%s", r->http.body);
    cr_assert_str_eq(rk_test_jstr(r->json, "error.code"), "context_length_exceeded");
    cr_assert_str_eq(rk_test_jstr(r->json, "error.type"), "invalid_request_error");
    cr_assert(strstr(rk_test_jstr(r->json, "error.message"), "KV memory"), "%s", r->http.body);
}

Test(http_opts, a_request_larger_than_the_kv_memory_is_context_length_exceeded, .fini = stop_server,
     .timeout = 300) {
    const char *args[] = {"--kv-memory-mb", "1", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    resp r = post("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 1000}");
    expect_context_exceeded(&r);
    rk_test_resp_free(&r);
    /* Chunks too many for the chunk and live pools together, with nothing else running. */
    char body[8192] = "{\"prompt\": \"S", piece[160];
    for (int i = 0; i < 24; i++) {
        snprintf(piece, sizeof piece,
                 "##Chunk %d: the little red fox ran into the deep forest "
                 "and found a friend there.",
                 i);
        strcat(body, piece);
    }
    strcat(body, "##Q\", \"max_tokens\": 2}");
    r = post("/v1/completions", body);
    expect_context_exceeded(&r);
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 4}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* A request whose chunks do not fit the chunk pool is served: the chunks
 * that still do not fit after eviction are computed uncached, and the
 * completion equals the one with the chunk cache off. */
Test(http_opts, chunks_beyond_the_chunk_pool_are_served_uncached, .fini = stop_server,
     .timeout = 300) {
    const char *args[] = {"--kv-memory-mb", "64", "--chunk-blocks", "4", "--kv-dtype", "f32", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    char prompt[4096] = "You are terse.", piece[200];
    for (int i = 0; i < 6; i++) {
        snprintf(piece, sizeof piece,
                 "##Document %d. The little red fox ran into the deep "
                 "forest, found a friend and came home.",
                 i);
        strcat(prompt, piece);
    }
    strcat(prompt, "##Who ran?");
    resp r = rk_test_postf(&S.t, "/v1/completions",
                           "{\"prompt\": \"%s\", \"max_tokens\": 8, "
                           "\"temperature\": 0}",
                           prompt);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    check_invariants(r.json);
    int uncached = 0, n = (int)json_array_size(rk_test_jget(r.json, "ragkv.chunks"));
    cr_assert_eq(n, 6);
    for (int i = 0; i < n; i++) {
        char path[64];
        snprintf(path, sizeof path, "ragkv.chunks.%d.status", i);
        uncached += !strcmp(rk_test_jstr(r.json, path), "uncached");
    }
    cr_assert_geq(uncached, 1, "%s", r.http.body);
    cr_assert_lt(uncached, n, "the pool took what it could: %s", r.http.body);
    resp o = rk_test_postf(&S.t, "/v1/completions",
                           "{\"prompt\": \"%s\", \"max_tokens\": 8, "
                           "\"temperature\": 0, \"chunk_cache\": false}",
                           prompt);
    cr_assert_eq(o.http.status, 200, "%s", o.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.text"),
                     rk_test_jstr(o.json, "choices.0.text"));
    rk_test_resp_free(&o);
    rk_test_resp_free(&r);
    /* The pools in tokens. */
    r = get("/v1/stats");
    cr_assert_eq(rk_test_jint(r.json, "pools.chunk.tokens"), 4 * 16);
    cr_assert_eq(rk_test_jint(r.json, "kv.pools.chunk.tokens"), 4 * 16);
    cr_assert_str_eq(rk_test_jstr(r.json, "kv.dtype"), "f32");
    rk_test_resp_free(&r);
}

/* ================================================================ keys */

Test(http_opts, api_key_protects_every_route_but_health, .fini = stop_server, .timeout = 300) {
    const char *env[] = {"RAGKV_API_KEY=sesame", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", env, NULL), 0);
    resp r;
    static const char *paths[] = {"/v1/models", "/v1/stats", "/metrics", "/v1/chunks"};
    for (size_t i = 0; i < 4; i++) {
        cr_assert_eq(http("GET", paths[i], NULL, NULL, &r), 0);
        expect_error(&r, 401);
        rk_test_resp_free(&r);
        cr_assert_eq(http("GET", paths[i], "Authorization: Bearer wrong\r\n", NULL, &r), 0);
        expect_error(&r, 401);
        rk_test_resp_free(&r);
        cr_assert_eq(http("GET", paths[i], "Authorization: Bearer sesame\r\n", NULL, &r), 0);
        cr_assert_eq(r.http.status, 200, "%s: %s", paths[i], r.http.body);
        rk_test_resp_free(&r);
    }
    /* The scheme is case-insensitive (RFC 7235), and may be followed by more than one space. */
    static const char *schemes[] = {"authorization: bearer sesame\r\n",
                                    "Authorization: BEARER  sesame\r\n"};
    for (size_t i = 0; i < 2; i++) {
        cr_assert_eq(http("GET", "/v1/models", schemes[i], NULL, &r), 0);
        cr_assert_eq(r.http.status, 200, "%s: %s", schemes[i], r.http.body);
        rk_test_resp_free(&r);
    }
    cr_assert_eq(http("GET", "/v1/models", "Authorization: Basic sesame\r\n", NULL, &r), 0);
    expect_error(&r, 401);
    rk_test_resp_free(&r);
    cr_assert_eq(http("POST", "/v1/completions", NULL, "{\"prompt\": \"x\"}", &r), 0);
    expect_error(&r, 401);
    rk_test_resp_free(&r);
    cr_assert_eq(http("POST", "/v1/completions", "Authorization: Bearer sesame\r\n",
                      "{\"prompt\": \"x\", \"max_tokens\": 1}", &r),
                 0);
    cr_assert_eq(r.http.status, 200);
    rk_test_resp_free(&r);
    r = get("/health");
    cr_assert_eq(r.http.status, 200);
    rk_test_resp_free(&r);
    r = get("/ready");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

Test(http_opts, admin_key_guards_flush_and_delete, .fini = stop_server, .timeout = 300) {
    const char *args[] = {"--api-key", "user", "--admin-key", "root", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    resp r;
    cr_assert_eq(http("POST", "/v1/cache/flush", "Authorization: Bearer user\r\n", "{}", &r), 0);
    expect_error(&r, 401);
    rk_test_resp_free(&r);
    cr_assert_eq(http("DELETE", "/v1/chunks/00000000000000000000000000000000",
                      "Authorization: Bearer user\r\n", NULL, &r),
                 0);
    expect_error(&r, 401);
    rk_test_resp_free(&r);
    cr_assert_eq(http("POST", "/v1/cache/flush", "Authorization: Bearer root\r\n",
                      "{\"what\": \"all\"}", &r),
                 0);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    /* The admin key opens the ordinary routes too. */
    cr_assert_eq(http("GET", "/v1/stats", "Authorization: Bearer root\r\n", NULL, &r), 0);
    cr_assert_eq(r.http.status, 200);
    rk_test_resp_free(&r);
}

/* ================================================================ chunks and cache */

Test(http, prewarm_list_get_delete_and_flush_chunks) {
    resp r = post("/v1/chunks", "{\"chunks\": [\"The sky is blue.\", {\"id\": \"doc-7#3\", "
                                "\"text\": \"Grass is green.\"}]}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.status"), "computed");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.1.id"), "doc-7#3");
    cr_assert(rk_test_jint(r.json, "data.1.tokens") > 0);
    char key[33];
    snprintf(key, sizeof key, "%s", rk_test_jstr(r.json, "data.1.key"));
    rk_test_resp_free(&r);
    r = post("/v1/chunks", "{\"chunks\": [\"Grass is green.\"]}");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.status"), "cached");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.key"), key);
    rk_test_resp_free(&r);
    /* A completion that uses it: a hit with the same key. */
    r = post("/v1/completions", "{\"prompt\": \"S##Grass is green.##Q\", \"max_tokens\": 1}");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.key"), key);
    rk_test_resp_free(&r);

    r = get("/v1/chunks?sort=hits&limit=10");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "total"), 2);
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.key"), key); /* most hits first */
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.id"), "doc-7#3");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.tier"), "arena");
    cr_assert_eq(rk_test_jint(r.json, "data.0.hits"), 1); /* the completion; a pre-warm is no hit */
    cr_assert(rk_test_jint(r.json, "data.0.bytes") > 0);
    cr_assert(!strstr(r.http.body, "Grass"), "chunk text leaked into the listing");
    rk_test_resp_free(&r);
    r = get("/v1/chunks?limit=1&offset=1");
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "data")), 1);
    rk_test_resp_free(&r);
    r = get("/v1/chunks?sort=size");
    expect_error(&r, 400);
    rk_test_resp_free(&r);

    char path[128];
    snprintf(path, sizeof path, "/v1/chunks/%s", key);
    r = get(path);
    cr_assert_eq(r.http.status, 200);
    cr_assert_eq(rk_test_jint(r.json, "refs"), 0);
    rk_test_resp_free(&r);
    r = get("/v1/chunks/xyz");
    expect_error(&r, 400);
    rk_test_resp_free(&r);
    r = get("/v1/chunks/0123456789abcdef0123456789abcdef");
    expect_error(&r, 404);
    rk_test_resp_free(&r);
    cr_assert_eq(http("DELETE", path, NULL, NULL, &r), 0);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    cr_assert_eq(http("DELETE", path, NULL, NULL, &r), 0);
    expect_error(&r, 404);
    rk_test_resp_free(&r);

    r = post("/v1/cache/flush", "{\"what\": \"chunks\"}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "flushed.chunks"), 1);
    rk_test_resp_free(&r);
    r = get("/v1/stats");
    cr_assert_eq(rk_test_jint(r.json, "chunks.entries"), 0);
    cr_assert_eq(rk_test_jint(r.json, "chunks.evictions.manual"), 2);
    rk_test_resp_free(&r);
    r = post("/v1/cache/flush", "{\"what\": \"everything\"}");
    expect_error(&r, 400);
    rk_test_resp_free(&r);
    r = post("/v1/chunks", "{\"chunks\": [\"x\"], \"persist\": true}");
    expect_error(&r, 501);
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "persistence is not configured"));
    rk_test_resp_free(&r);
    r = post("/v1/cache/flush", "{\"what\": \"all\", \"disk\": true}");
    expect_error(&r, 501);
    rk_test_resp_free(&r);
}

Test(http, prewarm_in_the_system_context_is_reused_under_that_system_prompt) {
    resp r = post("/v1/chunks", "{\"chunks\": [\"A chunk after the system.\"], "
                                "\"chunk_context\": \"system\", \"system\": \"Be terse.\"}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.status"), "computed");
    char key[33];
    snprintf(key, sizeof key, "%s", rk_test_jstr(r.json, "data.0.key"));
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"Be terse.##A chunk after the system.##Q\", "
                                "\"chunk_context\": \"system\", \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.key"), key);
    rk_test_resp_free(&r);
    /* Under another system prompt it is another key: a miss. */
    r = post("/v1/completions", "{\"prompt\": \"Be kind.##A chunk after the system.##Q\", "
                                "\"chunk_context\": \"system\", \"max_tokens\": 1}");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "miss");
    rk_test_resp_free(&r);
}

Test(http_opts, the_store_keeps_chunks_across_restarts, .fini = stop_server, .timeout = 300) {
    char *dir = rk_test_tmpdir("httpstore");
    const char *args[] = {"--store", dir, NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    resp r = post("/v1/chunks", "{\"chunks\": [{\"id\": \"doc-1\", \"text\": \"Stored chunk "
                                "text.\"}], \"persist\": true}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.status"), "computed");
    char key[33], path[128];
    snprintf(key, sizeof key, "%s", rk_test_jstr(r.json, "data.0.key"));
    snprintf(path, sizeof path, "/v1/chunks/%s", key);
    rk_test_resp_free(&r);
    r = get("/v1/stats");
    cr_assert(json_is_true(rk_test_jget(r.json, "store.configured")));
    cr_assert_eq(rk_test_jint(r.json, "store.rows"), 1);
    cr_assert(rk_test_jint(r.json, "store.writes") >= 1);
    cr_assert_eq(rk_test_jint(r.json, "store.writes_pending.bytes"), 0,
                 "pre-warming returns with its writes on disk");
    rk_test_resp_free(&r);
    r = get("/v1/chunks?tier=disk");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "total"), 1);
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.key"), key);
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.id"), "doc-1");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.tier"), "disk");
    rk_test_resp_free(&r);
    cr_assert_eq(rk_test_server_stop(&S), 0);

    /* A new process over the same store: the chunk comes back from disk,
     * read by the loader thread for a completion. */
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    r = get(path);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "tier"), "disk");
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"S##Stored chunk text.##Q\", \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.source"), "disk");
    rk_test_resp_free(&r);
    r = get("/metrics");
    cr_assert_eq(metric(r.http.body, "ragkv_store_loads_total"), 1);
    cr_assert_eq(metric(r.http.body, "ragkv_tier_load_seconds_count"), 1);
    cr_assert_eq(metric(r.http.body, "ragkv_tier_load_bytes_in_flight"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_tier_write_bytes_in_flight"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_tier_writes_failed_total"), 0);
    rk_test_resp_free(&r);
    r = get("/v1/stats");
    cr_assert_eq(rk_test_jint(r.json, "store.reads.completed"), 1);
    cr_assert_eq(rk_test_jint(r.json, "store.reads.failed"), 0);
    rk_test_resp_free(&r);
    r = post("/v1/chunks", "{\"chunks\": [\"Stored chunk text.\"]}");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.status"), "cached");
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.tier"), "arena");
    rk_test_resp_free(&r);
    cr_assert_eq(http("DELETE", path, NULL, NULL, &r), 0);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert(json_is_true(rk_test_jget(r.json, "arena")) &&
              json_is_true(rk_test_jget(r.json, "disk")));
    rk_test_resp_free(&r);
    r = post("/v1/cache/flush", "{\"what\": \"all\", \"disk\": true}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "flushed.disk_rows"), 0);
    rk_test_resp_free(&r);
    r = get("/v1/stats");
    cr_assert_eq(rk_test_jint(r.json, "store.rows"), 0);
    rk_test_resp_free(&r);
    free(dir);
}

/* The server started over a store whose database was deleted keeps every
 * payload file, rebuilds its row and serves the chunk from disk. */
Test(http_opts, a_deleted_store_database_is_rebuilt_and_its_chunks_served, .fini = stop_server,
     .timeout = 300) {
    char *dir = rk_test_tmpdir("httpstore-rebuild");
    const char *args[] = {"--store", dir, NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    resp r = post("/v1/chunks", "{\"chunks\": [\"A chunk kept on disk.\"], \"persist\": true}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    cr_assert_eq(rk_test_server_stop(&S), 0);
    char db[4200];
    snprintf(db, sizeof db, "%s/chunks.db", dir);
    cr_assert_eq(unlink(db), 0);

    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    r = get("/v1/stats");
    cr_assert_eq(rk_test_jint(r.json, "store.rows"), 1, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "store.rows_rebuilt"), 1, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "store.quarantined"), 0);
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"S##A chunk kept on disk.##Q\", \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.source"), "disk");
    rk_test_resp_free(&r);
    free(dir);
}

/* Pool, reference and lock counts of /v1/stats. */
typedef struct counts {
    long long live_used, chunk_refs, prefix_locked;
} counts;

static counts stats_counts(void) {
    resp r = get("/v1/stats");
    cr_assert_eq(r.http.status, 200);
    counts c = {rk_test_jint(r.json, "pools.live.used"), rk_test_jint(r.json, "chunks.referenced"),
                rk_test_jint(r.json, "prefix.locked_tokens")};
    rk_test_resp_free(&r);
    return c;
}

static int counts_equal(counts a, counts b) {
    return a.live_used == b.live_used && a.chunk_refs == b.chunk_refs &&
           a.prefix_locked == b.prefix_locked;
}

/* Start a stream on c and return once its first event arrived. */
static void stream_until_first_event(const char *body, rk_http_conn *c) {
    open_completion(body, c);
    cr_assert_eq(rk_http_wait_for(c, "data: "), RK_OK,
                 "the stream ended before its first event: %s", rk_error_message());
}

Test(http_opts, a_client_that_disconnects_mid_stream_releases_everything, .fini = stop_server,
     .timeout = 300) {
    const char *args[] = {"--token-delay-s", "0.01", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    counts base = stats_counts();
    const char *body = "{\"prompt\": \"A long system prompt for the prefix cache, long enough to "
                       "fill a block or two of sixteen tokens.##Chunk text here.##Go on\", "
                       "\"max_tokens\": 400, \"ignore_eos\": true, \"stream\": true}";
    rk_http_conn c;
    stream_until_first_event(body, &c);
    counts during = stats_counts();
    for (double t_end = rk_test_now() + 2;
         during.live_used == base.live_used && rk_test_now() < t_end;) {
        rk_test_sleep(0.01);
        during = stats_counts();
    }
    cr_assert(during.live_used > base.live_used, "the request holds no live blocks");
    cr_assert(during.chunk_refs > 0 && during.prefix_locked > 0);
    rk_http_close(&c);
    double until = rk_test_now() + 30;
    counts after = stats_counts();
    while (!counts_equal(after, base) && rk_test_now() < until) {
        rk_test_sleep(0.05);
        after = stats_counts();
    }
    cr_assert(counts_equal(after, base), "live %lld refs %lld locked %lld, want %lld %lld %lld",
              after.live_used, after.chunk_refs, after.prefix_locked, base.live_used,
              base.chunk_refs, base.prefix_locked);
    /* It stopped early: far fewer than 400 tokens went through. */
    resp r = get("/v1/stats");
    cr_assert(rk_test_jint(r.json, "tokens.generated") < 390, "generated %lld",
              rk_test_jint(r.json, "tokens.generated"));
    rk_test_resp_free(&r);
}

Test(http_opts, deleting_a_chunk_in_use_is_409, .fini = stop_server, .timeout = 300) {
    const char *args[] = {"--token-delay-s", "0.01", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    resp r = post("/v1/chunks", "{\"chunks\": [\"Busy chunk.\"]}");
    char path[128];
    snprintf(path, sizeof path, "/v1/chunks/%s", rk_test_jstr(r.json, "data.0.key"));
    rk_test_resp_free(&r);
    rk_http_conn c;
    stream_until_first_event("{\"prompt\": \"S##Busy chunk.##Q\", \"max_tokens\": 300, "
                             "\"ignore_eos\": true, \"stream\": true}",
                             &c);
    cr_assert_eq(http("DELETE", path, NULL, NULL, &r), 0);
    expect_error(&r, 409);
    rk_test_resp_free(&r);
    rk_http_close(&c);
}

Test(http_opts, a_full_queue_and_timeouts_give_503_or_cancel, .fini = stop_server, .timeout = 300) {
    const char *args[] = {"--token-delay-s", "0.02", "--queue", "1", "--max-batch", "1",
                          "--timeout-s",     "1.5",  NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    /* Q arrives first (its headers start its clock) but sends its body late,
     * so it waits in the queue behind R and times out there, before R does. */
    const char *qbody = "{\"prompt\": \"q\", \"max_tokens\": 5}";
    char qlen[96];
    snprintf(qlen, sizeof qlen, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
             strlen(qbody));
    rk_http_conn q, rc;
    cr_assert_eq(rk_http_open(&S.t, "POST", "/v1/completions", qlen, NULL, 0, &q), RK_OK);
    rk_test_sleep(0.2);
    stream_until_first_event("{\"prompt\": \"x\", \"max_tokens\": 500, \"ignore_eos\": "
                             "true, \"stream\": true}",
                             &rc);
    cr_assert_eq(rk_test_send_all(q.fd, qbody, strlen(qbody)), 0);
    rk_test_sleep(0.3);
    /* The queue (one place) is full now. */
    resp r = post("/v1/completions", "{\"prompt\": \"y\", \"max_tokens\": 1}");
    expect_error(&r, 503);
    cr_assert_str_eq(rk_test_header(&r, "Retry-After"), "1");
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "queue"));
    rk_test_resp_free(&r);
    r = finish(&q);
    expect_error(&r, 503);
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "timeout"), "%s", r.http.body);
    rk_test_resp_free(&r);
    /* R is cancelled at its deadline: the stream ends with finish_reason "cancelled". */
    r = finish(&rc);
    const char *rr = r.http.body;
    cr_assert(strstr(rr, "\"finish_reason\":\"cancelled\""), "stream tail: %s",
              strlen(rr) > 600 ? rr + strlen(rr) - 600 : rr);
    cr_assert(strstr(rr, "data: [DONE]"));
    rk_test_resp_free(&r);
    /* A non-streaming request that runs past the timeout is answered 503. */
    r = post("/v1/completions", "{\"prompt\": \"z\", \"max_tokens\": 500, \"ignore_eos\": true}");
    expect_error(&r, 503);
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "timeout"));
    rk_test_resp_free(&r);
}

/* ================================================================ life cycle */

/* /health is 200 while the process lives (a liveness probe must not kill a
 * server loading its model); /ready is 503 until the model is loaded. */
Test(http_opts, ready_is_503_and_health_200_while_loading, .fini = stop_server, .timeout = 300) {
    const char *args[] = {"--load-delay-s", "1.5", NULL};
    cr_assert_eq(rk_test_server_start(&S, "http", NULL, args, NULL), 0);
    resp r = get("/ready");
    cr_assert_eq(r.http.status, 503, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "status"), "loading");
    cr_assert_str_eq(rk_test_jstr(r.json, "error.type"), "service_unavailable_error");
    cr_assert(json_is_null(rk_test_jget(r.json, "error.code")), "%s", r.http.body);
    cr_assert_str_eq(rk_test_header(&r, "Retry-After"), "1");
    rk_test_resp_free(&r);
    r = get("/health");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "status"), "loading");
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"x\"}");
    expect_error(&r, 503);
    rk_test_resp_free(&r);
    double until = rk_test_now() + 30;
    int status = 0;
    while (rk_test_now() < until) {
        r = get("/ready");
        status = r.http.status;
        rk_test_resp_free(&r);
        if (status == 200) break;
        rk_test_sleep(0.05);
    }
    cr_assert_eq(status, 200);
    r = get("/health");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "status"), "ok");
    rk_test_resp_free(&r);
}

/* SIGTERM drains: /ready turns 503 at once (a load balancer stops sending
 * work), /health stays 200, new requests get 503 with Retry-After, the
 * request already running finishes whole, and the process exits 0. */
Test(http_opts, sigterm_drains_ready_503_running_requests_finish, .timeout = 300) {
    const char *args[] = {"--token-delay-s", "0.02", "--grace-s", "60", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    rk_http_conn c;
    open_completion("{\"prompt\": \"x\", \"max_tokens\": 300, \"ignore_eos\": true}", &c);
    for (double until = rk_test_now() + 20; rk_test_now() < until; rk_test_sleep(0.02)) {
        resp st = get("/v1/stats");
        long long running = rk_test_jint(st.json, "requests.running");
        rk_test_resp_free(&st);
        if (running > 0) break;
    }
    cr_assert_eq(kill(S.pid, SIGTERM), 0);
    resp r = {0};
    for (double until = rk_test_now() + 20; rk_test_now() < until; rk_test_sleep(0.02)) {
        r = get("/ready");
        if (r.http.status == 503) break;
        rk_test_resp_free(&r);
    }
    cr_assert_eq(r.http.status, 503, "/ready did not turn 503 after SIGTERM: %s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "status"), "stopping");
    cr_assert_str_eq(rk_test_header(&r, "Retry-After"), "1");
    rk_test_resp_free(&r);
    r = get("/health");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "status"), "stopping");
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"y\", \"max_tokens\": 1}");
    expect_error(&r, 503);
    cr_assert_str_eq(rk_test_header(&r, "Retry-After"), "1");
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "shutting down"), "%s", r.http.body);
    rk_test_resp_free(&r);
    /* The running request was not cut: all its tokens, finish_reason length. */
    r = finish(&c);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "usage.completion_tokens"), 300, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.finish_reason"), "length");
    rk_test_resp_free(&r);
    cr_assert_eq(rk_test_server_stop(&S), 0, "ragkv serve did not exit with status 0 on SIGTERM");
}

Test(http_opts, sigterm_exits_cleanly_after_work, .timeout = 300) {
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, NULL), 0);
    resp r = post("/v1/completions", "{\"prompt\": \"S##c##Q\", \"max_tokens\": 3}");
    cr_assert_eq(r.http.status, 200);
    rk_test_resp_free(&r);
    cr_assert_eq(rk_test_server_stop(&S), 0, "ragkv serve did not exit with status 0 on SIGTERM");
}

/* requests.queued of /v1/stats. */
static long long queued_now(void) {
    resp r = get("/v1/stats");
    long long q = rk_test_jint(r.json, "requests.queued");
    rk_test_resp_free(&r);
    return q;
}

Test(http_opts, sigterm_ends_streams_with_a_final_event_and_answers_queued_requests_503,
     .timeout = 300) {
    const char *args[] = {"--token-delay-s", "0.02", "--grace-s", "0.3", "--max-batch", "1", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    rk_http_conn c, qs[2];
    stream_until_first_event("{\"prompt\": \"x\", \"max_tokens\": 2000, \"ignore_eos\": "
                             "true, \"stream\": true, \"stream_options\": {\"include_usage\": "
                             "true}}",
                             &c);
    open_completion("{\"prompt\": \"q\", \"max_tokens\": 5}", &qs[0]);
    open_completion("{\"prompt\": \"r\", \"max_tokens\": 5, \"stream\": true}", &qs[1]);
    for (double until = rk_test_now() + 20; queued_now() < 2 && rk_test_now() < until;)
        rk_test_sleep(0.02);
    cr_assert_eq(queued_now(), 2, "the two requests are not queued behind the stream");
    double t = rk_test_now();
    cr_assert_eq(rk_test_server_stop(&S), 0, "ragkv serve did not exit with status 0 on SIGTERM");
    cr_assert(rk_test_now() - t < 20, "shutdown took %.1f s", rk_test_now() - t);
    /* The stream that was cut ends with its finish event (finish_reason
     * "cancelled"), the usage event and [DONE]. */
    resp cut = finish(&c);
    const char *rest = cut.http.body;
    size_t n = cut.http.body_len;
    const char *done = strstr(rest, "data: [DONE]\n\n");
    cr_assert(done && done[14] == '\0', "the stream does not end with [DONE]; its tail: %s",
              n > 400 ? rest + n - 400 : rest);
    const char *last = NULL;
    for (const char *p = strstr(rest, "data: {"); p && p < done; p = strstr(p + 1, "data: {"))
        last = p;
    cr_assert(last, "no event before [DONE]: %s", rest);
    json_t *ev = json_loadb(last + 6, (size_t)(done - 2 - last - 6), 0, NULL);
    cr_assert(ev, "the final event is not JSON: %.300s", last);
    cr_assert(strstr(rest, "\"finish_reason\":\"cancelled\""), "no cancelled finish event");
    cr_assert(rk_test_jint(ev, "usage.completion_tokens") > 0);
    check_invariants(ev);
    json_decref(ev);
    rk_test_resp_free(&cut);
    /* The queued ones are answered 503 in the JSON error shape. */
    for (int i = 0; i < 2; i++) {
        resp r = finish(&qs[i]);
        expect_error(&r, 503);
        cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "shutting down"), "%s",
                  r.http.body);
        rk_test_resp_free(&r);
    }
}

/* ================================================================ slow and idle clients */

Test(http_opts, idle_connections_do_not_starve_the_service, .fini = stop_server, .timeout = 300) {
    /* All from one address: allowed here (test_openai.c tests the limit). */
    const char *args[] = {"--max-connections-per-ip", "100000", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    enum { N_IDLE = 4 * (64 + 16) }; /* 4 x the default http_threads (queue + 16) */
    static int fds[N_IDLE];
    for (int i = 0; i < N_IDLE; i++) {
        fds[i] = connect_port();
        cr_assert(fds[i] >= 0, "connection %d refused", i);
    }
    rk_test_sleep(0.5); /* the server has taken them */
    rk_http_target within_2s = S.t;
    within_2s.timeout_s = 2.0;
    double t0 = rk_test_now();
    resp r;
    cr_assert_eq(rk_test_exchange(&within_2s, "GET", "/health", NULL, NULL, &r), 0,
                 "/health did not answer within 2 s with %d idle connections open: %s", N_IDLE,
                 rk_error_message());
    double took = rk_test_now() - t0;
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert(took < 2, "/health took %.2f s", took);
    rk_test_resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    for (int i = 0; i < N_IDLE; i++) close(fds[i]);
}

/* Take a request slot: a streamed completion that runs far longer than the
 * test (a token a second; the server cancels it when its client goes). A
 * request whose body is still arriving holds no slot. */
static void hold_slot(rk_http_conn *c) {
    static const char body[] =
        "{\"prompt\": \"x\", \"max_tokens\": 1000, \"ignore_eos\": true, \"stream\": true}";
    cr_assert_eq(rk_http_open(&S.t, "POST", "/v1/completions", NULL, body, sizeof body - 1, c),
                 RK_OK, "%s", rk_error_message());
}

/* If the server has answered or closed the held request c, put its status
 * line into note and hold a slot again on a new connection. A held stream
 * that has started is what it should be: its first bytes are read and
 * dropped. */
static void rehold_if_answered(rk_http_conn *c, int i, char *note, size_t note_size) {
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    if (poll(&p, 1, 0) <= 0) return;
    char buf[160];
    ssize_t k = recv(c->fd, buf, sizeof buf - 1, MSG_DONTWAIT);
    buf[k > 0 ? k : 0] = '\0';
    if (k > 0 && !strncmp(buf, "HTTP/1.1 200", 12)) return;
    if (k > 0 && strncmp(buf, "HTTP/1.1 ", 9)) return; /* more of a running stream */
    buf[strcspn(buf, "\r\n")] = '\0';
    snprintf(note, note_size, "held request %d was answered early: \"%s\"", i,
             k > 0 ? buf : "(closed)");
    rk_http_close(c);
    hold_slot(c);
}

/* The four request slots are held by streamed completions that run far
 * longer than the test (a token a second), so the slots stay full for as
 * long as the test needs, whatever the machine's speed. A held request the
 * server answers early (it should not) is noted and held again, so the
 * check of the slots still runs. */
Test(http_opts, requests_beyond_http_threads_get_503_but_probes_answer, .fini = stop_server,
     .timeout = 300) {
    const char *args[] = {"--http-threads", "4", "--token-delay-s", "1", "--max-batch", "4", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    rk_http_conn held[4];
    for (int i = 0; i < 4; i++) hold_slot(&held[i]);
    /* Once the four are being handled, a fifth request is refused at once. */
    resp r = {0};
    int last = -1, tries = 0;
    char note[256] = "";
    for (double until = rk_test_now() + 20; rk_test_now() < until; rk_test_sleep(0.02), tries++) {
        for (int i = 0; i < 4; i++) rehold_if_answered(&held[i], i, note, sizeof note);
        r = get("/v1/models");
        if (r.http.status == 503) break;
        last = r.http.status;
        rk_test_resp_free(&r);
    }
    /* Criterion exits non-zero after any warning: the note is information. */
    if (note[0]) cr_log_info("%s", note);
    cr_assert_eq(r.http.status, 503, "%d requests answered, the last %d; %s", tries, last,
                 note[0] ? note : "no held request was answered");
    expect_error(&r, 503);
    cr_assert_str_eq(rk_test_header(&r, "Retry-After"), "1");
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "http_threads"), "%s", r.http.body);
    rk_test_resp_free(&r);
    r = get("/health");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    r = get("/ready");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    r = get("/metrics");
    cr_assert_eq(r.http.status, 200);
    rk_test_resp_free(&r);
    /* Their clients gone, the slots are free again. */
    for (int i = 0; i < 4; i++) rk_http_close(&held[i]);
    for (double until = rk_test_now() + 20; rk_test_now() < until; rk_test_sleep(0.02)) {
        r = get("/v1/models");
        if (r.http.status == 200) break;
        rk_test_resp_free(&r);
    }
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

Test(http_opts, idle_and_slow_header_connections_are_closed_after_the_request_timeout,
     .fini = stop_server, .timeout = 300) {
    const char *env[] = {"RAGKV_REQUEST_TIMEOUT_S=1", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", env, NULL), 0);
    double took;
    /* Nothing sent: closed without an answer. */
    char *a = raw_exchange("", 0, 6, &took);
    cr_assert(took < 3, "an idle connection was kept %.2f s", took);
    cr_assert_eq(a[0], '\0', "%s", a);
    free(a);
    /* Headers never finished: closed, with an error in the JSON shape if any. */
    static const char part[] = "GET /health HTTP/1.1\r\nHost: x\r\n";
    a = raw_exchange(part, sizeof part - 1, 6, &took);
    cr_assert(took < 3, "unfinished headers kept the connection %.2f s", took);
    if (a[0]) {
        resp r;
        cr_assert_eq(parse_response(a, strlen(a), &r), 0, "%s", a);
        cr_assert(r.http.status >= 400 && r.json, "%s", a);
        expect_envelope(&r);
        rk_test_resp_free(&r);
    }
    free(a);
}

Test(http_opts, a_slow_body_is_answered_408_within_the_request_timeout, .fini = stop_server,
     .timeout = 300) {
    const char *env[] = {"RAGKV_REQUEST_TIMEOUT_S=1", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", env, NULL), 0);
    /* A body announced as 100 bytes of which one ever comes. */
    rk_http_target within_6s = S.t;
    within_6s.timeout_s = 6;
    rk_http_conn c;
    cr_assert_eq(rk_http_open(&within_6s, "POST", "/v1/completions",
                              "Content-Type: application/json\r\nContent-Length: 100\r\n", NULL, 0,
                              &c),
                 RK_OK);
    double t0 = rk_test_now();
    cr_assert_eq(rk_test_send_all(c.fd, "{", 1), 0);
    /* Meanwhile other requests are served. */
    resp r = get("/health");
    cr_assert_eq(r.http.status, 200);
    cr_assert(rk_test_now() - t0 < 0.5);
    rk_test_resp_free(&r);
    r = finish(&c);
    double took = rk_test_now() - t0;
    cr_assert(took < 3, "a body 99 bytes short held the connection %.2f s", took);
    expect_error(&r, 408);
    cr_assert_str_eq(rk_test_header(&r, "Connection"), "close");
    rk_test_resp_free(&r);
}

Test(http_opts, config_file_environment_and_flags_take_precedence_in_order, .timeout = 300) {
    char *dir = rk_test_tmpdir("httpcfg");
    char path[4200], cmd[9000], *out = NULL;
    snprintf(path, sizeof path, "%s/cfg.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"kv_memory_mb\": 64, \"max_chunks\": 5, \"queue\": 7, \"api_key\": \"k\"}", f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "RAGKV_MAX_CHUNKS=9 RAGKV_QUEUE=8 %s serve --config %s --queue 3 "
             "--print-config",
             RK_BIN, path);
    cr_assert_eq(rk_test_run(cmd, &out), 0);
    json_t *j = json_loads(out, 0, NULL);
    cr_assert(j, "%s", out);
    cr_assert_eq(rk_test_jint(j, "kv_memory_mb"), 64); /* file */
    cr_assert_eq(rk_test_jint(j, "max_chunks"), 9);    /* environment over file */
    cr_assert_eq(rk_test_jint(j, "queue"), 3);         /* flag over both */
    cr_assert_eq(rk_test_jint(j, "port"), 8080);       /* default */
    cr_assert_str_eq(rk_test_jstr(j, "api_key"), "<set>");
    cr_assert(json_real_value(rk_test_jget(j, "request_timeout_s")) == 10);
    json_decref(j);
    free(out);
    snprintf(cmd, sizeof cmd, "RAGKV_REQUEST_TIMEOUT_S=2.5 %s serve --print-config", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, &out), 0);
    j = json_loads(out, 0, NULL);
    cr_assert(j && json_real_value(rk_test_jget(j, "request_timeout_s")) == 2.5, "%s", out);
    json_decref(j);
    free(out);
    snprintf(cmd, sizeof cmd, "%s serve --request-timeout-s 0 2>&1", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, &out), 2);
    cr_assert(strstr(out, "request"), "%s", out);
    free(out);
    f = fopen(path, "w");
    fputs("{\"kv_memory_mb\": 64, \"no_such_setting\": 1}", f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s serve --config %s --print-config 2>&1", RK_BIN, path);
    cr_assert_eq(rk_test_run(cmd, &out), 2);
    cr_assert(strstr(out, "no_such_setting"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s serve --queue zero 2>&1", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, &out), 2);
    free(out);
    snprintf(cmd, sizeof cmd, "%s serve --help", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, &out), 0);
    cr_assert(strstr(out, "--api-key") && strstr(out, "--max-body-bytes") &&
              strstr(out, "--timeout-s") && strstr(out, "--request-timeout-s") &&
              strstr(out, "--print-config"));
    free(out);
    free(dir);
}

/* ================================================================ OpenAI request fields */

/* The ids a completion generated (ragkv.completion_ids), into out; returns how many. */
static int completion_ids(json_t *j, int32_t *out, int cap) {
    json_t *ids = rk_test_jget(j, "ragkv.completion_ids");
    cr_assert(json_is_array(ids), "no completion_ids");
    int n = (int)json_array_size(ids);
    for (int i = 0; i < n && i < cap; i++)
        out[i] = (int32_t)json_integer_value(json_array_get(ids, i));
    return n < cap ? n : cap;
}

/* A completion of "x" with extra fields (a JSON fragment starting with a
 * comma, or ""), 10 tokens without stopping; its generated ids into out. */
static int complete_ids(const char *extra, int32_t *out) {
    resp r = rk_test_postf(&S.t, "/v1/completions",
                           "{\"prompt\": \"The cat\", \"max_tokens\": 10, \"ignore_eos\": true%s}",
                           extra);
    cr_assert_eq(r.http.status, 200, "%s -> %s", extra, r.http.body);
    int n = completion_ids(r.json, out, 10);
    rk_test_resp_free(&r);
    cr_assert_eq(n, 10);
    return n;
}

/* logit_bias -100 bans a token; a +100 bias makes greedy repeat a token, and
 * penalties over the generated tokens move it off; one seed, one output. */
Test(http, logit_bias_and_penalties_act_on_the_generated_tokens) {
    int32_t base[10], out[10], again[10];
    char extra[256];
    complete_ids(", \"temperature\": 0", base);
    snprintf(extra, sizeof extra, ", \"temperature\": 0, \"logit_bias\": {\"%d\": -100}", base[0]);
    complete_ids(extra, out);
    for (int i = 0; i < 10; i++)
        cr_expect_neq(out[i], base[0], "banned token %d at %d", base[0], i);
    /* Bias +100 on one token: greedy gives it every time. */
    int32_t a = base[1] != base[0] ? base[1] : (base[0] + 1) % 256;
    snprintf(extra, sizeof extra, ", \"temperature\": 0, \"logit_bias\": {\"%d\": 100}", a);
    complete_ids(extra, out);
    for (int i = 0; i < 10; i++) cr_assert_eq(out[i], a, "step %d: %d", i, out[i]);
    /* With the penalties, the first token (no history) is still it; the
     * second is not: (100 + l) / 100 - 2 - 2 is below every other logit the
     * model gives here. */
    snprintf(extra, sizeof extra,
             ", \"temperature\": 0, \"logit_bias\": {\"%d\": 100}, \"presence_penalty\": 2, "
             "\"frequency_penalty\": 2, \"repetition_penalty\": 100",
             a);
    complete_ids(extra, out);
    cr_expect_eq(out[0], a);
    cr_expect_neq(out[1], a);
    /* Sampled with every adjustment: the same seed gives the same tokens. */
    snprintf(extra, sizeof extra,
             ", \"temperature\": 0.9, \"seed\": 42, \"logit_bias\": {\"%d\": -100}, "
             "\"presence_penalty\": 0.5, \"frequency_penalty\": 0.7, \"repetition_penalty\": 1.2",
             base[0]);
    complete_ids(extra, out);
    complete_ids(extra, again);
    cr_expect_eq(memcmp(out, again, sizeof out), 0, "one seed, two outputs");
    for (int i = 0; i < 10; i++) cr_expect_neq(out[i], base[0]);
    /* The chat route takes them too. */
    snprintf(extra, sizeof extra,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 6, "
             "\"temperature\": 0, \"ignore_eos\": true, \"logit_bias\": {\"%d\": 100}}",
             a);
    resp r = post("/v1/chat/completions", extra);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(completion_ids(r.json, out, 10), 6);
    for (int i = 0; i < 6; i++) cr_expect_eq(out[i], a);
    rk_test_resp_free(&r);
}

/* A value out of range, or a field ragkv does not implement asked to do
 * something, is a 400 whose message names the field; the values that ask for
 * nothing, and `user`, are accepted. */
Test(http, unsupported_and_out_of_range_fields_are_400_naming_the_field) {
    static const char *bad[][2] = {
        {"\"presence_penalty\": 2.5", "presence_penalty"},
        {"\"frequency_penalty\": -3", "frequency_penalty"},
        {"\"repetition_penalty\": 0", "repetition_penalty"},
        {"\"logit_bias\": {\"abc\": 1}", "logit_bias"},
        {"\"logit_bias\": {\"5\": 101}", "logit_bias"},
        {"\"logit_bias\": {\"16777215\": -100}", "logit_bias"},
        {"\"logit_bias\": [1]", "logit_bias"},
        {"\"n\": 2, \"best_of\": 3", "best_of"},
        {"\"suffix\": \"end\"", "suffix"},
        {"\"echo\": 1", "echo"}, /* echo: true is a completion's (test_openai) */
        {"\"store\": true", "store"},
        {"\"metadata\": {\"k\": \"v\"}", "metadata"},
        {"\"service_tier\": \"flex\"", "service_tier"},
        {"\"modalities\": [\"text\", \"audio\"]", "modalities"},
        {"\"audio\": {\"voice\": \"alloy\", \"format\": \"wav\"}", "audio"},
        {"\"prediction\": {\"type\": \"content\", \"content\": \"x\"}", "prediction"},
        {"\"reasoning_effort\": \"low\"", "reasoning_effort"},
        {"\"functions\": [{\"name\": \"f\"}]", "functions"},
        {"\"function_call\": \"auto\"", "function_call"},
        {"\"parallel_tool_calls\": true", "parallel_tool_calls"},
        {"\"web_search_options\": {}", "web_search_options"},
        {"\"verbosity\": \"low\"", "verbosity"},
        {"\"user\": 5", "user"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        for (int chat = 0; chat < 2; chat++) {
            resp r =
                chat ? rk_test_postf(&S.t, "/v1/chat/completions",
                                     "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                                     "\"max_tokens\": 1, %s}",
                                     bad[i][0])
                     : rk_test_postf(&S.t, "/v1/completions",
                                     "{\"prompt\": \"x\", \"max_tokens\": 1, %s}", bad[i][0]);
            expect_error(&r, 400);
            cr_expect_not_null(strstr(rk_test_jstr(r.json, "error.message"), bad[i][1]), "%s: %s",
                               bad[i][0], rk_test_jstr(r.json, "error.message"));
            rk_test_resp_free(&r);
        }
    }
    resp r = post("/v1/chat/completions",
                  "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": 1, "
                  "\"n\": 1, \"best_of\": 1, \"user\": \"u-1\", \"store\": false, \"metadata\": "
                  "{}, \"service_tier\": \"auto\", \"modalities\": [\"text\"], \"suffix\": null, "
                  "\"echo\": false, \"parallel_tool_calls\": false, \"safety_identifier\": \"s\", "
                  "\"prompt_cache_key\": \"k\", \"presence_penalty\": -2, \"frequency_penalty\": "
                  "2, \"repetition_penalty\": 1, \"logit_bias\": {}}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* A value out of range is answered with the range the server applies (32
 * choices a request), not the width of the field's parser. */
Test(http, range_errors_quote_the_limits_the_server_applies) {
    static const struct {
        const char *field;
        int status;
        const char *says;
    } cases[] = {{"\"n\": 0", 400, "from 1 to 32"},
                 {"\"n\": 2000000", 422, "at most 32"},
                 {"\"best_of\": 2000000", 400, "from 1 to 32"},
                 {"\"max_tokens\": -1", 400, "from 0 to "}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        resp r = rk_test_postf(&S.t, "/v1/completions", "{\"prompt\": \"x\", %s}", cases[i].field);
        expect_error(&r, cases[i].status);
        const char *m = rk_test_jstr(r.json, "error.message");
        cr_expect_not_null(strstr(m, cases[i].says), "%s: %s", cases[i].field, m);
        cr_expect_null(strstr(m, "1048576"), "%s: %s", cases[i].field, m);
        cr_expect_null(strstr(m, "1099511627776"), "%s: %s", cases[i].field, m);
        rk_test_resp_free(&r);
    }
}

/* Chat documents: "##" in a message is text unless the body names a
 * separator; the `documents` array and ragkv_chunk parts are chunks, cached
 * by content like the `chunks` extension's. */
Test(http, chat_documents_come_as_documents_parts_or_an_asked_separator) {
    resp r = post("/v1/chat/completions",
                  "{\"messages\": [{\"role\": \"user\", \"content\": \"## Summary\\nThe cat "
                  "sat.\\n## Details\\nOn the mat.\"}], \"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 0, "%s", r.http.body);
    check_invariants(r.json);
    rk_test_resp_free(&r);
    r = post("/v1/chat/completions",
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Doc one.##Doc two.##Q?\"}], "
             "\"separator\": \"##\", \"max_tokens\": 2}");
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 2, "%s", r.http.body);
    char key[2][40];
    snprintf(key[0], sizeof key[0], "%s", rk_test_jstr(r.json, "ragkv.chunks.0.key"));
    snprintf(key[1], sizeof key[1], "%s", rk_test_jstr(r.json, "ragkv.chunks.1.key"));
    rk_test_resp_free(&r);
    /* The same documents as `documents`, then as ragkv_chunk parts: the same
     * keys, found in the cache. */
    r = post("/v1/chat/completions",
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Other?\"}], \"documents\": "
             "[{\"id\": \"d1\", \"text\": \"Doc one.\"}, {\"content\": \"Doc two.\"}], "
             "\"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 2, "%s", r.http.body);
    for (int k = 0; k < 2; k++) {
        char path[32];
        snprintf(path, sizeof path, "ragkv.chunks.%d.key", k);
        cr_expect_str_eq(rk_test_jstr(r.json, path), key[k]);
        snprintf(path, sizeof path, "ragkv.chunks.%d.status", k);
        cr_expect_str_eq(rk_test_jstr(r.json, path), "hit");
    }
    rk_test_resp_free(&r);
    r = post(
        "/v1/chat/completions",
        "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
        "\"Doc two.\", \"ragkv_chunk\": true}, {\"type\": \"text\", \"text\": \"## Third?\"}]}], "
        "\"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 1, "%s", r.http.body);
    cr_expect_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.key"), key[1]);
    cr_expect_str_eq(rk_test_jstr(r.json, "ragkv.chunks.0.status"), "hit");
    rk_test_resp_free(&r);
}

/* A later turn's documents are chunk segments: computed once, then found in
 * the chunk cache when the conversation goes on, never recomputed as text. */
Test(http, a_later_turns_documents_are_chunks_reused_by_the_next_turn) {
    static const char *turn2 =
        "{\"role\": \"user\", \"content\": \"Who?\"}, {\"role\": \"assistant\", \"content\": "
        "\"Tim.\"}, {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"The "
        "dog ran home.\", \"ragkv_chunk\": true}, {\"type\": \"text\", \"text\": \"Where?\"}]}";
    resp r = rk_test_postf(&S.t, "/v1/chat/completions",
                           "{\"messages\": [%s], \"documents\": [{\"text\": \"Tim had a dog.\"}], "
                           "\"max_tokens\": 2}",
                           turn2);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 2, "%s", r.http.body);
    char key[40];
    snprintf(key, sizeof key, "%s", rk_test_jstr(r.json, "ragkv.chunks.1.key"));
    check_invariants(r.json);
    rk_test_resp_free(&r);
    /* Turn 3 sends the conversation back with one more question: both
     * documents are hits, the second turn's included. */
    r = rk_test_postf(
        &S.t, "/v1/chat/completions",
        "{\"messages\": [%s, {\"role\": \"assistant\", \"content\": \"Home.\"}, "
        "{\"role\": \"user\", \"content\": \"Why?\"}], \"documents\": [{\"text\": \"Tim "
        "had a dog.\"}], \"max_tokens\": 2}",
        turn2);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 2, "%s", r.http.body);
    cr_expect_str_eq(rk_test_jstr(r.json, "ragkv.chunks.1.key"), key);
    for (int k = 0; k < 2; k++) {
        char path[32];
        snprintf(path, sizeof path, "ragkv.chunks.%d.status", k);
        cr_expect_str_neq(rk_test_jstr(r.json, path), "miss", "%s", r.http.body);
    }
    check_invariants(r.json);
    rk_test_resp_free(&r);
}

/* A chat whose last message is the assistant's continues it: the pieces are
 * the template's turns with that message left open, so the greedy answer is
 * the one /v1/completions gives for the same system and question pieces. */
Test(http, a_last_assistant_message_is_continued) {
    resp m = get("/v1/models");
    const char *tmpl = rk_test_jstr(m.json, "data.0.ragkv.chat_template");
    const char *sys, *question;
    if (!strcmp(tmpl, "chatml")) {
        sys = "<|im_start|>user\\n";
        question = "Tell me a story<|im_end|>\\n<|im_start|>assistant\\nOnce upon";
    } else if (!strcmp(tmpl, "llama3")) {
        sys = "<|start_header_id|>user<|end_header_id|>\\n\\n";
        question = "Tell me a story<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n"
                   "Once upon";
    } else {
        sys = "[INST] ";
        question = "Tell me a story [/INST] Once upon";
    }
    resp chat = post("/v1/chat/completions",
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"Tell me a story\"}, "
                     "{\"role\": \"assistant\", \"content\": \"Once upon\"}], \"max_tokens\": 8, "
                     "\"temperature\": 0, \"ignore_eos\": true}");
    cr_assert_eq(chat.http.status, 200, "%s", chat.http.body);
    resp comp = rk_test_postf(&S.t, "/v1/completions",
                              "{\"system\": \"%s\", \"question\": \"%s\", \"max_tokens\": 8, "
                              "\"temperature\": 0, \"ignore_eos\": true}",
                              sys, question);
    cr_assert_eq(comp.http.status, 200, "%s", comp.http.body);
    cr_assert_eq(rk_test_jint(chat.json, "usage.prompt_tokens"),
                 rk_test_jint(comp.json, "usage.prompt_tokens"));
    cr_assert(json_equal(rk_test_jget(chat.json, "ragkv.completion_ids"),
                         rk_test_jget(comp.json, "ragkv.completion_ids")),
              "%s\n%s", chat.http.body, comp.http.body);
    rk_test_resp_free(&m);
    rk_test_resp_free(&chat);
    rk_test_resp_free(&comp);
}

/* An exact repeat served from the whole-sequence cache counts its chunks as
 * hits from the prefix: /v1/stats and /metrics agree with the responses. */
Test(http, chunks_reused_with_a_sequence_count_as_prefix_hits) {
    const char *body = "{\"prompt\": \"S##alpha beta##gamma delta##Q?\", \"max_tokens\": 3, "
                       "\"temperature\": 0}";
    int hits = 0, misses = 0, prefix = 0;
    for (int i = 0; i < 2; i++) {
        resp r = post("/v1/completions", body);
        cr_assert_eq(r.http.status, 200, "%s", r.http.body);
        json_t *chunks = rk_test_jget(r.json, "ragkv.chunks");
        for (size_t k = 0; k < json_array_size(chunks); k++) {
            json_t *c = json_array_get(chunks, k);
            const char *st = json_string_value(json_object_get(c, "status"));
            const char *src = json_string_value(json_object_get(c, "source"));
            hits += !strcmp(st, "hit");
            misses += !strcmp(st, "miss");
            prefix += !strcmp(src, "prefix");
        }
        rk_test_resp_free(&r);
    }
    cr_assert_eq(misses, 2);
    cr_assert_eq(hits, 2);
    cr_assert_eq(prefix, 2, "the repeat reuses the first sequence, chunks included");
    resp r = get("/v1/stats");
    cr_assert_eq(rk_test_jint(r.json, "chunks.lookups"), 4);
    cr_assert_eq(rk_test_jint(r.json, "chunks.hits"), 2);
    cr_assert_eq(rk_test_jint(r.json, "chunks.misses"), 2);
    cr_assert_eq(rk_test_jint(r.json, "chunks.hits_by_source.prefix"), 2);
    cr_assert_eq(rk_test_jint(r.json, "chunks.hits_by_source.arena"), 0);
    cr_assert_eq(json_real_value(rk_test_jget(r.json, "chunks.hit_rate")), 0.5);
    cr_assert_eq(rk_test_jint(r.json, "chunks.windows.1m.hits"), 2);
    cr_assert_eq(rk_test_jint(r.json, "chunks.hit_tokens"),
                 rk_test_jint(r.json, "chunks.computed_tokens"));
    cr_assert_eq(json_real_value(rk_test_jget(r.json, "chunks.token_hit_rate")), 0.5);
    rk_test_resp_free(&r);
    r = get("/metrics");
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_lookups_total"), 4);
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_hits_total{source=\"prefix\"}"), 2);
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_hits_total{source=\"arena\"}"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_hits_total{source=\"disk\"}"), 0);
    cr_assert_eq(metric(r.http.body, "ragkv_chunk_misses_total"), 2);
    rk_test_resp_free(&r);
}

/* --chat-separator splits chat messages for every request that names no
 * separator; an invalid one stops the server from starting. */
Test(http_opts, a_server_chat_separator_splits_chat_messages, .fini = stop_server, .timeout = 300) {
    const char *args[] = {"--chat-separator", "##", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    resp r = post("/v1/chat/completions",
                  "{\"messages\": [{\"role\": \"user\", \"content\": \"Doc one.##Q?\"}], "
                  "\"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 1, "%s", r.http.body);
    rk_test_resp_free(&r);
    char *out;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s serve --port 0 --chat-separator 'a\\b' 2>&1", RK_BIN);
    cr_assert_neq(rk_test_run(cmd, &out), 0);
    cr_assert(strstr(out, "chat_separator"), "%s", out);
    free(out);
}

/* n > 1: one choice per index, each the request alone with seed + index. */
Test(http, n_choices_have_their_own_index_and_seed) {
    resp r = post("/v1/completions", "{\"prompt\": \"The cat\", \"n\": 3, \"seed\": 7, "
                                     "\"temperature\": 0.9, \"max_tokens\": 6, \"ignore_eos\": "
                                     "true}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    json_t *choices = rk_test_jget(r.json, "choices");
    cr_assert_eq(json_array_size(choices), 3, "%s", r.http.body);
    long long prompt = 0;
    for (int i = 0; i < 3; i++) {
        char path[64];
        snprintf(path, sizeof path, "choices.%d.index", i);
        cr_assert_eq(rk_test_jint(r.json, path), i);
        resp one = rk_test_postf(&S.t, "/v1/completions",
                                 "{\"prompt\": \"The cat\", \"seed\": %d, \"temperature\": 0.9, "
                                 "\"max_tokens\": 6, \"ignore_eos\": true}",
                                 7 + i);
        snprintf(path, sizeof path, "choices.%d.ragkv.completion_ids", i);
        cr_assert(
            json_equal(rk_test_jget(r.json, path), rk_test_jget(one.json, "ragkv.completion_ids")),
            "choice %d differs from seed %d alone", i, 7 + i);
        snprintf(path, sizeof path, "choices.%d.text", i);
        cr_assert_str_eq(rk_test_jstr(r.json, path), rk_test_jstr(one.json, "choices.0.text"));
        prompt = rk_test_jint(one.json, "usage.prompt_tokens");
        rk_test_resp_free(&one);
    }
    cr_assert_eq(rk_test_jint(r.json, "usage.completion_tokens"), 18);
    cr_assert_eq(rk_test_jint(r.json, "usage.prompt_tokens"), prompt, "the prompt counts once");
    rk_test_resp_free(&r);
    /* The later choices start after the first one's first token: its system
     * prompt and chunks are cached for them. */
    r = post("/v1/completions", "{\"prompt\": \"Shared system.##A shared chunk of text.##Q?\", "
                                "\"n\": 2, \"max_tokens\": 3}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.ragkv.chunks.0.status"), "miss");
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.1.ragkv.chunks.0.status"), "hit");
    cr_assert_gt(rk_test_jint(r.json, "choices.1.ragkv.system.cached_tokens"), 0);
    rk_test_resp_free(&r);
    /* Streamed: every event names its choice; each choice's text is the whole one's. */
    resp whole = post("/v1/chat/completions",
                      "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"n\": 2, "
                      "\"seed\": 3, \"max_tokens\": 5, \"ignore_eos\": true}");
    cr_assert_eq(whole.http.status, 200, "%s", whole.http.body);
    resp st = post("/v1/chat/completions",
                   "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"n\": 2, "
                   "\"seed\": 3, \"max_tokens\": 5, \"ignore_eos\": true, \"stream\": true}");
    cr_assert_eq(st.http.status, 200, "%s", st.http.body);
    char *events[256];
    int n = sse_events(st.http.body, events, 256);
    cr_assert_gt(n, 2);
    cr_assert_str_eq(events[n - 1], "[DONE]");
    char text[2][512] = {"", ""};
    int finished[2] = {0, 0}, roles[2] = {0, 0};
    for (int e = 0; e < n - 1; e++) {
        json_t *ev = json_loads(events[e], 0, NULL);
        cr_assert(ev, "%s", events[e]);
        long long idx = rk_test_jint(ev, "choices.0.index");
        cr_assert(idx == 0 || idx == 1);
        json_t *c = rk_test_jget(ev, "choices.0.delta.content");
        if (json_is_string(c)) strncat(text[idx], json_string_value(c), 511 - strlen(text[idx]));
        finished[idx] += json_is_string(rk_test_jget(ev, "choices.0.finish_reason"));
        roles[idx] += json_is_string(rk_test_jget(ev, "choices.0.delta.role"));
        json_decref(ev);
    }
    for (int i = 0; i < 2; i++) {
        char path[64];
        snprintf(path, sizeof path, "choices.%d.message.content", i);
        cr_assert_str_eq(text[i], rk_test_jstr(whole.json, path), "choice %d", i);
        cr_assert_eq(finished[i], 1);
        cr_assert_eq(roles[i], 1, "choice %d: its first event carries the role", i);
    }
    for (int e = 0; e < n; e++) free(events[e]);
    rk_test_resp_free(&whole);
    rk_test_resp_free(&st);
}

/* prompt as an array: strings, one token list, or token lists; one choice
 * per prompt with its index, each what the prompt gives alone; usage summed. */
Test(http, prompt_arrays_are_batches) {
    static const char *prompts[2] = {"The cat", "S##a chunk of text##Q?"};
    resp one[2];
    for (int i = 0; i < 2; i++) {
        one[i] = rk_test_postf(&S.t, "/v1/completions",
                               "{\"prompt\": \"%s\", \"temperature\": 0, \"max_tokens\": 4, "
                               "\"ignore_eos\": true}",
                               prompts[i]);
        cr_assert_eq(one[i].http.status, 200, "%s", one[i].http.body);
    }
    resp r = rk_test_postf(&S.t, "/v1/completions",
                           "{\"prompt\": [\"%s\", \"%s\"], \"temperature\": 0, \"max_tokens\": 4, "
                           "\"ignore_eos\": true}",
                           prompts[0], prompts[1]);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "choices")), 2);
    for (int i = 0; i < 2; i++) {
        char path[64];
        snprintf(path, sizeof path, "choices.%d.index", i);
        cr_assert_eq(rk_test_jint(r.json, path), i);
        snprintf(path, sizeof path, "choices.%d.ragkv.completion_ids", i);
        cr_assert(json_equal(rk_test_jget(r.json, path),
                             rk_test_jget(one[i].json, "ragkv.completion_ids")),
                  "prompt %d", i);
    }
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "choices.1.ragkv.chunks")), 1);
    cr_assert_eq(rk_test_jint(r.json, "usage.prompt_tokens"),
                 rk_test_jint(one[0].json, "usage.prompt_tokens") +
                     rk_test_jint(one[1].json, "usage.prompt_tokens"));
    cr_assert_eq(rk_test_jint(r.json, "usage.completion_tokens"), 8);
    rk_test_resp_free(&r);
    /* Token ids: one list, then a batch of lists; BOS goes first, as for text. */
    resp t1 = post("/v1/completions", "{\"prompt\": [5, 6, 7], \"temperature\": 0, "
                                      "\"max_tokens\": 3, \"ignore_eos\": true}");
    cr_assert_eq(t1.http.status, 200, "%s", t1.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(t1.json, "choices")), 1);
    long long bos = rk_test_jint(t1.json, "ragkv.system.tokens");
    cr_assert_eq(rk_test_jint(t1.json, "usage.prompt_tokens"), 3 + bos);
    resp t2 = post("/v1/completions", "{\"prompt\": [[9, 10], [5, 6, 7]], \"temperature\": 0, "
                                      "\"max_tokens\": 3, \"ignore_eos\": true}");
    cr_assert_eq(t2.http.status, 200, "%s", t2.http.body);
    cr_assert(json_equal(rk_test_jget(t2.json, "choices.1.ragkv.completion_ids"),
                         rk_test_jget(t1.json, "ragkv.completion_ids")));
    cr_assert_eq(rk_test_jint(t2.json, "usage.prompt_tokens"), 5 + 2 * bos);
    rk_test_resp_free(&t1);
    rk_test_resp_free(&t2);
    rk_test_resp_free(&one[0]);
    rk_test_resp_free(&one[1]);
    static const char *bad[][2] = {
        {"{\"prompt\": []}", "400"},
        {"{\"prompt\": [[]]}", "400"},
        {"{\"prompt\": [1, \"a\"]}", "400"},
        {"{\"prompt\": [\"a\", 1]}", "400"},
        {"{\"prompt\": [[1], 2]}", "400"},
        {"{\"prompt\": [-1]}", "400"},
        {"{\"prompt\": [16000000]}", "400"},
        {"{\"prompt\": \"x\", \"n\": 33}", "422"},
        {"{\"prompt\": [\"a\", \"b\", \"c\"], \"n\": 11}", "422"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        resp b = post("/v1/completions", bad[i][0]);
        expect_error(&b, atoi(bad[i][1]));
        rk_test_resp_free(&b);
    }
}

/* A client that leaves a stream of several choices cancels every one: they
 * all release what they hold and stop early. */
Test(http_opts, a_client_that_disconnects_from_n_choices_cancels_them_all, .fini = stop_server,
     .timeout = 300) {
    const char *args[] = {"--token-delay-s", "0.01", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "http", NULL, args), 0);
    counts base = stats_counts();
    rk_http_conn c;
    stream_until_first_event("{\"prompt\": \"A system prompt.##A chunk.##Go on\", \"n\": 3, "
                             "\"max_tokens\": 400, \"ignore_eos\": true, \"stream\": true}",
                             &c);
    rk_http_close(&c);
    double until = rk_test_now() + 30;
    counts after = stats_counts();
    while (!counts_equal(after, base) && rk_test_now() < until) {
        rk_test_sleep(0.05);
        after = stats_counts();
    }
    cr_assert(counts_equal(after, base), "live %lld refs %lld locked %lld, want %lld %lld %lld",
              after.live_used, after.chunk_refs, after.prefix_locked, base.live_used,
              base.chunk_refs, base.prefix_locked);
    resp r = get("/v1/stats");
    cr_assert(rk_test_jint(r.json, "tokens.generated") < 3 * 390, "generated %lld",
              rk_test_jint(r.json, "tokens.generated"));
    cr_assert_eq(rk_test_jint(r.json, "requests.in_flight"), 0,
                 "nothing but this stats request, which it does not count, is in flight");
    rk_test_resp_free(&r);
}
