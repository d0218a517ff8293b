/* bench/runner_http.c — the request list against a running `ragkv serve`,
 * from --concurrency client threads. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_internal.h"

/* ---------------------------------------------------------------- HTTP runner */

typedef struct http_job {
    bench *b;
    const rk_http_target *t;
    int mode;
    pthread_mutex_t mu;
    int next, done;
    double t0;
} http_job;

static int json_int_at(json_t *o, const char *a, const char *b2, const char *c) {
    json_t *v = json_object_get(o, a);
    if (b2) v = json_object_get(v, b2);
    if (c) v = json_object_get(v, c);
    return json_is_integer(v) ? (int)json_integer_value(v) : -1;
}

static double json_num_at(json_t *o, const char *a, const char *b2, const char *c) {
    json_t *v = json_object_get(json_object_get(json_object_get(o, a), b2), c);
    return json_is_number(v) ? json_number_value(v) : -1;
}

/* Read a completion object into x; 0 when it has the fields the bench needs. */
static int fill_from_json(json_t *o, req_result *x) {
    x->prompt = json_int_at(o, "usage", "prompt_tokens", NULL);
    x->reused = json_int_at(o, "usage", "prompt_tokens_details", "cached_tokens");
    json_t *t = json_object_get(json_object_get(o, "ragkv"), "timings");
    json_t *pc = json_object_get(t, "prompt_tokens_computed");
    x->computed = json_is_integer(pc) ? (int)json_integer_value(pc) : -1;
    x->sys_tokens = json_int_at(json_object_get(o, "ragkv"), "system", "tokens", NULL);
    x->sys_cached = json_int_at(json_object_get(o, "ragkv"), "system", "cached_tokens", NULL);
    x->q_tokens = json_int_at(json_object_get(o, "ragkv"), "question", "tokens", NULL);
    json_t *chunks = json_object_get(json_object_get(o, "ragkv"), "chunks");
    if (x->prompt < 0 || x->reused < 0 || x->computed < 0 || x->sys_tokens < 0 ||
        x->sys_cached < 0 || x->q_tokens < 0 || !json_is_array(chunks))
        return -1;
    size_t i;
    json_t *c;
    json_array_foreach(chunks, i, c) {
        int tokens = json_int_at(c, "tokens", NULL, NULL);
        const char *status = json_string_value(json_object_get(c, "status"));
        if (tokens < 0 || !status) return -1;
        x->n_chunks++;
        x->chunk_tokens += tokens;
        if (!strcmp(status, "hit")) {
            x->hits++;
            x->hit_tokens += tokens;
        } else if (!strcmp(status, "miss")) {
            x->misses++;
        } else {
            x->offs++;
        }
    }
    return 0;
}

static void *http_worker(void *arg) {
    http_job *job = arg;
    bench *b = job->b;
    mode_result *m = &b->res[job->mode];
    for (;;) {
        pthread_mutex_lock(&job->mu);
        int j = job->next < m->n_run ? m->run[job->next++] : -1;
        pthread_mutex_unlock(&job->mu);
        if (j < 0) break;
        /* The same options as in-process (mode_options): greedy, no early stop. */
        int plain = job->mode == MODE_PLAIN || job->mode == MODE_PREFIX;
        json_t *body = json_pack("{s:s, s:i, s:f, s:i, s:b, s:s, s:s, s:b, s:b}", "prompt",
                                 b->w.prompt[j], "max_tokens", b->o.max_tokens, "temperature", 0.0,
                                 "seed", (int)(b->o.seed & 0x7fffffff), "ignore_eos", 1, "mode",
                                 plain ? "plain" : "rag", "chunk_cache",
                                 job->mode == MODE_ORACLE ? "off" : "on", "prefix_cache",
                                 job->mode != MODE_PLAIN, "reuse_sequences", 0);
        req_result *x = &m->req[j];
        int status = 0;
        json_t *resp = NULL;
        char *raw = NULL;
        double t0 = rk_time_now();
        rk_status st =
            body ? rk_http_post_json(job->t, "/v1/completions", body, &status, &resp, &raw)
                 : rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
        double e2e = (rk_time_now() - t0) * 1e3;
        json_decref(body);
        char err[256] = "";
        if (st) {
            snprintf(err, sizeof err, "request %d: %s", j, rk_error_message());
        } else if (status != 200 || !resp) {
            snprintf(err, sizeof err, "request %d: HTTP %d: %.180s", j, status, raw ? raw : "");
        } else if (fill_from_json(resp, x)) {
            snprintf(err, sizeof err, "request %d: the response lacks usage or ragkv fields", j);
        } else {
            double ttft = json_num_at(resp, "ragkv", "timings", "ttft_ms");
            double total = json_num_at(resp, "ragkv", "timings", "total_ms");
            double queue = json_num_at(resp, "ragkv", "timings", "queue_ms");
            x->e2e_ms = e2e;
            x->server_total_ms = total;
            /* Client-side TTFT: the latency less what the server spent after its first
             * token. The server's total_ms counts its queue wait, its ttft_ms does not. */
            double after = total - (queue > 0 ? queue : 0) - ttft;
            x->ttft_ms = ttft >= 0 && after >= 0 ? e2e - after : e2e;
            x->ok = 1;
        }
        json_decref(resp);
        free(raw);
        pthread_mutex_lock(&job->mu);
        if (err[0] && !m->error[0]) snprintf(m->error, sizeof m->error, "%s", err);
        int before = job->done++;
        rk_bench_maybe_progress(b, job->mode, before, before + 1, job->t0);
        pthread_mutex_unlock(&job->mu);
    }
    return NULL;
}

