/* tests/test_redis_service.c — the shared Redis tier wired into the service:
 * two in-process services on one redis-server (different arenas) share
 * chunks, a corrupted value is recomputed, a dead or stalled Redis never
 * holds a request up, sharing resumes after a restart, a refused password
 * stops start-up, a fleet computes a chunk once, and an abandoned compute
 * lock (a dead holder's, a replica killed with SIGKILL) is waited out. Trust:
 * with a secret a forged value is recomputed to the oracle's answer and never
 * reaches the disk store (in-process and through three real servers), NaN KV
 * from Redis is dropped and NaN KV in the arena fails the request, a logprob
 * JSON cannot hold is null, the secret is never printed or logged and the
 * server without one warns once.
 *
 * Every test starts its own redis-server on a free loopback port in a scratch
 * directory and stops it; the tests skip visibly without redis-server. The
 * services run the embedded tiny model. */
#include <criterion/criterion.h>
#include <hiredis/hiredis.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chunkcache/chunk_index.h"
#include "gateway/report.h"
#include "gateway/api.h"
#include "pipeline/loader.h"
#include "pipeline/pipeline.h"
#include "store/payload.h"
#include "tests/testutil.h"

static rk_service *open_svc(const rk_test_redis *s, const char *password, int wait_ms) {
    rk_config cfg = rk_test_config(1, 16, NULL);
    cfg.redis_min_tokens = 1;
    cfg.redis_timeout_ms = 100;
    cfg.redis_wait_ms = wait_ms;
    if (password)
        snprintf(cfg.redis_url, sizeof cfg.redis_url, "redis://:%s@127.0.0.1:%d", password,
                 s->port);
    else
        snprintf(cfg.redis_url, sizeof cfg.redis_url, "redis://127.0.0.1:%d", s->port);
    return rk_test_service_open(&cfg, NULL);
}

/* The configuration of a replica without the tier: one thread, 16 MiB of KV. */
static rk_config plain_config(void) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = 1;
    cfg.kv_memory_mb = 16;
    return cfg;
}

static rk_service *open_plain(void) {
    rk_config cfg = plain_config();
    rk_service *svc = NULL;
    cr_assert_eq(rk_service_open(&cfg, NULL, &svc), RK_OK, "%s", rk_error_message());
    return svc;
}

/* A holder that died while computing chunk key (hex) for svc's model: its
 * lock, left with ttl_ms to live. The caller frees the connection. */
static redisContext *hold_dead_lock(const rk_test_redis *s, rk_service *svc, const char *key,
                                    int ttl_ms) {
    char lock[160];
    snprintf(lock, sizeof lock, "ragkv:%s:%s:lock", rk_model_fingerprint(svc->model), key);
    redisContext *c = redisConnect("127.0.0.1", s->port);
    cr_assert(c && !c->err);
    redisReply *rep = redisCommand(c, "SET %s dead-holder NX PX %d", lock, ttl_ms);
    cr_assert(rep && rep->type == REDIS_REPLY_STATUS);
    freeReplyObject(rep);
    return c;
}

/* A greedy request over "system##chunks...##question", prepared on svc. */
static rk_request *make_req(rk_service *svc, const char *prompt, int max_tokens) {
    rk_split sp;
    cr_assert_eq(rk_split_prompt(prompt, strlen(prompt), NULL, 64, &sp), RK_OK);
    rk_request *r = calloc(1, sizeof *r);
    cr_assert_not_null(r);
    rk_req_options_default(&r->opt);
    r->opt.max_tokens = max_tokens;
    r->opt.sampling.temperature = 0;
    r->opt.stop_at_eog = 0;
    cr_assert_eq(rk_request_prepare(svc, &sp, r), RK_OK, "%s", rk_error_message());
    rk_split_free(&sp);
    return r;
}

static rk_request *run(rk_service *svc, const char *prompt) {
    rk_request *r = make_req(svc, prompt, 8);
    cr_assert_eq(rk_pipeline_run(svc, &r, 1, NULL), RK_OK, "%s", rk_error_message());
    return r;
}

static void req_free(rk_request *r) {
    rk_request_free(r);
    free(r);
}

/* Wait until the writer has committed what was queued. */
static void drain(rk_service *svc) {
    int idle = 0;
    cr_assert_eq(rk_redis_wait_idle(svc->redis, 5000, &idle), RK_OK);
    cr_assert(idle, "the Redis writer did not drain in 5 s");
}

static uint64_t computes(rk_service *svc) {
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    return cs.computes;
}

static const char *PROMPT =
    "You answer from the documents.##Lily found a shiny key under the old oak tree by the "
    "river, where the water ran cold and clear over the stones.##The key opened a small "
    "wooden box full of letters her grandmother had written long ago.##What was in the box?";

Test(redis_service, two_services_share_chunks_with_identical_results) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 300), *b = open_svc(&s, NULL, 300);
    rk_request *ra = run(a, PROMPT);
    cr_assert_eq(ra->n_chunks, 2);
    for (int k = 0; k < 2; k++) cr_assert_eq(ra->chunk_reports[k].source, RK_CHUNK_SOURCE_COMPUTED);
    drain(a);
    rk_request *rb = run(b, PROMPT);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(rb->chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
        cr_assert_eq(rb->chunk_reports[k].source, RK_CHUNK_SOURCE_REDIS, "chunk %d", k);
    }
    cr_assert_eq(computes(b), 0, "B computed nothing");
    cr_assert_eq(rb->n_out, ra->n_out);
    cr_assert_eq(memcmp(ra->out_tokens, rb->out_tokens, (size_t)ra->n_out * sizeof(int32_t)), 0,
                 "B's greedy tokens differ from A's");
    rk_redis_counters cb;
    rk_redis_stats(b->redis, &cb);
    cr_assert_eq(cb.hits, 2);
    cr_assert_gt(cb.bytes_in, 0);
    /* The next lookup on B hits its own arena (with the radix tree kept to
     * system prompts: the whole repeat would otherwise be a prefix hit). */
    rk_request *rb2 = make_req(b, PROMPT, 8);
    rb2->opt.reuse_sequences = 0;
    cr_assert_eq(rk_pipeline_run(b, &rb2, 1, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rb2->chunk_reports[0].source, RK_CHUNK_SOURCE_ARENA);
    req_free(ra);
    req_free(rb);
    req_free(rb2);
    rk_service_close(a);
    rk_service_close(b);
    rk_test_redis_free(&s);
}

/* The cache-control calls reach the shared tier without HTTP: a listing
 * with the model's entries (offset and limit applied), refused to a tenant's
 * viewer, then a flush that empties it. */
