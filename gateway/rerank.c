/* gateway/rerank.c — POST /v1/rerank (and /rerank) in the shape Cohere,
 * Jina and llama.cpp's server share: `query`, `documents` (strings or
 * {"text": ...}), `top_n`, `return_documents`; `results` sorted by
 * `relevance_score`, best first, each with the document's `index`.
 *
 * Each (query, document) pair becomes one input as the reference engine
 * forms it for the same file: the file's rerank prompt
 * (tokenizer.chat_template.rerank, Qwen3-Reranker's "Judge whether the
 * Document meets the requirements ...") with {query} and {document}
 * replaced, tokenized with control tokens parsed and nothing added; without
 * that key, [BOS] query [EOS] [SEP] document [EOS] with each special token
 * only where the vocabulary adds it. Parsing and tokenizing run on the
 * request's thread; the forward passes and the classification head run on
 * the engine thread as embedding work of its steps (rk_gw_run_embed with
 * rank pooling), keeping nothing in the caches. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer.h"
#include "gateway/http.h"

/* Documents per call (Cohere's limit). */
#define RERANK_MAX_DOCUMENTS 1000

/* The pairs of one call, tokenized. */
typedef struct rerank_inputs {
    int n;
    int32_t **ids; /* (n) each malloc'ed */
    int *n_tokens; /* (n) */
    json_t **docs; /* (n) borrowed from the request's JSON: each document's text */
} rerank_inputs;

static void inputs_free(rerank_inputs *in) {
    for (int i = 0; i < in->n; i++) free(in->ids[i]);
    free(in->ids);
    free(in->n_tokens);
    free(in->docs);
}

/* tmpl with every {query} and {document} replaced, into b. */
static rk_status fill_template(rk_strbuf *b, const char *tmpl, json_t *query, json_t *doc) {
    const char *p = tmpl;
    while (*p) {
        const char *q = strstr(p, "{query}"), *d = strstr(p, "{document}");
        const char *next = q && (!d || q < d) ? q : d;
        if (!next) {
            rk_strbuf_puts(b, p);
            break;
        }
        rk_strbuf_putn(b, p, (size_t)(next - p));
        json_t *v = next == q ? query : doc;
        rk_strbuf_putn(b, json_string_value(v), json_string_length(v));
        p = next + (next == q ? strlen("{query}") : strlen("{document}"));
    }
    return b->oom ? rk_errorf(RK_ERR_NOMEM, "out of memory") : RK_OK;
}

/* Append n ids to the growing array *ids (*n_ids long); 0 or -1. */
static int push_ids(int32_t **ids, size_t *n_ids, const int32_t *add, size_t n) {
    int32_t *p = realloc(*ids, (*n_ids + n + 1) * sizeof *p);
    if (!p) return -1;
    if (n) memcpy(p + *n_ids, add, n * sizeof *add);
    *ids = p;
    *n_ids += n;
    return 0;
}

/* How the model's file forms a pair. */
typedef struct pair_format {
    const rk_tokenizer *tok;
    const char *tmpl; /* tokenizer.chat_template.rerank, or NULL */
    int add_bos, add_eos, add_sep;
    int32_t bos, eos, sep;
} pair_format;

static void format_init(pair_format *f, rk_service *svc) {
    const rk_gguf *g = rk_model_gguf(svc->model);
    memset(f, 0, sizeof *f);
    f->tok = rk_model_tokenizer(svc->model);
    const char *s;
    size_t len;
    if (!rk_gguf_get_str(g, "tokenizer.chat_template.rerank", &s, &len)) f->tmpl = s;
    f->bos = rk_tokenizer_bos(f->tok);
    f->eos = rk_tokenizer_eos(f->tok);
    f->add_bos = rk_tokenizer_add_bos(f->tok) && f->bos >= 0;
    uint32_t sep;
    f->sep = rk_gguf_get_u32(g, "tokenizer.ggml.seperator_token_id", &sep) ? -1 : (int32_t)sep;
    if (f->eos < 0) f->eos = f->sep;
    int v;
    f->add_eos = !rk_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &v) && v && f->eos >= 0;
    f->add_sep = !rk_gguf_get_bool(g, "tokenizer.ggml.add_sep_token", &v) && v && f->sep >= 0;
    rk_error_clear();
}

