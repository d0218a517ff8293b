/* store/redis.c — the shared Redis tier (see store/redis.h for the layout,
 * the commit order, the trust model and which thread calls what).
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
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "store/payload.h"

enum {
    META_PLAIN = 1,  /* marker of a value without a tag */
    META_TAGGED = 2, /* marker of a value with an HMAC-SHA-256 tag */
    KEY_CAP = RK_REDIS_PREFIX_MAX + 2 * RK_STORE_KEY_LEN + 16, /* PREFIX:FP:K:meta */
    SCAN_COUNT = 1000,
};

/* Release a lock only if it still holds our token: atomic on the server. */
static const char k_unlock_lua[] =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end";

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
};

struct rk_redis {
    rk_redis_url url;
    char prefix[RK_REDIS_PREFIX_MAX + 1];
    char fp[RK_STORE_KEY_LEN + 1];
    rk_redis_config cfg; /* url and prefix point into this struct's copies */
    redisContext *eng;   /* engine thread's connection; NULL when down */
    redisContext *wctx;  /* writer thread's connection; NULL when down */
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

/* ---------------------------------------------------------------- helpers */

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

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

/* Write the payload header for the value (tokens and body already in place
 * after it), computing the checksum over them. */
/* Fill the value's header (its first RK_STORE_HEADER_BYTES) for its token
 * ids and body, which follow it; out_sum gets the checksum. */
static void encode_value(const char *fp, const rk_redis_value *j, uint8_t out_sum[16]) {
    const uint8_t *rest = j->value + RK_STORE_HEADER_BYTES;
    size_t tok_bytes = (size_t)j->n_tokens * sizeof(int32_t);
    rk_payload_header h = {.n_tokens = (uint32_t)j->n_tokens,
                           .layout = j->layout,
                           .body_size = j->size - RK_STORE_HEADER_BYTES - tok_bytes,
                           .created = wall_now()};
    memcpy(h.fingerprint, fp, RK_STORE_KEY_LEN);
    memcpy(h.key, j->key, RK_STORE_KEY_LEN);
    snprintf(h.policy, sizeof h.policy, "%s", j->policy);
    snprintf(h.doc_id, sizeof h.doc_id, "%s", j->doc_id);
    rk_payload_checksum((const int32_t *)(const void *)rest, (size_t)j->n_tokens, rest + tok_bytes,
                        (size_t)h.body_size, h.checksum);
    rk_payload_header_encode(&h, j->value);
    memcpy(out_sum, h.checksum, 16);
}

/* What the commit marker says. */
typedef struct meta {
    int version; /* META_PLAIN or META_TAGGED */
    int32_t n_tokens;
    uint64_t n_bytes;
    char checksum[RK_STORE_KEY_LEN + 1];
    double created;
} meta;

static int meta_parse(const char *s, size_t len, meta *m) {
    char buf[160];
    if (len >= sizeof buf) return -1;
    memcpy(buf, s, len);
    buf[len] = '\0';
    int version = 0, n = 0, end = 0;
    unsigned long long bytes = 0;
    if (sscanf(buf, "%d %d %llu %32s %lf%n", &version, &m->n_tokens, &bytes, m->checksum,
               &m->created, &n) != 5)
        return -1;
    end = n;
    if ((version != META_PLAIN && version != META_TAGGED) || (size_t)end != len ||
        m->n_tokens < 1 || strlen(m->checksum) != RK_STORE_KEY_LEN)
        return -1;
    m->version = version;
    m->n_bytes = bytes;
    return 0;
}

/* Check value (len bytes) against the marker, the model, the key and the
 * request's token ids. Returns NULL when good, else why it is bad. On success
 * out->layout, policy, doc_id and created come from the header. */
static const char *check_value(const rk_redis *r, const char *key, const meta *m, const uint8_t *v,
                               size_t len, const int32_t *tokens, int32_t n_tokens,
                               rk_store_payload *out) {
    if (len != m->n_bytes) return len < m->n_bytes ? "truncated" : "longer than its marker says";
    rk_payload_header h;
    if (len < RK_STORE_HEADER_BYTES || rk_payload_header_decode("redis value", v, len, &h) != RK_OK)
        return "bad header (magic, version, size, checksum or fields)";
    if (h.header_bytes != RK_STORE_HEADER_BYTES) return "old payload version";
    if (strcmp(h.fingerprint, r->fp) != 0) return "written for another model";
    if (memcmp(h.key, key, RK_STORE_KEY_LEN) != 0) return "header key differs";
    if ((int64_t)h.n_tokens != m->n_tokens) return "token count differs from its marker";
    uint64_t fixed = rk_payload_file_bytes(h.n_tokens, 0);
    if (len < fixed || h.body_size != len - fixed) return "body size does not fit the value size";
    char hex[RK_STORE_KEY_LEN + 1];
    rk_payload_checksum_hex(h.checksum, hex);
    if (strcmp(hex, m->checksum) != 0) return "checksum differs from its marker";
    const uint8_t *toks = v + RK_STORE_HEADER_BYTES;
    uint8_t sum[16];
    rk_payload_checksum((const int32_t *)(const void *)toks, h.n_tokens,
                        toks + 4 * (size_t)h.n_tokens, (size_t)h.body_size, sum);
    if (memcmp(sum, h.checksum, 16) != 0) return "checksum mismatch (token ids or body corrupt)";
    if ((int64_t)h.n_tokens != n_tokens || memcmp(toks, tokens, 4 * (size_t)h.n_tokens) != 0)
        return "token ids differ from the request's";
    memset(out, 0, sizeof *out);
    out->layout = h.layout;
    memcpy(out->meta.policy, h.policy, sizeof out->meta.policy);
    memcpy(out->meta.doc_id, h.doc_id, sizeof out->meta.doc_id);
    out->meta.created = h.created;
    return NULL;
}

/* ---------------------------------------------------------------- breaker */

/* 1 when a call may go to Redis now; counts a skipped call otherwise. */
static int breaker_allow(rk_redis *r) {
    pthread_mutex_lock(&r->mu);
    int ok = !r->is_open || rk_time_now() >= r->open_until;
    if (!ok) r->c.skipped++;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

static int breaker_is_open(rk_redis *r) {
    pthread_mutex_lock(&r->mu);
    int open = r->is_open && rk_time_now() < r->open_until;
    pthread_mutex_unlock(&r->mu);
    return open;
}

static void breaker_success(rk_redis *r) {
    pthread_mutex_lock(&r->mu);
    r->consecutive = 0;
    int was_open = r->is_open;
    r->is_open = 0;
    r->c.breaker = RK_REDIS_CLOSED;
    r->backoff_s = r->cfg.breaker_backoff_ms / 1e3;
    pthread_mutex_unlock(&r->mu);
    if (was_open)
        RK_LOG_WARN("redis %s:%d answers again: chunk sharing resumed", r->url.host, r->url.port);
}

/* Count a failed call; open the breaker (or lengthen its back-off after a
 * failed probe) once enough failed in a row. Logs only when it opens. */
static void breaker_failure(rk_redis *r, const char *why) {
    pthread_mutex_lock(&r->mu);
    r->c.errors++;
    r->consecutive++;
    int opened = 0;
    if (r->consecutive >= r->cfg.breaker_failures) {
        if (!r->is_open) {
            r->is_open = 1;
            r->c.breaker = RK_REDIS_OPEN;
            r->c.breaker_opened++;
            r->backoff_s = r->cfg.breaker_backoff_ms / 1e3;
            opened = 1;
        } else {
            double cap = r->cfg.breaker_backoff_max_ms / 1e3;
            r->backoff_s = r->backoff_s * 2 > cap ? cap : r->backoff_s * 2;
        }
        r->open_until = rk_time_now() + r->backoff_s;
    }
    double backoff_ms = r->backoff_s * 1e3;
    pthread_mutex_unlock(&r->mu);
    if (opened)
        RK_LOG_WARN("redis %s:%d unavailable (%s): chunk sharing paused, probing again in %.0f ms",
                    r->url.host, r->url.port, why, backoff_ms);
    else
        RK_LOG_DEBUG("redis %s:%d: %s", r->url.host, r->url.port, why);
}

/* ---------------------------------------------------------------- connections */

/* hiredis reports a timed-out read or write as EAGAIN's text: say what it is. */
static const char *conn_error(const redisContext *c) {
    return c->err == REDIS_ERR_IO && strcmp(c->errstr, strerror(EAGAIN)) == 0 ? "timed out"
                                                                              : c->errstr;
}

static struct timeval tv_ms(int ms) { return (struct timeval){ms / 1000, (ms % 1000) * 1000}; }

/* Run one command on a fresh connection during its set-up; an error reply is
 * RK_ERR_INVALID (the server refused what the URL asks), no reply RK_ERR_IO. */
static rk_status setup_cmd(redisContext *c, const rk_redis_url *u, const char *what, int argc,
                           const char **argv) {
    redisReply *rep = redisCommandArgv(c, argc, argv, NULL);
    if (!rep)
        return rk_errorf(RK_ERR_IO, "redis %s:%d: %s: %s", u->host, u->port, what, conn_error(c));
    rk_status st = RK_OK;
    if (rep->type == REDIS_REPLY_ERROR)
        st = rk_errorf(RK_ERR_INVALID, "redis %s:%d refused %s: %s", u->host, u->port, what,
                       rep->str);
    freeReplyObject(rep);
    return st;
}

/* Connect to the endpoint with the configured timeouts, authenticate, select
 * the database and check with PING that commands are accepted. RK_ERR_IO
 * when it cannot be reached, RK_ERR_INVALID when it refuses the credentials
 * or database (or needs a password none was given for). */
static rk_status connect_ctx(const rk_redis_url *u, int timeout_ms, redisContext **out) {
    *out = NULL;
    redisContext *c = redisConnectWithTimeout(u->host, u->port, tv_ms(timeout_ms));
    if (!c) return rk_errorf(RK_ERR_NOMEM, "redis: no memory for a connection");
    if (c->err) {
        rk_status st =
            rk_errorf(RK_ERR_IO, "redis %s:%d: connect: %s", u->host, u->port, conn_error(c));
        redisFree(c);
        return st;
    }
    rk_status st = RK_OK;
    if (redisSetTimeout(c, tv_ms(timeout_ms)) != REDIS_OK)
        st = rk_errorf(RK_ERR_IO, "redis %s:%d: cannot set the timeout", u->host, u->port);
    if (!st && u->has_password) {
        const char *a3[] = {"AUTH", u->user, u->password};
        const char *a2[] = {"AUTH", u->password};
        st = u->user[0] ? setup_cmd(c, u, "the user name and password (AUTH)", 3, a3)
                        : setup_cmd(c, u, "the password (AUTH)", 2, a2);
    }
    if (!st && u->db) {
        char db[16];
        snprintf(db, sizeof db, "%d", u->db);
        const char *a[] = {"SELECT", db};
        st = setup_cmd(c, u, "the database (SELECT)", 2, a);
    }
    if (!st) {
        const char *a[] = {"PING"};
        st = setup_cmd(c, u, "PING", 1, a);
    }
    if (st) {
        redisFree(c);
        return st;
    }
    *out = c;
    return RK_OK;
}

/* 1 when the last failure on c was a timed-out read or write. */
static int conn_timed_out(const redisContext *c) {
    return c->err == REDIS_ERR_IO && strcmp(c->errstr, strerror(EAGAIN)) == 0;
}

/* Run n pipelined commands (command i: argc[i] arguments argv[i], lengths
 * lens[i] or NULL) on *pc in one round trip, connecting first when it is
 * down, through the breaker. RK_OK with the n replies in out (never an error
 * reply; the caller frees them), RK_ERR_BUSY when the breaker skipped the
 * call, RK_ERR_IO on a failure (counted; a broken connection is closed and
 * reopened next time). A connection that was open before the call and fails
 * other than by a timeout (the server restarted and closed it) is reopened
 * and the commands sent once more before that counts as a failure: every
 * command of the tier may be repeated. */
static rk_status run_cmds(rk_redis *r, redisContext **pc, int n, const int *argc,
                          const char **const *argv, const size_t *const *lens, redisReply **out) {
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (!breaker_allow(r)) return RK_ERR_BUSY;
    for (int attempt = 0;; attempt++) {
        int fresh = !*pc;
        if (fresh) {
            rk_status st = connect_ctx(&r->url, r->cfg.timeout_ms, pc);
            if (st) {
                breaker_failure(r, rk_error_message());
                return st == RK_ERR_NOMEM ? st : RK_ERR_IO;
            }
        }
        int got = 0;
        for (int i = 0; i < n; i++)
            (void)redisAppendCommandArgv(*pc, argc[i], argv[i], lens ? lens[i] : NULL);
        while (got < n) {
            void *rep = NULL;
            if (redisGetReply(*pc, &rep) != REDIS_OK || !rep) break;
            out[got++] = rep;
        }
        if (got == n) break;
        for (int i = 0; i < got; i++) {
            freeReplyObject(out[i]);
            out[i] = NULL;
        }
        char why[160];
        snprintf(why, sizeof why, "%s: %s", argv[0][0], conn_error(*pc));
        int retry = !fresh && attempt == 0 && !conn_timed_out(*pc) && (*pc)->err != REDIS_ERR_OOM;
        redisFree(*pc);
        *pc = NULL;
        if (retry) {
            RK_LOG_DEBUG("redis %s:%d: %s; reconnecting once", r->url.host, r->url.port, why);
            continue;
        }
        breaker_failure(r, why);
        return RK_ERR_IO;
    }
    for (int i = 0; i < n; i++) {
        if (out[i]->type != REDIS_REPLY_ERROR) continue;
        char why[200];
        snprintf(why, sizeof why, "%s: %s", argv[i][0], out[i]->str);
        for (int k = 0; k < n; k++) {
            freeReplyObject(out[k]);
            out[k] = NULL;
        }
        breaker_failure(r, why);
        return RK_ERR_IO;
    }
    breaker_success(r);
    return RK_OK;
}

/* Run one command as run_cmds does. */
static rk_status run(rk_redis *r, redisContext **pc, int argc, const char **argv,
                     const size_t *lens, redisReply **out) {
    const char **const argvs[] = {argv};
    const size_t *const lenss[] = {lens};
    return run_cmds(r, pc, 1, &argc, argvs, lenss, out);
}

/* ---------------------------------------------------------------- authentication */

/* HMAC-SHA-256 of the n bytes at p under r's secret into tag. RK_ERR_NOMEM
 * when libcrypto cannot compute it (it allocates): never a verdict on the
 * value. */
static rk_status value_mac(const rk_redis *r, const uint8_t *p, size_t n,
                           uint8_t tag[RK_REDIS_TAG_BYTES]) {
    unsigned int len = 0;
    if (!HMAC(EVP_sha256(), r->secret, (int)r->secret_len, p, n, tag, &len) ||
        len != RK_REDIS_TAG_BYTES)
        return rk_errorf(RK_ERR_NOMEM, "redis: cannot compute a value's HMAC-SHA-256 (no memory)");
    return RK_OK;
}

rk_status rk_redis_secret_load(const char *path, const char *env_value,
                               uint8_t out[RK_REDIS_SECRET_MAX], size_t *out_len) {
    *out_len = 0;
    size_t n = 0;
    const char *what;
    if (path && path[0]) {
        what = path;
        FILE *f = fopen(path, "rb");
        if (!f) return rk_errorf(RK_ERR_IO, "redis secret file %s: %s", path, strerror(errno));
        n = fread(out, 1, RK_REDIS_SECRET_MAX, f);
        int more = fgetc(f) != EOF, err = ferror(f);
        fclose(f);
        if (err) {
            memset(out, 0, RK_REDIS_SECRET_MAX);
            return rk_errorf(RK_ERR_IO, "redis secret file %s: read error", path);
        }
        if (more) n = RK_REDIS_SECRET_MAX + 1;
        if (n > 0 && n <= RK_REDIS_SECRET_MAX && out[n - 1] == '\n') n--;
        if (n > 0 && n <= RK_REDIS_SECRET_MAX && out[n - 1] == '\r') n--;
    } else if (env_value && env_value[0]) {
        what = "RAGKV_REDIS_SECRET";
        n = strlen(env_value);
        if (n <= RK_REDIS_SECRET_MAX) memcpy(out, env_value, n);
    } else {
        return RK_OK;
    }
    if (n < RK_REDIS_SECRET_MIN || n > RK_REDIS_SECRET_MAX) {
        memset(out, 0, RK_REDIS_SECRET_MAX);
        return rk_errorf(RK_ERR_INVALID, "redis secret (%s) must be %d to %d bytes, got %s", what,
                         RK_REDIS_SECRET_MIN, RK_REDIS_SECRET_MAX,
                         n < RK_REDIS_SECRET_MIN ? "fewer" : "more");
    }
    *out_len = n;
    return RK_OK;
}

/* ---------------------------------------------------------------- URL, config */

void rk_redis_config_default(rk_redis_config *cfg) {
    *cfg = (rk_redis_config){.url = NULL,
                             .prefix = "ragkv",
                             .timeout_ms = 200,
                             .min_tokens = 32,
                             .queue_max = 256,
                             .queue_max_bytes = (size_t)256 << 20,
                             .lock_ttl_ms = 30000,
                             .ttl_s = 0,
                             .breaker_failures = 3,
                             .breaker_backoff_ms = 500,
                             .breaker_backoff_max_ms = 30000};
}

static int host_char_ok(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '-' || ch == '.' || ch == '_';
}

/* Parse the decimal digits in [s, e) into [lo, hi]; -1 when not such a number. */
static long parse_range(const char *s, const char *e, long lo, long hi) {
    if (s == e || e - s > 6) return -1;
    long v = 0;
    for (const char *p = s; p < e; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
    }
    return v < lo || v > hi ? -1 : v;
}

rk_status rk_redis_url_parse(const char *url, rk_redis_url *out) {
    memset(out, 0, sizeof *out);
    static const char scheme[] = "redis://";
    if (!url || strncmp(url, scheme, sizeof scheme - 1) != 0)
        return rk_errorf(
            RK_ERR_INVALID,
            "redis URL must start with redis:// (redis://[user:password@]host:port[/db])");
    const char *p = url + sizeof scheme - 1;
    const char *at = strrchr(p, '@');
    if (at) {
        const char *colon = memchr(p, ':', (size_t)(at - p));
        if (!colon)
            return rk_errorf(RK_ERR_INVALID,
                             "redis URL: credentials must be user:password@ (user may be empty)");
        size_t ulen = (size_t)(colon - p), plen = (size_t)(at - colon - 1);
        if (ulen > RK_REDIS_USER_MAX || plen > RK_REDIS_PASS_MAX)
            return rk_errorf(RK_ERR_INVALID, "redis URL: user name or password too long");
        if (plen == 0) return rk_errorf(RK_ERR_INVALID, "redis URL: empty password");
        if (memchr(p, '/', (size_t)(at - p)))
            return rk_errorf(RK_ERR_INVALID, "redis URL: '/' in the user name or password");
        memcpy(out->user, p, ulen);
        memcpy(out->password, colon + 1, plen);
        out->has_password = 1;
        p = at + 1;
    }
    const char *h = p;
    while (*p && host_char_ok(*p)) p++;
    if (p == h) return rk_errorf(RK_ERR_INVALID, "redis URL: missing host");
    if ((size_t)(p - h) > RK_REDIS_HOST_MAX)
        return rk_errorf(RK_ERR_INVALID, "redis URL: host name too long");
    if (*p != ':')
        return rk_errorf(RK_ERR_INVALID,
                         "redis URL: expected ':PORT' after the host (the port is required)");
    memcpy(out->host, h, (size_t)(p - h));
    const char *ps = ++p;
    while (*p && *p != '/') p++;
    long port = parse_range(ps, p, 1, 65535);
    if (port < 0) return rk_errorf(RK_ERR_INVALID, "redis URL: port must be 1..65535");
    out->port = (int)port;
    if (*p == '/') {
        const char *ds = ++p;
        p += strlen(p);
        long db = parse_range(ds, p, 0, 65535);
        if (db < 0) return rk_errorf(RK_ERR_INVALID, "redis URL: database must be 0..65535");
        out->db = (int)db;
    }
    return RK_OK;
}

static int prefix_ok(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > RK_REDIS_PREFIX_MAX) return 0;
    for (size_t i = 0; i < n; i++)
        if (!host_char_ok(s[i])) return 0;
    return 1;
}

static rk_status config_check(const rk_redis_config *c) {
    if (c->secret_len &&
        (!c->secret || c->secret_len < RK_REDIS_SECRET_MIN || c->secret_len > RK_REDIS_SECRET_MAX))
        return rk_errorf(RK_ERR_INVALID, "redis secret must be %d to %d bytes", RK_REDIS_SECRET_MIN,
                         RK_REDIS_SECRET_MAX);
    if (!c->prefix || !prefix_ok(c->prefix))
        return rk_errorf(RK_ERR_INVALID, "redis key prefix must be 1..%d of [A-Za-z0-9_.-]",
                         RK_REDIS_PREFIX_MAX);
    if (c->timeout_ms < 1 || c->timeout_ms > 60000)
        return rk_errorf(RK_ERR_INVALID, "redis timeout must be 1..60000 ms");
    if (c->min_tokens < 0) return rk_errorf(RK_ERR_INVALID, "redis min tokens must be >= 0");
    if (c->queue_max < 1 || c->queue_max_bytes < 1)
        return rk_errorf(RK_ERR_INVALID, "redis write queue must hold >= 1 write and >= 1 byte");
    if (c->lock_ttl_ms < 1) return rk_errorf(RK_ERR_INVALID, "redis lock TTL must be >= 1 ms");
    if (c->ttl_s < 0) return rk_errorf(RK_ERR_INVALID, "redis TTL must be >= 0 s");
    if (c->breaker_failures < 1 || c->breaker_backoff_ms < 1 ||
        c->breaker_backoff_max_ms < c->breaker_backoff_ms)
        return rk_errorf(RK_ERR_INVALID,
                         "redis breaker: failures >= 1, back-off >= 1 ms, cap >= back-off");
    return RK_OK;
}

/* ---------------------------------------------------------------- writer */

/* Release a lock we hold on connection *pc (either thread's). */
static void release_lock(rk_redis *r, redisContext **pc, const rk_redis_lock *lk) {
    char lkey[KEY_CAP];
    key_names(r, lk->key, NULL, NULL, lkey);
    const char *argv[] = {"EVAL", k_unlock_lua, "1", lkey, lk->token};
    redisReply *rep;
    if (run(r, pc, 5, argv, NULL, &rep) == RK_OK) freeReplyObject(rep);
}

static void write_job(rk_redis *r, rk_redis_value *j) {
    char vkey[KEY_CAP], mkey[KEY_CAP], meta_s[160], ttl[24];
    key_names(r, j->key, vkey, mkey, NULL);
    uint8_t sum[16];
    encode_value(r->fp, j, sum);
    char hex[RK_STORE_KEY_LEN + 1];
    rk_payload_checksum_hex(sum, hex);
    /* With a secret the tag follows the payload in the room left for it; a
     * value whose tag cannot be computed is not written at all. */
    size_t size = j->size;
    if (r->secret_len) {
        if (value_mac(r, j->value, j->size, j->value + j->size)) {
            RK_LOG_WARN("redis chunk %s not written: %s", j->key, rk_error_message());
            if (j->has_lock) release_lock(r, &r->wctx, &j->lock);
            pthread_mutex_lock(&r->mu);
            r->c.write_drops++;
            pthread_mutex_unlock(&r->mu);
            return;
        }
        size += RK_REDIS_TAG_BYTES;
    }
    snprintf(meta_s, sizeof meta_s, "%d %u %zu %s %.3f", r->secret_len ? META_TAGGED : META_PLAIN,
             j->n_tokens, size, hex, wall_now());
    snprintf(ttl, sizeof ttl, "%d", r->cfg.ttl_s);
    int argc = r->cfg.ttl_s > 0 ? 5 : 3;
    double t0 = rk_time_now();
    /* Payload first, marker second: a reader trusts only a marked payload. */
    const char *va[] = {"SET", vkey, (const char *)j->value, "EX", ttl};
    size_t vl[] = {3, strlen(vkey), size, 2, strlen(ttl)};
    redisReply *rep = NULL;
    rk_status st = run(r, &r->wctx, argc, va, vl, &rep);
    freeReplyObject(rep);
    rep = NULL;
    if (!st) {
        const char *ma[] = {"SET", mkey, meta_s, "EX", ttl};
        st = run(r, &r->wctx, argc, ma, NULL, &rep);
        freeReplyObject(rep);
    }
    double dt = rk_time_now() - t0;
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
}

static void *writer_main(void *arg) {
    rk_redis *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->head && !r->stopping) pthread_cond_wait(&r->cv_work, &r->mu);
        if (!r->head) break;
        rk_redis_value *j = r->head;
        r->head = j->next;
        if (!r->head) r->tail = NULL;
        r->n_queued--;
        r->c.queued = (uint64_t)r->n_queued;
        r->c.queued_bytes -= j->size;
        r->busy = 1;
        pthread_mutex_unlock(&r->mu);
        write_job(r, j);
        rk_redis_value_free(j);
        pthread_mutex_lock(&r->mu);
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
    rk_status st = config_check(cfg);
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
    pthread_cond_init(&r->cv_work, NULL);
    pthread_cond_init(&r->cv_idle, &ca);
    pthread_condattr_destroy(&ca);