Test(redis_service, the_service_lists_and_flushes_the_shared_tier) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 300);
    req_free(run(a, PROMPT));
    drain(a);
    rk_cache_viewer all = {.all = 1}, tenant = {.owner = 1};
    rk_chunk_listing l;
    cr_assert_eq(rk_service_redis_list(a, &all, 0, 10, &l), RK_OK, "%s", rk_error_message());
    cr_assert_eq(l.n, 2);
    cr_assert_eq(l.total, 2);
    for (int i = 0; i < l.n; i++) {
        cr_assert_str_eq(l.v[i].tier, "redis");
        cr_assert_eq(strlen(l.v[i].key), 32);
        cr_assert_gt(l.v[i].tokens, 0);
        cr_assert_gt(l.v[i].bytes, 0);
    }
    rk_chunk_listing_free(&l);
    cr_assert_eq(rk_service_redis_list(a, &all, 1, 10, &l), RK_OK);
    cr_assert_eq(l.n, 1);
    rk_chunk_listing_free(&l);
    cr_assert_eq(rk_service_redis_list(a, &tenant, 0, 10, &l), RK_ERR_INVALID);
    uint64_t removed = 0;
    cr_assert_eq(rk_service_redis_flush(a, &removed), RK_OK, "%s", rk_error_message());
    cr_assert_eq(removed, 2);
    cr_assert_eq(rk_service_redis_list(a, &all, 0, 10, &l), RK_OK);
    cr_assert_eq(l.n, 0);
    rk_chunk_listing_free(&l);
    rk_service_close(a);
    rk_test_redis_free(&s);
}

Test(redis_service, a_corrupted_value_is_recomputed_and_counted) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 300), *b = open_svc(&s, NULL, 300);
    rk_request *ra = run(a, PROMPT);
    drain(a);
    /* Flip one byte of the first chunk's KV, past the 512-byte header. */
    char key[160];
    snprintf(key, sizeof key, "ragkv:%s:%s", rk_model_fingerprint(a->model),
             ra->chunk_reports[0].key);
    redisContext *c = redisConnect("127.0.0.1", s.port);
    cr_assert(c && !c->err);
    redisReply *rep = redisCommand(c, "SETRANGE %s 4000 %b", key, "\x5a", (size_t)1);
    cr_assert(rep && rep->type == REDIS_REPLY_INTEGER, "no value at %s", key);
    freeReplyObject(rep);
    rk_request *rb = run(b, PROMPT);
    cr_assert_eq(rb->chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED, "the bad value was used");
    cr_assert_eq(rb->chunk_reports[1].source, RK_CHUNK_SOURCE_REDIS);
    cr_assert_eq(computes(b), 1);
    rk_redis_counters cb;
    rk_redis_stats(b->redis, &cb);
    cr_assert_eq(cb.dropped_corrupt, 1);
    cr_assert_eq(memcmp(ra->out_tokens, rb->out_tokens, (size_t)ra->n_out * sizeof(int32_t)), 0);
    /* B wrote its recomputed chunk back: a third replica loads both. */
    drain(b);
    rk_service *d = open_svc(&s, NULL, 300);
    rk_request *rd = run(d, PROMPT);
    for (int k = 0; k < 2; k++) cr_assert_eq(rd->chunk_reports[k].source, RK_CHUNK_SOURCE_REDIS);
    redisFree(c);
    req_free(ra);
    req_free(rb);
    req_free(rd);
    rk_service_close(a);
    rk_service_close(b);
    rk_service_close(d);
    rk_test_redis_free(&s);
}

/* A prompt whose chunks no earlier request had. */
static void fresh_prompt(char *buf, size_t n, int i) {
    snprintf(buf, n,
             "Answer briefly.##Note %d: the ferry to the island leaves at %d and returns before "
             "the tide turns in the late afternoon.##Item %d of the list is the blue lantern "
             "that hangs by the door.##When does it leave?",
             i, 7 + i % 5, i * 13);
}

Test(redis_service, a_stalled_then_killed_redis_never_holds_requests_up) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 300);
    char prompt[512];
    for (int i = 0; i < 12; i++) {
        if (i == 4) kill(s.pid, SIGSTOP); /* answers nothing: every call times out */
        if (i == 8) rk_test_redis_stop(&s);
        fresh_prompt(prompt, sizeof prompt, i);
        double t0 = rk_time_now();
        rk_request *r = run(a, prompt);
        double dt = rk_time_now() - t0;
        cr_assert_eq(r->n_out, 8, "request %d did not complete", i);
        /* A get, a lock and a second get each end at the 100 ms timeout and
         * the breaker opens after three: far below a TCP time-out or the
         * 30 s lock TTL that a hang would take. */
        cr_assert_lt(dt, 2.0, "request %d took %.2f s", i, dt);
        req_free(r);
    }
    rk_redis_counters c;
    rk_redis_stats(a->redis, &c);
    cr_assert_gt(c.errors, 0);
    cr_assert_gt(c.breaker_opened, 0);
    rk_service_close(a);
    rk_test_redis_free(&s);
}

Test(redis_service, sharing_resumes_after_redis_restarts) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 300), *b = open_svc(&s, NULL, 300);
    rk_test_redis_stop(&s);
    char prompt[512];
    fresh_prompt(prompt, sizeof prompt, 100);
    req_free(run(a, prompt)); /* Redis is down: computed, the write dropped */
    rk_test_redis_start(&s);  /* same port, empty */
    int shared = 0;
    for (int i = 101; i < 200 && !shared; i++) {
        fresh_prompt(prompt, sizeof prompt, i);
        req_free(run(a, prompt));
        drain(a);
        rk_request *r = run(b, prompt);
        shared = r->chunk_reports[0].source == RK_CHUNK_SOURCE_REDIS;
        req_free(r);
        if (!shared) usleep(100 * 1000); /* the breakers' back-off */
    }
    cr_assert(shared, "sharing did not resume after the restart");
    rk_service_close(a);
    rk_service_close(b);
    rk_test_redis_free(&s);
}

/* A pause of redis-server (SIGSTOP, then SIGCONT): every chunk computed
 * while it slept or right after it woke reaches Redis once it is back, and a
 * second replica loads them all from there. */
