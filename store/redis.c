/* store/redis.c — the shared Redis tier (see store/redis.h for the layout,
 * the commit order, the trust model and which thread calls what): open and
 * close, the writer thread, loads, writes, the compute locks, the cost gate
 * and the counters. The value format and its tag are in store/redis_value.c,
 * connections and commands in store/redis_conn.c, list and flush in
 * store/redis_admin.c.
 *
 * The value is byte for byte a disk payload file (the format at the top of
 * store/payload.c), followed by an HMAC-SHA-256 tag when the tier has a
 * secret; so a value (without its tag) can be written to a file and read by
 * the disk tier and the other way round: its header is written and checked
 * by payload.c's own encoder and decoder. */
#include "store/redis.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <openssl/crypto.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "store/payload.h"
#include "store/redis_internal.h"

/* Release a lock only if it still holds our token: atomic on the server. */
static const char k_unlock_lua[] =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end";

/* ---------------------------------------------------------------- helpers */

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void key_names(const rk_redis *r, const char *key, char *vkey, char *mkey, char *lkey) {
    if (vkey) snprintf(vkey, KEY_CAP, "%s:%s:%s", r->prefix, r->fp, key);
    if (mkey) snprintf(mkey, KEY_CAP, "%s:%s:%s:meta", r->prefix, r->fp, key);
    if (lkey) snprintf(lkey, KEY_CAP, "%s:%s:%s:lock", r->prefix, r->fp, key);
}

/* ---------------------------------------------------------------- writer */

/* Release a lock we hold on connection *pc (either thread's). */
static void release_lock(rk_redis *r, redisContext **pc, const rk_redis_lock *lk) {
    char lkey[KEY_CAP];
    key_names(r, lk->key, NULL, NULL, lkey);
    const char *argv[] = {"EVAL", k_unlock_lua, "1", lkey, lk->token};
    redisReply *rep;
    if (rk_redis_run(r, pc, 5, argv, NULL, &rep) == RK_OK) freeReplyObject(rep);
}

enum { WRITE_TRIES = 3 }; /* attempts of one write that reach Redis, at most */

/* Write j: the value, then its marker, then release its lock. Returns 1 when
 * the write failed and may be tried again (fewer than WRITE_TRIES attempts
 * failed, or the breaker skipped it: Redis is away, and the write waits for
 * it); 0 when it was committed or dropped for good (counted either way; its
 * lock released). */
