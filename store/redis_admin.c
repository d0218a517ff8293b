/* store/redis_admin.c — `ragkv cache` on the shared Redis tier: list and
 * flush this model's entries, walking them with SCAN on a connection of their
 * own. */
#include "store/redis.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/redis_internal.h"

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
        if (!rep) return rk_errorf(RK_ERR_IO, "redis SCAN: %s", rk_redis_conn_error(c));
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
    if (!rep) return rk_errorf(RK_ERR_IO, "redis MGET: %s", rk_redis_conn_error(c));
    rk_status st = RK_OK;
    size_t stem = strlen(r->prefix) + 1 + RK_STORE_KEY_LEN + 1; /* "PREFIX:FP:" */
    for (size_t i = 0; rep->type == REDIS_REPLY_ARRAY && i < rep->elements && i < n; i++) {
        if (lc->limit > 0 && lc->n >= lc->limit) break;
        const redisReply *k = keys->element[i], *v = rep->element[i];
        meta m;
        if (v->type != REDIS_REPLY_STRING || rk_redis_meta_parse(v->str, v->len, &m) ||
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
    rk_status st = rk_redis_connect(&r->url, r->cfg.timeout_ms, &c);
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
            st = rk_errorf(RK_ERR_IO, "redis UNLINK: %s", rk_redis_conn_error(c));
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
    rk_status st = rk_redis_connect(&r->url, r->cfg.timeout_ms, &c);
    if (st) return st;
    char pattern[KEY_CAP];
    snprintf(pattern, sizeof pattern, "%s:%s:*", r->prefix, r->fp);
    uint64_t removed = 0;
    st = scan_all(r, c, pattern, flush_batch, &removed);
    redisFree(c);
    if (out_removed) *out_removed = removed;
    return st;
}