Test(redis_service, chunks_computed_during_and_after_a_pause_reach_redis) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 300);
    char prompt[512];
    fresh_prompt(prompt, sizeof prompt, 300);
    req_free(run(a, prompt));
    drain(a);
    kill(s.pid, SIGSTOP);
    enum { FIRST = 301, DURING = 4, AFTER = 4 };
    for (int i = FIRST; i < FIRST + DURING; i++) {
        fresh_prompt(prompt, sizeof prompt, i);
        req_free(run(a, prompt));
    }
    rk_redis_counters c;
    rk_redis_stats(a->redis, &c);
    cr_assert_eq(c.breaker, RK_REDIS_OPEN, "the pause did not open the breaker");
    kill(s.pid, SIGCONT);
    for (int i = FIRST + DURING; i < FIRST + DURING + AFTER; i++) {
        fresh_prompt(prompt, sizeof prompt, i);
        req_free(run(a, prompt));
    }
    int idle = 0; /* the bound is against a hang only */
    cr_assert_eq(rk_redis_wait_idle(a->redis, 60000, &idle), RK_OK);
    cr_assert(idle, "the writes queued during the pause never landed");
    rk_redis_stats(a->redis, &c);
    cr_assert_eq(c.write_drops, 0);
    rk_service *b = open_svc(&s, NULL, 300);
    for (int i = FIRST; i < FIRST + DURING + AFTER; i++) {
        fresh_prompt(prompt, sizeof prompt, i);
        rk_request *r = run(b, prompt);
        cr_assert_eq(r->n_chunks, 2);
        for (int k = 0; k < 2; k++)
            cr_assert_eq(r->chunk_reports[k].source, RK_CHUNK_SOURCE_REDIS,
                         "prompt %d chunk %d was not shared", i, k);
        req_free(r);
    }
    cr_assert_eq(computes(b), 0, "B computed nothing");
    rk_service_close(a);
    rk_service_close(b);
    rk_test_redis_free(&s);
}

Test(redis_service, a_wrong_password_stops_start_up) {
    rk_test_redis s = {.password = "right-one"};
    rk_test_redis_start(&s);
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = 16;
    snprintf(cfg.redis_url, sizeof cfg.redis_url, "redis://:wrong@127.0.0.1:%d", s.port);
    rk_service *svc = NULL;
    cr_assert_eq(rk_service_open(&cfg, NULL, &svc), RK_ERR_INVALID);
    cr_assert_null(svc);
    cr_assert(strstr(rk_error_message(), "password"), "message: %s", rk_error_message());
    cr_assert_null(strstr(rk_error_message(), "wrong"), "the password leaked: %s",
                   rk_error_message());
    /* The right password opens. */
    rk_service *ok = open_svc(&s, "right-one", 300);
    rk_service_close(ok);
    /* End to end: the server exits 1 with the message. */
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "timeout 60 %s serve --port 0 --kv-memory-mb 16 --redis redis://:wrong@127.0.0.1:%d "
             "2>&1",
             RK_BIN, s.port);
    int rc = rk_test_run(cmd, &out);
    cr_assert_eq(rc, 1, "exit status %d: %s", rc, out);
    cr_assert(strstr(out, "cannot start") && strstr(out, "password"), "output: %s", out);
    cr_assert_null(strstr(out, "wrong"), "the password leaked: %s", out);
    free(out);
    rk_test_redis_free(&s);
}

typedef struct fleet_job {
    rk_service *svc;
    rk_request *reqs[4];
    rk_status st;
} fleet_job;

static void *fleet_run(void *arg) {
    fleet_job *j = arg;
    j->st = rk_pipeline_run(j->svc, j->reqs, 4, NULL);
    return NULL;
}

Test(redis_service, a_fleet_computes_a_shared_miss_once) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    /* A wait bound well above a compute on a loaded machine: the count below
     * is then exact. */
    fleet_job jobs[2] = {{.svc = open_svc(&s, NULL, 20000)}, {.svc = open_svc(&s, NULL, 20000)}};
    static const char *QS[4] = {"Who found it?", "Where was it?", "What did it open?",
                                "Who wrote the letters?"};
    for (int j = 0; j < 2; j++)
        for (int i = 0; i < 4; i++) {
            char prompt[512];
            snprintf(prompt, sizeof prompt,
                     "You answer from the documents.##The lighthouse keeper kept a log of every "
                     "ship that passed the reef during the long winter storms.##%s",
                     QS[i]);
            jobs[j].reqs[i] = make_req(jobs[j].svc, prompt, 2);
        }
    pthread_t t[2];
    for (int j = 0; j < 2; j++) cr_assert_eq(pthread_create(&t[j], NULL, fleet_run, &jobs[j]), 0);
    for (int j = 0; j < 2; j++) pthread_join(t[j], NULL);
    uint64_t total = 0;
    int from_redis = 0;
    for (int j = 0; j < 2; j++) {
        cr_assert_eq(jobs[j].st, RK_OK);
        total += computes(jobs[j].svc);
        for (int i = 0; i < 4; i++)
            from_redis += jobs[j].reqs[i]->chunk_reports[0].source == RK_CHUNK_SOURCE_REDIS;
    }
    cr_assert_eq(total, 1, "the fleet computed the chunk %llu times", (unsigned long long)total);
    cr_assert_geq(from_redis, 1, "the other replica loaded it");
    for (int j = 0; j < 2; j++) {
        for (int i = 0; i < 4; i++) req_free(jobs[j].reqs[i]);
        rk_service_close(jobs[j].svc);
    }
    rk_test_redis_free(&s);
}

Test(redis_service, an_abandoned_lock_is_waited_out_then_computed) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 10000);
    /* The key of the first chunk: from a run on a replica without the tier. */
    rk_service *plain = open_plain();
    rk_request *ref = run(plain, PROMPT);
    /* The lock is set after t0, so it lives until t0 + 0.8 s at the earliest,
     * however loaded the machine: a request that waits it out ends later. */
    double t0 = rk_time_now();
    redisContext *c = hold_dead_lock(&s, a, ref->chunk_reports[0].key, 800);
    rk_request *r = run(a, PROMPT);
    double dt = rk_time_now() - t0;
    cr_assert_eq(r->chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED);
    cr_assert_geq(dt, 0.79, "it did not wait for the lock (%.2f s)", dt);
    cr_assert_lt(dt, 9.0, "it waited for the whole bound, not the lock (%.2f s)", dt);
    cr_assert_eq(memcmp(ref->out_tokens, r->out_tokens, 8 * sizeof(int32_t)), 0);
    redisFree(c);
    req_free(ref);
    req_free(r);
    rk_service_close(plain);
    rk_service_close(a);
    rk_test_redis_free(&s);
}

/* With a step budget, Redis lookups run on the loader thread, each on its
 * own connection: a chunk another replica shared arrives while a stream
 * decodes beside it (a hit, the same tokens), and a chunk whose compute lock
 * a dead replica holds is waited for there, parked with its deadline, while
 * the stream keeps stepping, then computed to the reference tokens. */