static int write_job(rk_redis *r, rk_redis_value *j) {
    char vkey[KEY_CAP], mkey[KEY_CAP], meta_s[160], ttl[24];
    key_names(r, j->key, vkey, mkey, NULL);
    uint8_t sum[16];
    rk_redis_encode_value(r->fp, j, sum);
    char hex[RK_STORE_KEY_LEN + 1];
    rk_payload_checksum_hex(sum, hex);
    /* With a secret the tag follows the payload in the room left for it; a
     * value whose tag cannot be computed is not written at all. */
    size_t size = j->size;
    if (r->secret_len) {
        if (rk_redis_value_mac(r, j->value, j->size, j->value + j->size)) {
            RK_LOG_WARN("redis chunk %s not written: %s", j->key, rk_error_message());
            if (j->has_lock) release_lock(r, &r->wctx, &j->lock);
            pthread_mutex_lock(&r->mu);
            r->c.write_drops++;
            pthread_mutex_unlock(&r->mu);
            return 0;
        }
        size += RK_REDIS_TAG_BYTES;
    }
    snprintf(meta_s, sizeof meta_s, "%d %u %zu %s %.3f", r->secret_len ? META_TAGGED : META_PLAIN,
             j->n_tokens, size, hex, rk_redis_wall_now());
    snprintf(ttl, sizeof ttl, "%d", r->cfg.ttl_s);
    int argc = r->cfg.ttl_s > 0 ? 5 : 3;
    double t0 = rk_time_now();
    /* Payload first, marker second: a reader trusts only a marked payload. */
    const char *va[] = {"SET", vkey, (const char *)j->value, "EX", ttl};
    size_t vl[] = {3, strlen(vkey), size, 2, strlen(ttl)};
    redisReply *rep = NULL;
    rk_status st = rk_redis_run(r, &r->wctx, argc, va, vl, &rep);
    freeReplyObject(rep);
    rep = NULL;
    if (!st) {
        const char *ma[] = {"SET", mkey, meta_s, "EX", ttl};
        st = rk_redis_run(r, &r->wctx, argc, ma, NULL, &rep);
        freeReplyObject(rep);
    }
    double dt = rk_time_now() - t0;
    if (st == RK_ERR_IO) j->tries++;
    /* Every command of a write may be repeated: the value and its marker
     * are written whole again. RK_ERR_BUSY (skipped) costs no attempt. */
    if ((st == RK_ERR_IO || st == RK_ERR_BUSY) && j->tries < WRITE_TRIES) return 1;
    if (j->has_lock) release_lock(r, &r->wctx, &j->lock);
    pthread_mutex_lock(&r->mu);
    if (st) {
        r->c.write_drops++;
    } else {
        r->c.writes++;
        r->c.bytes_out += size;
        r->c.put_count++;
        r->c.put_seconds += dt;
    }
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* mu held. Wait on cv_work until rk_time_now() reaches t (or a signal). */
static void wait_work_until(rk_redis *r, double t) {
    struct timespec dl = {(time_t)t, (long)((t - (double)(time_t)t) * 1e9)};
    if (dl.tv_nsec >= 1000000000L) dl.tv_nsec = 999999999L;
    pthread_cond_timedwait(&r->cv_work, &r->mu, &dl);
}

/* mu held, and the caller's once more on return. Drop every queued write
 * (counted), releasing their locks (best effort), when closing with Redis
 * away. */
static void drop_queue(rk_redis *r) {
    rk_redis_value *list = r->head;
    r->c.write_drops += (uint64_t)r->n_queued;
    r->head = r->tail = NULL;
    r->n_queued = 0;
    r->c.queued = 0;
    r->c.queued_bytes = 0;
    pthread_mutex_unlock(&r->mu);
    while (list) {
        rk_redis_value *next = list->next;
        if (list->has_lock) release_lock(r, &r->wctx, &list->lock);
        rk_redis_value_free(list);
        list = next;
    }
    pthread_mutex_lock(&r->mu);
}

/* The writer thread. It takes writes in order. While the breaker is open,
 * or after a write failed, it does not skip the writes: it keeps them queued
 * (within the queue's bounds) and makes a half-open probe (a PING past the
 * breaker's back-off) when a write waits, then every breaker_backoff_ms
 * (the first back-off, never doubled) while Redis does not answer; the first
 * probe that is answered closes the breaker and the writes go on where they
 * stopped. A write is tried at most WRITE_TRIES times. When closing, a probe
 * that fails drops what is left. */
static void *writer_main(void *arg) {
    rk_redis *r = arg;
    int must_probe = 0;    /* the last write failed: a PING comes before the next */
    double next_probe = 0; /* after a failed probe, none before this */
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->head && !r->stopping) pthread_cond_wait(&r->cv_work, &r->mu);
        if (!r->head) break;
        if (must_probe || r->is_open) {
            if (!r->stopping && rk_time_now() < next_probe) {
                wait_work_until(r, next_probe);
                continue;
            }
            r->busy = 1;
            pthread_mutex_unlock(&r->mu);
            int up = rk_redis_probe(r, &r->wctx);
            pthread_mutex_lock(&r->mu);
            r->busy = 0;
            if (!up) {
                next_probe = rk_time_now() + r->cfg.breaker_backoff_ms / 1e3;
                if (r->stopping) {
                    drop_queue(r);
                    pthread_cond_broadcast(&r->cv_idle);
                }
                continue;
            }
            must_probe = 0;
        }
        rk_redis_value *j = r->head;
        r->head = j->next;
        if (!r->head) r->tail = NULL;
        r->n_queued--;
        r->c.queued = (uint64_t)r->n_queued;
        r->c.queued_bytes -= j->size;
        r->busy = 1;
        pthread_mutex_unlock(&r->mu);
        int again = write_job(r, j);
        if (!again) rk_redis_value_free(j);
        pthread_mutex_lock(&r->mu);
        if (again) { /* back at the head, in its turn, counted in the queue */
            j->next = r->head;
            r->head = j;
            if (!r->tail) r->tail = j;
            r->n_queued++;
            r->c.queued = (uint64_t)r->n_queued;
            r->c.queued_bytes += j->size;
            must_probe = 1;
        }
        r->busy = 0;
        if (!r->head) pthread_cond_broadcast(&r->cv_idle);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* ---------------------------------------------------------------- open, close */

rk_status rk_redis_open(const rk_redis_config *cfg, const char *model_fingerprint, rk_redis **out) {
    *out = NULL;
    if (!model_fingerprint || !rk_store_key_valid(model_fingerprint))
        return rk_errorf(RK_ERR_INVALID, "redis: model fingerprint must be 32 lowercase hex");
    rk_status st = rk_redis_config_check(cfg);
    if (st) return st;
    rk_redis *r = calloc(1, sizeof *r);
    if (!r) return rk_errorf(RK_ERR_NOMEM, "redis: no memory for the tier");
    if ((st = rk_redis_url_parse(cfg->url, &r->url))) {
        free(r);
        return st;
    }
    r->cfg = *cfg;
    snprintf(r->prefix, sizeof r->prefix, "%s", cfg->prefix);
    memcpy(r->fp, model_fingerprint, RK_STORE_KEY_LEN + 1);
    r->cfg.url = NULL; /* not kept: it may hold the password */
    r->cfg.prefix = r->prefix;
    r->cfg.secret = NULL; /* kept in r->secret */
    r->cfg.secret_len = 0;
    if (cfg->secret_len) {
        memcpy(r->secret, cfg->secret, cfg->secret_len);
        r->secret_len = cfg->secret_len;
    }
    r->backoff_s = cfg->breaker_backoff_ms / 1e3;
    if (getrandom(r->token_seed, sizeof r->token_seed, 0) != (ssize_t)sizeof r->token_seed) {
        free(r);
        return rk_errorf(RK_ERR_IO, "redis: getrandom: %s", strerror(errno));
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv_work, &ca);
    pthread_cond_init(&r->cv_idle, &ca);
    pthread_condattr_destroy(&ca);

    st = rk_redis_connect(&r->url, cfg->timeout_ms, &r->eng);
    if (st == RK_ERR_IO) {
        RK_LOG_WARN("%s; starting without chunk sharing until it answers", rk_error_message());
        rk_redis_breaker_failure(r, rk_error_message());
        st = RK_OK;
    }
    if (!st && pthread_create(&r->writer, NULL, writer_main, r) != 0)
        st = rk_errorf(RK_ERR_INTERNAL, "redis: cannot start the writer thread");
    if (st) {
        rk_redis_close(r);
        return st;
    }
    r->writer_started = 1;
    if (!r->secret_len)
        RK_LOG_WARN("redis %s:%d: no shared-tier secret (--redis-secret-file or "
                    "RAGKV_REDIS_SECRET): chunk values are not authenticated, so anyone who can "
                    "write to this Redis can change every replica's answers; Redis must be trusted",
                    r->url.host, r->url.port);
    *out = r;
    return RK_OK;
}

void rk_redis_close(rk_redis *r) {
    if (!r) return;
    if (r->writer_started) {
        pthread_mutex_lock(&r->mu);
        r->stopping = 1;
        pthread_cond_signal(&r->cv_work);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->writer, NULL);
    }
    if (r->eng) redisFree(r->eng);
    if (r->lctx) redisFree(r->lctx);
    if (r->wctx) redisFree(r->wctx);
    pthread_cond_destroy(&r->cv_work);
    pthread_cond_destroy(&r->cv_idle);
    pthread_mutex_destroy(&r->mu);
    memset(&r->url, 0, sizeof r->url); /* the password */
    OPENSSL_cleanse(r->secret, sizeof r->secret);
    free(r);
}

