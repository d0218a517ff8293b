/* tests/test_redis.c — the shared Redis tier against a real redis-server:
 * values, markers, corruption, breaker, locks, the writer queue, the cost
 * gate, listing and flushing; and trust: HMAC-tagged values with a secret
 * (forged, untagged and other-secret values deleted and counted), the body
 * check, values too large refused unread, reconnecting after a restart.
 *
 * Every test that needs a server starts its own redis-server on a free
 * loopback port in a scratch directory (no persistence) and stops it at the
 * end; the tests skip visibly when redis-server is not installed. */
#include <criterion/criterion.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "store/payload.h"
#include "store/redis.h"
#include "testutil.h"

static const char *FP_A = "0123456789abcdef0123456789abcdef";
static const char *FP_B = "fedcba9876543210fedcba9876543210";

/* ---------------------------------------------------------------- server */

/* A raw hiredis connection for inspecting and damaging values. */
static redisContext *raw(const rk_test_redis *s) {
    redisContext *c = redisConnectWithTimeout("127.0.0.1", s->port, (struct timeval){1, 0});
    cr_assert(c && !c->err);
    return c;
}

static long long raw_int(redisContext *c, const char *fmt, const char *arg) {
    redisReply *rep = redisCommand(c, fmt, arg);
    cr_assert(rep && rep->type == REDIS_REPLY_INTEGER);
    long long v = rep->integer;
    freeReplyObject(rep);
    return v;
}

/* ---------------------------------------------------------------- chunks */

static char g_url[64];

static rk_redis *open_tier(const rk_test_redis *s, const char *fp, rk_redis_config *cfg_in) {
    rk_redis_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        rk_redis_config_default(&cfg);
    snprintf(g_url, sizeof g_url, "redis://127.0.0.1:%d", s->port);
    cfg.url = g_url;
    cfg.min_tokens = cfg_in ? cfg.min_tokens : 1;
    rk_redis *r = NULL;
    cr_assert_eq(rk_redis_open(&cfg, fp, &r), RK_OK, "%s", rk_error_message());
    return r;
}

typedef struct chunk {
    char key[33];
    int32_t tokens[64];
    int32_t n_tokens;
    uint8_t body[4096];
    rk_store_layout layout;
} chunk;

static void chunk_make(chunk *c, unsigned seed) {
    snprintf(c->key, sizeof c->key, "%08x%08x%08x%08x", seed, seed * 7u + 1, seed * 13u + 5,
             seed ^ 0xa5a5a5a5u);
    c->n_tokens = 40 + (int32_t)(seed % 20);
    for (int i = 0; i < c->n_tokens; i++) c->tokens[i] = (int32_t)(seed * 1000 + (unsigned)i);
    for (size_t i = 0; i < sizeof c->body; i++) c->body[i] = (uint8_t)(seed * 31 + i * 7);
    c->layout = (rk_store_layout){
        .n_layers = 2, .n_kv_heads = 4, .head_dim = 8, .dtype = 0, .block_size = 16, .base_pos = 0};
}

static rk_store_put_args chunk_args(const chunk *c) {
    return (rk_store_put_args){.key = c->key,
                               .policy = "isolated",
                               .layout = c->layout,
                               .tokens = c->tokens,
                               .n_tokens = c->n_tokens,
                               .body = c->body,
                               .body_size = sizeof c->body};
}

static void put_and_settle(rk_redis *r, const chunk *c) {
    rk_store_put_args a = chunk_args(c);
    cr_assert_eq(rk_redis_put(r, &a, NULL), RK_OK, "%s", rk_error_message());
    int idle = 0;
    cr_assert_eq(rk_redis_wait_idle(r, 10000, &idle), RK_OK);
    cr_assert_eq(idle, 1);
}

static void expect_same(const rk_store_payload *p, const chunk *c) {
    cr_assert_eq(p->meta.n_tokens, c->n_tokens);
    cr_assert_eq(memcmp(p->tokens, c->tokens, (size_t)c->n_tokens * 4), 0);
    cr_assert_eq(p->body_size, sizeof c->body);
    cr_assert_eq(memcmp(p->body, c->body, sizeof c->body), 0);
    cr_assert_eq(memcmp(&p->layout, &c->layout, sizeof c->layout), 0);
    cr_assert_str_eq(p->meta.key, c->key);
}

static rk_status get_chunk(rk_redis *r, const chunk *c, rk_store_payload *p) {
    return rk_redis_get(r, c->key, c->tokens, c->n_tokens, &c->layout, sizeof c->body, p);
}

static void init(void) { signal(SIGPIPE, SIG_IGN); }

TestSuite(redis, .init = init);

/* ---------------------------------------------------------------- tests */

