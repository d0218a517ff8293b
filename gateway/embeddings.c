/* gateway/embeddings.c — POST /v1/embeddings in OpenAI's shape: `input` (a
 * string, an array of strings, an array of token ids, or an array of
 * those), `encoding_format` (float or base64: little-endian float32),
 * `dimensions` (the first ones, renormalised), `truncate` and
 * `truncation_direction` (text-embeddings-inference's), and
 * `usage.prompt_tokens`. Parsing and tokenizing run on the
 * request's thread; the forward passes run on the engine thread as
 * embedding work of its steps (rk_gw_run_embed: an rk_embed_task fed a
 * slice a step beside the decoding streams), keeping nothing in the caches. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "engine/tokenizer.h"
#include "gateway/http.h"

/* The inputs of one call, tokenized. */
typedef struct embed_inputs {
    int n;
    int32_t **ids; /* (n) each malloc'ed */
    int *n_tokens; /* (n) */
} embed_inputs;

static void inputs_free(embed_inputs *in) {
    for (int i = 0; i < in->n; i++) free(in->ids[i]);
    free(in->ids);
    free(in->n_tokens);
}

/* Tokenize text as a prompt is (control tokens parsed, BOS when the model
 * asks for it) into *out. 0, or -1 after filling err. */
static int encode_text(const rk_tokenizer *tok, json_t *s, const char *where, int32_t **out,
                       int *out_n, rk_http_error *err) {
    int32_t *ids = NULL;
    size_t n = 0;
    rk_error_clear();
    if (rk_tokenizer_encode(tok, json_string_value(s), json_string_length(s), 1, &ids, &n)) {
        rk_http_errorf(err, 400, "%s cannot be tokenized: %s", where, rk_error_message());
        return -1;
    }
    int bos = rk_tokenizer_add_bos(tok) && rk_tokenizer_bos(tok) >= 0;
    int32_t *all = malloc((n + (size_t)bos + 1) * sizeof *all);
    if (!all) {
        free(ids);
        rk_http_errorf(err, 500, "out of memory");
        return -1;
    }
    if (bos) all[0] = rk_tokenizer_bos(tok);
    if (n) memcpy(all + bos, ids, n * sizeof *ids);
    free(ids);
    *out = all;
    *out_n = (int)n + bos;
    return 0;
}

/* An array of token ids into *out. 0, or -1 after filling err. */
static int read_ids(json_t *a, int n_vocab, const char *where, int32_t **out, int *out_n,
                    rk_http_error *err) {
    size_t n = json_array_size(a);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        rk_http_errorf(err, 500, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
        if (id < 0 || id >= n_vocab) {
            free(ids);
            rk_http_errorf(err, 400, "'%s[%zu]' must be a token id in [0, %d)", where, i, n_vocab);
            return -1;
        }
        ids[i] = (int32_t)id;
    }
    *out = ids;
    *out_n = (int)n;
    return 0;
}

/* How an input over the context is handled: refused (the default), or cut
 * to the context keeping its start (right) or its end (left). */
typedef enum truncation { TRUNC_NONE, TRUNC_RIGHT, TRUNC_LEFT } truncation;

/* `input` into in: each input tokenized, none empty, none over context
 * tokens (or cut to them as trunc says). 0, or -1 after filling err (in
 * holds what to free either way). */