/* ---------------------------------------------------------------- loads */

typedef enum load_result { LOAD_HIT, LOAD_ABSENT, LOAD_UNAVAILABLE } load_result;

static void drop_entry(rk_redis *r, redisContext **pc, const char *vkey, const char *mkey) {
    const char *argv[] = {"DEL", vkey, mkey};
    redisReply *rep;
    if (rk_redis_run(r, pc, 3, argv, NULL, &rep) == RK_OK) freeReplyObject(rep);
}

/* The marker of key alone, for a read with no expected size: *out_want
 * gets the size it gives the value (0 when unreadable). RK_OK with
 * *res LOAD_ABSENT (no marker: *out_want 0 and *present 0) or set
 * unavailable. */
static rk_status marker_size(rk_redis *r, redisContext **pc, const char *mkey, uint64_t *out_want,
                             int *present, load_result *res) {
    *out_want = 0;
    *present = 0;
    const char *argv[] = {"GET", mkey};
    redisReply *rep;
    rk_status st = rk_redis_run(r, pc, 2, argv, NULL, &rep);
    if (st == RK_ERR_NOMEM) return st;
    if (st) {
        *res = LOAD_UNAVAILABLE;
        return RK_OK;
    }
    meta m;
    if (rep->type == REDIS_REPLY_STRING) {
        *present = 1;
        if (!rk_redis_meta_parse(rep->str, rep->len, &m)) *out_want = m.n_bytes;
    }
    freeReplyObject(rep);
    return RK_OK;
}

