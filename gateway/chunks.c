/* gateway/chunks.c — the chunk and cache routes: POST /v1/chunks
 * (pre-warm), GET /v1/chunks (list), GET and DELETE /v1/chunks/{key},
 * POST /v1/cache/flush. What touches the caches runs on the engine thread as
 * a queued command (run_command); a Redis SCAN runs on the worker thread
 * with a connection of its own, so it never holds the engine up. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer.h"
#include "gateway/http.h"

/* ================================================================ cache commands */

/* Run fn on the engine thread and wait (at most until the request timeout).
 * Returns the command's status (RK_ERR_EXHAUSTED when it never ran: queue
 * full, timeout, shutdown), with its message in msg. */
static rk_status run_command(req_ctx *rc, rk_scheduler_fn fn, void *ctx, int anytime, char *msg,
                             size_t cap) {
    server *S = rc->S;
    rk_job job;
    if (rk_job_init(&job)) return rk_errorf(RK_ERR_INTERNAL, "cannot create a job");
    job.fn = fn;
    job.fn_ctx = ctx;
    job.anytime = anytime;
    rk_status st = rk_scheduler_submit(S->engine, &job);
    if (st) {
        snprintf(msg, cap, "%s", rk_error_message());
        rk_job_destroy(&job);
        return RK_ERR_EXHAUSTED; /* queue full, loading or stopping: 503 */
    }
    int n, done = 0, timed_out = 0;
    while (!done)
        if (rk_job_wait(&job, 0, timed_out ? 0 : rc->t0 + S->o.timeout_s, &n, &done)) {
            timed_out = 1;
            rk_scheduler_cancel(S->engine, &job);
        }
    st = job.ran ? job.status : RK_ERR_EXHAUSTED;
    snprintf(msg, cap, "%s",
             job.ran                     ? job.error
             : atomic_load(&S->stopping) ? "the server is shutting down"
                                         : "the command was cancelled before it ran");
    rk_job_destroy(&job);
    return st;
}

/* A chunk as JSON: an arena entry with the id and last use the engine
 * remembers (engine thread), or a store row. */
static json_t *chunk_json(rk_scheduler *e, const rk_chunk_info *c) {
    if (!strcmp(c->tier, "disk"))
        return json_pack("{s:s, s:s?, s:i, s:I, s:I, s:f, s:f, s:s, s:s}", "key", c->key, "id",
                         c->doc_id[0] ? c->doc_id : NULL, "tokens", c->tokens, "bytes",
                         (json_int_t)c->bytes, "hits", (json_int_t)c->hits, "created", c->created,
                         "last_access", c->last_access, "tier", "disk", "policy", c->policy);
    double last = 0;
    const char *id = rk_scheduler_chunk_meta(e, c->key, &last);
    return json_pack("{s:s, s:s?, s:i, s:I, s:I, s:f, s:f, s:s, s:s, s:i, s:i}", "key", c->key,
                     "id", id, "tokens", c->tokens, "bytes", (json_int_t)c->bytes, "hits",
                     (json_int_t)c->hits, "created", c->created, "last_access",
                     last > 0 ? last : c->created, "tier", "arena", "source", c->source, "refs",
                     c->refs, "base_pos", c->base_pos);
}

typedef struct list_cmd {
    rk_cache_viewer who;
    int by_hits, limit, offset, disk;
    json_t *out;
} list_cmd;

static rk_status list_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    list_cmd *l = ctx;
    rk_chunk_listing ls;
    rk_status st =
        rk_service_chunk_list(svc, &l->who, l->disk, l->by_hits, l->offset, l->limit, &ls);
    if (st) return st;
    json_t *data = json_array();
    for (int i = 0; i < ls.n && data; i++) json_array_append_new(data, chunk_json(e, &ls.v[i]));
    l->out = json_pack("{s:s, s:o, s:I, s:i, s:i, s:s, s:s}", "object", "list", "data", data,
                       "total", (json_int_t)ls.total, "offset", l->offset, "limit", l->limit,
                       "sort", l->by_hits ? "hits" : "recent", "tier", l->disk ? "disk" : "arena");
    rk_chunk_listing_free(&ls);
    return l->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

