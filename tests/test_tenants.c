/* tests/test_tenants.c — tenant isolation end to end: the real `ragkv serve`
 * binary on a free loopback port with --api-keys-file, two tenants with their
 * own keys and an admin key, spoken to with bench/httpclient.h. Tenant B must
 * never learn that tenant A sent a document: no hit, no shared sequence, no
 * chunk id or key in listings, lookups or statistics. (Timing is compared in
 * a benchmark, docs/benchmarks.md, never in a test.) Uses the embedded model. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/httpclient.h"
#include "gateway/tenants.h"
#include "tests/testutil.h"

#define KEY_A      "key-a-7f3c1e"
#define KEY_B      "key-b-90d2aa"
#define KEY_ADMIN  "admin-55e1"
#define DOC_ID     "tenantA/merger-memo.pdf#1"
#define DOC_A      "The merger memo puts the price at ten dollars a share, payable in cash on closing."
#define DOC_FRESH  "The quarterly report shows revenue flat and costs down by a tenth."
#define DOC_FRESH2 "The board meets on Tuesday to approve the budget for the new plant."

/* The server of the current test (tests/testutil.h starts and stops it). */
static rk_test_server S;

/* Run `ragkv serve --port 0 ARGS...`. Returns 0 once it listens; -1 when it
 * exited first (its wait status in *exit_status). */
static int srv_start(const char *const *args, int *exit_status) {
    return rk_test_server_start(&S, "tenants", NULL, args, exit_status);
}

/* Stop the test's server; an unclean exit or a sanitizer report fails. */
static void srv_stop(void) { rk_test_server_stop_checked(&S); }

/* The body of an exchange with key as JSON (NULL when not JSON); *status
 * gets the HTTP status. */
static json_t *call(const char *key, const char *method, const char *path, const char *body,
                    int *status) {
    char headers[256];
    snprintf(headers, sizeof headers,
             "Authorization: Bearer %s\r\nContent-Type: application/json\r\n", key);
    rk_http_response r;
    cr_assert_eq(rk_http_exchange(&S.t, method, path, headers, body, body ? strlen(body) : 0, &r),
                 RK_OK, "%s %s", method, path);
    *status = r.status;
    json_t *j = json_loadb(r.body, r.body_len, 0, NULL);
    rk_http_response_free(&r);
    return j;
}

/* A completion with one chunk; returns the response (200 asserted). */
static json_t *complete(const char *key, const char *id, const char *doc, const char *extra) {
    char body[1024];
    snprintf(body, sizeof body,
             "{\"system\": \"Answer from the document.\", \"chunks\": [{\"id\": \"%s\", "
             "\"text\": \"%s\"}], \"question\": \"What is the price?\", \"max_tokens\": 2, "
             "\"temperature\": 0%s}",
             id, doc, extra ? extra : "");
    int status;
    json_t *j = call(key, "POST", "/v1/completions", body, &status);
    cr_assert_eq(status, 200, "%s", j ? json_dumps(j, 0) : "(no JSON)");
    return j;
}

static const char *chunk_status(json_t *resp) {
    return json_string_value(json_object_get(
        json_array_get(json_object_get(json_object_get(resp, "ragkv"), "chunks"), 0), "status"));
}

static const char *chunk_key(json_t *resp) {
    return json_string_value(json_object_get(
        json_array_get(json_object_get(json_object_get(resp, "ragkv"), "chunks"), 0), "key"));
}

static int cached_tokens(json_t *resp) {
    return (int)json_integer_value(json_object_get(
        json_object_get(json_object_get(resp, "usage"), "prompt_tokens_details"), "cached_tokens"));
}

/* 1 when the serialized document holds needle. */
static int mentions(json_t *j, const char *needle) {
    char *text = json_dumps(j, 0);
    int found = text && strstr(text, needle);
    free(text);
    return found;
}

static char *keys_file(const char *text) { return rk_test_write_tmp("tenants", "keys.json", text); }

static void start_two_tenants(const char *extra1, const char *extra2) {
    char *keys = keys_file("{\"keys\": [{\"key\": \"" KEY_A "\", \"tenant\": \"A\"}, "
                           "{\"key\": \"" KEY_B "\", \"tenant\": \"B\", \"salt\": \"b-salt\"}]}");
    const char *args[] = {"--api-keys-file", keys, "--admin-key", KEY_ADMIN, extra1, extra2, NULL};
    if (!extra1) args[4] = NULL;
    int started = rk_test_server_start_ready(&S, "tenants", NULL, args);
    free(keys);
    cr_assert_eq(started, 0, "the server did not start or load its model (log: %s)", S.log);
}