Test(redis_service, lookups_and_lock_waits_run_off_the_engine_thread) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 300);
    rk_request *ra = run(a, PROMPT);
    drain(a);
    rk_service *plain = open_plain();
    char fresh[512];
    fresh_prompt(fresh, sizeof fresh, 901);
    rk_request *ref = run(plain, fresh);

    rk_config cfg = plain_config();
    cfg.redis_min_tokens = 1;
    cfg.redis_timeout_ms = 1000;
    cfg.redis_wait_ms = 10000;
    cfg.step_tokens = 3;
    snprintf(cfg.redis_url, sizeof cfg.redis_url, "redis://127.0.0.1:%d", s.port);
    rk_service *b;
    cr_assert_eq(rk_service_open(&cfg, NULL, &b), RK_OK, "%s", rk_error_message());
    rk_pipeline *p;
    cr_assert_eq(rk_pipeline_create(b, &p), RK_OK);
    rk_request *stream = make_req(b, "Tell a story.##Tom had a red ball.##Go on.", 3000);
    cr_assert_eq(rk_pipeline_admit(p, &stream, 1, NULL), RK_OK, "%s", rk_error_message());

    /* Shared by a: both chunks come from Redis through the loader. */
    rk_request *r = make_req(b, PROMPT, 8);
    uint64_t computed = computes(b);
    cr_assert_eq(rk_pipeline_join(p, &r, 1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_loader_pending(b->loader), 2, "the two lookups were queued");
    for (int i = 0; i < 10000 && !r->finished; i++)
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(r->chunk_reports[k].status, RK_CHUNK_STATUS_HIT, "chunk %d", k);
        cr_assert_eq(r->chunk_reports[k].source, RK_CHUNK_SOURCE_REDIS, "chunk %d", k);
    }
    cr_assert_eq(computes(b), computed, "nothing was computed");
    cr_assert_eq(memcmp(ra->out_tokens, r->out_tokens, 8 * sizeof(int32_t)), 0);

    /* A dead holder's lock on the first chunk, 1.5 s to live from after t0. */
    rk_request *w = make_req(b, fresh, 8);
    double t0 = rk_time_now();
    redisContext *c = hold_dead_lock(&s, b, ref->chunk_reports[0].key, 1500);
    /* The cost gate weighs the measured Redis bandwidth against the measured
     * prefill rate; both are noisy on a loaded machine, and a gate that says
     * "compute" asks nobody's lock. With no prefill rate known it asks Redis,
     * which is the path under test. */
    b->prefill_tps = 0;
    cr_assert_eq(rk_pipeline_join(p, &w, 1), RK_OK, "%s", rk_error_message());
    cr_assert_gt(rk_loader_pending(b->loader), 0, "joining returned with the lookup queued");
    int before = stream->n_out;
    while (rk_loader_pending(b->loader) > 0) {
        cr_assert_lt(rk_time_now() - t0, 30, "the lookups did not end");
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
    }
    cr_assert_geq(rk_time_now() - t0, 1.49, "the lookup did not wait for the lock");
    cr_assert_geq(stream->n_out - before, 2, "the stream decoded %d tokens during the wait",
                  stream->n_out - before);
    for (int i = 0; i < 10000 && !w->finished; i++)
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(w->chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED);
    cr_assert_eq(memcmp(ref->out_tokens, w->out_tokens, 8 * sizeof(int32_t)), 0,
                 "the chunk computed after the wait gives the reference tokens");
    stream->cancel = 1;
    for (int i = 0; i < 100 && rk_pipeline_n_running(p) > 0; i++)
        cr_assert_eq(rk_pipeline_step(p, NULL), RK_OK);
    rk_pipeline_free(p);
    redisFree(c);
    req_free(stream);
    req_free(r);
    req_free(w);
    req_free(ra);
    req_free(ref);
    rk_service_close(b);
    rk_service_close(plain);
    rk_service_close(a);
    rk_test_redis_free(&s);
}

/* A replica killed with SIGKILL while it holds a compute lock: the lock is
 * taken through the tier's own client in a separate process, which is then
 * killed before it can release or fill it. The surviving replica waits out
 * the lock's TTL, computes the chunk itself and gets the reference tokens. */
Test(redis_service, sigkill_of_the_lock_holder_lets_the_others_compute_after_it_expires) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *plain = open_plain();
    rk_request *ref = run(plain, PROMPT);
    const char *key = ref->chunk_reports[0].key;
    char fp[128];
    snprintf(fp, sizeof fp, "%s", rk_model_fingerprint(plain->model));

    int sync[2];
    cr_assert_eq(pipe(sync), 0);
    pid_t holder = fork();
    cr_assert_geq(holder, 0);
    if (holder == 0) { /* the replica that dies: no Criterion calls from here on */
        close(sync[0]);
        char url[64];
        snprintf(url, sizeof url, "redis://127.0.0.1:%d", s.port);
        rk_redis_config rc;
        rk_redis_config_default(&rc);
        rc.url = url;
        rc.lock_ttl_ms = 1500;
        rk_redis *r;
        rk_redis_lock lk;
        rk_redis_lock_state ls;
        if (rk_redis_open(&rc, fp, &r) || rk_redis_try_lock(r, key, &lk, &ls) ||
            ls != RK_REDIS_LOCK_ACQUIRED)
            _exit(1);
        char one = 1;
        if (write(sync[1], &one, 1) != 1) _exit(1);
        for (;;) pause(); /* "computing" until killed */
    }
    close(sync[1]);
    char got = 0;
    cr_assert_eq(read(sync[0], &got, 1), 1, "the holder did not take the lock");
    close(sync[0]);
    double t_lock = rk_time_now();
    cr_assert_eq(kill(holder, SIGKILL), 0);
    int wst = 0;
    cr_assert_eq(waitpid(holder, &wst, 0), holder);
    cr_assert(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL);

    rk_service *b = open_svc(&s, NULL, 10000);
    rk_request *r = run(b, PROMPT);
    double dt = rk_time_now() - t_lock;
    cr_assert_eq(r->chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED);
    cr_assert_geq(dt, 1.2, "it did not wait for the dead holder's lock (%.2f s)", dt);
    cr_assert_lt(dt, 9.0, "it waited for the whole bound, not the lock (%.2f s)", dt);
    cr_assert_eq(memcmp(ref->out_tokens, r->out_tokens, 8 * sizeof(int32_t)), 0);
    /* What it computed reaches the fleet. */
    drain(b);
    rk_redis_counters c;
    rk_redis_stats(b->redis, &c);
    cr_assert_geq(c.writes, 1);
    req_free(ref);
    req_free(r);
    rk_service_close(b);
    rk_service_close(plain);
    rk_test_redis_free(&s);
}

/* ---------------------------------------------------------------- the server */

/* Run curl against the server; the reply's body as JSON (asserts it is) or,
 * with text set, its raw text in *text. */
static json_t *curl(int port, const char *method, const char *path, const char *body, char **text) {
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "curl -s -m 30 -X %s -H 'Content-Type: application/json' %s%s%s "
             "http://127.0.0.1:%d%s",
             method, body ? "--data '" : "", body ? body : "", body ? "'" : "", port, path);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "curl failed: %s", cmd);
    if (text) {
        *text = out;
        return NULL;
    }
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "%s %s: not JSON: %s", method, path, out);
    free(out);
    return j;
}