    st = connect_ctx(&r->url, cfg->timeout_ms, &r->eng);
    if (st == RK_ERR_IO) {
        RK_LOG_WARN("%s; starting without chunk sharing until it answers", rk_error_message());
        breaker_failure(r, rk_error_message());
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

static void drop_entry(rk_redis *r, const char *vkey, const char *mkey) {
    const char *argv[] = {"DEL", vkey, mkey};
    redisReply *rep;
    if (run(r, &r->eng, 3, argv, NULL, &rep) == RK_OK) freeReplyObject(rep);
}

/* What became of a value read by load. */
typedef enum verdict {
    V_GOOD,    /* usable */
    V_CORRUPT, /* deleted, counted in dropped_corrupt */
    V_AUTH,    /* deleted, counted in auth_failures */
    V_LAYOUT,  /* sound but for another layout: kept, a miss */
} verdict;

/* Judge the value read by load: marker mr, the value's length vlen and its
 * first bytes vr (at most want of them). On V_GOOD *got has the header fields
 * and *out_payload the bytes without the tag; otherwise why says what is
 * wrong (perhaps in buf, cap bytes) and *out_unread is set when the value was
 * refused by its size without being read. RK_ERR_NOMEM when the tag cannot be computed (no
 * verdict). */
static rk_status judge(rk_redis *r, const char *key, const redisReply *mr, uint64_t vlen,
                       const redisReply *vr, uint64_t want, const int32_t *tokens, int32_t n_tokens,
                       const rk_store_layout *layout, meta *m, rk_store_payload *got,
                       uint64_t *out_payload, verdict *v, const char **why, int *out_unread,
                       char *buf, size_t cap) {
    *v = V_CORRUPT;
    *out_unread = 0;
    if (meta_parse(mr->str, mr->len, m)) {
        *why = "unreadable commit marker";
        return RK_OK;
    }
    if (vlen != m->n_bytes) {
        *why = vlen < m->n_bytes ? "truncated" : "longer than its marker says";
        *out_unread = vlen > want;
        return RK_OK;
    }
    if (r->secret_len && m->version != META_TAGGED) {
        *v = V_AUTH;
        *why = "written without the shared secret (no tag)";
        return RK_OK;
    }
    uint64_t tag = m->version == META_TAGGED ? RK_REDIS_TAG_BYTES : 0;
    if (vlen < tag + RK_STORE_HEADER_BYTES) {
        *why = "shorter than a header";
        return RK_OK;
    }
    const uint8_t *p = (const uint8_t *)vr->str;
    if (vlen > want || vr->len != vlen) {
        /* Not read whole: too large for this chunk. Its header (read) tells a
         * sound value of another layout, which is kept, from a bad one. */
        rk_payload_header h;
        if (layout && vr->len >= RK_STORE_HEADER_BYTES &&
            rk_payload_header_decode("redis value", p, vr->len, &h) == RK_OK &&
            h.header_bytes == RK_STORE_HEADER_BYTES && strcmp(h.fingerprint, r->fp) == 0 &&
            memcmp(h.key, key, RK_STORE_KEY_LEN) == 0 && (int64_t)h.n_tokens == n_tokens &&
            memcmp(&h.layout, layout, sizeof h.layout) != 0) {
            *v = V_LAYOUT;
            return RK_OK;
        }
        *why = "larger than a value of this chunk can be: refused unread";
        *out_unread = 1;
        return RK_OK;
    }
    uint64_t plen = vlen - tag;
    if (tag && r->secret_len) {
        uint8_t mac[RK_REDIS_TAG_BYTES];
        rk_status st = value_mac(r, p, (size_t)plen, mac);
        if (st) return st;
        if (CRYPTO_memcmp(mac, p + plen, RK_REDIS_TAG_BYTES) != 0) {
            *v = V_AUTH;
            *why = "tag does not verify (forged, or written under another secret)";
            return RK_OK;
        }
    }
    meta pm = *m;
    pm.n_bytes = plen;
    if ((*why = check_value(r, key, &pm, p, (size_t)plen, tokens, n_tokens, got))) return RK_OK;
    if (layout && memcmp(layout, &got->layout, sizeof got->layout) != 0) {
        *v = V_LAYOUT;
        return RK_OK;
    }
    size_t tok_bytes = 4 * (size_t)m->n_tokens;
    if (r->cfg.body_check &&
        r->cfg.body_check(&got->layout, p + RK_STORE_HEADER_BYTES + tok_bytes,
                          (size_t)plen - RK_STORE_HEADER_BYTES - tok_bytes, buf, cap)) {
        *why = buf;
        return RK_OK;
    }
    *out_payload = plen;
    *v = V_GOOD;
    return RK_OK;
}

/* The marker of key alone, for a read with no expected size: *out_want
 * gets the size it gives the value (0 when unreadable). RK_OK with
 * *res LOAD_ABSENT (no marker: *out_want 0 and *present 0) or set
 * unavailable. */
static rk_status marker_size(rk_redis *r, const char *mkey, uint64_t *out_want, int *present,
                             load_result *res) {
    *out_want = 0;
    *present = 0;
    const char *argv[] = {"GET", mkey};
    redisReply *rep;
    rk_status st = run(r, &r->eng, 2, argv, NULL, &rep);
    if (st == RK_ERR_NOMEM) return st;
    if (st) {
        *res = LOAD_UNAVAILABLE;
        return RK_OK;
    }
    meta m;
    if (rep->type == REDIS_REPLY_STRING) {
        *present = 1;
        if (!meta_parse(rep->str, rep->len, &m)) *out_want = m.n_bytes;
    }
    freeReplyObject(rep);
    return RK_OK;
}

/* One round trip for the marker, the value's length and at most the bytes a
 * value of the expected size has (GETRANGE: a larger value is never read
 * whole); the value checked; fills *out on LOAD_HIT. body_size 0: the size
 * comes from the marker, read first. */
static rk_status load(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                      const rk_store_layout *layout, uint64_t body_size, rk_store_payload *out,
                      load_result *res) {
    *res = LOAD_ABSENT;
    char vkey[KEY_CAP], mkey[KEY_CAP];
    key_names(r, key, vkey, mkey, NULL);
    uint64_t want;
    if (layout && body_size) {
        want = rk_payload_file_bytes((uint64_t)n_tokens, body_size) + RK_REDIS_TAG_BYTES;
    } else {
        int present;
        rk_status st = marker_size(r, mkey, &want, &present, res);
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
    rk_status st = run_cmds(r, &r->eng, 3, argcs, argvs, NULL, rep);
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
        if (marked) drop_entry(r, vkey, mkey);
        return RK_OK;
    }
    meta m;
    rk_store_payload got; /* header fields; the buffers come last */
    uint64_t plen = 0;
    verdict v;
    const char *why = NULL;
    int unread = 0;
    char buf[200];
    st = judge(r, key, mr, (uint64_t)lr->integer, vr, want, tokens, n_tokens, layout, &m, &got,
               &plen, &v, &why, &unread, buf, sizeof buf);
    if (st || v != V_GOOD) {
        if (!st && v != V_LAYOUT)
            RK_LOG_WARN("redis chunk %s: %s (%lld bytes); dropped, computing it", key, why,
                        (long long)lr->integer);
        for (int i = 0; i < 3; i++) freeReplyObject(rep[i]);
        if (st) return st;
        if (v != V_LAYOUT) drop_entry(r, vkey, mkey);
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
        (st = load(r, key, tokens, n_tokens, layout, body_size, out, &res)))
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

rk_status rk_redis_value_new(const char *key, const char *policy, const char *doc_id,
                             const rk_store_layout *layout, const int32_t *tokens, int32_t n_tokens,
                             size_t body_size, rk_redis_value **out, void **out_body) {
    *out = NULL;
    if (out_body) *out_body = NULL;
    if (!key || !rk_store_key_valid(key) || !layout || !tokens || n_tokens < 1)
        return rk_errorf(RK_ERR_INVALID, "redis: a value needs a key, a layout and token ids");
    size_t np = policy ? strlen(policy) : 0, nd = doc_id ? strlen(doc_id) : 0;
    if (np == 0 || np > RK_STORE_POLICY_MAX || !rk_payload_printable((const uint8_t *)policy, np))
        return rk_errorf(RK_ERR_INVALID, "redis: policy must be 1..%d printable characters",
                         RK_STORE_POLICY_MAX);
    if (nd > RK_STORE_DOC_ID_MAX)
        return rk_errorf(RK_ERR_INVALID, "redis: document id longer than %d bytes",
                         RK_STORE_DOC_ID_MAX);
    size_t tok_bytes = (size_t)n_tokens * sizeof(int32_t);
    size_t size = RK_STORE_HEADER_BYTES + tok_bytes + body_size;
    rk_redis_value *j = calloc(1, sizeof *j);
    if (j) j->value = malloc(size + RK_REDIS_TAG_BYTES);
    if (!j || !j->value) {
        free(j);
        return rk_errorf(RK_ERR_NOMEM, "redis: no memory for a %zu-byte value", size);
    }
    memcpy(j->key, key, RK_STORE_KEY_LEN + 1);
    memcpy(j->policy, policy, np);
    if (nd) memcpy(j->doc_id, doc_id, nd);
    j->layout = *layout;
    j->n_tokens = (uint32_t)n_tokens;
    j->size = size;
    memcpy(j->value + RK_STORE_HEADER_BYTES, tokens, tok_bytes);
    *out = j;
    if (out_body) *out_body = j->value + RK_STORE_HEADER_BYTES + tok_bytes;
    return RK_OK;
}

void rk_redis_value_free(rk_redis_value *v) {
    if (!v) return;
    free(v->value);
    free(v);
}

/* Count a dropped write and release its lock at once, so that waiters
 * compute now rather than wait out the lock's TTL. */
static rk_status drop_write(rk_redis *r, const char *key, const rk_redis_lock *release) {
    pthread_mutex_lock(&r->mu);
    r->c.write_drops++;
    pthread_mutex_unlock(&r->mu);
    if (release) release_lock(r, &r->eng, release);
    return rk_errorf(RK_ERR_LIMIT, "redis: write of chunk %s dropped (queue full or Redis down)",
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
    int room = 0;
    if (!breaker_is_open(r)) {
        pthread_mutex_lock(&r->mu);
        room = queue_has_room(r, v->size);
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
    }
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
        int room = !breaker_is_open(r);
        if (room) {
            pthread_mutex_lock(&r->mu);
            room = queue_has_room(r, rk_redis_value_bytes(args->n_tokens, args->body_size));
            pthread_mutex_unlock(&r->mu);
        }
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

rk_status rk_redis_try_lock(rk_redis *r, const char *key, rk_redis_lock *out_lock,
                            rk_redis_lock_state *out_state) {
    *out_state = RK_REDIS_LOCK_UNAVAILABLE;
    memset(out_lock, 0, sizeof *out_lock);
    if (!key || !rk_store_key_valid(key))
        return rk_errorf(RK_ERR_INVALID, "redis: chunk key must be 32 lowercase hex");
    /* A token unique to this lock: the seed is random per handle. */
    uint64_t ctr = ++r->token_counter;
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
    rk_status st = run(r, &r->eng, 6, argv, NULL, &rep);
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

rk_status rk_redis_unlock(rk_redis *r, const rk_redis_lock *lk) {
    if (!lk || !rk_store_key_valid(lk->key))
        return rk_errorf(RK_ERR_INVALID, "redis: not a lock taken by rk_redis_try_lock");
    release_lock(r, &r->eng, lk);
    return RK_OK;
}

rk_status rk_redis_poll(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                        const rk_store_layout *layout, uint64_t body_size, rk_store_payload *out,
                        rk_redis_poll_state *out_state) {
    *out_state = RK_REDIS_GONE;
    rk_status st = check_query(key, tokens, n_tokens, out);
    if (st) return st;
    load_result res;
    if ((st = load(r, key, tokens, n_tokens, layout, body_size, out, &res))) return st;
    if (res == LOAD_ABSENT) {
        char lkey[KEY_CAP];
        key_names(r, key, NULL, NULL, lkey);
        const char *argv[] = {"EXISTS", lkey};
        redisReply *rep;
        if ((st = run(r, &r->eng, 2, argv, NULL, &rep)) == RK_ERR_NOMEM) return st;
        int held = !st && rep->type == REDIS_REPLY_INTEGER && rep->integer > 0;
        if (!st) freeReplyObject(rep);
        if (held) {
            *out_state = RK_REDIS_PENDING;
            return RK_OK;
        }
        /* The holder may have committed and released between the two calls. */
        if (!st && (st = load(r, key, tokens, n_tokens, layout, body_size, out, &res))) return st;
    }
    *out_state = res == LOAD_HIT ? RK_REDIS_READY : RK_REDIS_GONE;
    count_outcome(r, res == LOAD_HIT);
    return RK_OK;
}

rk_status rk_redis_wait_for(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                            const rk_store_layout *layout, uint64_t body_size, int bound_ms,
                            rk_store_payload *out) {
    double deadline = rk_time_now() + bound_ms / 1e3;
    int nap = 1;
    for (;;) {
        rk_redis_poll_state ps;
        rk_status st = rk_redis_poll(r, key, tokens, n_tokens, layout, body_size, out, &ps);
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

/* ---------------------------------------------------------------- cost gate */

uint64_t rk_redis_value_bytes(int32_t n_tokens, uint64_t kv_bytes) {
    return rk_payload_file_bytes(n_tokens > 0 ? (uint64_t)n_tokens : 0, kv_bytes);
}

int rk_redis_worth_fetching(rk_redis *r, int32_t n_tokens, uint64_t n_bytes,
                            double prefill_tokens_per_s) {
    if (n_tokens < r->cfg.min_tokens || breaker_is_open(r)) return 0;
    pthread_mutex_lock(&r->mu);
    double bw = r->c.load_bytes_per_s;
    pthread_mutex_unlock(&r->mu);
    if (bw <= 0 || prefill_tokens_per_s <= 0) return 1;
    return (double)n_bytes / bw < (double)n_tokens / prefill_tokens_per_s;
}

/* ---------------------------------------------------------------- admin */

/* SCAN every key matching pattern on c, calling fn on each batch of keys. */
typedef rk_status (*batch_fn)(rk_redis *r, redisContext *c, redisReply *keys, void *ctx);

static rk_status scan_all(rk_redis *r, redisContext *c, const char *pattern, batch_fn fn,
                          void *ctx) {
    char cursor[32] = "0", count[16];
    snprintf(count, sizeof count, "%d", SCAN_COUNT);
    do {
        const char *argv[] = {"SCAN", cursor, "MATCH", pattern, "COUNT", count};
        redisReply *rep = redisCommandArgv(c, 6, argv, NULL);
        if (!rep) return rk_errorf(RK_ERR_IO, "redis SCAN: %s", conn_error(c));
        if (rep->type != REDIS_REPLY_ARRAY || rep->elements != 2 ||
            rep->element[0]->type != REDIS_REPLY_STRING ||
            rep->element[1]->type != REDIS_REPLY_ARRAY || rep->element[0]->len >= sizeof cursor) {
            rk_status st = rk_errorf(RK_ERR_IO, "redis SCAN: unexpected reply%s%s",
                                     rep->type == REDIS_REPLY_ERROR ? ": " : "",
                                     rep->type == REDIS_REPLY_ERROR ? rep->str : "");
            freeReplyObject(rep);
            return st;
        }
        memcpy(cursor, rep->element[0]->str, rep->element[0]->len + 1);
        rk_status st = rep->element[1]->elements ? fn(r, c, rep->element[1], ctx) : RK_OK;
        freeReplyObject(rep);
        if (st) return st;
    } while (strcmp(cursor, "0") != 0);
    return RK_OK;
}

typedef struct list_ctx {
    rk_redis_entry *v;
    int n, cap, limit;
} list_ctx;

static rk_status list_batch(rk_redis *r, redisContext *c, redisReply *keys, void *arg) {
    list_ctx *lc = arg;
    size_t n = keys->elements;
    const char **argv = malloc((n + 1) * sizeof *argv);
    size_t *lens = malloc((n + 1) * sizeof *lens);
    if (!argv || !lens) {
        free(argv);
        free(lens);
        return rk_errorf(RK_ERR_NOMEM, "redis: no memory to list");
    }
    argv[0] = "MGET";
    lens[0] = 4;
    for (size_t i = 0; i < n; i++) {
        argv[i + 1] = keys->element[i]->str;
        lens[i + 1] = keys->element[i]->len;
    }
    redisReply *rep = redisCommandArgv(c, (int)n + 1, argv, lens);
    free(argv);
    free(lens);
    if (!rep) return rk_errorf(RK_ERR_IO, "redis MGET: %s", conn_error(c));
    rk_status st = RK_OK;
    size_t stem = strlen(r->prefix) + 1 + RK_STORE_KEY_LEN + 1; /* "PREFIX:FP:" */
    for (size_t i = 0; rep->type == REDIS_REPLY_ARRAY && i < rep->elements && i < n; i++) {
        if (lc->limit > 0 && lc->n >= lc->limit) break;
        const redisReply *k = keys->element[i], *v = rep->element[i];
        meta m;
        if (v->type != REDIS_REPLY_STRING || meta_parse(v->str, v->len, &m) ||
            k->len != stem + RK_STORE_KEY_LEN + 5)
            continue; /* removed since SCAN saw it, or not ours */
        if (lc->n == lc->cap) {
            int cap = lc->cap ? 2 * lc->cap : 64;
            rk_redis_entry *nv = realloc(lc->v, (size_t)cap * sizeof *nv);
            if (!nv) {
                st = rk_errorf(RK_ERR_NOMEM, "redis: no memory to list");
                break;
            }
            lc->v = nv;
            lc->cap = cap;
        }
        rk_redis_entry *e = &lc->v[lc->n];
        memset(e, 0, sizeof *e);
        memcpy(e->key, k->str + stem, RK_STORE_KEY_LEN);
        if (!rk_store_key_valid(e->key)) continue;
        e->n_tokens = m.n_tokens;
        e->n_bytes = m.n_bytes;
        e->created = m.created;
        lc->n++;
    }
    freeReplyObject(rep);
    return st;
}

rk_status rk_redis_list(rk_redis *r, int limit, rk_redis_entry **out, int *out_n) {
    *out = NULL;
    *out_n = 0;
    redisContext *c;
    rk_status st = connect_ctx(&r->url, r->cfg.timeout_ms, &c);
    if (st) return st;
    char pattern[KEY_CAP];
    snprintf(pattern, sizeof pattern, "%s:%s:*:meta", r->prefix, r->fp);
    list_ctx lc = {.limit = limit};
    st = scan_all(r, c, pattern, list_batch, &lc);
    redisFree(c);
    if (st) {
        free(lc.v);
        return st;
    }
    *out = lc.v;
    *out_n = lc.n;
    return RK_OK;
}

/* UNLINK the keys of one SCAN batch: payloads in one call (their count is
 * what flush reports), markers and locks in another. */
static rk_status flush_batch(rk_redis *r, redisContext *c, redisReply *keys, void *arg) {
    uint64_t *removed = arg;
    size_t n = keys->elements, payload_len = strlen(r->prefix) + 2 + 2 * RK_STORE_KEY_LEN;
    const char **argv = malloc((n + 1) * sizeof *argv);
    size_t *lens = malloc((n + 1) * sizeof *lens);
    if (!argv || !lens) {
        free(argv);
        free(lens);
        return rk_errorf(RK_ERR_NOMEM, "redis: no memory to flush");
    }
    rk_status st = RK_OK;
    for (int pass = 0; pass < 2 && !st; pass++) {
        int argc = 1;
        argv[0] = "UNLINK";
        lens[0] = 6;
        for (size_t i = 0; i < n; i++) {
            int is_payload = keys->element[i]->len == payload_len;
            if (is_payload != (pass == 0)) continue;
            argv[argc] = keys->element[i]->str;
            lens[argc++] = keys->element[i]->len;
        }
        if (argc == 1) continue;
        redisReply *rep = redisCommandArgv(c, argc, argv, lens);
        if (!rep) {
            st = rk_errorf(RK_ERR_IO, "redis UNLINK: %s", conn_error(c));
        } else if (rep->type != REDIS_REPLY_INTEGER) {
            st = rk_errorf(RK_ERR_IO, "redis UNLINK: %s",
                           rep->type == REDIS_REPLY_ERROR ? rep->str : "unexpected reply");
        } else if (pass == 0) {
            *removed += (uint64_t)rep->integer;
        }
        freeReplyObject(rep);
    }
    free(argv);
    free(lens);
    return st;
}

rk_status rk_redis_flush(rk_redis *r, uint64_t *out_removed) {
    if (out_removed) *out_removed = 0;
    redisContext *c;
    rk_status st = connect_ctx(&r->url, r->cfg.timeout_ms, &c);
    if (st) return st;
    char pattern[KEY_CAP];
    snprintf(pattern, sizeof pattern, "%s:%s:*", r->prefix, r->fp);
    uint64_t removed = 0;
    st = scan_all(r, c, pattern, flush_batch, &removed);
    redisFree(c);
    if (out_removed) *out_removed = removed;
    return st;
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