typedef struct top_cmd {
    rk_cache_viewer who;
    json_t *out;
} top_cmd;

/* The viewer's most hit chunks, as /v1/stats' top_chunks. */
static rk_status top_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    top_cmd *t = ctx;
    rk_chunk_listing ls;
    rk_status st = rk_service_chunk_list(svc, &t->who, 0, 1, 0, RK_STATS_TOP, &ls);
    if (st) return st;
    t->out = json_array();
    for (int i = 0; i < ls.n && t->out && ls.v[i].hits > 0; i++)
        json_array_append_new(t->out, json_pack("{s:s, s:s?, s:I}", "key", ls.v[i].key, "id",
                                                rk_scheduler_chunk_meta(e, ls.v[i].key, NULL),
                                                "hits", (json_int_t)ls.v[i].hits));
    rk_chunk_listing_free(&ls);
    return t->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

json_t *rk_gw_top_chunks(req_ctx *rc) {
    top_cmd t = {.who = rk_gw_viewer(rc)};
    char msg[320];
    if (run_command(rc, top_fn, &t, 1, msg, sizeof msg)) {
        json_decref(t.out);
        return NULL;
    }
    return t.out;
}

typedef struct key_cmd {
    rk_cache_viewer who;
    rk_chunk_key key;
    char hex[33];
    json_t *out;
    int in_arena, on_disk; /* what a delete removed */
    char disk_why[200];    /* why its payload file stayed; "" when it did not */
} key_cmd;

static rk_status get_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    key_cmd *k = ctx;
    rk_chunk_info c;
    rk_status st = rk_service_chunk_get(svc, &k->who, k->key, &c);
    if (st) return st;
    k->out = chunk_json(e, &c);
    if (k->out && svc->store && !strcmp(c.tier, "arena"))
        json_object_set_new(k->out, "on_disk", json_boolean(c.on_disk));
    return k->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

/* Remove a chunk from the arena and from the store. */
static rk_status delete_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    key_cmd *k = ctx;
    rk_status st = rk_service_chunk_delete(svc, &k->who, k->key, &k->in_arena, &k->on_disk,
                                           k->disk_why, sizeof k->disk_why);
    if (k->in_arena) rk_scheduler_count_removed(e, 1, 0);
    return st;
}

typedef struct flush_cmd {
    rk_flush_request req;
    rk_flush_counts n;
} flush_cmd;

static rk_status flush_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    flush_cmd *f = ctx;
    rk_status st = rk_service_flush(svc, f->req.chunks, f->req.prefix, f->req.disk, &f->n);
    rk_scheduler_count_removed(e, (uint64_t)f->n.chunks, f->n.prefix_nodes);
    return st;
}

typedef struct prewarm_cmd {
    /* The isolated context: the pipeline's own pre-warm, which also checks
     * the disk tier and writes to it (persist). */
    rk_prewarm_item *items; /* (n) or NULL */
    int persist;
    /* The system context: one request per chunk, computing and generating nothing. */
    rk_request **reqs; /* (n) NULL where the chunk failed before running */
    rk_run_result *res;
    int n;
    char **ids;
} prewarm_cmd;