static rk_status http_prewarm(bench *b, const rk_http_target *t, mode_result *m) {
    const workload *w = &b->w;
    double t0 = rk_time_now();
    for (int i = 0; i < w->n_chunks; i += PREWARM_GROUP) {
        int n = w->n_chunks - i < PREWARM_GROUP ? w->n_chunks - i : PREWARM_GROUP;
        json_t *arr = json_array();
        for (int c = 0; c < n; c++) json_array_append_new(arr, json_string(w->chunk[i + c]));
        json_t *body = json_pack("{s:o, s:b}", "chunks", arr, "persist", 0);
        if (!body) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
        int status;
        json_t *resp;
        char *raw;
        rk_status st = rk_http_post_json(t, "/v1/chunks", body, &status, &resp, &raw);
        json_decref(body);
        if (st) return st;
        if (status != 200) {
            st = rk_errorf(RK_ERR_IO, "POST /v1/chunks: HTTP %d: %.180s", status, raw ? raw : "");
            json_decref(resp);
            free(raw);
            return st;
        }
        size_t q;
        json_t *e;
        json_t *list = json_object_get(resp, "data"); /* API.md's list, OpenAI style */
        if (!json_is_array(list)) list = json_object_get(resp, "chunks");
        int failed = 0;
        json_array_foreach(list, q, e) {
            const char *s = json_string_value(json_object_get(e, "status"));
            if (s && !strcmp(s, "computed")) {
                m->prewarm_chunks++;
                m->prewarm_tokens += json_int_at(e, "tokens", NULL, NULL);
            }
            failed += !s || !strcmp(s, "failed");
        }
        if (!json_is_array(list) || json_array_size(list) != (size_t)n || failed) {
            json_decref(resp);
            free(raw);
            return rk_errorf(RK_ERR_FORMAT,
                             "POST /v1/chunks: %d of %d chunks not pre-warmed (or no list)", failed,
                             n);
        }
        json_decref(resp);
        free(raw);
    }
    m->prewarm_s = rk_time_now() - t0;
    m->prewarmed = 1;
    return RK_OK;
}

/* Name the served model from GET /v1/models, and warn when the workload was
 * sized with another model's tokenizer (the embedded one against a file, or
 * the other way round). */
void rk_bench_http_describe_model(bench *b, const rk_http_target *t) {
    int status = 0;
    char *raw = NULL;
    snprintf(b->model_desc, sizeof b->model_desc, "served model");
    if (rk_http_request(t, "GET", "/v1/models", NULL, 0, &status, &raw) || status != 200) {
        free(raw);
        return;
    }
    json_t *root = json_loads(raw, 0, NULL);
    free(raw);
    json_t *m = json_array_get(json_object_get(root, "data"), 0);
    const char *id = json_string_value(json_object_get(m, "id"));
    const char *src = json_string_value(json_object_get(json_object_get(m, "ragkv"), "source"));
    if (id) snprintf(b->model_desc, sizeof b->model_desc, "%s", id);
    if (src && (strcmp(src, "embedded") == 0) != (b->o.model == NULL))
        rk_bench_add_warning(
            b,
            "the server serves %s but the workload was sized with the tokenizer of %s: "
            "token counts differ from the server's",
            src, b->o.model ? b->o.model : "the embedded model");
    json_decref(root);
}

rk_status rk_bench_run_http(bench *b, const rk_http_target *t, int mode) {
    mode_result *m = &b->res[mode];
    /* Empty caches: flush both (an admin endpoint; a refusal is reported, not fatal). */
    json_t *body = json_pack("{s:s, s:b}", "what", "all", "disk", 0);
    int status = 0;
    json_t *resp = NULL;
    rk_status st = body ? rk_http_post_json(t, "/v1/cache/flush", body, &status, &resp, NULL)
                        : rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    json_decref(body);
    json_decref(resp);
    if (st) return st;
    if (status != 200)
        rk_bench_add_warning(b, "POST /v1/cache/flush answered %d before %s: caches carry over",
                             status, k_mode_names[mode]);
    m->vmhwm_kb = -1;
    if (mode == MODE_RAG && b->o.prewarm && (st = http_prewarm(b, t, m))) return st;
    int C = b->o.concurrency;
    pthread_t *th = calloc((size_t)C, sizeof *th);
    if (!th) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    http_job job = {.b = b, .t = t, .mode = mode, .t0 = rk_time_now()};
    pthread_mutex_init(&job.mu, NULL);
    int started = 0;
    for (int i = 0; i < C; i++) {
        if (pthread_create(&th[i], NULL, http_worker, &job)) break;
        started++;
    }
    if (started == 0) http_worker(&job);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    m->wall_s = rk_time_now() - job.t0;
    pthread_mutex_destroy(&job.mu);
    free(th);
    m->ran = 1;
    return RK_OK;
}