static long long jint(json_t *j, const char *a, const char *b) {
    json_t *v = json_object_get(j, a);
    if (b) v = json_object_get(v, b);
    cr_assert(json_is_integer(v), "no integer %s.%s", a, b ? b : "");
    return (long long)json_integer_value(v);
}

Test(redis_service, the_server_prewarms_lists_reports_and_flushes_the_tier) {
    char *where = NULL;
    int no_curl = rk_test_run("command -v curl", &where) != 0 || !where || !where[0];
    free(where);
    if (no_curl) cr_skip_test("curl is not installed");
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", s.port);
    rk_test_server srv = {0};
    const char *args[] = {"--kv-memory-mb", "16", "--redis", url, "--redis-min-tokens", "1", NULL};
    cr_assert_eq(rk_test_server_start_ready(&srv, "redis-serve", NULL, args), 0,
                 "the server did not start; see %s", srv.log);
    int port = srv.port;
    json_t *j = curl(port, "GET", "/v1/stats", NULL, NULL);
    cr_assert(json_is_true(json_object_get(json_object_get(j, "redis"), "configured")));
    json_decref(j);
    j = curl(port, "POST", "/v1/chunks",
             "{\"chunks\": [\"The harbour master rang the bell at noon.\", \"Gulls followed "
             "the fishing boats home.\"]}",
             NULL);
    cr_assert_eq(jint(j, "computed", NULL), 2);
    json_decref(j);
    long long total = 0;
    for (int i = 0; i < 250 && total < 2; i++) { /* the writes are asynchronous */
        j = curl(port, "GET", "/v1/chunks?tier=redis", NULL, NULL);
        total = jint(j, "total", NULL);
        if (total == 2) {
            json_t *e = json_array_get(json_object_get(j, "data"), 0);
            cr_assert_str_eq(json_string_value(json_object_get(e, "tier")), "redis");
            cr_assert_gt(json_integer_value(json_object_get(e, "tokens")), 0);
        }
        json_decref(j);
        if (total < 2) usleep(20 * 1000);
    }
    cr_assert_eq(total, 2, "the tier did not list both chunks");
    char *m;
    curl(port, "GET", "/metrics", NULL, &m);
    cr_assert(strstr(m, "ragkv_redis_writes_total 2"), "%s", m);
    cr_assert(strstr(m, "ragkv_redis_auth_failures_total 0"), "%s", m);
    cr_assert(strstr(m, "ragkv_nonfinite_logits_total 0"), "%s", m);
    cr_assert(strstr(m, "ragkv_redis_bytes_total{direction=\"out\"}"), "%s", m);
    cr_assert(strstr(m, "ragkv_redis_latency_seconds_count"), "%s", m);
    if (rk_test_run("command -v promtool >/dev/null", NULL) == 0) {
        char *path = rk_test_write_tmp("redis-promtool", "metrics.txt", m), check[4200];
        snprintf(check, sizeof check, "promtool check metrics < %s 2>&1", path);
        char *lint = NULL;
        cr_assert_eq(rk_test_run(check, &lint), 0, "promtool: %s", lint);
        free(lint);
        free(path);
    }
    free(m);
    j = curl(port, "POST", "/v1/cache/flush", "{\"redis\": true}", NULL);
    cr_assert_eq(jint(j, "flushed", "redis_keys"), 2);
    json_decref(j);
    j = curl(port, "GET", "/v1/chunks?tier=redis", NULL, NULL);
    cr_assert_eq(jint(j, "total", NULL), 0);
    json_decref(j);
    j = curl(port, "GET", "/v1/stats", NULL, NULL);
    cr_assert_eq(jint(j, "redis", "auth_failures"), 0);
    cr_assert_eq(jint(j, "requests", "nonfinite_logits"), 0);
    json_decref(j);
    int status = rk_test_server_stop(&srv);
    cr_assert_eq(status, 0, "server exit status %d", status);
    /* Without a secret the server said once that Redis must be trusted. */
    char *text = rk_test_read_file(srv.log, NULL);
    cr_assert_not_null(text);
    int warnings = 0;
    for (const char *p = text; (p = strstr(p, "no shared-tier secret")); p++) warnings++;
    cr_assert_eq(warnings, 1, "%d trust warnings in:\n%s", warnings, text);
    free(text);
    rk_test_redis_free(&s);
}

Test(redis_service, print_config_shows_whether_a_secret_is_set_never_the_secret) {
    char *path = rk_test_write_tmp("redis-secret-file", "secret", "file secret 0123456789abcdef\n");
    char cmd[4400], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "RAGKV_REDIS_SECRET='env secret 0123456789abcdef' %s serve --print-config "
             "--redis-secret-file %s",
             RK_BIN, path);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", cmd);
    cr_assert_null(strstr(out, "0123456789abcdef"), "a secret was printed: %s", out);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "%s", out);
    cr_assert_str_eq(json_string_value(json_object_get(j, "redis_secret")), "<set>");
    cr_assert_str_eq(json_string_value(json_object_get(j, "redis_secret_file")), path);
    json_decref(j);
    free(out);
    free(path);
}

Test(redis_service, offline_prewarm_shares_chunks_with_the_fleet) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    static const char *CHUNK =
        "The lighthouse keeper wrote down every ship that passed the reef, its name, its flag, "
        "the hour it rounded the point and the weather, through the whole of the long winter.";
    char line[512];
    snprintf(line, sizeof line, "{\"id\": \"log\", \"text\": \"%s\"}\n", CHUNK);
    char *input = rk_test_write_tmp("redis-prewarm", "in.jsonl", line);
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "%s prewarm --input %s --kv-memory-mb 16 --redis redis://127.0.0.1:%d 2>&1", RK_BIN,
             input, s.port);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "1 computed"), "%s", out);
    free(out);
    rk_service *a = open_svc(&s, NULL, 300);
    char prompt[512];
    snprintf(prompt, sizeof prompt, "Answer briefly.##%s##Who kept the log?", CHUNK);
    rk_request *r = run(a, prompt);
    cr_assert_eq(r->chunk_reports[0].source, RK_CHUNK_SOURCE_REDIS);
    cr_assert_eq(computes(a), 0);
    req_free(r);
    rk_service_close(a);
    free(input);
    rk_test_redis_free(&s);
}