Test(redis, url_parser_is_strict_and_names_the_bad_part) {
    rk_redis_url u;
    cr_assert_eq(rk_redis_url_parse("redis://alice:s3cret@cache.local:6380/2", &u), RK_OK);
    cr_assert_str_eq(u.host, "cache.local");
    cr_assert_eq(u.port, 6380);
    cr_assert_eq(u.db, 2);
    cr_assert_str_eq(u.user, "alice");
    cr_assert_str_eq(u.password, "s3cret");
    cr_assert_eq(rk_redis_url_parse("redis://:pw@127.0.0.1:6379", &u), RK_OK);
    cr_assert_str_eq(u.user, "");
    cr_assert_eq(u.has_password, 1);
    cr_assert_eq(rk_redis_url_parse("redis://127.0.0.1:6379", &u), RK_OK);
    cr_assert_eq(u.has_password, 0);
    cr_assert_eq(u.db, 0);

    static const struct {
        const char *url, *msg;
    } bad[] = {
        {"http://127.0.0.1:6379", "redis://"}, {"redis://127.0.0.1", "port"},
        {"redis://127.0.0.1:0", "port"},       {"redis://127.0.0.1:65536", "port"},
        {"redis://127.0.0.1:63x9", "port"},    {"redis://:6379", "host"},
        {"redis://h:1/x", "database"},         {"redis://h:1/", "database"},
        {"redis://user@h:1", "user:password"}, {"redis://u:@h:1", "empty password"},
        {"redis://h st:1", "':PORT'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(rk_redis_url_parse(bad[i].url, &u), RK_ERR_INVALID, "%s", bad[i].url);
        cr_assert(strstr(rk_error_message(), bad[i].msg), "%s: %s", bad[i].url, rk_error_message());
    }
}

Test(redis, put_then_get_returns_identical_bytes_and_a_second_client_sees_it) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL), *b = open_tier(&s, FP_A, NULL);
    chunk c;
    chunk_make(&c, 1);
    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c, &p), RK_ERR_NOT_FOUND);
    put_and_settle(a, &c);
    cr_assert_eq(get_chunk(a, &c, &p), RK_OK);
    expect_same(&p, &c);
    cr_assert_str_eq(p.meta.model, FP_A);
    rk_store_payload_free(&p);
    cr_assert_eq(get_chunk(b, &c, &p), RK_OK); /* replica B */
    expect_same(&p, &c);
    rk_store_payload_free(&p);

    rk_redis_counters ca, cb;
    rk_redis_stats(a, &ca);
    rk_redis_stats(b, &cb);
    size_t value_bytes = RK_STORE_HEADER_BYTES + 4 * (size_t)c.n_tokens + sizeof c.body;
    cr_assert_eq(ca.writes, 1);
    cr_assert_eq(ca.bytes_out, value_bytes);
    cr_assert_eq(ca.hits, 1);
    cr_assert_eq(ca.misses, 1);
    cr_assert_eq(ca.get_count, 2);
    cr_assert_gt(ca.get_seconds, 0);
    cr_assert_eq(cb.hits, 1);
    cr_assert_eq(cb.bytes_in, value_bytes);
    cr_assert_gt(cb.load_bytes_per_s, 0);
    cr_assert_eq(cb.errors, 0);

    /* Another KV layout (another kind of replica) is a miss and is kept. */
    rk_store_layout other = c.layout;
    other.dtype = 1;
    cr_assert_eq(rk_redis_get(b, c.key, c.tokens, c.n_tokens, &other, sizeof c.body, &p),
                 RK_ERR_NOT_FOUND);
    rk_redis_stats(b, &cb);
    cr_assert_eq(cb.layout_mismatch, 1);
    cr_assert_eq(cb.dropped_corrupt, 0);
    cr_assert_eq(get_chunk(b, &c, &p), RK_OK);
    rk_store_payload_free(&p);
    rk_redis_close(a);
    rk_redis_close(b);
    rk_test_redis_free(&s);
}

Test(redis, put_value_hands_over_a_buffer_the_caller_filled_in_place) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL);
    chunk c;
    chunk_make(&c, 9);
    rk_redis_value *v = NULL;
    void *body = NULL;
    cr_assert_eq(rk_redis_value_new(c.key, "isolated", "doc-9", &c.layout, c.tokens, c.n_tokens,
                                    sizeof c.body, &v, &body),
                 RK_OK);
    memcpy(body, c.body, sizeof c.body); /* as the KV download would */
    cr_assert_eq(rk_redis_put_value(a, v, NULL), RK_OK);
    int idle = 0;
    cr_assert_eq(rk_redis_wait_idle(a, 10000, &idle), RK_OK);
    cr_assert_eq(idle, 1);
    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c, &p), RK_OK);
    expect_same(&p, &c);
    cr_assert_str_eq(p.meta.policy, "isolated");
    cr_assert_str_eq(p.meta.doc_id, "doc-9");
    rk_store_payload_free(&p);
    rk_redis_close(a);

    /* A dropped value is freed too (the sanitizer build checks it). */
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.min_tokens = 1000;
    a = open_tier(&s, FP_A, &cfg);
    cr_assert_eq(rk_redis_value_new(c.key, "isolated", "doc-9", &c.layout, c.tokens, c.n_tokens,
                                    sizeof c.body, &v, &body),
                 RK_OK);
    cr_assert_eq(rk_redis_put_value(a, v, NULL), RK_ERR_LIMIT);
    cr_assert_eq(rk_redis_value_new("not-a-key", "isolated", NULL, &c.layout, c.tokens, c.n_tokens,
                                    0, &v, &body),
                 RK_ERR_INVALID);
    cr_assert_null(v);
    rk_redis_value_free(NULL);
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, value_is_byte_for_byte_a_disk_payload_file) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL);
    chunk c;
    chunk_make(&c, 2);
    put_and_settle(a, &c);
    redisContext *rc = raw(&s);
    redisReply *rep = redisCommand(rc, "GET ragkv:%s:%s", FP_A, c.key);
    cr_assert(rep && rep->type == REDIS_REPLY_STRING);
    char path[4200];
    snprintf(path, sizeof path, "%s/value.kv", s.dir);
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    cr_assert_eq(fwrite(rep->str, 1, rep->len, f), rep->len);
    fclose(f);
    uint8_t sum[16];
    char hex[33];
    rk_payload_checksum(c.tokens, (size_t)c.n_tokens, c.body, sizeof c.body, sum);
    rk_payload_checksum_hex(sum, hex);
    rk_payload_expect e = {.key = c.key,
                           .fingerprint = FP_A,
                           .checksum_hex = hex,
                           .n_tokens = c.n_tokens,
                           .n_bytes = rep->len};
    rk_payload_header h;
    int32_t *tokens = NULL;
    void *body = NULL;
    cr_assert_eq(rk_payload_read(path, &e, &h, &tokens, &body), RK_OK, "%s", rk_error_message());
    cr_assert_eq(memcmp(tokens, c.tokens, (size_t)c.n_tokens * 4), 0);
    cr_assert_eq(memcmp(body, c.body, sizeof c.body), 0);
    cr_assert_eq(h.layout.block_size, 16);
    cr_assert_eq(h.header_bytes, RK_STORE_HEADER_BYTES);
    cr_assert_str_eq(h.policy, "isolated");
    cr_assert_gt(h.created, 1e9);
    free(tokens);
    free(body);
    freeReplyObject(rep);
    redisFree(rc);
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, corrupt_truncated_wrong_model_and_wrong_token_values_are_dropped_and_counted) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL), *other = open_tier(&s, FP_B, NULL);
    chunk c[4];
    for (int i = 0; i < 4; i++) {
        chunk_make(&c[i], 10 + (unsigned)i);
        put_and_settle(i == 2 ? other : a, &c[i]);
    }
    redisContext *rc = raw(&s);
    char k[200];
    /* 0: one body byte flipped in place */
    snprintf(k, sizeof k, "ragkv:%s:%s", FP_A, c[0].key);
    redisReply *rep =
        redisCommand(rc, "SETRANGE %s %d %b", k, RK_STORE_HEADER_BYTES + 4 * c[0].n_tokens + 100,
                     "\xff", (size_t)1);
    cr_assert(rep && rep->type == REDIS_REPLY_INTEGER);
    freeReplyObject(rep);
    /* 1: the value cut short (its marker still has the full size) */
    snprintf(k, sizeof k, "ragkv:%s:%s", FP_A, c[1].key);
    rep = redisCommand(rc, "GET %s", k);
    cr_assert(rep && rep->type == REDIS_REPLY_STRING);
    redisReply *rep2 = redisCommand(rc, "SET %s %b", k, rep->str, rep->len - 1000);
    freeReplyObject(rep2);
    freeReplyObject(rep);
    /* 2: another model's value and marker copied under this model's keys */
    char src[200], dst[200];
    snprintf(src, sizeof src, "ragkv:%s:%s", FP_B, c[2].key);
    snprintf(dst, sizeof dst, "ragkv:%s:%s", FP_A, c[2].key);
    rep = redisCommand(rc, "GET %s", src);
    rep2 = redisCommand(rc, "SET %s %b", dst, rep->str, rep->len);
    freeReplyObject(rep2);
    freeReplyObject(rep);
    rep = redisCommand(rc, "GET %s:meta", src);
    rep2 = redisCommand(rc, "SET %s:meta %b", dst, rep->str, rep->len);
    freeReplyObject(rep2);
    freeReplyObject(rep);

    rk_store_payload p;
    for (int i = 0; i < 3; i++) cr_assert_eq(get_chunk(a, &c[i], &p), RK_ERR_NOT_FOUND, "%d", i);
    /* 3: a request whose token ids differ under the same key */
    int32_t wrong[64];
    memcpy(wrong, c[3].tokens, sizeof wrong);
    wrong[5] ^= 1;
    cr_assert_eq(rk_redis_get(a, c[3].key, wrong, c[3].n_tokens, NULL, 0, &p), RK_ERR_NOT_FOUND);

    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.dropped_corrupt, 4);
    cr_assert_eq(ct.hits, 0);
    cr_assert_eq(ct.misses, 4);
    for (int i = 0; i < 4; i++) {
        snprintf(k, sizeof k, "ragkv:%s:%.32s", FP_A, c[i].key);
        cr_assert_eq(raw_int(rc, "EXISTS %s", k), 0, "payload %d was not deleted", i);
        snprintf(k, sizeof k, "ragkv:%s:%.32s:meta", FP_A, c[i].key);
        cr_assert_eq(raw_int(rc, "EXISTS %s", k), 0, "marker %d was not deleted", i);
    }
    /* The other model's own copy is untouched and still served to it. */
    cr_assert_eq(get_chunk(other, &c[2], &p), RK_OK);
    rk_store_payload_free(&p);
    redisFree(rc);
    rk_redis_close(a);
    rk_redis_close(other);
    rk_test_redis_free(&s);
}

