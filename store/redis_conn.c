/* store/redis_conn.c — the Redis tier's connections and commands: the
 * circuit breaker, connecting (timeouts, AUTH, SELECT, PING), pipelined
 * commands with one reconnect after a dropped connection, and the URL and
 * configuration checks. */
#include "store/redis.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>

#include "store/redis_internal.h"

/* ---------------------------------------------------------------- breaker */

/* 1 when a call may go to Redis now; counts a skipped call otherwise. */
static int breaker_allow(rk_redis *r) {
    pthread_mutex_lock(&r->mu);
    int ok = !r->is_open || rk_time_now() >= r->open_until;
    if (!ok) r->c.skipped++;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

int rk_redis_breaker_is_open(rk_redis *r) {
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
void rk_redis_breaker_failure(rk_redis *r, const char *why) {
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
const char *rk_redis_conn_error(const redisContext *c) {
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
        return rk_errorf(RK_ERR_IO, "redis %s:%d: %s: %s", u->host, u->port, what,
                         rk_redis_conn_error(c));
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
rk_status rk_redis_connect(const rk_redis_url *u, int timeout_ms, redisContext **out) {
    *out = NULL;
    redisContext *c = redisConnectWithTimeout(u->host, u->port, tv_ms(timeout_ms));
    if (!c) return rk_errorf(RK_ERR_NOMEM, "redis: no memory for a connection");
    if (c->err) {
        rk_status st = rk_errorf(RK_ERR_IO, "redis %s:%d: connect: %s", u->host, u->port,
                                 rk_redis_conn_error(c));
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

/* A half-open probe on *pc that does not wait for the breaker's back-off:
 * PING on the open connection (once more on a new one when the server
 * closed it), or connect (which PINGs) when it is down. Returns 1 when Redis
 * answered: the breaker closes, so every connection's calls resume. Returns
 * 0 when it did not: a failure counted against the breaker, the connection
 * closed. Costs at most about two timeouts. */
int rk_redis_probe(rk_redis *r, redisContext **pc) {
    char why[200] = "";
    if (*pc) {
        redisReply *rep = redisCommand(*pc, "PING");
        int ok = rep && rep->type != REDIS_REPLY_ERROR;
        if (!ok) snprintf(why, sizeof why, "PING: %s", rep ? rep->str : rk_redis_conn_error(*pc));
        int timed_out = !rep && conn_timed_out(*pc);
        freeReplyObject(rep);
        if (ok) {
            breaker_success(r);
            return 1;
        }
        redisFree(*pc);
        *pc = NULL;
        if (timed_out) {
            rk_redis_breaker_failure(r, why);
            return 0;
        }
    }
    rk_status st = rk_redis_connect(&r->url, r->cfg.timeout_ms, pc);
    if (st) {
        rk_redis_breaker_failure(r, rk_error_message());
        return 0;
    }
    breaker_success(r);
    return 1;
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
rk_status rk_redis_run_cmds(rk_redis *r, redisContext **pc, int n, const int *argc,
                            const char **const *argv, const size_t *const *lens, redisReply **out) {
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (!breaker_allow(r)) return RK_ERR_BUSY;
    for (int attempt = 0;; attempt++) {
        int fresh = !*pc;
        if (fresh) {
            rk_status st = rk_redis_connect(&r->url, r->cfg.timeout_ms, pc);
            if (st) {
                rk_redis_breaker_failure(r, rk_error_message());
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
        snprintf(why, sizeof why, "%s: %s", argv[0][0], rk_redis_conn_error(*pc));
        int retry = !fresh && attempt == 0 && !conn_timed_out(*pc) && (*pc)->err != REDIS_ERR_OOM;
        redisFree(*pc);
        *pc = NULL;
        if (retry) {
            RK_LOG_DEBUG("redis %s:%d: %s; reconnecting once", r->url.host, r->url.port, why);
            continue;
        }
        rk_redis_breaker_failure(r, why);
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
        rk_redis_breaker_failure(r, why);
        return RK_ERR_IO;
    }
    breaker_success(r);
    return RK_OK;
}

/* Run one command as rk_redis_run_cmds does. */
rk_status rk_redis_run(rk_redis *r, redisContext **pc, int argc, const char **argv,
                       const size_t *lens, redisReply **out) {
    const char **const argvs[] = {argv};
    const size_t *const lenss[] = {lens};
    return rk_redis_run_cmds(r, pc, 1, &argc, argvs, lenss, out);
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

rk_status rk_redis_config_check(const rk_redis_config *c) {
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