Test(redis_service, an_admission_waits_for_other_replicas_once_not_per_chunk) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_svc(&s, NULL, 600);
    rk_service *plain = open_plain();
    double tc = rk_time_now();
    rk_request *ref = run(plain, PROMPT);
    tc = rk_time_now() - tc; /* computing both chunks, as a below will */
    /* Both chunks locked by replicas that will not finish in time. */
    redisContext *c = redisConnect("127.0.0.1", s.port);
    cr_assert(c && !c->err);
    for (int k = 0; k < 2; k++) {
        char lock[160];
        snprintf(lock, sizeof lock, "ragkv:%s:%s:lock", rk_model_fingerprint(a->model),
                 ref->chunk_reports[k].key);
        redisReply *rep = redisCommand(c, "SET %s slow-holder NX PX 20000", lock);
        cr_assert(rep && rep->type == REDIS_REPLY_STATUS);
        freeReplyObject(rep);
    }
    double t0 = rk_time_now();
    rk_request *r = run(a, PROMPT);
    double dt = rk_time_now() - t0;
    for (int k = 0; k < 2; k++) cr_assert_eq(r->chunk_reports[k].source, RK_CHUNK_SOURCE_COMPUTED);
    cr_assert_geq(dt, 0.55, "it did not wait for the holders (%.2f s)", dt);
    /* One 600 ms bound for the admission; a bound per chunk would be 1.2 s.
     * The computing after the waits is taken off (it is slow in the
     * sanitizer build on a busy machine). */
    cr_assert_lt(dt - tc, 1.0, "the waits added up to %.2f s (%.2f s in all, %.2f s computing)",
                 dt - tc, dt, tc);
    cr_assert_eq(memcmp(ref->out_tokens, r->out_tokens, 8 * sizeof(int32_t)), 0);
    redisFree(c);
    req_free(ref);
    req_free(r);
    rk_service_close(plain);
    rk_service_close(a);
    rk_test_redis_free(&s);
}

/* ---------------------------------------------------------------- trust */

static const char SECRET[] = "a fleet secret of more than sixteen bytes";

/* A service on s with the given secret (NULL: none) and disk store (NULL:
 * none); s NULL: no Redis tier. */
static rk_service *open_tiers(const rk_test_redis *s, const char *secret, const char *store) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = 1;
    cfg.kv_memory_mb = 16;
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "f32"); /* what the forgeries rewrite */
    cfg.redis_min_tokens = 1;
    cfg.redis_timeout_ms = 100;
    if (s) snprintf(cfg.redis_url, sizeof cfg.redis_url, "redis://127.0.0.1:%d", s->port);
    if (secret) snprintf(cfg.redis_secret, sizeof cfg.redis_secret, "%s", secret);
    if (store) snprintf(cfg.store_dir, sizeof cfg.store_dir, "%s", store);
    rk_service *svc = NULL;
    cr_assert_eq(rk_service_open(&cfg, NULL, &svc), RK_OK, "%s", rk_error_message());
    return svc;
}

typedef enum forgery { NEGATE, ONE_NAN } forgery;

/* Rewrite the f32 KV of chunk key's value as someone with write access to
 * Redis but without the secret can: the KV changed (negated, or one value
 * made NaN), the checksum, header and commit marker recomputed to agree; a
 * tag, when there was one, kept as it was (nobody can recompute it without
 * the secret). */
static void forge_value(const rk_test_redis *s, const char *fp, const char *key, forgery how) {
    redisContext *c = redisConnect("127.0.0.1", s->port);
    cr_assert(c && !c->err);
    redisReply *m = redisCommand(c, "GET ragkv:%s:%s:meta", fp, key);
    redisReply *v = redisCommand(c, "GET ragkv:%s:%s", fp, key);
    cr_assert(m && m->type == REDIS_REPLY_STRING && v && v->type == REDIS_REPLY_STRING);
    int version = m->str[0] - '0';
    size_t tag = version == 2 ? 32 : 0, len = v->len;
    uint8_t *b = malloc(len);
    cr_assert_not_null(b);
    memcpy(b, v->str, len);
    rk_payload_header h;
    cr_assert_eq(rk_payload_header_decode("value", b, len - tag, &h), RK_OK);
    cr_assert_eq(h.layout.dtype, 0, "the test forges f32 KV");
    int32_t *toks = (int32_t *)(void *)(b + RK_STORE_HEADER_BYTES);
    float *kv = (float *)(void *)(b + RK_STORE_HEADER_BYTES + 4 * (size_t)h.n_tokens);
    size_t n = (size_t)h.body_size / 4;
    if (how == NEGATE)
        for (size_t i = 0; i < n; i++) kv[i] = -kv[i];
    else
        kv[n / 3] = NAN;
    rk_payload_checksum(toks, h.n_tokens, kv, (size_t)h.body_size, h.checksum);
    rk_payload_header_encode(&h, b);
    char hex[33], marker[160];
    rk_payload_checksum_hex(h.checksum, hex);
    snprintf(marker, sizeof marker, "%d %u %zu %s 1000000000.000", version, h.n_tokens, len, hex);
    redisReply *r1 = redisCommand(c, "SET ragkv:%s:%s %b", fp, key, b, len);
    redisReply *r2 = redisCommand(c, "SET ragkv:%s:%s:meta %s", fp, key, marker);
    cr_assert(r1 && r2 && r1->type == REDIS_REPLY_STATUS && r2->type == REDIS_REPLY_STATUS);
    freeReplyObject(r1);
    freeReplyObject(r2);
    freeReplyObject(m);
    freeReplyObject(v);
    free(b);
    redisFree(c);
}

static void expect_tokens(const rk_request *a, const rk_request *b) {
    cr_assert_eq(a->n_out, b->n_out);
    cr_assert_eq(memcmp(a->out_tokens, b->out_tokens, (size_t)a->n_out * sizeof(int32_t)), 0,
                 "the answer differs from the oracle's");
}

Test(redis_service, with_a_secret_a_forged_value_is_recomputed_and_never_reaches_the_disk) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_tiers(&s, SECRET, NULL);
    rk_request *oracle = run(a, PROMPT); /* computed alone: the right answer */
    drain(a);
    const char *fp = rk_model_fingerprint(a->model);
    forge_value(&s, fp, oracle->chunk_reports[0].key, NEGATE);
    char *dir = rk_test_tmpdir("redis-forged-store");
    rk_service *b = open_tiers(&s, SECRET, dir);
    rk_request *rb = run(b, PROMPT);
    cr_assert_eq(rb->chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED,
                 "the forged value was used");
    cr_assert_eq(rb->chunk_reports[1].source, RK_CHUNK_SOURCE_REDIS);
    expect_tokens(oracle, rb);
    rk_redis_counters cb;
    rk_redis_stats(b->redis, &cb);
    cr_assert_eq(cb.auth_failures, 1);
    cr_assert_eq(cb.hits, 1);
    rk_service_close(b);
    /* Redis flushed, a restart with the store alone: what B kept is right. */
    redisContext *c = redisConnect("127.0.0.1", s.port);
    cr_assert(c && !c->err);
    freeReplyObject(redisCommand(c, "FLUSHALL"));
    redisFree(c);
    rk_service *d = open_tiers(NULL, NULL, dir);
    rk_request *rd = run(d, PROMPT);
    for (int k = 0; k < 2; k++)
        cr_assert_eq(rd->chunk_reports[k].source, RK_CHUNK_SOURCE_DISK, "chunk %d", k);
    expect_tokens(oracle, rd);
    req_free(oracle);
    req_free(rb);
    req_free(rd);
    rk_service_close(a);
    rk_service_close(d);
    free(dir);
    rk_test_redis_free(&s);
}