static int parse_input(json_t *input, const rk_tokenizer *tok, int context, truncation trunc,
                       embed_inputs *in, rk_http_error *err) {
    int single = json_is_string(input);
    if (json_is_array(input) && json_array_size(input) > 0 &&
        json_is_integer(json_array_get(input, 0)))
        single = 1; /* one array of token ids */
    if (!single && !json_is_array(input)) {
        rk_http_errorf(err, 400,
                       "'input' must be a string, an array of strings, an array of token ids or "
                       "an array of those");
        err->param = "input";
        return -1;
    }
    size_t n = single ? 1 : json_array_size(input);
    if (n == 0 || n > 2048) {
        rk_http_errorf(err, 400, "'input' must hold 1 to 2048 inputs, got %zu", n);
        err->param = "input";
        return -1;
    }
    in->ids = calloc(n, sizeof *in->ids);
    in->n_tokens = calloc(n, sizeof *in->n_tokens);
    if (!in->ids || !in->n_tokens) {
        rk_http_errorf(err, 500, "out of memory");
        return -1;
    }
    in->n = (int)n;
    int n_vocab = rk_tokenizer_n_vocab(tok);
    for (size_t i = 0; i < n; i++) {
        json_t *v = single ? input : json_array_get(input, i);
        char where[32];
        if (single)
            snprintf(where, sizeof where, "input");
        else
            snprintf(where, sizeof where, "input[%zu]", i);
        int bad;
        if (json_is_string(v))
            bad = encode_text(tok, v, where, &in->ids[i], &in->n_tokens[i], err);
        else if (json_is_array(v))
            bad = read_ids(v, n_vocab, where, &in->ids[i], &in->n_tokens[i], err);
        else
            bad = rk_http_errorf(err, 400, "'%s' must be a string or an array of token ids",
                                 where) != RK_OK;
        if (bad) return -1;
        if (in->n_tokens[i] == 0 || (json_is_string(v) && !json_string_length(v))) {
            rk_http_errorf(err, 400, "'%s' is empty", where);
            return -1;
        }
        if (in->n_tokens[i] > context && trunc != TRUNC_NONE) {
            if (trunc == TRUNC_LEFT)
                memmove(in->ids[i], in->ids[i] + (in->n_tokens[i] - context),
                        (size_t)context * sizeof *in->ids[i]);
            in->n_tokens[i] = context;
        }
        if (in->n_tokens[i] > context) {
            rk_http_errorf(err, 400,
                           "'%s' has %d tokens, more than the context of %d (set \"truncate\": "
                           "true to cut it)",
                           where, in->n_tokens[i], context);
            err->code = RK_CODE_CONTEXT_LENGTH;
            return -1;
        }
    }
    return 0;
}

rk_status rk_gw_run_embed(req_ctx *rc, rk_service *svc, int32_t *const *ids, const int *n_tokens,
                          int n, rk_pooling pooling, float *out, char *msg, size_t cap) {
    server *S = rc->S;
    rk_embed_task *task;
    rk_error_clear();
    rk_status st =
        rk_embed_task_create(svc, (const int32_t *const *)ids, n_tokens, n, pooling, out, &task);
    if (st) {
        snprintf(msg, cap, "%s", rk_error_message());
        return st;
    }
    rk_job job;
    if (rk_job_init(&job)) {
        rk_embed_task_free(task);
        snprintf(msg, cap, "cannot create a job");
        return RK_ERR_INTERNAL;
    }
    job.embed = task;
    if ((st = rk_scheduler_submit(S->engine, &job))) {
        snprintf(msg, cap, "%s", rk_error_message());
        rk_job_destroy(&job);
        rk_embed_task_free(task);
        return RK_ERR_EXHAUSTED; /* queue full, loading or stopping: 503 */
    }
    int n_seen, done = 0, timed_out = 0;
    while (!done)
        if (rk_job_wait(&job, 0, timed_out ? 0 : rc->t0 + S->o.timeout_s, &n_seen, &done)) {
            timed_out = 1;
            rk_scheduler_cancel(S->engine, &job);
        }
    st = job.ran ? job.status : RK_ERR_EXHAUSTED;
    if (timed_out && st) {
        st = RK_ERR_BUSY; /* 503 */
        snprintf(msg, cap, "the request ran longer than the timeout (%g s) and was cancelled",
                 S->o.timeout_s);
    } else {
        snprintf(msg, cap, "%s",
                 job.ran                     ? job.error
                 : atomic_load(&S->stopping) ? "the server is shutting down"
                                             : "the request was cancelled before it ran");
    }
    rk_job_destroy(&job);
    rk_embed_task_free(task);
    return st;
}