Test(redis, payload_without_its_marker_is_not_trusted) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL);
    chunk c;
    chunk_make(&c, 3);
    put_and_settle(a, &c);
    redisContext *rc = raw(&s);
    char k[200];
    snprintf(k, sizeof k, "ragkv:%s:%s:meta", FP_A, c.key);
    cr_assert_eq(raw_int(rc, "DEL %s", k), 1);
    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c, &p), RK_ERR_NOT_FOUND);
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.dropped_corrupt, 0);
    /* Left alone: it may be a write whose marker is on its way. */
    snprintf(k, sizeof k, "ragkv:%s:%s", FP_A, c.key);
    cr_assert_eq(raw_int(rc, "EXISTS %s", k), 1);
    int n = -1;
    rk_redis_entry *list = NULL;
    cr_assert_eq(rk_redis_list(a, 0, &list, &n), RK_OK);
    cr_assert_eq(n, 0);
    free(list);
    redisFree(rc);
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, killed_server_fails_fast_opens_the_breaker_and_sharing_resumes_after_restart) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.min_tokens = 1;
    cfg.timeout_ms = 200;
    cfg.breaker_failures = 3;
    cfg.breaker_backoff_ms = 100;
    cfg.breaker_backoff_max_ms = 400;
    rk_redis *a = open_tier(&s, FP_A, &cfg);
    chunk c;
    chunk_make(&c, 4);
    put_and_settle(a, &c);
    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c, &p), RK_OK);
    rk_store_payload_free(&p);

    rk_test_redis_stop(&s); /* SIGKILL */
    for (int i = 0; i < 10; i++) {
        double t0 = rk_time_now();
        cr_assert_eq(get_chunk(a, &c, &p), RK_ERR_NOT_FOUND);
        rk_store_put_args args = chunk_args(&c);
        rk_status st = rk_redis_put(a, &args, NULL);
        cr_assert(st == RK_OK || st == RK_ERR_LIMIT);
        /* Far below any TCP time-out: nothing waits on a dead server. */
        cr_assert_lt(rk_time_now() - t0, 2.0, "call %d took %.2f s", i, rk_time_now() - t0);
    }
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.breaker, RK_REDIS_OPEN);
    cr_assert_geq(ct.breaker_opened, 1);
    cr_assert_geq(ct.errors, 3);
    cr_assert_gt(ct.skipped, 0);
    cr_assert_eq(rk_redis_worth_fetching(a, 1000, 1, 1.0), 0, "no fetch with the breaker open");

    rk_test_redis_start(&s); /* same port, empty */
    int hit = 0;
    for (int i = 0; i < 100 && !hit; i++) { /* bounded: about 5 s */
        rk_store_put_args args = chunk_args(&c);
        (void)rk_redis_put(a, &args, NULL);
        int idle;
        rk_redis_wait_idle(a, 1000, &idle);
        hit = get_chunk(a, &c, &p) == RK_OK;
        if (hit)
            rk_store_payload_free(&p);
        else
            usleep(50000);
    }
    cr_assert(hit, "sharing did not resume after the restart");
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.breaker, RK_REDIS_CLOSED);
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, stalled_server_costs_at_most_the_timeout_per_call_and_then_nothing) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.min_tokens = 1;
    cfg.timeout_ms = 150;
    cfg.breaker_failures = 2;
    cfg.breaker_backoff_ms = 200;
    rk_redis *a = open_tier(&s, FP_A, &cfg);
    chunk c;
    chunk_make(&c, 8);
    put_and_settle(a, &c);
    rk_store_payload p;
    rk_redis_lock lk;
    rk_redis_lock_state ls;
    kill(s.pid, SIGSTOP); /* accepts connections, answers nothing */
    for (int i = 0; i < 6; i++) {
        double t0 = rk_time_now();
        cr_assert_eq(get_chunk(a, &c, &p), RK_ERR_NOT_FOUND);
        cr_assert_eq(rk_redis_try_lock(a, c.key, &lk, &ls), RK_OK);
        cr_assert_eq(ls, RK_REDIS_LOCK_UNAVAILABLE);
        double dt = rk_time_now() - t0;
        /* two calls of at most one timeout each (plus a reconnect) */
        cr_assert_lt(dt, 1.5, "calls %d took %.2f s with a 150 ms timeout", i, dt);
    }
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.breaker, RK_REDIS_OPEN);
    cr_assert_eq(ct.breaker_opened, 1);
    cr_assert_gt(ct.skipped, 0, "the open breaker spares the stalled server");
    kill(s.pid, SIGCONT);
    int hit = 0;
    for (int i = 0; i < 100 && !hit; i++) { /* bounded: about 5 s */
        hit = get_chunk(a, &c, &p) == RK_OK;
        if (hit)
            rk_store_payload_free(&p);
        else
            usleep(50000);
    }
    cr_assert(hit, "sharing did not resume after the server woke up");
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, writes_made_while_a_paused_server_is_away_land_once_it_answers) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.min_tokens = 1;
    cfg.timeout_ms = 100;
    cfg.breaker_failures = 2;
    cfg.breaker_backoff_ms = 100;
    cfg.breaker_backoff_max_ms = 600000; /* a back-off that would outlast the test */
    rk_redis *a = open_tier(&s, FP_A, &cfg);
    enum { N = 16 };
    static chunk c[N];
    for (int i = 0; i < N; i++) chunk_make(&c[i], 300 + (unsigned)i);
    put_and_settle(a, &c[0]);
    rk_store_payload p;
    rk_redis_counters ct;
    kill(s.pid, SIGSTOP); /* accepts connections, answers nothing */
    /* Reads fail at the timeout until the breaker opens (the bound is
     * against a hang only). */
    double give_up = rk_time_now() + 60;
    do {
        cr_assert_eq(get_chunk(a, &c[0], &p), RK_ERR_NOT_FOUND);
        rk_redis_stats(a, &ct);
    } while (ct.breaker != RK_REDIS_OPEN && rk_time_now() < give_up);
    cr_assert_eq(ct.breaker, RK_REDIS_OPEN);
    uint64_t errors = ct.errors;
    /* Chunks computed while Redis is away wait in the queue... */
    for (int i = 1; i < N / 2; i++) {
        rk_store_put_args args = chunk_args(&c[i]);
        cr_assert_eq(rk_redis_put(a, &args, NULL), RK_OK, "put %d: %s", i, rk_error_message());
    }
    /* ...through the writer's probes, which fail while the server sleeps. */
    do {
        usleep(1000);
        rk_redis_stats(a, &ct);
    } while (ct.errors < errors + 2 && rk_time_now() < give_up);
    cr_assert_geq(ct.errors, errors + 2, "the writer did not probe the paused server");
    cr_assert_eq(ct.queued, N / 2 - 1);
    cr_assert_eq(ct.write_drops, 0);
    kill(s.pid, SIGCONT);
    /* ...as do those computed right after it is back, breaker open or not. */
    for (int i = N / 2; i < N; i++) {
        rk_store_put_args args = chunk_args(&c[i]);
        cr_assert_eq(rk_redis_put(a, &args, NULL), RK_OK, "put %d: %s", i, rk_error_message());
    }
    int idle = 0;
    cr_assert_eq(rk_redis_wait_idle(a, 60000, &idle), RK_OK);
    cr_assert_eq(idle, 1, "the queued writes never landed");
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.write_drops, 0);
    cr_assert_eq(ct.writes, N);
    cr_assert_eq(ct.queued, 0);
    cr_assert_eq(ct.queued_bytes, 0);
    /* The writer's probe closed the breaker: reads resume at once, not after
     * the back-off. */
    cr_assert_eq(ct.breaker, RK_REDIS_CLOSED);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(get_chunk(a, &c[i], &p), RK_OK, "chunk %d: %s", i, rk_error_message());
        expect_same(&p, &c[i]);
        rk_store_payload_free(&p);
    }
    redisContext *rc = raw(&s);
    char mkey[160];
    for (int i = 0; i < N; i++) {
        snprintf(mkey, sizeof mkey, "ragkv:%.32s:%.32s:meta", FP_A, c[i].key);
        cr_assert_eq(raw_int(rc, "EXISTS %s", mkey), 1, "chunk %d has no marker", i);
    }
    redisFree(rc);
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, wrong_password_fails_open_with_a_clear_message) {
    rk_test_redis s = {.password = "x"};
    rk_test_redis_start(&s);
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    char url[96];
    cfg.url = url;
    rk_redis *r = NULL;

    snprintf(url, sizeof url, "redis://:wrong@127.0.0.1:%d", s.port);
    cr_assert_eq(rk_redis_open(&cfg, FP_A, &r), RK_ERR_INVALID);
    cr_assert_null(r);
    const char *msg = rk_error_message();
    cr_assert(strstr(msg, "refused the password (AUTH)"), "%s", msg);
    cr_assert_null(strstr(msg, "wrong"), "the message must not show the password: %s", msg);

    snprintf(url, sizeof url, "redis://127.0.0.1:%d", s.port);
    cr_assert_eq(rk_redis_open(&cfg, FP_A, &r), RK_ERR_INVALID);
    cr_assert(strstr(rk_error_message(), "NOAUTH"), "%s", rk_error_message());

    snprintf(url, sizeof url, "redis://:x@127.0.0.1:%d/1", s.port);
    cr_assert_eq(rk_redis_open(&cfg, FP_A, &r), RK_OK, "%s", rk_error_message());
    rk_redis_url ep;
    rk_redis_endpoint(r, &ep);
    cr_assert_eq(ep.db, 1);
    cr_assert_eq(ep.has_password, 1);
    cr_assert_str_eq(ep.password, "");
    rk_redis_close(r);

    /* An ACL user (Redis 6+): user and password both count. */
    redisContext *rc = raw(&s);
    redisReply *rep = redisCommand(rc, "AUTH x");
    freeReplyObject(rep);
    rep = redisCommand(rc, "ACL SETUSER alice on >pw ~* +@all");
    cr_assert(rep && rep->type == REDIS_REPLY_STATUS, "%s", rep ? rep->str : rc->errstr);
    freeReplyObject(rep);
    redisFree(rc);
    snprintf(url, sizeof url, "redis://alice:pw@127.0.0.1:%d", s.port);
    cr_assert_eq(rk_redis_open(&cfg, FP_A, &r), RK_OK, "%s", rk_error_message());
    rk_redis_close(r);
    snprintf(url, sizeof url, "redis://alice:x@127.0.0.1:%d", s.port);
    cr_assert_eq(rk_redis_open(&cfg, FP_A, &r), RK_ERR_INVALID);
    cr_assert(strstr(rk_error_message(), "refused the user name and password (AUTH)"), "%s",
              rk_error_message());
    rk_test_redis_free(&s);
}

