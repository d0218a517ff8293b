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

static uint64_t kv_block_bytes(rk_service *svc) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    return 2ull * (uint64_t)kv->n_layers * (uint64_t)kv->block_size * (uint64_t)kv->n_kv_heads *
           (uint64_t)kv->head_dim * rk_dtype_size(kv->dtype);
}

/* One cached entry as JSON (engine thread: reads the index and metadata). */
static json_t *entry_json(rk_scheduler *e, rk_service *svc, const rk_chunk_entry *en) {
    char key[33];
    rk_chunk_key_hex(en->key, key);
    double last = 0;
    const char *id = rk_scheduler_chunk_meta(e, key, &last);
    return json_pack(
        "{s:s, s:s?, s:i, s:I, s:I, s:f, s:f, s:s, s:s, s:i, s:i}", "key", key, "id", id, "tokens",
        en->n_tokens, "bytes", (json_int_t)((uint64_t)en->n_blocks * kv_block_bytes(svc)), "hits",
        (json_int_t)en->hits, "created", en->created, "last_access", last > 0 ? last : en->created,
        "tier", "arena", "source", en->source, "refs", en->refs, "base_pos", en->base_pos);
}

/* One store row as JSON (the disk tier). */
static json_t *disk_entry_json(const rk_store_entry *r) {
    return json_pack("{s:s, s:s?, s:i, s:I, s:I, s:f, s:f, s:s, s:s}", "key", r->key, "id",
                     r->doc_id[0] ? r->doc_id : NULL, "tokens", r->n_tokens, "bytes",
                     (json_int_t)r->n_bytes, "hits", (json_int_t)r->hits, "created", r->created,
                     "last_access", r->last_access, "tier", "disk", "policy", r->policy);
}

typedef struct list_cmd {
    int by_hits, limit, offset, disk;
    const rk_chunk_entry **v;
    int n, cap, oom;
    json_t *out;
} list_cmd;

static int collect(void *ctx, const rk_chunk_entry *en) {
    list_cmd *l = ctx;
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 256;
        const rk_chunk_entry **v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) {
            l->oom = 1;
            return 1;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = en;
    return 0;
}

static void sort_by_hits(const rk_chunk_entry **v, int n) {
    /* Stable insertion-merge: a bottom-up merge sort keeps recency order among ties. */
    const rk_chunk_entry **tmp = malloc((size_t)(n ? n : 1) * sizeof *tmp);
    if (!tmp) return;
    for (int w = 1; w < n; w *= 2)
        for (int lo = 0; lo < n; lo += 2 * w) {
            int mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = v[j]->hits > v[i]->hits ? v[j++] : v[i++];
            while (i < mid) tmp[k++] = v[i++];
            while (j < hi) tmp[k++] = v[j++];
            memcpy(v + lo, tmp + lo, (size_t)(hi - lo) * sizeof *v);
        }
    free(tmp);
}

/* The disk tier's rows (the store sorts and pages them). */
static rk_status list_disk(list_cmd *l, rk_service *svc) {
    rk_store_entry *rows = NULL;
    int n = 0;
    rk_store_counters sc;
    rk_status st = rk_store_stats(svc->store, &sc);
    if (!st)
        st = rk_store_list(svc->store, l->by_hits ? RK_STORE_SORT_HITS : RK_STORE_SORT_RECENT,
                           l->limit, l->offset, &rows, &n);
    if (st) return st;
    json_t *data = json_array();
    for (int i = 0; i < n && data; i++) json_array_append_new(data, disk_entry_json(&rows[i]));
    free(rows);
    l->out = json_pack("{s:s, s:o, s:I, s:i, s:i, s:s, s:s}", "object", "list", "data", data,
                       "total", (json_int_t)sc.rows, "offset", l->offset, "limit", l->limit, "sort",
                       l->by_hits ? "hits" : "recent", "tier", "disk");
    return l->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

static rk_status list_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    list_cmd *l = ctx;
    if (l->disk) return list_disk(l, svc);
    rk_chunk_index_foreach(svc->chunks, collect, l);
    if (l->oom) return rk_errorf(RK_ERR_NOMEM, "out of memory");
    if (l->by_hits) sort_by_hits(l->v, l->n);
    json_t *data = json_array();
    for (int i = l->offset; i < l->n && i < l->offset + l->limit && data; i++)
        json_array_append_new(data, entry_json(e, svc, l->v[i]));
    l->out = json_pack("{s:s, s:o, s:i, s:i, s:i, s:s, s:s}", "object", "list", "data", data,
                       "total", l->n, "offset", l->offset, "limit", l->limit, "sort",
                       l->by_hits ? "hits" : "recent", "tier", "arena");
    return l->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

typedef struct key_cmd {
    rk_chunk_key key;
    char hex[33];
    json_t *out;
    int in_arena, on_disk; /* what a delete removed */
} key_cmd;

static rk_status get_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    key_cmd *k = ctx;
    rk_chunk_entry *en = rk_chunk_index_find(svc->chunks, k->key);
    int on_disk = 0;
    if (svc->store) rk_store_contains(svc->store, k->hex, &on_disk);
    if (en) {
        k->out = entry_json(e, svc, en);
        if (k->out && svc->store) json_object_set_new(k->out, "on_disk", json_boolean(on_disk));
    } else if (on_disk) {
        rk_store_entry row;
        if (rk_store_lookup(svc->store, k->hex, &row) == RK_OK) k->out = disk_entry_json(&row);
    }
    if (!k->out && !en && !on_disk)
        return rk_errorf(RK_ERR_NOT_FOUND, "no cached chunk has the key %s", k->hex);
    return k->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

/* Remove a chunk from the arena and from the store. */
static rk_status delete_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    key_cmd *k = ctx;
    rk_status st = rk_chunk_index_remove(svc->chunks, k->key);
    if (st == RK_ERR_BUSY)
        return rk_errorf(st, "the chunk %s is in use by a request in flight; try again", k->hex);
    if (st && st != RK_ERR_NOT_FOUND) return st;
    k->in_arena = st == RK_OK;
    if (k->in_arena) rk_scheduler_count_removed(e, 1, 0);
    if (svc->store) {
        rk_status ds = rk_store_delete(svc->store, k->hex);
        if (ds && ds != RK_ERR_NOT_FOUND) return ds;
        k->on_disk = ds == RK_OK;
    }
    if (!k->in_arena && !k->on_disk)
        return rk_errorf(RK_ERR_NOT_FOUND, "no cached chunk has the key %s", k->hex);
    return RK_OK;
}