/* One round trip for the marker, the value's length and at most the bytes a
 * value of the expected size has (GETRANGE: a larger value is never read
 * whole); the value checked; fills *out on LOAD_HIT. body_size 0: the size
 * comes from the marker, read first. */
static rk_status load(rk_redis *r, redisContext **pc, const char *key, const int32_t *tokens,
                      int32_t n_tokens, const rk_store_layout *layout, uint64_t body_size,
                      rk_store_payload *out, load_result *res) {
    *res = LOAD_ABSENT;
    char vkey[KEY_CAP], mkey[KEY_CAP];
    key_names(r, key, vkey, mkey, NULL);
    uint64_t want;
    if (layout && body_size) {
        want = rk_payload_file_bytes((uint64_t)n_tokens, body_size) + RK_REDIS_TAG_BYTES;
    } else {
        int present;
        rk_status st = marker_size(r, pc, mkey, &want, &present, res);
        if (st || !present || *res == LOAD_UNAVAILABLE) return st;
    }
    char last[24];
    snprintf(last, sizeof last, "%llu", (unsigned long long)(want ? want - 1 : 0));
    const char *ga[] = {"GET", mkey}, *sa[] = {"STRLEN", vkey},
               *ra[] = {"GETRANGE", vkey, "0", last};
    const char **const argvs[] = {ga, sa, ra};
    const int argcs[] = {2, 2, 4};
    redisReply *rep[3];
    double t0 = rk_time_now();
    rk_status st = rk_redis_run_cmds(r, pc, 3, argcs, argvs, NULL, rep);
    double dt = rk_time_now() - t0;
    if (st == RK_ERR_NOMEM) return st;
    if (st) {
        *res = LOAD_UNAVAILABLE;
        return RK_OK;
    }
    pthread_mutex_lock(&r->mu);
    r->c.get_count++;
    r->c.get_seconds += dt;
    pthread_mutex_unlock(&r->mu);
    const redisReply *mr = rep[0], *lr = rep[1], *vr = rep[2];
    int marked = mr->type == REDIS_REPLY_STRING;
    int valued =
        lr->type == REDIS_REPLY_INTEGER && lr->integer > 0 && vr->type == REDIS_REPLY_STRING;
    if (!marked || !valued) { /* not committed (yet), or the payload was evicted */
        for (int i = 0; i < 3; i++) freeReplyObject(rep[i]);
        if (marked) drop_entry(r, pc, vkey, mkey);
        return RK_OK;
    }
    meta m;
    rk_store_payload got; /* header fields; the buffers come last */
    uint64_t plen = 0;
    verdict v;
    const char *why = NULL;
    int unread = 0;
    char buf[200];
    st = rk_redis_judge(r, key, mr, (uint64_t)lr->integer, vr, want, tokens, n_tokens, layout, &m,
                        &got, &plen, &v, &why, &unread, buf, sizeof buf);
    if (st || v != V_GOOD) {
        if (!st && v != V_LAYOUT)
            RK_LOG_WARN("redis chunk %s: %s (%lld bytes); dropped, computing it", key, why,
                        (long long)lr->integer);
        for (int i = 0; i < 3; i++) freeReplyObject(rep[i]);
        if (st) return st;
        if (v != V_LAYOUT) drop_entry(r, pc, vkey, mkey);
        pthread_mutex_lock(&r->mu);
        if (v == V_LAYOUT) {
            r->c.layout_mismatch++;
        } else if (v == V_AUTH) {
            r->c.auth_failures++;
        } else {
            r->c.dropped_corrupt++;
            if (unread) r->c.size_refused++;
        }
        pthread_mutex_unlock(&r->mu);
        return RK_OK;
    }
    size_t tok_bytes = 4 * (size_t)m.n_tokens,
           body_bytes = (size_t)plen - RK_STORE_HEADER_BYTES - tok_bytes;
    int32_t *tk = malloc(tok_bytes);
    void *body = body_bytes ? malloc(body_bytes) : NULL;
    if (!tk || (body_bytes && !body)) {
        free(tk);
        free(body);
        for (int i = 0; i < 3; i++) freeReplyObject(rep[i]);
        return rk_errorf(RK_ERR_NOMEM, "redis: no memory for a %llu-byte payload",
                         (unsigned long long)plen);
    }
    memcpy(tk, vr->str + RK_STORE_HEADER_BYTES, tok_bytes);
    if (body_bytes) memcpy(body, vr->str + RK_STORE_HEADER_BYTES + tok_bytes, body_bytes);
    *out = got;
    memcpy(out->meta.key, key, RK_STORE_KEY_LEN);
    memcpy(out->meta.model, r->fp, RK_STORE_KEY_LEN);
    memcpy(out->meta.checksum, m.checksum, RK_STORE_KEY_LEN);
    out->meta.n_tokens = m.n_tokens;
    out->meta.n_bytes = plen;
    out->meta.last_access = out->meta.created;
    out->tokens = tk;
    out->body = body;
    out->body_size = body_bytes;
    size_t len = vr->len;
    /* The cost gate weighs the whole load: the round trip and the checks
     * (the tag's HMAC-SHA-256 is the costly one). */
    dt = rk_time_now() - t0;
    pthread_mutex_lock(&r->mu);
    r->c.bytes_in += len;
    /* Moving averages of size and time, so that the ratio is a throughput
     * weighted by size rather than dominated by small values' latency. */
    const double a = 0.2;
    if (r->avg_secs == 0) {
        r->avg_bytes = (double)len;
        r->avg_secs = dt > 1e-9 ? dt : 1e-9;
    } else {
        r->avg_bytes = a * (double)len + (1 - a) * r->avg_bytes;
        r->avg_secs = a * (dt > 1e-9 ? dt : 1e-9) + (1 - a) * r->avg_secs;
    }
    r->c.load_bytes_per_s = r->avg_bytes / r->avg_secs;
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < 3; i++) freeReplyObject(rep[i]);
    *res = LOAD_HIT;
    return RK_OK;
}