Test(redis, unreachable_server_at_open_is_not_an_error) {
    rk_test_redis s = {0};
    s.port = rk_test_free_port(); /* nothing listens there */
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", s.port);
    cfg.url = url;
    rk_redis *r = NULL;
    cr_assert_eq(rk_redis_open(&cfg, FP_A, &r), RK_OK, "%s", rk_error_message());
    rk_redis_counters ct;
    rk_redis_stats(r, &ct);
    cr_assert_eq(ct.errors, 1);
    rk_redis_entry *list = NULL;
    int n = 0;
    cr_assert_eq(rk_redis_list(r, 0, &list, &n), RK_ERR_IO);
    rk_redis_close(r);
}

Test(redis, nx_lock_is_taken_once_and_freed_when_its_holder_dies) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.min_tokens = 1;
    cfg.lock_ttl_ms = 300;
    rk_redis *a = open_tier(&s, FP_A, &cfg), *b = open_tier(&s, FP_A, &cfg);
    chunk c;
    chunk_make(&c, 5);
    rk_redis_lock la, lb;
    rk_redis_lock_state sa, sb;
    double t0 = rk_time_now(); /* the lock is set after this */
    cr_assert_eq(rk_redis_try_lock(a, c.key, &la, &sa), RK_OK);
    cr_assert_eq(rk_redis_try_lock(b, c.key, &lb, &sb), RK_OK);
    cr_assert_eq(sa, RK_REDIS_LOCK_ACQUIRED);
    cr_assert_eq(sb, RK_REDIS_LOCK_HELD);
    rk_store_payload p;
    rk_redis_poll_state ps;
    cr_assert_eq(rk_redis_poll(b, c.key, c.tokens, c.n_tokens, NULL, 0, &p, &ps), RK_OK);
    cr_assert_eq(ps, RK_REDIS_PENDING);

    /* A dies holding the lock (it never unlocks): the TTL frees it for B. */
    rk_redis_close(a);
    while (sb != RK_REDIS_LOCK_ACQUIRED && rk_time_now() - t0 < 5.0) {
        usleep(20000);
        cr_assert_eq(rk_redis_try_lock(b, c.key, &lb, &sb), RK_OK);
    }
    cr_assert_eq(sb, RK_REDIS_LOCK_ACQUIRED);
    cr_assert_geq(rk_time_now() - t0, 0.25, "the lock went before its 300 ms TTL");

    /* A's stale token cannot release B's lock. */
    a = open_tier(&s, FP_A, &cfg);
    cr_assert_eq(rk_redis_unlock(a, &la), RK_OK);
    cr_assert_eq(rk_redis_try_lock(a, c.key, &la, &sa), RK_OK);
    cr_assert_eq(sa, RK_REDIS_LOCK_HELD);

    /* B computes and puts with its lock: A, waiting, gets the value. */
    rk_store_put_args args = chunk_args(&c);
    cr_assert_eq(rk_redis_put(b, &args, &lb), RK_OK);
    cr_assert_eq(
        rk_redis_wait_for(a, c.key, c.tokens, c.n_tokens, &c.layout, sizeof c.body, 5000, &p),
        RK_OK);
    expect_same(&p, &c);
    rk_store_payload_free(&p);
    int idle;
    rk_redis_wait_idle(b, 5000, &idle);
    redisContext *rc = raw(&s);
    char k[200];
    snprintf(k, sizeof k, "ragkv:%s:%s:lock", FP_A, c.key);
    cr_assert_eq(raw_int(rc, "EXISTS %s", k), 0, "the writer released the lock");
    /* A lock held past the wait's bound, then released without a value: the
     * waiter is told to compute both times. */
    chunk d;
    chunk_make(&d, 15);
    cr_assert_eq(rk_redis_try_lock(a, d.key, &la, &sa), RK_OK);
    cr_assert_eq(sa, RK_REDIS_LOCK_ACQUIRED);
    double w0 = rk_time_now();
    cr_assert_eq(rk_redis_wait_for(b, d.key, d.tokens, d.n_tokens, NULL, 0, 150, &p),
                 RK_ERR_NOT_FOUND);
    cr_assert_geq(rk_time_now() - w0, 0.15, "the wait ended before its bound");
    cr_assert_eq(rk_redis_unlock(a, &la), RK_OK);
    snprintf(k, sizeof k, "ragkv:%s:%s:lock", FP_A, d.key);
    cr_assert_eq(raw_int(rc, "EXISTS %s", k), 0);
    cr_assert_eq(rk_redis_poll(b, d.key, d.tokens, d.n_tokens, NULL, 0, &p, &ps), RK_OK);
    cr_assert_eq(ps, RK_REDIS_GONE);
    redisFree(rc);
    rk_redis_close(a);
    rk_redis_close(b);
    rk_test_redis_free(&s);
}