typedef struct flush_cmd {
    rk_flush_request req;
    int chunks;
    uint64_t prefix_nodes, prefix_tokens, disk_rows;
} flush_cmd;

static rk_status flush_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    flush_cmd *f = ctx;
    if (f->req.chunks) f->chunks = rk_chunk_index_flush(svc->chunks);
    if (f->req.prefix && svc->prefix) {
        rk_radix_stats a, b;
        rk_radix_get_stats(svc->prefix, &a);
        rk_radix_flush(svc->prefix);
        rk_radix_get_stats(svc->prefix, &b);
        f->prefix_nodes = b.evictions - a.evictions;
        f->prefix_tokens = b.tokens_evicted - a.tokens_evicted;
    }
    rk_scheduler_count_removed(e, (uint64_t)f->chunks, f->prefix_nodes);
    if (f->req.disk && svc->store) return rk_store_flush(svc->store, &f->disk_rows);
    return RK_OK;
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
            p->cmd.items[i] = (rk_prewarm_item){
                .text = p->pw.texts[i], .len = strlen(p->pw.texts[i]), .doc_id = p->pw.ids[i]};
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

/* The shared tier's entries, in SCAN order, listed on this thread: the tier
 * opens a connection of its own, so the engine is never held up by a SCAN. */
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
    rk_redis_entry *v = NULL;
    int n = 0;
    if (rk_redis_list(svc->redis, l->offset + l->limit, &v, &n)) {
        rk_gw_send_errorf(rc, 503, "%s", rk_error_message());
        return;
    }
    json_t *data = json_array();
    for (int i = l->offset; i < n && data; i++)
        json_array_append_new(data,
                              json_pack("{s:s, s:i, s:I, s:f, s:s}", "key", v[i].key, "tokens",
                                        v[i].n_tokens, "bytes", (json_int_t)v[i].n_bytes, "created",
                                        v[i].created, "tier", "redis"));
    free(v);
    /* SCAN has no count: total is what was seen, offset + limit at most. */
    rk_gw_send_json(rc, 200,
                    json_pack("{s:s, s:o, s:i, s:i, s:i, s:s, s:s}", "object", "list", "data", data,
                              "total", n, "offset", l->offset, "limit", l->limit, "sort", "scan",
                              "tier", "redis"));
}

int rk_gw_handle_list(req_ctx *rc) {
    const struct mg_request_info *ri = mg_get_request_info(rc->conn);
    const char *qs = ri->query_string;
    long limit, offset;
    if (query_int(qs, "limit", 1, 100000, 100, &limit))
        return rk_gw_send_errorf(rc, 400, "'limit' must be an integer from 1 to 100000"), 0;
    if (query_int(qs, "offset", 0, 1L << 30, 0, &offset))
        return rk_gw_send_errorf(rc, 400, "'offset' must be a non-negative integer"), 0;
    list_cmd l = {.limit = (int)limit, .offset = (int)offset};
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
    free(l.v);
    if (st) {
        json_decref(l.out);
        return rk_gw_send_errorf(rc, rk_http_status_of(st), "%s", msg), 0;
    }
    rk_gw_send_json(rc, 200, l.out);
    return 0;
}

int rk_gw_handle_chunk_key(req_ctx *rc, const char *hex, int del) {
    key_cmd k = {0};
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
    if (del)
        rk_gw_send_json(rc, 200,
                        json_pack("{s:s, s:b, s:b, s:b}", "key", k.hex, "deleted", 1, "arena",
                                  k.in_arena, "disk", k.on_disk));
    else
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
    /* The shared tier on this thread (its own connection): a SCAN over many
     * keys must not hold the engine up. Other models' keys are kept. */
    uint64_t redis_keys = 0;
    if (f.req.redis && rk_redis_flush(svc->redis, &redis_keys))
        return rk_gw_send_errorf(rc, 503, "%s", rk_error_message()), 0;
    rk_gw_send_json(rc, 200,
                    json_pack("{s:{s:i, s:I, s:I, s:I, s:I}}", "flushed", "chunks", f.chunks,
                              "prefix_nodes", (json_int_t)f.prefix_nodes, "prefix_tokens",
                              (json_int_t)f.prefix_tokens, "disk_rows", (json_int_t)f.disk_rows,
                              "redis_keys", (json_int_t)redis_keys));
    return 0;
}