static rk_status check_query(const char *key, const int32_t *tokens, int32_t n_tokens,
                             rk_store_payload *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!key || !rk_store_key_valid(key))
        return rk_errorf(RK_ERR_INVALID, "redis: chunk key must be 32 lowercase hex");
    if (!tokens || n_tokens < 1 || !out)
        return rk_errorf(RK_ERR_INVALID, "redis: a load needs the request's token ids");
    return RK_OK;
}

static void count_outcome(rk_redis *r, int hit) {
    pthread_mutex_lock(&r->mu);
    if (hit)
        r->c.hits++;
    else
        r->c.misses++;
    pthread_mutex_unlock(&r->mu);
}

rk_status rk_redis_get(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                       const rk_store_layout *layout, uint64_t body_size, rk_store_payload *out) {
    rk_status st = check_query(key, tokens, n_tokens, out);
    if (st) return st;
    load_result res = LOAD_ABSENT;
    if (n_tokens >= r->cfg.min_tokens &&
        (st = load(r, &r->eng, key, tokens, n_tokens, layout, body_size, out, &res)))
        return st;
    count_outcome(r, res == LOAD_HIT);
    if (res == LOAD_HIT) return RK_OK;
    return rk_errorf(RK_ERR_NOT_FOUND, "redis: chunk %s %s", key,
                     res == LOAD_UNAVAILABLE ? "not loaded: Redis unavailable"
                                             : "not shared (or not usable)");
}

/* ---------------------------------------------------------------- writes */

/* 1 when a value of size bytes fits the queue now (mu held). One value
 * larger than the byte cap still goes when the queue is empty. */
static int queue_has_room(const rk_redis *r, size_t size) {
    return r->n_queued < r->cfg.queue_max &&
           (r->n_queued == 0 || r->c.queued_bytes + size <= r->cfg.queue_max_bytes);
}

/* Count a dropped write and release its lock at once, so that waiters
 * compute now rather than wait out the lock's TTL. */