Test(redis, async_writer_lands_every_put_and_counts_queue_full_drops) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL);
    enum { N = 200 };
    static chunk c[N];
    for (int i = 0; i < N; i++) {
        chunk_make(&c[i], 100 + (unsigned)i);
        rk_store_put_args args = chunk_args(&c[i]);
        cr_assert_eq(rk_redis_put(a, &args, NULL), RK_OK, "%s", rk_error_message());
    }
    int idle = 0;
    cr_assert_eq(rk_redis_wait_idle(a, 20000, &idle), RK_OK);
    cr_assert_eq(idle, 1);
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.writes, N);
    cr_assert_eq(ct.write_drops, 0);
    cr_assert_eq(ct.queued, 0);
    rk_redis_entry *list = NULL;
    int n = 0;
    cr_assert_eq(rk_redis_list(a, 0, &list, &n), RK_OK);
    cr_assert_eq(n, N);
    free(list);
    cr_assert_eq(rk_redis_list(a, 7, &list, &n), RK_OK);
    cr_assert_eq(n, 7);
    free(list);
    rk_store_payload p;
    for (int i = 0; i < N; i += 37) {
        cr_assert_eq(get_chunk(a, &c[i], &p), RK_OK);
        expect_same(&p, &c[i]);
        rk_store_payload_free(&p);
    }
    rk_redis_close(a);

    /* A stopped server holds the writer on its first write: a queue of two
     * writes, or of 10000 bytes (two values of 4.8 kB), takes at most three
     * puts of ten; the rest are dropped and counted. */
    for (int cap = 0; cap < 2; cap++) {
        rk_redis_config cfg;
        rk_redis_config_default(&cfg);
        cfg.min_tokens = 1;
        cfg.timeout_ms = 300;
        if (cap == 0)
            cfg.queue_max = 2;
        else
            cfg.queue_max_bytes = 10000;
        a = open_tier(&s, cap == 0 ? FP_B : FP_A, &cfg);
        kill(s.pid, SIGSTOP);
        int dropped = 0;
        for (int i = 0; i < 10; i++) {
            rk_store_put_args args = chunk_args(&c[i]);
            rk_status st = rk_redis_put(a, &args, NULL);
            cr_assert(st == RK_OK || st == RK_ERR_LIMIT);
            dropped += st == RK_ERR_LIMIT;
        }
        cr_assert_geq(dropped, 7, "cap %d: %d dropped", cap, dropped);
        kill(s.pid, SIGCONT);
        cr_assert_eq(rk_redis_wait_idle(a, 20000, &idle), RK_OK);
        cr_assert_eq(idle, 1);
        rk_redis_stats(a, &ct);
        cr_assert_geq(ct.write_drops, (uint64_t)dropped);
        cr_assert_eq(ct.writes + ct.write_drops, 10);
        cr_assert_eq(ct.queued_bytes, 0);
        rk_redis_close(a);
    }
    rk_test_redis_free(&s);
}