TestSuite(tenants, .fini = srv_stop, .timeout = 300);

Test(tenants, tenant_b_never_sees_or_hits_a_chunk_only_a_sent) {
    start_two_tenants(NULL, NULL);
    json_t *a1 = complete(KEY_A, DOC_ID, DOC_A, NULL);
    cr_assert_str_eq(chunk_status(a1), "miss");
    char key_a[33];
    snprintf(key_a, sizeof key_a, "%s", chunk_key(a1));
    json_t *a2 = complete(KEY_A, DOC_ID, DOC_A, ", \"reuse_sequences\": false");
    cr_assert_str_eq(chunk_status(a2), "hit", "A's own repeat hits");

    json_t *fresh = complete(KEY_B, "b/report#1", DOC_FRESH, NULL);
    json_t *b1 = complete(KEY_B, "b/memo#1", DOC_A, NULL);
    cr_assert_str_eq(chunk_status(b1), "miss", "B never hits a chunk only A sent");
    cr_assert_str_neq(chunk_key(b1), key_a, "B's chunk has a key of its own");
    json_t *fresh2 = complete(KEY_B, "b/board#1", DOC_FRESH2, NULL);
    cr_assert_eq(cached_tokens(b1), cached_tokens(fresh2),
                 "B's cached tokens for A's document are a fresh document's");
    /* The same through the whole-sequence path: no prefix of A's is reused. */
    json_t *b2 = complete(KEY_B, "b/memo#2", DOC_A, ", \"cache_salt\": \"guess\"");
    cr_assert_str_eq(chunk_status(b2), "miss", "a request salt never reaches A's scope");

    int st;
    json_t *list = call(KEY_B, "GET", "/v1/chunks?limit=1000", NULL, &st);
    cr_assert_eq(st, 200);
    cr_assert(!mentions(list, key_a) && !mentions(list, DOC_ID), "B's listing hides A's chunk");
    cr_assert_eq(json_integer_value(json_object_get(list, "total")), 4, "B's own four chunks");
    json_t *hits = call(KEY_B, "GET", "/v1/chunks?sort=hits", NULL, &st);
    cr_assert(!mentions(hits, key_a));
    char path[64];
    snprintf(path, sizeof path, "/v1/chunks/%s", key_a);
    json_t *get = call(KEY_B, "GET", path, NULL, &st);
    cr_assert_eq(st, 404, "B cannot look A's chunk up");
    json_decref(get);
    get = call(KEY_B, "DELETE", path, NULL, &st);
    cr_assert_eq(st, 404, "B cannot delete A's chunk: it is absent to B");
    json_decref(get);
    get = call(KEY_A, "GET", path, NULL, &st);
    cr_assert_eq(st, 200, "A still has it");
    cr_assert(mentions(get, DOC_ID));
    json_decref(get);
    json_t *stats = call(KEY_B, "GET", "/v1/stats", NULL, &st);
    cr_assert_eq(st, 200);
    cr_assert(!mentions(json_object_get(stats, "top_chunks"), key_a));
    json_t *tenants = json_object_get(stats, "tenants");
    cr_assert_eq(json_object_size(tenants), 1, "B reads its own counters only");
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(tenants, "B"), "chunk_hits")),
                 0);
    json_t *all = call(KEY_ADMIN, "GET", "/v1/chunks", NULL, &st);
    cr_assert(mentions(all, key_a), "the admin key sees every tenant's chunks");
    json_t *admin_stats = call(KEY_ADMIN, "GET", "/v1/stats", NULL, &st);
    cr_assert(mentions(json_object_get(admin_stats, "top_chunks"), key_a));
    json_t *ta = json_object_get(json_object_get(admin_stats, "tenants"), "A");
    cr_assert_eq(json_integer_value(json_object_get(ta, "requests")), 2);
    cr_assert_eq(json_integer_value(json_object_get(ta, "chunk_hits")), 1);

    /* Flushing is the admin's. */
    json_t *fl = call(KEY_B, "POST", "/v1/cache/flush", "{}", &st);
    cr_assert_eq(st, 401);
    json_decref(fl);

    /* Prometheus: the tenant label. */
    rk_http_response m;
    cr_assert_eq(rk_http_exchange(&S.t, "GET", "/metrics",
                                  "Authorization: Bearer " KEY_ADMIN "\r\n", NULL, 0, &m),
                 RK_OK);
    cr_assert(strstr(m.body, "ragkv_tenant_requests_total{tenant=\"A\"} 2"), "%s", m.body);
    cr_assert(strstr(m.body, "ragkv_tenant_chunk_misses_total{tenant=\"B\"} 4"));
    rk_http_response_free(&m);
    cr_assert_eq(rk_http_exchange(&S.t, "GET", "/metrics", "Authorization: Bearer " KEY_B "\r\n",
                                  NULL, 0, &m),
                 RK_OK);
    cr_assert_eq(m.status, 401, "every tenant's counters are not for a tenant key");
    rk_http_response_free(&m);

    /* Keys never reach the log. */
    srv_stop();
    char *log = rk_test_read_file(S.log, NULL);
    cr_assert(log && !strstr(log, KEY_A) && !strstr(log, KEY_B) && !strstr(log, KEY_ADMIN));
    free(log);
    json_t *docs[] = {a1, a2, fresh, fresh2, b1, b2, list, hits, stats, all, admin_stats};
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) json_decref(docs[i]);
}