Test(redis_service, nan_kv_in_redis_is_dropped_and_the_answer_is_the_oracles) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    rk_service *a = open_tiers(&s, NULL, NULL);
    rk_request *oracle = run(a, PROMPT);
    drain(a);
    forge_value(&s, rk_model_fingerprint(a->model), oracle->chunk_reports[1].key, ONE_NAN);
    char *dir = rk_test_tmpdir("redis-nan-store");
    rk_service *b = open_tiers(&s, NULL, dir);
    rk_request *rb = run(b, PROMPT);
    cr_assert_eq(rb->chunk_reports[0].source, RK_CHUNK_SOURCE_REDIS);
    cr_assert_eq(rb->chunk_reports[1].source, RK_CHUNK_SOURCE_COMPUTED, "the NaN value was used");
    expect_tokens(oracle, rb);
    rk_redis_counters cb;
    rk_redis_stats(b->redis, &cb);
    cr_assert_eq(cb.dropped_corrupt, 1);
    req_free(oracle);
    req_free(rb);
    rk_service_close(a);
    rk_service_close(b);
    free(dir);
    rk_test_redis_free(&s);
}

Test(redis_service, non_finite_kv_in_the_arena_fails_the_request_instead_of_answering_garbage) {
    rk_service *a = open_tiers(NULL, NULL, NULL);
    rk_request *first = run(a, PROMPT);
    /* Poison the cached chunk's keys in the arena, as a bad payload that
     * slipped through or an overflow would. */
    rk_chunk_key k;
    cr_assert_eq(rk_chunk_key_parse(first->chunk_reports[0].key, &k), RK_OK);
    rk_chunk_entry *e = rk_chunk_index_find(a->chunks, k);
    cr_assert_not_null(e);
    const rk_kv_cache *kv = rk_arena_kv(a->arena);
    cr_assert_eq(kv->dtype, RK_DTYPE_F32);
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    for (int l = 0; l < kv->n_layers; l++)
        for (int t = 0; t < e->n_tokens; t++) {
            float *kr = (float *)(void *)kv->k[l] +
                        ((size_t)e->blocks[t / kv->block_size] * kv->block_size +
                         (size_t)(t % kv->block_size)) *
                            row;
            for (size_t i = 0; i < row; i++) kr[i] = NAN;
        }
    rk_request *r = make_req(a, PROMPT, 8);
    r->opt.reuse_sequences = 0;
    rk_status st = rk_pipeline_run(a, &r, 1, NULL);
    cr_assert_eq(st, RK_ERR_INTERNAL, "a request over NaN KV answered (%s)", rk_status_str(st));
    cr_assert(strstr(rk_error_message(), "non-finite logit"), "%s", rk_error_message());
    cr_assert_eq(r->chunk_reports[0].source, RK_CHUNK_SOURCE_ARENA);
    cr_assert_eq(r->failure, RK_ERR_INTERNAL);
    cr_assert_eq(a->nonfinite_logits, 1);
    cr_assert_eq(rk_http_status_of(r->failure), 500, "the server answers it with a 500");
    req_free(first);
    req_free(r);
    rk_service_close(a);
}