/* n floats as little-endian float32 bytes in base64 (new reference). */
static json_t *base64_floats(const float *v, int n) {
    static const char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t len = (size_t)n * 4, out_len = (len + 2) / 3 * 4;
    unsigned char *b = malloc(len ? len : 1);
    char *s = malloc(out_len + 1);
    if (!b || !s) {
        free(b);
        free(s);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        for (int k = 0; k < 4; k++) b[4 * i + k] = (unsigned char)(u >> (8 * k));
    }
    size_t o = 0;
    for (size_t i = 0; i < len; i += 3) {
        uint32_t w = (uint32_t)b[i] << 16 | (i + 1 < len ? (uint32_t)b[i + 1] << 8 : 0) |
                     (i + 2 < len ? b[i + 2] : 0);
        s[o++] = abc[w >> 18 & 63];
        s[o++] = abc[w >> 12 & 63];
        s[o++] = i + 1 < len ? abc[w >> 6 & 63] : '=';
        s[o++] = i + 2 < len ? abc[w & 63] : '=';
    }
    s[o] = '\0';
    free(b);
    json_t *j = json_stringn(s, o);
    free(s);
    return j;
}

static json_t *float_array(const float *v, int n) {
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_real((double)v[i]))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* Read and check the body into in (and the options: base64, the width
 * served); 0, or -1 after filling err. */
static int parse_request(server *S, rk_service *svc, json_t *root, embed_inputs *in, int *base64,
                         int *width, rk_http_error *err) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    json_t *model = json_object_get(root, "model");
    if (model && !json_is_null(model) && !json_is_string(model)) {
        rk_http_errorf(err, 400, "'model' must be a string");
        return -1;
    }
    if (rk_gw_check_model(S, svc, json_string_value(model), err)) return -1;
    json_t *fmt = json_object_get(root, "encoding_format");
    const char *f = fmt && !json_is_null(fmt) ? json_string_value(fmt) : "float";
    if (!f || (strcmp(f, "float") && strcmp(f, "base64"))) {
        rk_http_errorf(err, 400, "'encoding_format' must be \"float\" or \"base64\"");
        return -1;
    }
    *base64 = !strcmp(f, "base64");
    json_t *dims = json_object_get(root, "dimensions");
    *width = hp->dim;
    if (dims && !json_is_null(dims)) {
        if (!json_is_integer(dims) || json_integer_value(dims) < 1 ||
            json_integer_value(dims) > hp->dim) {
            rk_http_errorf(err, 400, "'dimensions' must be an integer from 1 to %d", hp->dim);
            err->param = "dimensions";
            return -1;
        }
        /* Truncating is sound for embedding models trained for it
         * (Matryoshka, as Qwen3-Embedding is); no GGUF key says which, so an
         * embedding model's file (one declaring a pooling type) may be
         * truncated, and a generative model pooled by --pooling, never
         * trained to embed at all, serves its full width alone. */
        rk_pooling file = hp->pooling;
        if (json_integer_value(dims) != hp->dim &&
            (file == RK_POOLING_UNSET || file == RK_POOLING_NONE)) {
            rk_http_errorf(err, 400,
                           "'dimensions' must be %d: this model is a generative one pooled by "
                           "--pooling, not an embedding model trained to be truncated",
                           hp->dim);
            err->param = "dimensions";
            return -1;
        }
        *width = (int)json_integer_value(dims);
    }
    json_t *tr = json_object_get(root, "truncate");
    if (tr && !json_is_null(tr) && !json_is_boolean(tr)) {
        rk_http_errorf(err, 400, "'truncate' must be true or false");
        err->param = "truncate";
        return -1;
    }
    json_t *dir = json_object_get(root, "truncation_direction");
    const char *d = dir && !json_is_null(dir) ? json_string_value(dir) : "right";
    if (!d || (strcasecmp(d, "right") && strcasecmp(d, "left"))) {
        rk_http_errorf(err, 400, "'truncation_direction' must be \"right\" or \"left\"");
        err->param = "truncation_direction";
        return -1;
    }
    truncation trunc = !json_is_true(tr)         ? TRUNC_NONE
                       : !strcasecmp(d, "right") ? TRUNC_RIGHT
                                                 : TRUNC_LEFT;
    json_t *input = json_object_get(root, "input");
    if (!input) {
        rk_http_errorf(err, 400, "'input' is required");
        return -1;
    }
    int context = svc->cfg.max_context > 0 ? svc->cfg.max_context : hp->n_ctx;
    return parse_input(input, rk_model_tokenizer(svc->model), context, trunc, in, err);
}