Test(tenants, prewarm_names_a_tenant_only_with_the_admin_key) {
    start_two_tenants(NULL, NULL);
    int st;
    json_t *j =
        call(KEY_B, "POST", "/v1/chunks",
             "{\"chunks\": [{\"id\": \"x\", \"text\": \"" DOC_A "\"}], \"tenant\": \"A\"}", &st);
    cr_assert_eq(st, 403);
    json_decref(j);
    j = call(KEY_ADMIN, "POST", "/v1/chunks",
             "{\"chunks\": [{\"id\": \"" DOC_ID "\", \"text\": \"" DOC_A "\"}], \"tenant\": \"A\"}",
             &st);
    cr_assert_eq(st, 200);
    json_decref(j);
    j = call(KEY_B, "POST", "/v1/chunks", "{\"chunks\": [\"" DOC_FRESH "\"]}", &st);
    cr_assert_eq(st, 200, "a tenant key pre-warms into its own cache");
    json_decref(j);
    json_t *a = complete(KEY_A, DOC_ID, DOC_A, NULL);
    cr_assert_str_eq(chunk_status(a), "hit", "pre-warmed for A, a hit for A");
    json_t *b = complete(KEY_B, DOC_ID, DOC_A, NULL);
    cr_assert_str_eq(chunk_status(b), "miss", "and a miss for B");
    json_t *b2 = complete(KEY_B, "b", DOC_FRESH, NULL);
    cr_assert_str_eq(chunk_status(b2), "hit", "B's own pre-warmed chunk");
    json_t *stats = call(KEY_B, "GET", "/v1/stats", NULL, &st);
    json_t *top = json_object_get(stats, "top_chunks");
    cr_assert_eq(json_array_size(top), 1, "B's one chunk with hits: %s", json_dumps(top, 0));
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(top, 0), "key")),
                     chunk_key(b2));
    json_decref(stats);
    json_decref(a);
    json_decref(b);
    json_decref(b2);
}

Test(tenants, the_cli_prewarms_a_tenants_chunks_into_the_store) {
    char *dir = rk_test_tmpdir("tenants-store");
    char *input = rk_test_write_tmp("tenants", "docs.jsonl",
                                    "{\"id\": \"" DOC_ID "\", \"text\": \"" DOC_A "\"}\n");
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s prewarm --input %s --store %s --tenant A 2>&1", RK_BIN, input,
             dir);
    char *out = NULL;
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out ? out : "");
    free(out);
    start_two_tenants("--store", dir);
    json_t *a = complete(KEY_A, DOC_ID, DOC_A, NULL);
    cr_assert_str_eq(chunk_status(a), "hit", "tenant A finds its chunk on disk");
    json_t *b = complete(KEY_B, DOC_ID, DOC_A, NULL);
    cr_assert_str_eq(chunk_status(b), "miss");
    int st;
    json_t *disk = call(KEY_B, "GET", "/v1/chunks?tier=disk", NULL, &st);
    cr_assert_eq(st, 403, "the disk tier keeps no tenants: the admin's to list");
    json_decref(disk);
    disk = call(KEY_ADMIN, "GET", "/v1/chunks?tier=disk", NULL, &st);
    cr_assert_eq(st, 200);
    cr_assert(mentions(disk, DOC_ID));
    json_decref(disk);
    json_decref(a);
    json_decref(b);
    free(input);
    free(dir);
}