static rk_status prewarm_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    prewarm_cmd *p = ctx;
    if (p->items) {
        rk_status st = rk_pipeline_prewarm(svc, p->items, p->n, p->persist);
        for (int i = 0; i < p->n; i++)
            if (p->items[i].key[0] && strcmp(p->items[i].status, "failed"))
                rk_scheduler_chunk_touch(e, p->items[i].key, p->ids[i]);
        return st;
    }
    rk_request **run = malloc((size_t)p->n * sizeof *run);
    rk_run_result *res = malloc((size_t)p->n * sizeof *res);
    if (!run || !res) {
        free(run);
        free(res);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    int m = 0;
    for (int i = 0; i < p->n; i++)
        if (p->reqs[i]) run[m++] = p->reqs[i];
    rk_scheduler_run(e, run, m, res);
    for (int i = 0, k = 0; i < p->n; i++) {
        if (!p->reqs[i]) continue;
        p->res[i] = res[k++];
        if (p->res[i].status == RK_OK && p->reqs[i]->chunk_reports[0].key[0])
            rk_scheduler_chunk_touch(e, p->reqs[i]->chunk_reports[0].key, p->ids[i]);
    }
    free(run);
    free(res);
    return RK_OK;
}

/* A request that computes one chunk and generates nothing. */
static rk_status prewarm_request(rk_service *svc, const int32_t *sys, int n_sys, const char *text,
                                 int context_system, rk_request **out) {
    *out = NULL;
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int32_t *ids = NULL;
    size_t n = 0;
    rk_status st = rk_tokenizer_encode(tok, text, strlen(text), 0, &ids, &n);
    if (st) return st;
    if (n == 0) {
        free(ids);
        return rk_errorf(RK_ERR_INVALID, "the chunk tokenizes to nothing");
    }
    if ((long)n > svc->cfg.max_chunk_tokens) {
        free(ids);
        return rk_errorf(RK_ERR_LIMIT, "the chunk has %zu tokens; at most %d are allowed", n,
                         svc->cfg.max_chunk_tokens);
    }
    long ctx_limit =
        svc->cfg.max_context > 0 ? svc->cfg.max_context : rk_model_hparams(svc->model)->n_ctx;
    if ((long)n + n_sys > ctx_limit) {
        free(ids);
        return rk_errorf(RK_ERR_LIMIT, "the chunk needs %ld tokens of context; the limit is %ld",
                         (long)n + n_sys, ctx_limit);
    }
    rk_request *r = calloc(1, sizeof *r);
    if (!r) {
        free(ids);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    rk_req_options_default(&r->opt);
    r->opt.max_tokens = 0;
    r->opt.chunk_context = context_system ? RK_CONTEXT_SYSTEM : RK_CONTEXT_ISOLATED;
    r->opt.prefix_cache = context_system;
    r->sys = malloc((size_t)(n_sys + 1) * sizeof *r->sys);
    r->chunks = calloc(1, sizeof *r->chunks);
    r->chunk_lens = calloc(1, sizeof *r->chunk_lens);
    r->out_tokens = malloc(sizeof *r->out_tokens);
    r->logprobs = malloc(sizeof *r->logprobs);
    r->chunk_reports = calloc(1, sizeof *r->chunk_reports);
    if (!r->sys || !r->chunks || !r->chunk_lens || !r->out_tokens || !r->logprobs ||
        !r->chunk_reports) {
        free(ids);
        rk_request_free(r);
        free(r);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    if (n_sys) memcpy(r->sys, sys, (size_t)n_sys * sizeof *sys);
    r->n_sys = n_sys;
    r->chunks[0] = ids;
    r->chunk_lens[0] = (int)n;
    r->n_chunks = 1;
    *out = r;
    return RK_OK;
}

typedef struct prep_pw {
    const req_ctx *rc;
    rk_service *svc;
    const char *body;
    size_t len;
    rk_prewarm_request pw;
    prewarm_cmd cmd;
    rk_http_error err; /* status 0: prepared */
} prep_pw;

/* Parse the body and tokenize every chunk (on a big stack). */
static void prep_prewarm(void *arg) {
    prep_pw *p = arg;
    rk_service *svc = p->svc;
    if (rk_prewarm_parse(p->body, p->len, &p->pw, &p->err)) return;
    /* Whose chunks: the caller's own, or (the admin key) the tenant named. */
    const req_ctx *rc = p->rc;
    const rk_tenants *tn = rc->S->tenants;
    int owner = rc->tenant;
    if (p->pw.tenant[0]) {
        int named = rk_tenants_by_name(tn, p->pw.tenant);
        if (!tn) {
            rk_http_errorf(&p->err, 400, "'tenant': no keys file names tenants on this server");
            return;
        }
        if (!rc->sees_all && named != rc->tenant) {
            rk_http_errorf(&p->err, 403, "only the admin key may pre-warm for another tenant");
            return;
        }
        if (!named) {
            rk_http_errorf(&p->err, 400, "'tenant': no tenant is named \"%s\"", p->pw.tenant);
            return;
        }
        owner = named;
    }
    rk_chunk_key salt = rk_cache_scope(rk_tenants_salt(tn, owner), p->pw.cache_salt);
    if (p->pw.persist && !svc->store && !svc->redis) {
        rk_http_errorf(&p->err, 501,
                       "persistence is not configured: start the server with --store DIR "
                       "or --redis URL");
        return;
    }
    p->cmd.n = p->pw.n;
    p->cmd.ids = p->pw.ids;
    if (!p->pw.context_system) { /* the engine tokenizes and looks up */
        p->cmd.persist = p->pw.persist;
        p->cmd.items = calloc((size_t)p->pw.n, sizeof *p->cmd.items);
        if (!p->cmd.items) {
            rk_http_errorf(&p->err, 500, "out of memory");
            return;
        }
        for (int i = 0; i < p->pw.n; i++)
            p->cmd.items[i] = (rk_prewarm_item){.text = p->pw.texts[i],
                                                .len = strlen(p->pw.texts[i]),
                                                .doc_id = p->pw.ids[i],
                                                .salt = salt,
                                                .owner = owner};
        return;
    }
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int bos = rk_tokenizer_add_bos(tok) && rk_tokenizer_bos(tok) >= 0;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    rk_error_clear();
    rk_status st = RK_OK;
    if (p->pw.context_system && *p->pw.system &&
        (st = rk_tokenizer_encode(tok, p->pw.system, strlen(p->pw.system), 1, &ids, &n_ids))) {
        rk_http_errorf(&p->err, rk_http_status_of(st), "system: %s", rk_error_message());
        return;
    }
    int32_t *sys = malloc((n_ids + 1) * sizeof *sys);
    p->cmd.n = p->pw.n;
    p->cmd.ids = p->pw.ids;
    p->cmd.reqs = calloc((size_t)p->pw.n, sizeof *p->cmd.reqs);
    p->cmd.res = calloc((size_t)p->pw.n, sizeof *p->cmd.res);
    if (!sys || !p->cmd.reqs || !p->cmd.res) {
        free(ids);
        free(sys);
        rk_http_errorf(&p->err, 500, "out of memory");
        return;
    }
    if (bos) sys[0] = rk_tokenizer_bos(tok);
    if (n_ids) memcpy(sys + bos, ids, n_ids * sizeof *sys);
    free(ids);
    for (int i = 0; i < p->pw.n; i++) {
        rk_error_clear();
        rk_status cs = prewarm_request(svc, sys, (int)n_ids + bos, p->pw.texts[i],
                                       p->pw.context_system, &p->cmd.reqs[i]);
        if (!cs) {
            p->cmd.reqs[i]->opt.salt = salt;
            p->cmd.reqs[i]->opt.owner = owner;
        }
        if (cs) {
            p->cmd.res[i].status = cs;
            snprintf(p->cmd.res[i].error, sizeof p->cmd.res[i].error, "%s", rk_error_message());
        }
    }
    free(sys);
}

int rk_gw_handle_prewarm(req_ctx *rc) {
    server *S = rc->S;
    char *body;
    size_t len;
    if (rk_gw_read_body(rc, &body, &len)) return 0;
    prep_pw p;
    memset(&p, 0, sizeof p);
    p.rc = rc;
    p.svc = rk_gw_ready_service(S);
    p.body = body;
    p.len = len;
    if (!p.svc) {
        rk_gw_send_not_ready(rc);
        goto done;
    }
    prep_prewarm(&p);
    if (p.err.status) {
        rk_gw_send_error(rc, &p.err);
        goto done;
    }
    char msg[320];
    rk_status st = run_command(rc, prewarm_fn, &p.cmd, 0, msg, sizeof msg);
    if (st) {
        rk_gw_send_errorf(rc, rk_http_status_of(st), "%s", msg);
        goto done;
    }
    json_t *data = json_array();
    int computed = 0, cached = 0, failed = 0;
    for (int i = 0; i < p.pw.n && data; i++) {
        const char *status = "failed", *key = NULL, *tier = NULL, *error = NULL;
        int tokens = 0;
        if (p.cmd.items) { /* isolated: the pipeline's pre-warm */
            rk_prewarm_item *it = &p.cmd.items[i];
            status = it->status ? it->status : "failed";
            key = it->key[0] ? it->key : NULL;
            tier = strcmp(status, "failed") ? it->tier : NULL;
            error = strcmp(status, "failed") ? NULL : it->error;
            tokens = it->tokens;
        } else { /* system context: one request per chunk */
            rk_request *r = p.cmd.reqs[i];
            if (p.cmd.res[i].status == RK_OK && r) {
                status = r->chunk_reports[0].status == RK_CHUNK_STATUS_HIT ? "cached" : "computed";
                tier = r->chunk_reports[0].source == RK_CHUNK_SOURCE_DISK ? "disk" : "arena";
            } else {
                error = p.cmd.res[i].error;
            }
            key = r && r->chunk_reports[0].key[0] ? r->chunk_reports[0].key : NULL;
            tokens = r ? r->chunk_lens[0] : 0;
        }
        computed += !strcmp(status, "computed");
        cached += !strcmp(status, "cached");
        failed += !strcmp(status, "failed");
        json_array_append_new(data, json_pack("{s:i, s:s?, s:s?, s:i, s:s, s:s?, s:s?}", "index", i,
                                              "id", p.pw.ids[i], "key", key, "tokens", tokens,
                                              "status", status, "tier", tier, "error", error));
    }
    snprintf(rc->detail, sizeof rc->detail, " chunks=%d computed=%d cached=%d failed=%d", p.pw.n,
             computed, cached, failed);
    rk_gw_send_json(rc, 200,
                    json_pack("{s:s, s:o, s:i, s:i, s:i}", "object", "list", "data", data,
                              "computed", computed, "cached", cached, "failed", failed));
done:
    free(body);
    if (p.cmd.reqs)
        for (int i = 0; i < p.cmd.n; i++) {
            rk_request_free(p.cmd.reqs[i]);
            free(p.cmd.reqs[i]);
        }
    free(p.cmd.reqs);
    free(p.cmd.res);
    free(p.cmd.items);
    rk_prewarm_request_free(&p.pw);
    return 0;
}

/* Query parameter as an integer in [lo, hi]; def when absent. -1 on a bad value. */
static int query_int(const char *qs, const char *name, long lo, long hi, long def, long *out) {
    char buf[32];
    *out = def;
    if (!qs) return 0;
    int n = mg_get_var(qs, strlen(qs), name, buf, sizeof buf);
    if (n == -1) return 0;
    if (n < 0) return -1;
    char *end;
    errno = 0;
    long v = strtol(buf, &end, 10);
    if (errno || end == buf || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* The shared tier's entries, in SCAN order, listed on this thread (see
 * rk_service_redis_list): the engine is never held up by a SCAN. */
static void list_redis(req_ctx *rc, const list_cmd *l) {
    if (!rc->S->o.cfg.redis_url[0]) {
        rk_gw_send_errorf(rc, 501,
                          "the shared tier is not configured: start the server with --redis URL");
        return;
    }
    rk_service *svc = rk_gw_ready_service(rc->S);
    if (!svc) {
        rk_gw_send_not_ready(rc);
        return;
    }
    if (l->by_hits) {
        rk_gw_send_errorf(rc, 400, "the redis tier is listed in SCAN order: 'sort' must be recent");
        return;
    }
    rk_chunk_listing got;
    rk_status st = rk_service_redis_list(svc, &l->who, l->offset, l->limit, &got);
    if (st) {
        rk_gw_send_errorf(rc, st == RK_ERR_IO ? 503 : rk_http_status_of(st), "%s",
                          rk_error_message());
        return;
    }
    json_t *data = json_array();
    for (int i = 0; i < got.n && data; i++)
        json_array_append_new(data,
                              json_pack("{s:s, s:i, s:I, s:f, s:s}", "key", got.v[i].key, "tokens",
                                        got.v[i].tokens, "bytes", (json_int_t)got.v[i].bytes,
                                        "created", got.v[i].created, "tier", "redis"));
    rk_gw_send_json(rc, 200,
                    json_pack("{s:s, s:o, s:I, s:i, s:i, s:s, s:s}", "object", "list", "data", data,
                              "total", (json_int_t)got.total, "offset", l->offset, "limit",
                              l->limit, "sort", "scan", "tier", "redis"));
    rk_chunk_listing_free(&got);
}

int rk_gw_handle_list(req_ctx *rc) {
    const struct mg_request_info *ri = mg_get_request_info(rc->conn);
    const char *qs = ri->query_string;
    long limit, offset;
    if (query_int(qs, "limit", 1, 100000, 100, &limit))
        return rk_gw_send_errorf(rc, 400, "'limit' must be an integer from 1 to 100000"), 0;
    if (query_int(qs, "offset", 0, 1L << 30, 0, &offset))
        return rk_gw_send_errorf(rc, 400, "'offset' must be a non-negative integer"), 0;
    list_cmd l = {.who = rk_gw_viewer(rc), .limit = (int)limit, .offset = (int)offset};
    char sort[16] = "recent";
    int sn = qs ? mg_get_var(qs, strlen(qs), "sort", sort, sizeof sort) : -1;
    if (sn == -1)
        snprintf(sort, sizeof sort, "recent");
    else if (sn < 0)
        return rk_gw_send_errorf(rc, 400, "'sort' must be hits or recent"), 0;
    if (!strcmp(sort, "hits"))
        l.by_hits = 1;
    else if (strcmp(sort, "recent") != 0)
        return rk_gw_send_errorf(rc, 400, "'sort' must be hits or recent"), 0;
    char tier[16] = "arena";
    int tn = qs ? mg_get_var(qs, strlen(qs), "tier", tier, sizeof tier) : -1;
    if (tn == -1) snprintf(tier, sizeof tier, "arena");
    if (tn < -1 || (strcmp(tier, "arena") && strcmp(tier, "disk") && strcmp(tier, "redis")))
        return rk_gw_send_errorf(rc, 400, "'tier' must be arena, disk or redis"), 0;
    if (strcmp(tier, "arena") && !l.who.all)
        return rk_gw_send_errorf(rc, 403,
                                 "the %s tier keeps no tenants: only the admin key lists it", tier),
               0;
    if (!strcmp(tier, "redis")) return list_redis(rc, &l), 0;
    l.disk = !strcmp(tier, "disk");
    if (l.disk && !rc->S->o.cfg.store_dir[0])
        return rk_gw_send_errorf(rc, 501,
                                 "persistence is not configured: start the server with "
                                 "--store DIR"),
               0;
    if (!rk_gw_ready_service(rc->S)) return rk_gw_send_not_ready(rc), 0;
    char msg[320];
    rk_status st = run_command(rc, list_fn, &l, 1, msg, sizeof msg);
    if (st) {
        json_decref(l.out);
        return rk_gw_send_errorf(rc, rk_http_status_of(st), "%s", msg), 0;
    }
    rk_gw_send_json(rc, 200, l.out);
    return 0;
}

int rk_gw_handle_chunk_key(req_ctx *rc, const char *hex, int del) {
    key_cmd k = {.who = rk_gw_viewer(rc)};
    if (strlen(hex) != 32 || rk_chunk_key_parse(hex, &k.key))
        return rk_gw_send_errorf(rc, 400, "a chunk key is 32 lowercase hexadecimal digits"), 0;
    rk_chunk_key_hex(k.key, k.hex);
    if (!rk_gw_ready_service(rc->S)) return rk_gw_send_not_ready(rc), 0;
    char msg[320];
    rk_status st = run_command(rc, del ? delete_fn : get_fn, &k, 1, msg, sizeof msg);
    if (st) {
        json_decref(k.out);
        int status = st == RK_ERR_BUSY ? 409 : rk_http_status_of(st);
        return rk_gw_send_errorf(rc, status, "%s", msg), 0;
    }
    if (del) {
        json_t *out = json_pack("{s:s, s:b, s:b, s:b}", "key", k.hex, "deleted", 1, "arena",
                                k.in_arena, "disk", k.on_disk);
        if (out && k.disk_why[0]) json_object_set_new(out, "disk_error", json_string(k.disk_why));
        rk_gw_send_json(rc, 200, out);
    } else
        rk_gw_send_json(rc, 200, k.out);
    return 0;
}

int rk_gw_handle_flush(req_ctx *rc) {
    char *body;
    size_t len;
    if (rk_gw_read_body(rc, &body, &len)) return 0;
    flush_cmd f = {0};
    rk_http_error err = {0};
    rk_status st = rk_flush_parse(body, len, &f.req, &err);
    free(body);
    if (st) return rk_gw_send_error(rc, &err), 0;
    if (f.req.disk && !rc->S->o.cfg.store_dir[0])
        return rk_gw_send_errorf(rc, 501,
                                 "persistence is not configured: start the server with "
                                 "--store DIR"),
               0;
    if (f.req.redis && !rc->S->o.cfg.redis_url[0])
        return rk_gw_send_errorf(
                   rc, 501, "the shared tier is not configured: start the server with --redis URL"),
               0;
    rk_service *svc = rk_gw_ready_service(rc->S);
    if (!svc) return rk_gw_send_not_ready(rc), 0;
    char msg[320];
    if ((st = run_command(rc, flush_fn, &f, 1, msg, sizeof msg)))
        return rk_gw_send_errorf(rc, rk_http_status_of(st), "%s", msg), 0;
    /* The shared tier on this thread (rk_service_redis_flush): a SCAN over
     * many keys must not hold the engine up. */
    uint64_t redis_keys = 0;
    if (f.req.redis && (st = rk_service_redis_flush(svc, &redis_keys)))
        return rk_gw_send_errorf(rc, st == RK_ERR_IO ? 503 : rk_http_status_of(st), "%s",
                                 rk_error_message()),
               0;
    json_t *out = json_pack("{s:{s:i, s:I, s:I, s:I, s:I, s:I}}", "flushed", "chunks", f.n.chunks,
                            "prefix_nodes", (json_int_t)f.n.prefix_nodes, "prefix_tokens",
                            (json_int_t)f.n.prefix_tokens, "disk_rows", (json_int_t)f.n.disk_rows,
                            "disk_files_left", (json_int_t)f.n.disk_files_left, "redis_keys",
                            (json_int_t)redis_keys);
    if (out && f.n.disk_why[0])
        json_object_set_new(json_object_get(out, "flushed"), "disk_error",
                            json_string(f.n.disk_why));
    rk_gw_send_json(rc, 200, out);
    return 0;
}

rk_status rk_gw_run_command(req_ctx *rc, rk_scheduler_fn fn, void *ctx, int anytime, char *msg,
                            size_t cap) {
    return run_command(rc, fn, ctx, anytime, msg, cap);
}