Test(redis, cost_gate_uses_min_tokens_and_measured_throughput) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.min_tokens = 32;
    rk_redis *a = open_tier(&s, FP_A, &cfg);
    cr_assert_eq(rk_redis_value_bytes(40, 4096), RK_STORE_HEADER_BYTES + 4 * 40 + 4096);
    cr_assert_eq(rk_redis_worth_fetching(a, 31, 1000, 100.0), 0, "below min_tokens");
    cr_assert_eq(rk_redis_worth_fetching(a, 32, 1000, 100.0), 1, "nothing measured yet");
    chunk c;
    chunk_make(&c, 6);
    put_and_settle(a, &c);
    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c, &p), RK_OK);
    rk_store_payload_free(&p);
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    double bw = ct.load_bytes_per_s;
    cr_assert_gt(bw, 0);
    /* Loading bw bytes takes about a second: worth it against a 10-second
     * recompute, not against a 0.1-second one. */
    cr_assert_eq(rk_redis_worth_fetching(a, 1000, (uint64_t)bw, 100.0), 1);
    cr_assert_eq(rk_redis_worth_fetching(a, 1000, (uint64_t)bw, 10000.0), 0);
    cr_assert_eq(rk_redis_worth_fetching(a, 1000, (uint64_t)bw, 0.0), 1, "prefill rate unknown");
    /* A short chunk is neither fetched nor written. */
    chunk_make(&c, 7);
    c.n_tokens = 8;
    rk_store_put_args args = chunk_args(&c);
    cr_assert_eq(rk_redis_put(a, &args, NULL), RK_ERR_LIMIT);
    cr_assert_eq(get_chunk(a, &c, &p), RK_ERR_NOT_FOUND);
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.write_drops, 0, "a short chunk is not a dropped write");
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, list_and_flush_touch_only_this_models_keys) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL), *b = open_tier(&s, FP_B, NULL);
    chunk c;
    for (int i = 0; i < 5; i++) {
        chunk_make(&c, 50 + (unsigned)i);
        put_and_settle(i < 3 ? a : b, &c);
    }
    rk_redis_lock lk;
    rk_redis_lock_state ls;
    cr_assert_eq(rk_redis_try_lock(a, c.key, &lk, &ls), RK_OK);
    cr_assert_eq(ls, RK_REDIS_LOCK_ACQUIRED);
    rk_redis_entry *list = NULL;
    int n = 0;
    cr_assert_eq(rk_redis_list(a, 0, &list, &n), RK_OK);
    cr_assert_eq(n, 3);
    for (int i = 0; i < n; i++) {
        cr_assert(rk_store_key_valid(list[i].key));
        cr_assert_geq(list[i].n_tokens, 40);
        cr_assert_eq(list[i].n_bytes,
                     RK_STORE_HEADER_BYTES + 4 * (uint64_t)list[i].n_tokens + 4096);
        cr_assert_gt(list[i].created, 1e9);
    }
    free(list);
    uint64_t removed = 0;
    cr_assert_eq(rk_redis_flush(a, &removed), RK_OK);
    cr_assert_eq(removed, 3);
    cr_assert_eq(rk_redis_list(a, 0, &list, &n), RK_OK);
    cr_assert_eq(n, 0);
    cr_assert_eq(rk_redis_list(b, 0, &list, &n), RK_OK);
    cr_assert_eq(n, 2);
    free(list);
    redisContext *rc = raw(&s);
    char pat[64];
    snprintf(pat, sizeof pat, "ragkv:%s:*", FP_A);
    redisReply *rep = redisCommand(rc, "KEYS %s", pat); /* a test may use KEYS */
    cr_assert(rep && rep->type == REDIS_REPLY_ARRAY);
    cr_assert_eq(rep->elements, 0, "markers and the lock are gone too");
    freeReplyObject(rep);
    redisFree(rc);
    rk_redis_close(a);
    rk_redis_close(b);
    rk_test_redis_free(&s);
}