/* One pair's tokens into *out; 0, or -1 after filling err. */
static int encode_pair(const pair_format *f, json_t *query, json_t *doc, const char *where,
                       int32_t **out, int *out_n, rk_http_error *err) {
    int32_t *ids = NULL, *part = NULL;
    size_t n = 0, n_part = 0;
    rk_status st = RK_OK;
    rk_error_clear();
    if (f->tmpl) {
        rk_strbuf b = {0};
        st = fill_template(&b, f->tmpl, query, doc);
        if (!st) st = rk_tokenizer_encode(f->tok, b.s ? b.s : "", b.len, 1, &ids, &n);
        rk_strbuf_free(&b);
    } else {
        int oom = 0;
        if (f->add_bos) oom |= push_ids(&ids, &n, &f->bos, 1);
        st = rk_tokenizer_encode(f->tok, json_string_value(query), json_string_length(query), 0,
                                 &part, &n_part);
        if (!st) oom |= push_ids(&ids, &n, part, n_part);
        free(part);
        part = NULL;
        if (!st && f->add_eos) oom |= push_ids(&ids, &n, &f->eos, 1);
        if (!st && f->add_sep) oom |= push_ids(&ids, &n, &f->sep, 1);
        if (!st)
            st = rk_tokenizer_encode(f->tok, json_string_value(doc), json_string_length(doc), 0,
                                     &part, &n_part);
        if (!st) oom |= push_ids(&ids, &n, part, n_part);
        free(part);
        if (!st && f->add_eos) oom |= push_ids(&ids, &n, &f->eos, 1);
        if (!st && oom) st = rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    if (st) {
        free(ids);
        rk_http_errorf(err, st == RK_ERR_NOMEM ? 500 : 400, "%s cannot be tokenized: %s", where,
                       rk_error_message());
        return -1;
    }
    *out = ids;
    *out_n = (int)n;
    return 0;
}

/* Read and check the body into in, *top_n and *return_docs; 0, or -1 after
 * filling err (in holds what to free either way). */
static int parse_request(server *S, rk_service *svc, json_t *root, rerank_inputs *in, int *top_n,
                         int *return_docs, rk_http_error *err) {
    json_t *model = json_object_get(root, "model");
    if (model && !json_is_null(model) && !json_is_string(model)) {
        rk_http_errorf(err, 400, "'model' must be a string");
        err->param = "model";
        return -1;
    }
    if (rk_gw_check_model(S, svc, json_string_value(model), err)) return -1;
    json_t *query = json_object_get(root, "query");
    if (!query || !json_is_string(query)) {
        rk_http_errorf(err, 400, query ? "'query' must be a string" : "'query' is required");
        err->param = "query";
        return -1;
    }
    if (json_string_length(query) == 0) {
        rk_http_errorf(err, 400, "'query' is empty");
        err->param = "query";
        return -1;
    }
    json_t *docs = json_object_get(root, "documents");
    size_t n = json_array_size(docs);
    if (!json_is_array(docs) || n == 0 || n > RERANK_MAX_DOCUMENTS) {
        if (!docs)
            rk_http_errorf(err, 400, "'documents' is required");
        else if (!json_is_array(docs))
            rk_http_errorf(err, 400,
                           "'documents' must be an array of strings or of objects "
                           "with a 'text' string");
        else
            rk_http_errorf(err, 400, "'documents' must hold 1 to %d documents, got %zu",
                           RERANK_MAX_DOCUMENTS, n);
        err->param = "documents";
        return -1;
    }
    json_t *tn = json_object_get(root, "top_n");
    *top_n = (int)n;
    if (tn && !json_is_null(tn)) {
        if (!json_is_integer(tn) || json_integer_value(tn) < 1) {
            rk_http_errorf(err, 400, "'top_n' must be a positive integer");
            err->param = "top_n";
            return -1;
        }
        if (json_integer_value(tn) < (json_int_t)n) *top_n = (int)json_integer_value(tn);
    }
    json_t *rd = json_object_get(root, "return_documents");
    if (rd && !json_is_null(rd) && !json_is_boolean(rd)) {
        rk_http_errorf(err, 400, "'return_documents' must be a boolean");
        err->param = "return_documents";
        return -1;
    }
    *return_docs = json_is_true(rd);
    in->ids = calloc(n, sizeof *in->ids);
    in->n_tokens = calloc(n, sizeof *in->n_tokens);
    in->docs = calloc(n, sizeof *in->docs);
    if (!in->ids || !in->n_tokens || !in->docs) {
        rk_http_errorf(err, 500, "out of memory");
        return -1;
    }
    in->n = (int)n;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    int context = svc->cfg.max_context > 0 ? svc->cfg.max_context : hp->n_ctx;
    pair_format f;
    format_init(&f, svc);
    for (size_t i = 0; i < n; i++) {
        json_t *d = json_array_get(docs, i);
        if (json_is_object(d)) d = json_object_get(d, "text");
        char where[32];
        snprintf(where, sizeof where, "documents[%zu]", i);
        if (!json_is_string(d)) {
            rk_http_errorf(err, 400, "'%s' must be a string or an object with a 'text' string",
                           where);
            err->param = "documents";
            return -1;
        }
        in->docs[i] = d;
        if (encode_pair(&f, query, d, where, &in->ids[i], &in->n_tokens[i], err)) return -1;
        if (in->n_tokens[i] == 0) {
            rk_http_errorf(err, 400, "'%s' with the query gives no tokens", where);
            err->param = "documents";
            return -1;
        }
        if (in->n_tokens[i] > context) {
            rk_http_errorf(err, 400,
                           "'%s' with the query has %d tokens, more than the context of %d", where,
                           in->n_tokens[i], context);
            err->code = RK_CODE_CONTEXT_LENGTH;
            err->param = "documents";
            return -1;
        }
    }
    return 0;
}

/* Result order: the score descending, then the index ascending. */
typedef struct ranked {
    float score;
    int index;
} ranked;

static int ranked_cmp(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The answer's body (new reference, NULL when out of memory). */
static json_t *answer(req_ctx *rc, const rerank_inputs *in, const float *scores, int top_n,
                      int return_docs) {
    ranked *r = malloc((size_t)in->n * sizeof *r);
    json_t *results = json_array();
    long long tokens = 0;
    if (!r || !results) {
        free(r);
        json_decref(results);
        return NULL;
    }
    for (int i = 0; i < in->n; i++) {
        r[i] = (ranked){scores[i], i};
        tokens += in->n_tokens[i];
    }
    qsort(r, (size_t)in->n, sizeof *r, ranked_cmp);
    for (int k = 0; k < top_n; k++) {
        json_t *item =
            json_pack("{s:i, s:f}", "index", r[k].index, "relevance_score", (double)r[k].score);
        if (item && return_docs &&
            json_object_set_new(item, "document",
                                json_pack("{s:O}", "text", in->docs[r[k].index]))) {
            json_decref(item);
            item = NULL;
        }
        if (!item || json_array_append_new(results, item)) {
            free(r);
            json_decref(results);
            return NULL;
        }
    }
    free(r);
    return json_pack("{s:s, s:s, s:o, s:{s:I, s:I}}", "object", "list", "model", rc->S->model_name,
                     "results", results, "usage", "prompt_tokens", (json_int_t)tokens,
                     "total_tokens", (json_int_t)tokens);
}

int rk_gw_handle_rerank(req_ctx *rc) {
    rk_service *svc;
    json_t *root = rk_gw_read_json(rc, &svc);
    if (!root) return 0;
    if (!rk_service_can_rerank(svc)) {
        char why[200];
        snprintf(why, sizeof why, "%s", rk_error_message());
        json_decref(root);
        rk_gw_send_errorf(rc, 400,
                          "this model does not rerank (%s): serve a reranking model, such as a "
                          "Qwen3-Reranker GGUF",
                          why);
        return 0;
    }
    rerank_inputs in = {0};
    rk_http_error err = {0};
    int top_n = 0, return_docs = 0;
    if (parse_request(rc->S, svc, root, &in, &top_n, &return_docs, &err)) {
        inputs_free(&in);
        json_decref(root);
        rk_gw_send_error(rc, &err);
        return 0;
    }
    float *scores = malloc((size_t)in.n * sizeof *scores);
    if (!scores) {
        inputs_free(&in);
        json_decref(root);
        rk_gw_send_errorf(rc, 500, "out of memory");
        return 0;
    }
    char msg[320];
    rk_status st = rk_gw_run_embed(rc, svc, in.ids, in.n_tokens, in.n, RK_POOLING_RANK, scores, msg,
                                   sizeof msg);
    if (st) {
        rk_gw_send_errorf(rc, rk_http_status_of(st), "%s", msg);
    } else {
        json_t *out = answer(rc, &in, scores, top_n, return_docs);
        rk_gw_send_json(rc, 200, out);
    }
    free(scores);
    inputs_free(&in);
    json_decref(root);
    return 0;
}
