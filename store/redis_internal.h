/* store/redis_internal.h — private to store/: nothing outside this folder
 * includes it (the public interface is redis.h). It holds the Redis tier's
 * handle, a queued write, the commit marker and the functions its files
 * share.
 *
 * The Redis tier's files:
 *   redis.c        the tier: open and close, the writer thread, loads, writes,
 *                  the compute locks, the cost gate, the counters.
 *   redis_value.c  the value format: encoding a value's header, the commit
 *                  marker, the HMAC-SHA-256 tag and the shared secret, the
 *                  checks a value read back must pass, rk_redis_value_new.
 *   redis_conn.c   connections and commands: connecting (AUTH, SELECT, PING),
 *                  pipelined commands with one reconnect, the circuit breaker,
 *                  the URL and the configuration checks.
 *   redis_admin.c  `ragkv cache` on the tier: list and flush by SCAN. */
#ifndef RK_STORE_REDIS_INTERNAL_H
#define RK_STORE_REDIS_INTERNAL_H

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "store/redis.h"

enum {
    META_PLAIN = 1,  /* marker of a value without a tag */
    META_TAGGED = 2, /* marker of a value with an HMAC-SHA-256 tag */
    KEY_CAP = RK_REDIS_PREFIX_MAX + 2 * RK_STORE_KEY_LEN + 16, /* PREFIX:FP:K:meta */
    SCAN_COUNT = 1000,
};

/* A write waiting for the writer thread. value is the whole payload with its
 * header still zero: the writer computes the checksum and fills it. It has
 * RK_REDIS_TAG_BYTES of room after size for the tag. */
struct rk_redis_value {
    struct rk_redis_value *next;
    char key[RK_STORE_KEY_LEN + 1];
    char policy[RK_STORE_POLICY_MAX + 1];
    char doc_id[RK_STORE_DOC_ID_MAX + 1];
    rk_store_layout layout;
    uint32_t n_tokens;
    uint8_t *value; /* (size) bytes: header, token ids, body */
    size_t size;
    int has_lock;
    rk_redis_lock lock;
    int tries; /* attempts that reached Redis (or its time-out) and failed */
};

struct rk_redis {
    rk_redis_url url;
    char prefix[RK_REDIS_PREFIX_MAX + 1];
    char fp[RK_STORE_KEY_LEN + 1];
    rk_redis_config cfg; /* url and prefix point into this struct's copies */
    redisContext *eng;   /* engine thread's connection; NULL when down */
    redisContext *wctx;  /* writer thread's connection; NULL when down */
    redisContext *lctx;  /* the loader thread's connection; NULL until used or when down */
    uint8_t token_seed[16];
    uint64_t token_counter;
    uint8_t secret[RK_REDIS_SECRET_MAX]; /* the values' HMAC key; secret_len 0 = none */
    size_t secret_len;

    pthread_mutex_t mu; /* everything below */
    pthread_cond_t cv_work, cv_idle;
    pthread_t writer;
    int writer_started;
    rk_redis_value *head, *tail;
    int n_queued, busy, stopping;
    rk_redis_counters c;
    double avg_bytes, avg_secs; /* moving averages of load size and time */
    int consecutive;            /* failures in a row */
    int is_open;
    double open_until, backoff_s;
};

/* What the commit marker says. */
typedef struct meta {
    int version; /* META_PLAIN or META_TAGGED */
    int32_t n_tokens;
    uint64_t n_bytes;
    char checksum[RK_STORE_KEY_LEN + 1];
    double created;
} meta;

/* What became of a value read by load. */
typedef enum verdict {
    V_GOOD,    /* usable */
    V_CORRUPT, /* deleted, counted in dropped_corrupt */
    V_AUTH,    /* deleted, counted in auth_failures */
    V_LAYOUT,  /* sound but for another layout: kept, a miss */
} verdict;

/* redis_value.c: the wall clock (unix seconds), a value's header, the commit
 * marker (0 when it parses, -1 when not), the tag, and the verdict on a value
 * read back (see the comment at its definition). */
double rk_redis_wall_now(void);
void rk_redis_encode_value(const char *fp, const rk_redis_value *j, uint8_t out_sum[16]);
int rk_redis_meta_parse(const char *s, size_t len, meta *m);
rk_status rk_redis_value_mac(const rk_redis *r, const uint8_t *p, size_t n,
                             uint8_t tag[RK_REDIS_TAG_BYTES]);
rk_status rk_redis_judge(rk_redis *r, const char *key, const redisReply *mr, uint64_t vlen,
                         const redisReply *vr, uint64_t want, const int32_t *tokens,
                         int32_t n_tokens, const rk_store_layout *layout, meta *m,
                         rk_store_payload *got, uint64_t *out_payload, verdict *v, const char **why,
                         int *out_unread, char *buf, size_t cap);

/* redis_conn.c: the breaker's state, a failure counted against it and a
 * half-open probe past its back-off; a new
 * connection; hiredis's error in words; commands through the breaker (see
 * the comments at their definitions); the configuration's checks. */
int rk_redis_breaker_is_open(rk_redis *r);
void rk_redis_breaker_failure(rk_redis *r, const char *why);
int rk_redis_probe(rk_redis *r, redisContext **pc);
rk_status rk_redis_connect(const rk_redis_url *u, int timeout_ms, redisContext **out);
const char *rk_redis_conn_error(const redisContext *c);
rk_status rk_redis_run_cmds(rk_redis *r, redisContext **pc, int n, const int *argc,
                            const char **const *argv, const size_t *const *lens, redisReply **out);
rk_status rk_redis_run(rk_redis *r, redisContext **pc, int argc, const char **argv,
                       const size_t *lens, redisReply **out);
rk_status rk_redis_config_check(const rk_redis_config *c);

#endif