Test(tenants, a_malformed_keys_file_stops_the_server_naming_the_entry_not_the_key) {
    static const struct {
        const char *text, *says;
    } bad[] = {
        {"{\"keys\": [{\"key\": \"secret-one\", \"tenant\": \"A\"}, {\"key\": \"secret-two\"}]}",
         "keys[1].tenant"},
        {"{\"keys\": [{\"key\": \"secret-one\", \"tenant\": \"A\", \"salt\": 7}]}", "keys[0].salt"},
        {"{\"keys\": [{\"key\": \"secret-one\", \"tenant\": \"A\"}, {\"key\": \"secret-one\", "
         "\"tenant\": \"B\"}]}",
         "keys[1].key"},
        {"{\"keys\": [{\"key\": \"secret one\", \"tenant\": \"A\"}]}", "keys[0].key"},
        {"{\"keys\": [{\"key\": \"secret-one\", \"tenant\": \"A/B\"}]}", "keys[0].tenant"},
        {"{\"keys\": []}", "keys:"},
        {"{\"keys\": [{\"key\": \"secret-one\", \"tenant\": \"A\"}", "line 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *keys = keys_file(bad[i].text);
        const char *args[] = {"--api-keys-file", keys, NULL};
        int status = 0;
        cr_assert_eq(srv_start(args, &status), -1, "case %zu started", i);
        cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0);
        char *log = rk_test_read_file(S.log, NULL);
        cr_assert(log && strstr(log, bad[i].says), "case %zu: %s", i, log ? log : "");
        cr_assert(!strstr(log, "secret-one") && !strstr(log, "secret one") &&
                      !strstr(log, "secret-two"),
                  "case %zu printed a key: %s", i, log);
        free(log);
        free(keys);
    }
    /* A tenant key that is also the admin key. */
    char *keys = keys_file("{\"keys\": [{\"key\": \"" KEY_ADMIN "\", \"tenant\": \"A\"}]}");
    const char *args[] = {"--api-keys-file", keys, "--admin-key", KEY_ADMIN, NULL};
    int status = 0;
    cr_assert_eq(srv_start(args, &status), -1);
    free(keys);
}

Test(tenants, the_parser_numbers_tenants_and_finds_each_key) {
    rk_tenants *t;
    const char *text =
        "{\"keys\": [{\"key\": \"k1\", \"tenant\": \"A\"}, {\"key\": \"k2\", "
        "\"tenant\": \"B\", \"salt\": \"s\"}, {\"key\": \"k3\", \"tenant\": \"A\"}]}";
    cr_assert_eq(rk_tenants_parse(text, strlen(text), &t), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_tenants_count(t), 2, "two tenants, A with two keys");
    cr_assert_eq(rk_tenants_find(t, "k1"), 1);
    cr_assert_eq(rk_tenants_find(t, "k3"), 1);
    cr_assert_eq(rk_tenants_find(t, "k2"), 2);
    cr_assert_eq(rk_tenants_find(t, "k"), 0);
    cr_assert_eq(rk_tenants_find(t, "k22"), 0);
    cr_assert_eq(rk_tenants_find(t, ""), 0);
    cr_assert_str_eq(rk_tenants_salt(t, 1), "A", "the salt defaults to the name");
    cr_assert_str_eq(rk_tenants_salt(t, 2), "s");
    cr_assert_eq(rk_tenants_by_name(t, "B"), 2);
    cr_assert_null(rk_tenants_name(t, 3));
    rk_tenants_free(t);
    const char *clash = "{\"keys\": [{\"key\": \"k1\", \"tenant\": \"A\"}, {\"key\": \"k2\", "
                        "\"tenant\": \"A\", \"salt\": \"other\"}]}";
    cr_assert_eq(rk_tenants_parse(clash, strlen(clash), &t), RK_ERR_INVALID);
    cr_assert(strstr(rk_error_message(), "keys[1].salt"), "%s", rk_error_message());
    cr_assert_null(t);
    const char *shared = "{\"keys\": [{\"key\": \"k1\", \"tenant\": \"A\"}, {\"key\": \"k2\", "
                         "\"tenant\": \"B\", \"salt\": \"A\"}]}";
    cr_assert_eq(rk_tenants_parse(shared, strlen(shared), &t), RK_ERR_INVALID,
                 "two tenants with one salt would share a cache");
    cr_assert(strstr(rk_error_message(), "keys[1].salt"), "%s", rk_error_message());
}