/* ---------------------------------------------------------------- trust */

static const char SECRET[] = "correct horse battery staple 42";

static rk_redis *open_secret_tier(const rk_test_redis *s, const char *fp, const char *secret) {
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.min_tokens = 1;
    if (secret) {
        cfg.secret = secret;
        cfg.secret_len = strlen(secret);
    }
    return open_tier(s, fp, &cfg);
}

/* Store under c's keys what someone with write access to Redis but without
 * the secret can: a well-formed payload with body (and c's token ids), its
 * checksums recomputed, then a marker of version (1: no tag; 2: a tag of 32
 * bytes the forger has to guess, here zeros) that agrees with it. */
static void forge(redisContext *rc, const char *fp, const chunk *c, const void *body,
                  size_t body_size, int version) {
    rk_payload_header h = {.n_tokens = (uint32_t)c->n_tokens,
                           .layout = c->layout,
                           .body_size = body_size,
                           .created = 1e9};
    memcpy(h.fingerprint, fp, 32);
    memcpy(h.key, c->key, 32);
    snprintf(h.policy, sizeof h.policy, "isolated");
    rk_payload_checksum(c->tokens, (size_t)c->n_tokens, body, body_size, h.checksum);
    size_t tag = version == 2 ? RK_REDIS_TAG_BYTES : 0;
    size_t n = RK_STORE_HEADER_BYTES + 4 * (size_t)c->n_tokens + body_size + tag;
    uint8_t *v = calloc(1, n);
    cr_assert_not_null(v);
    rk_payload_header_encode(&h, v);
    memcpy(v + RK_STORE_HEADER_BYTES, c->tokens, 4 * (size_t)c->n_tokens);
    memcpy(v + RK_STORE_HEADER_BYTES + 4 * (size_t)c->n_tokens, body, body_size);
    char hex[33], k[200], meta[200];
    rk_payload_checksum_hex(h.checksum, hex);
    snprintf(k, sizeof k, "ragkv:%s:%s", fp, c->key);
    redisReply *rep = redisCommand(rc, "SET %s %b", k, v, n);
    cr_assert(rep && rep->type == REDIS_REPLY_STATUS);
    freeReplyObject(rep);
    snprintf(meta, sizeof meta, "%d %d %zu %s 1000000000.000", version, c->n_tokens, n, hex);
    rep = redisCommand(rc, "SET %s:meta %s", k, meta);
    cr_assert(rep && rep->type == REDIS_REPLY_STATUS);
    freeReplyObject(rep);
    free(v);
}

static long long key_exists(redisContext *rc, const char *fp, const chunk *c, const char *suffix) {
    char k[200];
    snprintf(k, sizeof k, "ragkv:%s:%s%s", fp, c->key, suffix);
    return raw_int(rc, "EXISTS %s", k);
}

Test(redis, with_a_secret_forged_values_are_deleted_and_counted_and_honest_ones_load) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_secret_tier(&s, FP_A, SECRET);
    chunk c[3];
    for (int i = 0; i < 3; i++) {
        chunk_make(&c[i], 70 + (unsigned)i);
        put_and_settle(a, &c[i]);
    }
    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c[0], &p), RK_OK, "an authenticated value loads");
    expect_same(&p, &c[0]);
    rk_store_payload_free(&p);
    /* The tagged value is the disk payload plus its 32-byte tag. */
    redisContext *rc = raw(&s);
    char k[200];
    snprintf(k, sizeof k, "ragkv:%s:%s", FP_A, c[0].key);
    cr_assert_eq(raw_int(rc, "STRLEN %s", k), RK_STORE_HEADER_BYTES + 4 * c[0].n_tokens +
                                                  (long long)sizeof c[0].body + RK_REDIS_TAG_BYTES);

    /* Forged: the KV changed, checksums and marker recomputed; once as an
     * old untagged value, once with a tag made up without the secret. */
    uint8_t evil[sizeof c[1].body];
    for (size_t i = 0; i < sizeof evil; i++) evil[i] = (uint8_t)(c[1].body[i] ^ 0x80);
    forge(rc, FP_A, &c[1], evil, sizeof evil, 1);
    forge(rc, FP_A, &c[2], evil, sizeof evil, 2);
    for (int i = 1; i < 3; i++) {
        cr_assert_eq(get_chunk(a, &c[i], &p), RK_ERR_NOT_FOUND, "forged value %d was served", i);
        cr_assert_eq(key_exists(rc, FP_A, &c[i], ""), 0, "forged value %d kept", i);
        cr_assert_eq(key_exists(rc, FP_A, &c[i], ":meta"), 0, "forged marker %d kept", i);
    }
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.auth_failures, 2);
    cr_assert_eq(ct.dropped_corrupt, 0);
    cr_assert_eq(ct.hits, 1);

    /* Another secret: the value is a miss, deleted and counted, as after a
     * rotation. Without a secret the tier trusts Redis and loads it. */
    rk_redis *plain = open_secret_tier(&s, FP_A, NULL);
    cr_assert_eq(get_chunk(plain, &c[0], &p), RK_OK, "a tier without a secret reads tagged values");
    expect_same(&p, &c[0]);
    rk_store_payload_free(&p);
    rk_redis *other = open_secret_tier(&s, FP_A, "another secret, sixteen bytes+");
    cr_assert_eq(get_chunk(other, &c[0], &p), RK_ERR_NOT_FOUND);
    rk_redis_stats(other, &ct);
    cr_assert_eq(ct.auth_failures, 1);
    cr_assert_eq(key_exists(rc, FP_A, &c[0], ""), 0);
    redisFree(rc);
    rk_redis_close(a);
    rk_redis_close(plain);
    rk_redis_close(other);
    rk_test_redis_free(&s);
}

