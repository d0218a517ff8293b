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
    const rk_http_target *t; /* (n_t) replicas, round-robin by request */
    int n_t;
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
            const char *source = json_string_value(json_object_get(c, "source"));
            x->hits++;
            x->prefix_hits += source && !strcmp(source, "prefix");
            x->hit_tokens += tokens;
        } else if (!strcmp(status, "miss")) {
            x->misses++;
        } else {
            x->offs++;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- one streamed request */

/* When the first generated text arrived: the first event whose "text" (a
 * completion) or "content" (a chat delta) is a non-empty string. Events
 * are compact JSON, so the key and its opening quote are adjacent. */
typedef struct first_text {
    size_t scanned;
    double t;
} first_text;

static void note_first_text(void *ctx, const char *raw, size_t len) {
    first_text *f = ctx;
    if (f->t > 0) return;
    size_t from = f->scanned > 16 ? f->scanned - 16 : 0;
    f->scanned = len;
    static const char *const keys[2] = {"\"text\":\"", "\"content\":\""};
    for (int k = 0; k < 2; k++) {
        size_t kl = strlen(keys[k]);
        for (const char *p = raw + from; (p = strstr(p, keys[k])); p++)
            if ((size_t)(p - raw) + kl < len && p[kl] != '"') {
                f->t = rk_time_now();
                return;
            }
    }
}

/* The events of an SSE body: the generated text, concatenated, and the last
 * event that carries a usage object (NULL when none did); an error event is
 * an error. */
static rk_status read_events(char *sse, char **out_text, json_t **out_final) {
    size_t cap = 256, len = 0;
    char *text = malloc(cap);
    json_t *final = NULL;
    rk_status st = text ? RK_OK : rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    if (text) text[0] = '\0';
    for (char *line = sse; !st && line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        if (!strncmp(line, "data: ", 6) && strncmp(line + 6, "[DONE]", 6)) {
            json_t *ev = json_loads(line + 6, 0, NULL);
            json_t *c0 = json_array_get(json_object_get(ev, "choices"), 0);
            const char *piece = json_string_value(json_object_get(c0, "text"));
            if (!piece)
                piece = json_string_value(json_object_get(json_object_get(c0, "delta"), "content"));
            size_t n = piece ? strlen(piece) : 0;
            if (json_object_get(ev, "error")) {
                st = rk_errorf(RK_ERR_IO, "error event: %.160s", line + 6);
            } else if (len + n + 1 > cap) {
                while (len + n + 1 > cap) cap *= 2;
                char *g = realloc(text, cap);
                if (!g)
                    st = rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
                else
                    text = g;
            }
            if (!st && n) {
                memcpy(text + len, piece, n + 1);
                len += n;
            }
            /* OpenAI's streams send "usage": null in every event but the last. */
            if (!st && json_is_object(json_object_get(ev, "usage"))) {
                json_decref(final);
                final = json_incref(ev);
            }
            json_decref(ev);
        }
        line = nl ? nl + 1 : NULL;
    }
    if (st) {
        free(text);
        json_decref(final);
        return st;
    }
    *out_text = text;
    *out_final = final;
    return RK_OK;
}

/* Append the elements of more (a new reference, NULL when out of memory)
 * to a; nonzero on failure. */
static int extend_new(json_t *a, json_t *more) {
    int rc = !more || json_array_extend(a, more);
    json_decref(more);
    return rc;
}

/* The request body of turn `turn` of conversation j. A single turn is a
 * completion of the request's prompt; a conversation goes to the chat API:
 * the system prompt, then the documents and the question in the first user
 * turn (the part of the prompt after the system piece), then the turns so
 * far (msgs). The peer gets plain OpenAI fields, its pieces joined by
 * newlines (text never holds '#', so every "##" is a separator). */
static json_t *request_body(const bench *b, int mode, int j, json_t *msgs, int turn) {
    const workload *w = &b->w;
    int peer = mode == MODE_PEER;
    const char *sys = w->sys[w->req_sys[j]];
    char *text = strdup(b->o.turns > 1 ? w->prompt[j] + strlen(sys) + 2 : w->prompt[j]);
    if (!text) return NULL;
    if (peer) {
        char *o = text;
        for (const char *p = text; *p; p++) {
            int sep = p[0] == '#' && p[1] == '#';
            *o++ = sep ? '\n' : *p;
            p += sep;
        }
        *o = '\0';
    }
    json_t *body =
        json_pack("{s:i, s:f, s:i, s:b, s:b}", "max_tokens", w->max_out[j], "temperature", 0.0,
                  "seed", (int)(b->o.seed & 0x7fffffff), "ignore_eos", 1, "stream", 1);
    int bad = !body;
    if (body && b->o.turns > 1) {
        if (turn == 0)
            bad = extend_new(msgs, json_pack("[{s:s, s:s}, {s:s, s:s}]", "role", "system",
                                             "content", sys, "role", "user", "content", text));
        bad = bad || json_object_set(body, "messages", msgs);
    } else if (body) {
        bad = json_object_set_new(body, "prompt", json_string(text));
    }
    free(text);
    if (bad) {
        json_decref(body);
        return NULL;
    }
    /* Usage (and ragkv's report with it) comes in a stream's last event only
     * when asked for, as OpenAI does. */
    json_object_set_new(body, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (peer) return body;
    /* The same options as in-process (mode_options): greedy, no early stop. */
    int plain = mode == MODE_PLAIN || mode == MODE_PREFIX;
    json_object_set_new(body, "mode", json_string(plain ? "plain" : "rag"));
    json_object_set_new(body, "chunk_cache", json_string(mode == MODE_ORACLE ? "off" : "on"));
    json_object_set_new(body, "prefix_cache", json_boolean(mode != MODE_PLAIN));
    /* Each mode's invariants assume it reuses only its own caches; a
     * conversation's later turns are meant to reuse the earlier ones. */
    json_object_set_new(body, "reuse_sequences", json_boolean(b->o.turns > 1));
    /* Chat messages are split into documents only on a separator the body names. */
    if (b->o.turns > 1) json_object_set_new(body, "separator", json_string("##"));
    return body;
}

/* Read a peer's final event into x: OpenAI usage only. */
static int fill_from_usage(json_t *o, req_result *x) {
    x->prompt = json_int_at(o, "usage", "prompt_tokens", NULL);
    int cached = json_int_at(o, "usage", "prompt_tokens_details", "cached_tokens");
    x->reused = cached > 0 ? cached : 0;
    x->computed = x->prompt - x->reused;
    return x->prompt < 0 ? -1 : 0;
}

/* One streamed request: its result in x, the generated text in *out_text
 * (for the next turn), err set on failure. Times count from t_ref: the send,
 * or the arrival time in an open loop. */
static void one_request(http_job *job, int j, json_t *body, int turn, double t_ref, req_result *x,
                        char **out_text, char *err, size_t err_n) {
    int peer = job->mode == MODE_PEER;
    const char *path = job->b->o.turns > 1 ? "/v1/chat/completions" : "/v1/completions";
    char *s = json_dumps(body, JSON_COMPACT);
    first_text ft = {0};
    rk_http_response r = {0};
    rk_status st = s ? rk_http_exchange_stream(&job->t[j % job->n_t], "POST", path, NULL, s,
                                               strlen(s), note_first_text, &ft, &r)
                     : rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    double t_end = rk_time_now();
    free(s);
    json_t *final = NULL;
    *out_text = NULL;
    if (st) {
        snprintf(err, err_n, "request %d turn %d: %s", j, turn + 1, rk_error_message());
    } else if (r.status != 200) {
        snprintf(err, err_n, "request %d turn %d: HTTP %d: %.160s", j, turn + 1, r.status, r.body);
    } else if ((st = read_events(r.body, out_text, &final)) || !final) {
        snprintf(err, err_n, "request %d turn %d: %s", j, turn + 1,
                 st ? rk_error_message() : "the stream has no event with usage");
    } else if (peer ? fill_from_usage(final, x) : fill_from_json(final, x)) {
        snprintf(err, err_n, "request %d turn %d: the response lacks usage%s fields", j, turn + 1,
                 peer ? "" : " or ragkv");
    } else {
        x->n_out = json_int_at(final, "usage", "completion_tokens", NULL);
        x->e2e_ms = (t_end - t_ref) * 1e3;
        /* No text event (nothing decodable yet when the stream ended): the
         * first token came with the last event. */
        x->ttft_ms = ((ft.t > 0 ? ft.t : t_end) - t_ref) * 1e3;
        x->tpot_ms = x->n_out > 1 ? (x->e2e_ms - x->ttft_ms) / (x->n_out - 1) : NAN;
        x->server_total_ms = peer ? NAN : json_num_at(final, "ragkv", "timings", "total_ms");
        x->ok = x->n_out >= 0;
        if (!x->ok) snprintf(err, err_n, "request %d turn %d: no completion_tokens", j, turn + 1);
    }
    if (err[0]) {
        free(*out_text);
        *out_text = NULL;
    }
    json_decref(final);
    rk_http_response_free(&r);
}

static void *http_worker(void *arg) {
    http_job *job = arg;
    bench *b = job->b;
    const workload *w = &b->w;
    mode_result *m = &b->res[job->mode];
    for (;;) {
        pthread_mutex_lock(&job->mu);
        int j = job->next < m->n_run ? m->run[job->next++] : -1;
        pthread_mutex_unlock(&job->mu);
        if (j < 0) break;
        /* Open loop: wait for the arrival time; a request taken after it
         * (every sender was busy) is late, and its wait counts in its TTFT. */
        double t_ref = rk_time_now();
        if (b->o.arrival_rate > 0) {
            double due = job->t0 + w->arrival_s[j];
            while (t_ref < due) {
                /* usleep takes under a second portably. */
                double wait = due - t_ref < 0.5 ? due - t_ref : 0.5;
                usleep((useconds_t)(wait * 1e6));
                t_ref = rk_time_now();
            }
            m->req[j].late_ms = (t_ref - due) * 1e3;
            t_ref = due;
        }
        json_t *msgs = json_array();
        char err[256] = "";
        for (int turn = 0; turn < b->o.turns && !err[0]; turn++) {
            req_result *x = turn ? &m->turn[(size_t)(turn - 1) * w->n_req + j] : &m->req[j];
            json_t *body = msgs ? request_body(b, job->mode, j, msgs, turn) : NULL;
            char *answer = NULL;
            if (!body)
                snprintf(err, sizeof err, "request %d: out of memory", j);
            else
                one_request(job, j, body, turn, turn ? rk_time_now() : t_ref, x, &answer, err,
                            sizeof err);
            json_decref(body);
            /* The next turn: the model's answer, then the next question. */
            if (!err[0] && turn + 1 < b->o.turns &&
                extend_new(msgs, json_pack("[{s:s, s:s}, {s:s, s:s}]", "role", "assistant",
                                           "content", answer, "role", "user", "content",
                                           w->followup[(size_t)j * w->n_followups + turn])))
                snprintf(err, sizeof err, "request %d: out of memory", j);
            free(answer);
        }
        json_decref(msgs);
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
    m->prewarm_s += rk_time_now() - t0; /* over the replicas */
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

/* Empty caches: flush both (an admin endpoint; a refusal is reported, not fatal). */
static rk_status flush_caches(bench *b, const rk_http_target *t, int mode) {
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
    return RK_OK;
}

rk_status rk_bench_run_http(bench *b, const rk_http_target *t, int n_t, int mode) {
    mode_result *m = &b->res[mode];
    rk_status st;
    /* The peer is any OpenAI-compatible server: no cache endpoint to call. */
    for (int i = 0; i < n_t && mode != MODE_PEER; i++)
        if ((st = flush_caches(b, &t[i], mode))) return st;
    m->vmhwm_kb = -1;
    for (int i = 0; i < n_t && mode == MODE_RAG && b->o.prewarm; i++)
        if ((st = http_prewarm(b, &t[i], m))) return st;
    /* Closed loop: --concurrency clients; open loop: enough senders that a
     * request goes out at its arrival time, up to MAX_IN_FLIGHT. */
    int C = b->o.arrival_rate > 0 ? (m->n_run < MAX_IN_FLIGHT ? m->n_run : MAX_IN_FLIGHT)
                                  : b->o.concurrency;
    pthread_t *th = calloc((size_t)C, sizeof *th);
    if (!th) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    http_job job = {.b = b, .t = t, .n_t = n_t, .mode = mode, .t0 = rk_time_now()};
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