static rk_status drop_write(rk_redis *r, const char *key, const rk_redis_lock *release) {
    pthread_mutex_lock(&r->mu);
    r->c.write_drops++;
    pthread_mutex_unlock(&r->mu);
    if (release) release_lock(r, &r->eng, release);
    return rk_errorf(RK_ERR_LIMIT, "redis: write of chunk %s dropped (the write queue is full)",
                     key);
}

rk_status rk_redis_put_value(rk_redis *r, rk_redis_value *v, const rk_redis_lock *release) {
    if (!v) return rk_errorf(RK_ERR_INVALID, "redis: no value to put");
    char key[RK_STORE_KEY_LEN + 1];
    memcpy(key, v->key, sizeof key);
    if ((int64_t)v->n_tokens < r->cfg.min_tokens) {
        rk_redis_value_free(v);
        if (release) release_lock(r, &r->eng, release);
        return rk_errorf(RK_ERR_LIMIT, "redis: chunk %s is shorter than %d tokens: not shared", key,
                         r->cfg.min_tokens);
    }
    if (release) {
        v->has_lock = 1;
        v->lock = *release;
    }
    /* Queued also while the breaker is open: the writer holds it until Redis
     * answers its probe. */
    pthread_mutex_lock(&r->mu);
    int room = queue_has_room(r, v->size);
    if (room) {
        v->next = NULL;
        if (r->tail)
            r->tail->next = v;
        else
            r->head = v;
        r->tail = v;
        r->n_queued++;
        r->c.queued = (uint64_t)r->n_queued;
        r->c.queued_bytes += v->size;
        pthread_cond_signal(&r->cv_work);
    }
    pthread_mutex_unlock(&r->mu);
    if (room) return RK_OK;
    rk_redis_value_free(v);
    return drop_write(r, key, release);
}

rk_status rk_redis_put(rk_redis *r, const rk_store_put_args *args, const rk_redis_lock *release) {
    if (!args || !args->key || !rk_store_key_valid(args->key) || !args->tokens ||
        args->n_tokens < 1 || (args->body_size && !args->body))
        return rk_errorf(RK_ERR_INVALID, "redis: a put needs a key, token ids and a body");
    if (args->n_tokens >= r->cfg.min_tokens) {
        /* Skip the copy when the write would be dropped anyway. */
        pthread_mutex_lock(&r->mu);
        int room = queue_has_room(r, rk_redis_value_bytes(args->n_tokens, args->body_size));
        pthread_mutex_unlock(&r->mu);
        if (!room) return drop_write(r, args->key, release);
    }
    rk_redis_value *v;
    void *body;
    rk_status st = rk_redis_value_new(args->key, args->policy, args->doc_id, &args->layout,
                                      args->tokens, args->n_tokens, args->body_size, &v, &body);
    if (st) {
        if (release) release_lock(r, &r->eng, release);
        return st;
    }
    if (args->body_size) memcpy(body, args->body, args->body_size);
    return rk_redis_put_value(r, v, release);
}

rk_status rk_redis_wait_idle(rk_redis *r, int timeout_ms, int *out_idle) {
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&r->mu);
    int rc = 0;
    while ((r->head || r->busy) && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&r->cv_idle, &r->mu, &dl);
    *out_idle = !r->head && !r->busy;
    pthread_mutex_unlock(&r->mu);
    return RK_OK;
}

/* ---------------------------------------------------------------- locks */