int rk_gw_handle_embeddings(req_ctx *rc) {
    rk_service *svc;
    json_t *root = rk_gw_read_json(rc, &svc);
    if (!root) return 0;
    rk_pooling pooling = rk_service_pooling(svc);
    if (pooling == RK_POOLING_RANK) {
        json_decref(root);
        rk_gw_send_errorf(rc, 400,
                          "this model makes no embeddings: it is a reranking model (pooling type "
                          "rank); use /v1/rerank");
        return 0;
    }
    if (pooling == RK_POOLING_NONE) {
        json_decref(root);
        rk_gw_send_errorf(rc, 400,
                          "this model makes no embeddings: its file has no pooling type (set one "
                          "with --pooling mean, cls or last)");
        return 0;
    }
    int dim = rk_model_hparams(svc->model)->dim, base64 = 0, width = dim;
    embed_inputs in = {0};
    rk_http_error err = {0};
    if (parse_request(rc->S, svc, root, &in, &base64, &width, &err)) {
        json_decref(root);
        inputs_free(&in);
        rk_gw_send_error(rc, &err);
        return 0;
    }
    json_decref(root);
    float *out = malloc((size_t)in.n * dim * sizeof *out);
    if (!out) {
        inputs_free(&in);
        rk_gw_send_errorf(rc, 500, "out of memory");
        return 0;
    }
    char msg[320];
    rk_status st =
        rk_gw_run_embed(rc, svc, in.ids, in.n_tokens, in.n, pooling, out, msg, sizeof msg);
    if (st) {
        free(out);
        inputs_free(&in);
        rk_gw_send_errorf(rc, rk_http_status_of(st), "%s", msg);
        return 0;
    }
    long long prompt_tokens = 0;
    json_t *data = json_array();
    for (int i = 0; data && i < in.n; i++) {
        prompt_tokens += in.n_tokens[i];
        float *v = out + (size_t)i * dim;
        if (width < dim) { /* the first width values, made unit length again */
            double norm = 0;
            for (int k = 0; k < width; k++) norm += (double)v[k] * v[k];
            float scale = norm > 0 ? (float)(1.0 / sqrt(norm)) : 0.0f;
            for (int k = 0; k < width; k++) v[k] *= scale;
        }
        json_t *e = base64 ? base64_floats(v, width) : float_array(v, width);
        json_t *item =
            e ? json_pack("{s:s, s:i, s:o}", "object", "embedding", "index", i, "embedding", e)
              : NULL;
        if (!item || json_array_append_new(data, item)) {
            json_decref(data);
            data = NULL;
        }
    }
    free(out);
    inputs_free(&in);
    rk_gw_send_json(rc, 200,
                    data ? json_pack("{s:s, s:o, s:s, s:{s:I, s:I}}", "object", "list", "data",
                                     data, "model", rc->S->model_name, "usage", "prompt_tokens",
                                     (json_int_t)prompt_tokens, "total_tokens",
                                     (json_int_t)prompt_tokens)
                         : NULL);
    return 0;
}