Test(redis_service, a_logprob_json_cannot_hold_is_written_as_null_never_dropped) {
    rk_service *a = open_tiers(NULL, NULL, NULL);
    rk_split sp;
    cr_assert_eq(rk_split_prompt(PROMPT, strlen(PROMPT), NULL, 64, &sp), RK_OK);
    rk_request *r = calloc(1, sizeof *r);
    cr_assert_not_null(r);
    rk_req_options_default(&r->opt);
    r->opt.max_tokens = 3;
    r->opt.sampling.temperature = 0;
    r->opt.stop_at_eog = 0;
    r->opt.n_logprobs = 1;
    cr_assert_eq(rk_request_prepare(a, &sp, r), RK_OK, "%s", rk_error_message());
    rk_split_free(&sp);
    cr_assert_eq(rk_pipeline_run(a, &r, 1, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->n_out, 3);
    r->logprobs[1] = -INFINITY; /* a token of probability 0 */
    r->logprobs[2] = NAN;
    r->top_logprobs[2] = NAN;
    json_t *j = rk_report_completion(rk_model_tokenizer(a->model), r, "cmpl-1", 0, "tiny");
    cr_assert_not_null(j);
    json_t *lp = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    json_t *tl = json_object_get(lp, "token_logprobs");
    cr_assert_eq(json_array_size(tl), 3, "a log-probability was dropped");
    cr_assert(json_is_real(json_array_get(tl, 0)));
    cr_assert(json_is_null(json_array_get(tl, 1)));
    cr_assert(json_is_null(json_array_get(tl, 2)));
    json_t *top = json_array_get(json_object_get(lp, "top_logprobs"), 2);
    cr_assert_eq(json_object_size(top), 1);
    const char *k;
    json_t *v;
    json_object_foreach(top, k, v) cr_assert(json_is_null(v), "top logprob %s", k);
    char *text = json_dumps(j, 0);
    cr_assert_not_null(text, "the completion does not serialise");
    free(text);
    json_decref(j);
    req_free(r);
    rk_service_close(a);
}

/* ---------------------------------------------------------------- the server, forged */

/* Start `ragkv serve` with f32 KV (what the forgeries rewrite) and the
 * given extra arguments (NULL terminated, at most 11); wait until it is
 * ready. */
static void serve(rk_test_server *srv, const char *const *args) {
    const char *argv[16] = {"--kv-memory-mb", "16", "--kv-dtype", "f32"};
    int n = 4;
    for (int i = 0; args[i] && n < 15; i++) argv[n++] = args[i];
    argv[n] = NULL;
    *srv = (rk_test_server){0};
    cr_assert_eq(rk_test_server_start_ready(srv, "redis-forged-serve", NULL, argv), 0,
                 "the server did not start; see %s", srv->log);
}

/* Stop the server and check that its log never shows the secret. */
static void stop(rk_test_server *srv) {
    int status = rk_test_server_stop(srv);
    cr_assert_eq(status, 0, "server exit status %d", status);
    char *text = rk_test_read_file(srv->log, NULL);
    cr_assert_not_null(text);
    cr_assert_null(strstr(text, SECRET), "the log shows the secret");
    free(text);
}

static const char *COMPLETION =
    "{\"prompt\": \"You answer from the documents.##Lily found a shiny key under the old oak "
    "tree by the river, where the water ran cold and clear over the stones.##The key opened a "
    "small wooden box full of letters her grandmother had written long ago.##What was in the "
    "box?\", \"max_tokens\": 8, \"temperature\": 0}";

/* POST the completion; its text (malloc'ed) and the chunks' sources. */
static char *complete(int port, char src[2][16], char key[2][33]) {
    json_t *j = curl(port, "POST", "/v1/completions", COMPLETION, NULL);
    json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
    cr_assert(json_is_string(json_object_get(choice, "text")), "no completion");
    char *text = rk_strdup(json_string_value(json_object_get(choice, "text")));
    json_t *chunks = json_object_get(json_object_get(j, "ragkv"), "chunks");
    cr_assert_eq(json_array_size(chunks), 2);
    for (int k = 0; k < 2; k++) {
        json_t *c = json_array_get(chunks, (size_t)k);
        snprintf(src[k], 16, "%s", json_string_value(json_object_get(c, "source")));
        if (key) snprintf(key[k], 33, "%s", json_string_value(json_object_get(c, "key")));
    }
    json_decref(j);
    return text;
}

Test(redis_service, the_server_with_a_secret_recomputes_a_forged_value_and_keeps_it_off_disk) {
    char *where = NULL;
    int no_curl = rk_test_run("command -v curl", &where) != 0 || !where || !where[0];
    free(where);
    if (no_curl) cr_skip_test("curl is not installed");
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    char *dir = rk_test_tmpdir("redis-forged-serve");
    char url[64], store[4200], src[2][16], key[2][33];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", s.port);
    snprintf(store, sizeof store, "%s/store", dir);
    char *secret = rk_test_write_tmp("redis-forged-secret", "secret", SECRET);
    const char *tier[] = {"--redis", url, "--redis-min-tokens", "1", "--redis-secret-file",
                          secret,    NULL};
    rk_test_server srv;
    /* The oracle: computed alone by a replica with the secret. */
    serve(&srv, tier);
    int port = srv.port;
    char *oracle = complete(port, src, key);
    cr_assert_str_eq(src[0], "computed");
    long long total = 0;
    for (int i = 0; i < 250 && total < 2; i++) { /* the writes are asynchronous */
        json_t *j = curl(port, "GET", "/v1/chunks?tier=redis", NULL, NULL);
        total = jint(j, "total", NULL);
        json_decref(j);
        if (total < 2) usleep(20 * 1000);
    }
    cr_assert_eq(total, 2);
    stop(&srv);
    /* Someone with write access to Redis, without the secret, negates the
     * first chunk's KV and recomputes its checksums and marker. */
    char fp[33];
    {
        rk_service *svc = open_tiers(NULL, NULL, NULL); /* the same embedded model */
        snprintf(fp, sizeof fp, "%s", rk_model_fingerprint(svc->model));
        rk_service_close(svc);
    }
    forge_value(&s, fp, key[0], NEGATE);
    const char *tier_store[] = {
        "--redis", url, "--redis-min-tokens", "1", "--redis-secret-file", secret, "--store",
        store,     NULL};
    serve(&srv, tier_store);
    port = srv.port;
    char *text = complete(port, src, NULL);
    cr_assert_str_eq(src[0], "computed", "the forged value was served");
    cr_assert_str_eq(src[1], "redis");
    cr_assert_str_eq(text, oracle);
    free(text);
    json_t *j = curl(port, "GET", "/v1/stats", NULL, NULL);
    cr_assert_eq(jint(j, "redis", "auth_failures"), 1);
    json_decref(j);
    char *m;
    curl(port, "GET", "/metrics", NULL, &m);
    cr_assert(strstr(m, "ragkv_redis_auth_failures_total 1"), "%s", m);
    free(m);
    stop(&srv);
    /* Redis flushed: the store verifies and a restart with it alone answers
     * as the oracle did, from disk. */
    redisContext *c = redisConnect("127.0.0.1", s.port);
    cr_assert(c && !c->err);
    freeReplyObject(redisCommand(c, "FLUSHALL"));
    redisFree(c);
    char cmd[8600], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s cache verify --store %s 2>&1", RK_BIN, store);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "checked 2 payloads: 0 bad"), "%s", out);
    free(out);
    const char *disk[] = {"--store", store, NULL};
    serve(&srv, disk);
    port = srv.port;
    text = complete(port, src, NULL);
    cr_assert_str_eq(src[0], "disk");
    cr_assert_str_eq(src[1], "disk");
    cr_assert_str_eq(text, oracle, "the disk store kept a wrong answer");
    free(text);
    stop(&srv);
    free(oracle);
    free(secret);
    free(dir);
    rk_test_redis_free(&s);
}

Test(redis_service, offline_prewarm_with_the_secret_writes_values_the_fleet_accepts) {
    rk_test_redis s = {0};
    rk_test_redis_start(&s);
    static const char *CHUNK =
        "The ferry left the island at dawn with the mail, three goats, a crate of lemons and the "
        "schoolteacher, who read the whole crossing and never once looked at the sea.";
    char line[512];
    snprintf(line, sizeof line, "{\"id\": \"ferry\", \"text\": \"%s\"}\n", CHUNK);
    char *input = rk_test_write_tmp("redis-prewarm-secret", "in.jsonl", line);
    char cmd[1024], *out = NULL;
    snprintf(
        cmd, sizeof cmd,
        "RAGKV_REDIS_SECRET='%s' %s prewarm --input %s --kv-memory-mb 16 --kv-dtype f32 --redis "
        "redis://127.0.0.1:%d 2>&1",
        SECRET, RK_BIN, input, s.port);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "1 computed"), "%s", out);
    cr_assert_null(strstr(out, "no shared-tier secret"), "prewarm ignored the secret: %s", out);
    free(out);
    char prompt[512];
    snprintf(prompt, sizeof prompt, "Answer briefly.##%s##Who read?", CHUNK);
    /* A replica with the secret loads it; one with another secret cannot. */
    rk_service *other = open_tiers(&s, "not the fleet's secret at all", NULL);
    rk_request *r = run(other, prompt);
    cr_assert_eq(r->chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED);
    rk_redis_counters c;
    rk_redis_stats(other->redis, &c);
    cr_assert_eq(c.auth_failures, 1);
    req_free(r);
    rk_service_close(other); /* writes its own value back under its secret */
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out); /* and the fleet's again */
    free(out);
    rk_service *a = open_tiers(&s, SECRET, NULL);
    r = run(a, prompt);
    cr_assert_eq(r->chunk_reports[0].source, RK_CHUNK_SOURCE_REDIS);
    rk_redis_stats(a->redis, &c);
    cr_assert_eq(c.auth_failures, 0);
    req_free(r);
    rk_service_close(a);
    free(input);
    rk_test_redis_free(&s);
}