Test(redis, a_secret_too_short_or_unreadable_is_refused_without_printing_it) {
    uint8_t buf[RK_REDIS_SECRET_MAX];
    size_t n = 99;
    cr_assert_eq(rk_redis_secret_load("", NULL, buf, &n), RK_OK);
    cr_assert_eq(n, 0, "no secret");
    cr_assert_eq(rk_redis_secret_load(NULL, "short-secret", buf, &n), RK_ERR_INVALID);
    cr_assert_null(strstr(rk_error_message(), "short-secret"), "%s", rk_error_message());
    char *path = rk_test_write_tmp("redis-secret", "secret", "a file secret of 28 bytes!!\n");
    cr_assert_eq(rk_redis_secret_load(path, "the environment's secret", buf, &n), RK_OK);
    cr_assert_eq(n, 27, "the file wins and its newline is dropped");
    cr_assert_eq(memcmp(buf, "a file secret of 28 bytes!!", 27), 0);
    cr_assert_eq(rk_redis_secret_load(NULL, "the environment's secret", buf, &n), RK_OK);
    cr_assert_eq(n, strlen("the environment's secret"));
    cr_assert_eq(rk_redis_secret_load("/nonexistent/secret", NULL, buf, &n), RK_ERR_IO);
    free(path);
}

/* A body check that refuses any body holding the byte 0xee. */
static int no_ee(const rk_store_layout *layout, const void *body, size_t n, char *why, size_t cap) {
    (void)layout;
    if (!memchr(body, 0xee, n)) return 0;
    snprintf(why, cap, "holds 0xee");
    return 1;
}

Test(redis, a_value_failing_the_body_check_is_deleted_and_counted) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis_config cfg;
    rk_redis_config_default(&cfg);
    cfg.min_tokens = 1;
    cfg.body_check = no_ee;
    rk_redis *a = open_tier(&s, FP_A, &cfg);
    chunk c;
    chunk_make(&c, 90);
    for (size_t i = 0; i < sizeof c.body; i++)
        if (c.body[i] == 0xee) c.body[i] = 0;
    put_and_settle(a, &c);
    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c, &p), RK_OK);
    rk_store_payload_free(&p);
    c.body[100] = 0xee;
    put_and_settle(a, &c); /* overwrites the value, its checksums sound */
    cr_assert_eq(get_chunk(a, &c, &p), RK_ERR_NOT_FOUND);
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.dropped_corrupt, 1);
    redisContext *rc = raw(&s);
    cr_assert_eq(key_exists(rc, FP_A, &c, ""), 0);
    redisFree(rc);
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, a_value_larger_than_its_chunk_is_refused_unread) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL);
    chunk c, d;
    chunk_make(&c, 80);
    chunk_make(&d, 81);
    put_and_settle(a, &c);
    put_and_settle(a, &d);
    /* c: its real value with 4 MiB appended, the marker made to agree. */
    redisContext *rc = raw(&s);
    char k[200], meta[200];
    snprintf(k, sizeof k, "ragkv:%s:%s", FP_A, c.key);
    redisReply *rep = redisCommand(rc, "GET %s", k);
    cr_assert(rep && rep->type == REDIS_REPLY_STRING);
    size_t big = rep->len + ((size_t)4 << 20);
    char *v = calloc(1, big);
    cr_assert_not_null(v);
    memcpy(v, rep->str, rep->len);
    freeReplyObject(rep);
    rep = redisCommand(rc, "SET %s %b", k, v, big);
    freeReplyObject(rep);
    free(v);
    rep = redisCommand(rc, "GET %s:meta", k);
    cr_assert(rep && rep->type == REDIS_REPLY_STRING);
    int ver, nt;
    unsigned long long nb;
    char sum[40];
    double created;
    cr_assert_eq(sscanf(rep->str, "%d %d %llu %32s %lf", &ver, &nt, &nb, sum, &created), 5);
    freeReplyObject(rep);
    snprintf(meta, sizeof meta, "%d %d %zu %s %.3f", ver, nt, big, sum, created);
    rep = redisCommand(rc, "SET %s:meta %s", k, meta);
    freeReplyObject(rep);

    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c, &p), RK_ERR_NOT_FOUND);
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.size_refused, 1);
    cr_assert_eq(ct.dropped_corrupt, 1);
    cr_assert_lt(ct.bytes_in, 1u << 20, "%llu bytes were read", (unsigned long long)ct.bytes_in);
    cr_assert_eq(key_exists(rc, FP_A, &c, ""), 0, "the planted value is deleted");

    /* d, read by a tier of another layout (larger KV expected, same value):
     * a sound value of another layout is a miss and kept. */
    rk_store_layout other = d.layout;
    other.dtype = 1;
    cr_assert_eq(rk_redis_get(a, d.key, d.tokens, d.n_tokens, &other, 64, &p), RK_ERR_NOT_FOUND);
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.layout_mismatch, 1);
    cr_assert_eq(ct.dropped_corrupt, 1);
    cr_assert_eq(key_exists(rc, FP_A, &d, ""), 1, "another layout's value is kept");
    cr_assert_eq(get_chunk(a, &d, &p), RK_OK);
    rk_store_payload_free(&p);
    redisFree(rc);
    rk_redis_close(a);
    rk_test_redis_free(&s);
}

Test(redis, the_first_write_and_read_after_a_restart_reconnect_instead_of_failing) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_redis *a = open_tier(&s, FP_A, NULL);
    chunk c, d;
    chunk_make(&c, 84);
    chunk_make(&d, 85);
    put_and_settle(a, &c); /* both connections are open now */
    rk_store_payload p;
    cr_assert_eq(get_chunk(a, &c, &p), RK_OK);
    rk_store_payload_free(&p);
    rk_test_redis_stop(&s);
    rk_test_redis_start(&s); /* same port, empty */
    put_and_settle(a, &d);
    rk_redis_counters ct;
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.writes, 2, "the first write after the restart was dropped");
    cr_assert_eq(ct.write_drops, 0);
    cr_assert_eq(get_chunk(a, &d, &p), RK_OK, "the first read after the restart missed");
    expect_same(&p, &d);
    rk_store_payload_free(&p);
    rk_redis_stats(a, &ct);
    cr_assert_eq(ct.errors, 0);
    rk_redis_close(a);
    rk_test_redis_free(&s);
}