static rk_status try_lock(rk_redis *r, redisContext **pc, const char *key, rk_redis_lock *out_lock,
                          rk_redis_lock_state *out_state) {
    *out_state = RK_REDIS_LOCK_UNAVAILABLE;
    memset(out_lock, 0, sizeof *out_lock);
    if (!key || !rk_store_key_valid(key))
        return rk_errorf(RK_ERR_INVALID, "redis: chunk key must be 32 lowercase hex");
    /* A token unique to this lock: the seed is random per handle. */
    pthread_mutex_lock(&r->mu);
    uint64_t ctr = ++r->token_counter;
    pthread_mutex_unlock(&r->mu);
    uint8_t in[24];
    memcpy(in, r->token_seed, 16);
    memcpy(in + 16, &ctr, 8);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(in, sizeof in));
    rk_payload_checksum_hex(c.digest, out_lock->token);
    memcpy(out_lock->key, key, RK_STORE_KEY_LEN + 1);

    char lkey[KEY_CAP], ttl[24];
    key_names(r, key, NULL, NULL, lkey);
    snprintf(ttl, sizeof ttl, "%d", r->cfg.lock_ttl_ms);
    const char *argv[] = {"SET", lkey, out_lock->token, "NX", "PX", ttl};
    redisReply *rep;
    rk_status st = rk_redis_run(r, pc, 6, argv, NULL, &rep);
    if (st == RK_ERR_NOMEM) return st;
    if (st) return RK_OK;
    int got = rep->type == REDIS_REPLY_STATUS;
    freeReplyObject(rep);
    *out_state = got ? RK_REDIS_LOCK_ACQUIRED : RK_REDIS_LOCK_HELD;
    pthread_mutex_lock(&r->mu);
    if (got)
        r->c.locks_acquired++;
    else
        r->c.locks_busy++;
    pthread_mutex_unlock(&r->mu);
    return RK_OK;
}

rk_status rk_redis_try_lock(rk_redis *r, const char *key, rk_redis_lock *out_lock,
                            rk_redis_lock_state *out_state) {
    return try_lock(r, &r->eng, key, out_lock, out_state);
}

rk_status rk_redis_unlock(rk_redis *r, const rk_redis_lock *lk) {
    if (!lk || !rk_store_key_valid(lk->key))
        return rk_errorf(RK_ERR_INVALID, "redis: not a lock taken by rk_redis_try_lock");
    release_lock(r, &r->eng, lk);
    return RK_OK;
}

static rk_status poll_on(rk_redis *r, redisContext **pc, const char *key, const int32_t *tokens,
                         int32_t n_tokens, const rk_store_layout *layout, uint64_t body_size,
                         rk_store_payload *out, rk_redis_poll_state *out_state) {
    *out_state = RK_REDIS_GONE;
    rk_status st = check_query(key, tokens, n_tokens, out);
    if (st) return st;
    load_result res;
    if ((st = load(r, pc, key, tokens, n_tokens, layout, body_size, out, &res))) return st;
    if (res == LOAD_ABSENT) {
        char lkey[KEY_CAP];
        key_names(r, key, NULL, NULL, lkey);
        const char *argv[] = {"EXISTS", lkey};
        redisReply *rep;
        if ((st = rk_redis_run(r, pc, 2, argv, NULL, &rep)) == RK_ERR_NOMEM) return st;
        int held = !st && rep->type == REDIS_REPLY_INTEGER && rep->integer > 0;
        if (!st) freeReplyObject(rep);
        if (held) {
            *out_state = RK_REDIS_PENDING;
            return RK_OK;
        }
        /* The holder may have committed and released between the two calls. */
        if (!st && (st = load(r, pc, key, tokens, n_tokens, layout, body_size, out, &res)))
            return st;
    }
    *out_state = res == LOAD_HIT ? RK_REDIS_READY : RK_REDIS_GONE;
    count_outcome(r, res == LOAD_HIT);
    return RK_OK;
}

rk_status rk_redis_poll(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                        const rk_store_layout *layout, uint64_t body_size, rk_store_payload *out,
                        rk_redis_poll_state *out_state) {
    return poll_on(r, &r->eng, key, tokens, n_tokens, layout, body_size, out, out_state);
}

static rk_status wait_for(rk_redis *r, redisContext **pc, const char *key, const int32_t *tokens,
                          int32_t n_tokens, const rk_store_layout *layout, uint64_t body_size,
                          int bound_ms, rk_store_payload *out) {
    double deadline = rk_time_now() + bound_ms / 1e3;
    int nap = 1;
    for (;;) {
        rk_redis_poll_state ps;
        rk_status st = poll_on(r, pc, key, tokens, n_tokens, layout, body_size, out, &ps);
        if (st) return st;
        if (ps == RK_REDIS_READY) return RK_OK;
        if (ps == RK_REDIS_GONE)
            return rk_errorf(RK_ERR_NOT_FOUND, "redis: chunk %s: nobody computes it", key);
        double left_ms = (deadline - rk_time_now()) * 1e3;
        if (left_ms <= 0) break;
        sleep_ms(nap < left_ms ? nap : (int)left_ms + 1);
        nap = nap * 2 > 50 ? 50 : nap * 2;
    }
    count_outcome(r, 0);
    return rk_errorf(RK_ERR_NOT_FOUND, "redis: chunk %s did not appear within %d ms", key,
                     bound_ms);
}

rk_status rk_redis_wait_for(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                            const rk_store_layout *layout, uint64_t body_size, int bound_ms,
                            rk_store_payload *out) {
    return wait_for(r, &r->eng, key, tokens, n_tokens, layout, body_size, bound_ms, out);
}

/* ---------------------------------------------------------------- a miss's lookup */

rk_status rk_redis_lookup(rk_redis *r, rk_redis_conn conn, const char *key, const int32_t *tokens,
                          int32_t n_tokens, const rk_store_layout *layout, uint64_t body_size,
                          int wait_ms, rk_store_payload *out, rk_redis_lock *out_lock,
                          rk_redis_found *out_found) {
    *out_found = RK_REDIS_FOUND_NOTHING;
    rk_status st = check_query(key, tokens, n_tokens, out);
    if (st) return st;
    if (n_tokens < r->cfg.min_tokens) return RK_OK;
    redisContext **pc = conn == RK_REDIS_CONN_LOADER ? &r->lctx : &r->eng;
    load_result res;
    if ((st = load(r, pc, key, tokens, n_tokens, layout, body_size, out, &res))) return st;
    if (res == LOAD_UNAVAILABLE) {
        count_outcome(r, 0);
        return RK_OK;
    }
    if (res == LOAD_ABSENT) {
        rk_redis_lock_state ls;
        if ((st = try_lock(r, pc, key, out_lock, &ls))) return st;
        if (ls == RK_REDIS_LOCK_UNAVAILABLE) {
            count_outcome(r, 0);
            return RK_OK;
        }
        if (ls == RK_REDIS_LOCK_ACQUIRED) {
            /* A replica may have committed the value and released its lock
             * between our get and our lock: look once more before computing. */
            if ((st = load(r, pc, key, tokens, n_tokens, layout, body_size, out, &res))) {
                release_lock(r, pc, out_lock);
                return st;
            }
            if (res != LOAD_HIT) {
                count_outcome(r, 0);
                *out_found = RK_REDIS_FOUND_LOCK;
                return RK_OK;
            }
            release_lock(r, pc, out_lock);
        } else {
            /* Another replica computes it: wait a bounded time for its value,
             * then compute it here if it has not come. */
            st = wait_for(r, pc, key, tokens, n_tokens, layout, body_size, wait_ms, out);
            if (st == RK_ERR_NOT_FOUND) return RK_OK; /* counted by wait_for */
            if (st) return st;
            *out_found = RK_REDIS_FOUND_VALUE;
            return RK_OK;
        }
    }
    count_outcome(r, 1);
    *out_found = RK_REDIS_FOUND_VALUE;
    return RK_OK;
}

/* ---------------------------------------------------------------- cost gate */

uint64_t rk_redis_value_bytes(int32_t n_tokens, uint64_t kv_bytes) {
    return rk_payload_file_bytes(n_tokens > 0 ? (uint64_t)n_tokens : 0, kv_bytes);
}

int rk_redis_worth_fetching(rk_redis *r, int32_t n_tokens, uint64_t n_bytes,
                            double prefill_tokens_per_s) {
    if (n_tokens < r->cfg.min_tokens || rk_redis_breaker_is_open(r)) return 0;
    pthread_mutex_lock(&r->mu);
    double bw = r->c.load_bytes_per_s;
    pthread_mutex_unlock(&r->mu);
    if (bw <= 0 || prefill_tokens_per_s <= 0) return 1;
    return (double)n_bytes / bw < (double)n_tokens / prefill_tokens_per_s;
}

/* ---------------------------------------------------------------- reports */

void rk_redis_stats(rk_redis *r, rk_redis_counters *out) {
    pthread_mutex_lock(&r->mu);
    *out = r->c;
    out->breaker = r->is_open ? RK_REDIS_OPEN : RK_REDIS_CLOSED;
    pthread_mutex_unlock(&r->mu);
}

const char *rk_redis_prefix(const rk_redis *r) { return r->prefix; }

void rk_redis_endpoint(const rk_redis *r, rk_redis_url *out) {
    *out = r->url;
    memset(out->password, 0, sizeof out->password);
}
