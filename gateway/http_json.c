/* gateway/http_json.c — request bodies of the HTTP API: JSON (jansson) in,
 * validated pipeline options and split pieces out. Nothing here needs a
 * model, so the fuzz target (fuzz/fuzz_request.c) and the corpus replay test
 * run exactly this code on hostile input.
 *
 * Fields no OpenAI client sends are ignored. OpenAI's own request fields are
 * each honoured, ignored for a stated reason (`user`: an end-user id), or
 * refused with a 400 that names the field when the value asks for something
 * ragkv does not do (refuse_unsupported lists them; docs/api.md has the
 * table). */
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/api.h"
#include "gateway/json_fields.h"

/* An error of a lower layer (split, separator check) as an HTTP error. */
static rk_status from_status(rk_http_error *err, rk_status st, const char *what) {
    int status = st == RK_ERR_LIMIT     ? 422
                 : st == RK_ERR_NOMEM   ? 500
                 : st == RK_ERR_INVALID ? 400
                                        : 500;
    rk_http_errorf(err, status, "%s: %s", what, rk_error_message());
    return st;
}

/* ---------------------------------------------------------------- common fields */

static int parse_stop(json_t *root, rk_api_request *out, rk_http_error *err) {
    json_t *v = json_object_get(root, "stop");
    if (!v || json_is_null(v)) return 0;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > RK_MAX_STOP)
            return rk_http_errorf(err, 400, "'stop' has %zu strings; at most %d are allowed", n,
                                  RK_MAX_STOP),
                   1;
        items = NULL;
    } else if (!json_is_string(v)) {
        return rk_http_errorf(err, 400, "'stop' must be a string or an array of strings"), 1;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = items ? items[i] : json_array_get(v, i);
        if (!json_is_string(s))
            return rk_http_errorf(err, 400, "'stop' must be a string or an array of strings"), 1;
        size_t len = json_string_length(s);
        if (len == 0 || len > RK_STOP_MAX_BYTES)
            return rk_http_errorf(err, 400, "each stop string must be 1 to %d bytes",
                                  RK_STOP_MAX_BYTES),
                   1;
        if (!(out->stop[out->n_stop] = rk_strdup(json_string_value(s))))
            return rk_http_errorf(err, 500, "out of memory"), 1;
        out->n_stop++;
    }
    return 0;
}

/* repair: {"policy": "auto" | "none" | "first_k" | "deviation" | "query",
 * "k": 16, "ratio": 0.15}; no repair, or "auto", is the service's policy (lim). */
static int parse_repair(json_t *root, const rk_parse_limits *lim, rk_req_options *o,
                        rk_http_error *err) {
    json_t *v = json_object_get(root, "repair");
    o->repair_k = lim->repair_k;
    o->repair_ratio = lim->repair_ratio;
    o->repair_query = lim->repair_query;
    if (!v || json_is_null(v)) return 0;
    if (!json_is_object(v))
        return rk_http_errorf(err, 400,
                              "'repair' must be an object {\"policy\", \"k\", \"ratio\"}"),
               1;
    json_int_t k = 16;
    double ratio = 0.15;
    if (get_int(v, "k", 0, 1 << 20, &k, err) || get_num(v, "ratio", 0, 1, 0, &ratio, err)) return 1;
    json_t *p = json_object_get(v, "policy");
    const char *policy = p && !json_is_null(p) ? json_string_value(p) : "auto";
    if (!policy) return rk_http_errorf(err, 400, "'repair.policy' must be a string"), 1;
    if (!strcmp(policy, "auto")) return 0;
    o->repair_k = 0;
    o->repair_ratio = 0;
    o->repair_query = 0;
    if (!strcmp(policy, "none")) return 0;
    if (!strcmp(policy, "first_k")) {
        o->repair_k = (int)k;
        return 0;
    }
    if (!strcmp(policy, "deviation") || !strcmp(policy, "query")) {
        o->repair_ratio = (float)ratio;
        o->repair_query = policy[0] == 'q';
        return 0;
    }
    return rk_http_errorf(err, 400,
                          "'repair.policy' must be \"auto\", \"none\", \"first_k\", "
                          "\"deviation\" or \"query\""),
           1;
}

/* OpenAI request fields ragkv does not implement: a value that asks for
 * what they do is a 400 naming the field, never silence. The values that
 * ask for nothing (null, the default) pass. `user` and `safety_identifier`
 * (end-user ids for abuse monitoring) and `prompt_cache_key` (a caching hint;
 * ragkv caches by content) are accepted and ignored. */
static int refuse_unsupported(json_t *root, rk_http_error *err) {
    /* Refused unless null. */
    static const char *const any[] = {"audio",         "prediction",         "functions",
                                      "function_call", "web_search_options", "verbosity"};
    for (size_t i = 0; i < sizeof any / sizeof any[0]; i++) {
        json_t *v = json_object_get(root, any[i]);
        if (v && !json_is_null(v))
            return rk_http_errorf(err, 400, "'%s' is not supported by this server", any[i]), 1;
    }
    json_t *v = json_object_get(root, "suffix");
    if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
        return rk_http_errorf(err, 400, "'suffix' is not supported (no fill-in-the-middle)"), 1;
    v = json_object_get(root, "store");
    if (v && !json_is_null(v) && !json_is_false(v))
        return rk_http_errorf(err, 400, "'store' must be false: this server stores no completions"),
               1;
    v = json_object_get(root, "metadata");
    if (v && !json_is_null(v) && !(json_is_object(v) && json_object_size(v) == 0))
        return rk_http_errorf(err, 400,
                              "'metadata' is not supported: this server stores no completions"),
               1;
    v = json_object_get(root, "service_tier");
    const char *tier = json_string_value(v);
    if (v && !json_is_null(v) && !(tier && (!strcmp(tier, "auto") || !strcmp(tier, "default"))))
        return rk_http_errorf(err, 400,
                              "'service_tier' must be \"auto\" or \"default\": this server has "
                              "one tier"),
               1;
    v = json_object_get(root, "modalities");
    if (v && !json_is_null(v)) {
        int ok = json_is_array(v);
        for (size_t i = 0; ok && i < json_array_size(v); i++) {
            const char *m = json_string_value(json_array_get(v, i));
            ok = m && !strcmp(m, "text");
        }
        if (!ok) return rk_http_errorf(err, 400, "'modalities' must be [\"text\"]"), 1;
    }
    v = json_object_get(root, "chat_template_kwargs");
    json_t *think = json_object_get(v, "enable_thinking");
    if (v && !json_is_null(v) && (!json_is_object(v) || (think && !json_is_boolean(think))))
        return rk_http_errorf(err, 400,
                              "'chat_template_kwargs' must be an object; its 'enable_thinking' "
                              "true or false"),
               1;
    v = json_object_get(root, "parallel_tool_calls");
    if (v && !json_is_null(v) && !json_is_boolean(v))
        return rk_http_errorf(err, 400, "'parallel_tool_calls' must be true or false"), 1;
    json_t *tools = json_object_get(root, "tools");
    if (json_is_true(v) && !json_array_size(tools))
        return rk_http_errorf(err, 400,
                              "'parallel_tool_calls' true needs 'tools' (chat completions)"),
               1;
    static const char *const ids[] = {"user", "safety_identifier", "prompt_cache_key"};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        v = json_object_get(root, ids[i]);
        if (v && !json_is_null(v) && !json_is_string(v))
            return rk_http_errorf(err, 400, "'%s' must be a string", ids[i]), 1;
    }
    return 0;
}

/* presence_penalty, frequency_penalty (OpenAI: -2 to 2), repetition_penalty
 * (llama.cpp's: above 0, 1 = off) and logit_bias ({"token id": bias from
 * -100 to 100}, at most RK_MAX_LOGIT_BIAS; the ids are checked against the
 * vocabulary when the sampler starts). */
static int parse_penalties(json_t *root, rk_sampler_params *p, rk_http_error *err) {
    double pres = 0, freq = 0, rep = 1;
    if (get_num(root, "presence_penalty", -2, 2, 0, &pres, err) ||
        get_num(root, "frequency_penalty", -2, 2, 0, &freq, err) ||
        get_num(root, "repetition_penalty", 0, 100, 1, &rep, err))
        return 1;
    p->presence_penalty = (float)pres;
    p->frequency_penalty = (float)freq;
    p->repetition_penalty = (float)rep;
    json_t *lb = json_object_get(root, "logit_bias");
    if (!lb || json_is_null(lb)) return 0;
    if (!json_is_object(lb))
        return rk_http_errorf(err, 400,
                              "'logit_bias' must be an object {\"token id\": bias from -100 to "
                              "100}"),
               1;
    if (json_object_size(lb) > RK_MAX_LOGIT_BIAS)
        return rk_http_errorf(err, 400, "'logit_bias' has %zu entries; at most %d are allowed",
                              json_object_size(lb), RK_MAX_LOGIT_BIAS),
               1;
    const char *key;
    json_t *v;
    int n = 0;
    json_object_foreach(lb, key, v) {
        size_t digits = strspn(key, "0123456789");
        long id = digits && digits < 9 && !key[digits] ? strtol(key, NULL, 10) : -1;
        if (id < 0 || id >= (1L << 24))
            return rk_http_errorf(err, 400, "'logit_bias' keys must be token ids, got \"%.40s\"",
                                  key),
                   1;
        if (!json_is_number(v))
            return rk_http_errorf(err, 400, "'logit_bias' values must be numbers (token %ld)", id),
                   1;
        double b = json_number_value(v);
        if (!(b >= -100 && b <= 100))
            return rk_http_errorf(err, 400,
                                  "'logit_bias' values must be from -100 to 100, got %g (token "
                                  "%ld)",
                                  b, id),
                   1;
        p->logit_bias[n++] = (rk_logit_bias){.token = (int32_t)id, .bias = (float)b};
    }
    p->n_logit_bias = n;
    return 0;
}

/* max_tokens (or max_completion_tokens) into *max_tokens, which holds the
 * default: absent, the server's limit caps it; beyond the context it is
 * context_length_exceeded, beyond the server's limit 422. */
static int parse_max_tokens(json_t *root, const rk_parse_limits *lim, rk_api_request *out,
                            json_int_t *max_tokens_io, rk_http_error *err) {
    rk_req_options *o = &out->opt;
    json_int_t max_tokens = *max_tokens_io;
    json_t *mct = json_object_get(root, "max_completion_tokens");
    const char *mt_name = mct && !json_is_null(mct) ? "max_completion_tokens" : "max_tokens";
    json_t *mt = json_object_get(root, mt_name);
    if (!mt || json_is_null(mt)) { /* the default, within the server's limit and the context */
        if (max_tokens > lim->max_tokens) max_tokens = lim->max_tokens;
        o->max_tokens_fit = 1;
    } else if (get_int(root, mt_name, LLONG_MIN, LLONG_MAX, &max_tokens, err)) {
        return 1;
    }
    if (max_tokens < 0)
        return rk_http_errorf(err, 400, "'%s' must be from 0 to %d, got %lld", mt_name,
                              lim->max_tokens, (long long)max_tokens),
               1;
    if (max_tokens > lim->max_tokens && lim->context > 0 && max_tokens >= lim->context) {
        /* No prompt fits beside it: over the context, whatever the prompt. */
        rk_http_errorf(err, 400,
                       "the context is %d tokens, prompt and completion together; '%s' is %lld",
                       lim->context, mt_name, (long long)max_tokens);
        err->code = RK_CODE_CONTEXT_LENGTH;
        err->param = out->chat ? "messages" : "prompt";
        return 1;
    }
    if (max_tokens > lim->max_tokens)
        return rk_http_errorf(err, 422, "'%s' is %lld; this server allows at most %d", mt_name,
                              (long long)max_tokens, lim->max_tokens),
               1;
    *max_tokens_io = max_tokens;
    return 0;
}

/* ragkv's own fields: chunk_cache, and the model name and separator. */
static int parse_cache_fields(json_t *root, rk_api_request *out, rk_http_error *err) {
    rk_req_options *o = &out->opt;
    json_t *cc = json_object_get(root, "chunk_cache");
    if (cc && !json_is_null(cc)) {
        const char *s = json_string_value(cc);
        if (json_is_boolean(cc))
            o->chunk_cache = json_is_true(cc);
        else if (s && !strcmp(s, "on"))
            o->chunk_cache = 1;
        else if (s && !strcmp(s, "off"))
            o->chunk_cache = 0;
        else
            return rk_http_errorf(err, 400, "'chunk_cache' must be \"on\" or \"off\""), 1;
    }
    json_t *m = json_object_get(root, "model");
    if (m && !json_is_null(m)) {
        if (!json_is_string(m)) return rk_http_errorf(err, 400, "'model' must be a string"), 1;
        if (!(out->model = rk_strdup(json_string_value(m))))
            return rk_http_errorf(err, 500, "out of memory"), 1;
    }
    json_t *sep = json_object_get(root, "separator");
    if (sep && !json_is_null(sep)) {
        const char *s = json_string_value(sep);
        if (!s || strlen(s) != json_string_length(sep) || rk_separator_check(s))
            return rk_http_errorf(err, 400,
                                  "'separator' must be a string of 1 to %d bytes without a "
                                  "backslash",
                                  RK_SEPARATOR_MAX),
                   1;
        snprintf(out->separator, sizeof out->separator, "%s", s);
    }
    return 0;
}

/* Fields shared by both shapes: sampling, limits, extensions. */
static int parse_common(json_t *root, const rk_parse_limits *lim, rk_api_request *out,
                        rk_http_error *err) {
    rk_req_options *o = &out->opt;
    json_int_t max_tokens = o->max_tokens, top_k = 0, seed = 0, n = 1, best_of = 1;
    double temp = o->sampling.temperature, top_p = o->sampling.top_p;
    int echo = 0, ignore_eos = 0, prefix = -1, plain = 0, ctx = 0, pos = 0, whole = 1;
    if (parse_max_tokens(root, lim, out, &max_tokens, err)) return 1;
    if (get_num(root, "temperature", 0, 100, 0, &temp, err) ||
        get_num(root, "top_p", 0, 1, 1, &top_p, err) ||
        get_int(root, "top_k", 0, 1 << 24, &top_k, err) ||
        get_int(root, "seed", 0, (json_int_t)0x7fffffffffffffffLL, &seed, err) ||
        get_int(root, "n", LLONG_MIN, LLONG_MAX, &n, err) ||
        get_int(root, "best_of", 1, RK_MAX_CHOICES, &best_of, err) ||
        get_bool(root, "echo", &echo, err) || get_bool(root, "stream", &out->stream, err) ||
        get_bool(root, "ignore_eos", &ignore_eos, err) ||
        get_bool(root, "prefix_cache", &prefix, err) ||
        get_bool(root, "reuse_sequences", &whole, err) ||
        get_choice(root, "mode", "rag", "plain", &plain, err) || get_context(root, &ctx, err) ||
        get_choice(root, "position_mode", "sequential", "parallel", &pos, err) ||
        parse_stop(root, out, err) || parse_repair(root, lim, o, err) ||
        get_text(root, "cache_salt", out->cache_salt, sizeof out->cache_salt, err))
        return 1;
    json_t *so = json_object_get(root, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return rk_http_errorf(err, 400, "'stream_options' must be an object"), 1;
        if (get_bool(so, "include_usage", &out->include_usage, err)) return 1;
    }
    if (n < 1)
        return rk_http_errorf(err, 400, "'n' must be from 1 to %d, got %lld", RK_MAX_CHOICES,
                              (long long)n),
               1;
    if (n > RK_MAX_CHOICES)
        return rk_http_errorf(err, 422, "'n' is %lld; at most %d choices per request", (long long)n,
                              RK_MAX_CHOICES),
               1;
    if (best_of != 1 && best_of != n)
        return rk_http_errorf(err, 400,
                              "'best_of' must be 1 or equal to 'n': every completion is returned"),
               1;
    out->n_choices = (int)n;
    out->echo = echo;
    if (refuse_unsupported(root, err) || parse_penalties(root, &o->sampling, err)) return 1;
    if (parse_cache_fields(root, out, err)) return 1;
    json_t *seed_v = json_object_get(root, "seed");
    out->seed_given = seed_v && !json_is_null(seed_v);
    o->max_tokens = (int)max_tokens;
    o->sampling.temperature = (float)temp;
    o->sampling.top_p = (float)top_p;
    o->sampling.top_k = (int)top_k;
    o->sampling.seed = (uint64_t)seed;
    o->stop_at_eog = !ignore_eos;
    o->mode = plain ? RK_MODE_PLAIN : RK_MODE_RAG;
    o->chunk_context = (rk_chunk_context)ctx;
    o->positions = pos ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
    /* Plain mode is the no-cache reference unless asked otherwise (as `ragkv generate`). */
    o->prefix_cache = prefix >= 0 ? prefix : !plain;
    o->reuse_sequences = whole;
    return rk_api_parse_response_format(root, lim->grammar_cache, out, err);
}

/* ---------------------------------------------------------------- completions */

/* The structured form: system + chunks + question. */
static int parse_structured(json_t *root, const rk_parse_limits *lim, rk_api_request *out,
                            rk_http_error *err) {
    json_t *sys = json_object_get(root, "system"), *q = json_object_get(root, "question");
    json_t *ch = json_object_get(root, "chunks");
    if (sys && !json_is_null(sys) && !json_is_string(sys))
        return rk_http_errorf(err, 400, "'system' must be a string"), 1;
    if (!json_is_string(q))
        return rk_http_errorf(err, 400,
                              "give 'prompt', or 'question' (with optional 'system' "
                              "and 'chunks')"),
               1;
    if (ch && !json_is_null(ch) && !json_is_array(ch))
        return rk_http_errorf(err, 400, "'chunks' must be an array"), 1;
    size_t n = ch && json_is_array(ch) ? json_array_size(ch) : 0;
    if (n > (size_t)lim->max_chunks + 65536)
        return rk_http_errorf(err, 422, "the request has %zu chunks; at most %d are allowed", n,
                              lim->max_chunks),
               1;
    const char **texts = calloc(n ? n : 1, sizeof *texts), **ids = calloc(n ? n : 1, sizeof *ids);
    int failed = 0, kept = 0, empty = 0, any_id = 0;
    if (!texts || !ids) {
        rk_http_errorf(err, 500, "out of memory");
        failed = 1;
    }
    for (size_t i = 0; i < n && !failed; i++) {
        const char *t, *id;
        if (chunk_entry(json_array_get(ch, i), (int)i, &t, &id, err)) {
            failed = 1;
        } else if (*t) { /* empty chunks are skipped and counted */
            texts[kept] = t;
            ids[kept++] = id;
            any_id |= id != NULL;
        } else {
            empty++;
        }
    }
    if (!failed) {
        const char *question = json_string_value(q);
        rk_status st = rk_split_structured(sys && !json_is_null(sys) ? json_string_value(sys) : "",
                                           texts, kept, question, lim->max_chunks, &out->pieces);
        if (st) {
            from_status(err, st, "bad request");
            failed = 1;
        } else {
            out->have_pieces = 1;
            out->pieces.n_empty_chunks += empty;
        }
    }
    if (!failed && any_id) {
        out->chunk_ids = calloc((size_t)kept, sizeof *out->chunk_ids);
        if (!out->chunk_ids) {
            rk_http_errorf(err, 500, "out of memory");
            failed = 1;
        }
        for (int i = 0; i < kept && !failed; i++)
            if (ids[i] && !(out->chunk_ids[i] = rk_strdup(ids[i]))) {
                rk_http_errorf(err, 500, "out of memory");
                failed = 1;
            }
    }
    free(texts);
    free(ids);
    return failed;
}

/* A token-id list: *out (malloc'ed) and *n; ids are checked against the
 * vocabulary when the request is prepared. */
static int token_list(json_t *a, const char *what, int32_t **out, int *n, rk_http_error *err) {
    size_t len = json_array_size(a);
    if (len == 0) return rk_http_errorf(err, 400, "%s is an empty token list", what), 1;
    if (len > (size_t)1 << 24) return rk_http_errorf(err, 422, "%s is too long", what), 1;
    *out = malloc(len * sizeof **out);
    if (!*out) return rk_http_errorf(err, 500, "out of memory"), 1;
    *n = (int)len;
    for (size_t i = 0; i < len; i++) {
        json_t *v = json_array_get(a, i);
        json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
        if (id < 0 || id >= (json_int_t)1 << 24)
            return rk_http_errorf(err, 400, "%s[%zu] must be a token id (a non-negative integer)",
                                  what, i),
                   1;
        (*out)[i] = (int32_t)id;
    }
    return 0;
}

/* A string prompt into its pieces: split on the separator, or with the
 * prompt's log-probabilities (`echo` with `logprobs`: every token of it is
 * scored as written) taken whole, all of it the question. */
static rk_status split_prompt(json_t *v, const rk_parse_limits *lim, const rk_api_request *in,
                              rk_split *out) {
    const char *s = json_string_value(v);
    if (in->opt.prompt_logprobs && *s) return rk_split_structured("", NULL, 0, s, 0, out);
    return rk_split_prompt(s, json_string_length(v), in->separator, lim->max_chunks, out);
}

/* `prompt` as an array: strings (each split like a prompt), one token-id
 * list, or token-id lists; a batch of one choice per prompt (times n). */
static int parse_prompt_batch(json_t *prompt, const rk_parse_limits *lim, rk_api_request *out,
                              rk_http_error *err) {
    size_t n = json_array_size(prompt);
    if (n == 0) return rk_http_errorf(err, 400, "'prompt' is an empty array"), 1;
    json_t *first = json_array_get(prompt, 0);
    int one_list = json_is_integer(first);
    size_t n_prompts = one_list ? 1 : n;
    if (n_prompts * (size_t)out->n_choices > RK_MAX_CHOICES)
        return rk_http_errorf(err, 422,
                              "the request asks for %zu choices (prompts × n); at most %d are "
                              "allowed",
                              n_prompts * (size_t)out->n_choices, RK_MAX_CHOICES),
               1;
    if (one_list || json_is_array(first)) {
        out->batch_tokens = calloc(n_prompts, sizeof *out->batch_tokens);
        out->batch_lens = calloc(n_prompts, sizeof *out->batch_lens);
        if (!out->batch_tokens || !out->batch_lens)
            return rk_http_errorf(err, 500, "out of memory"), 1;
        out->n_prompts = (int)n_prompts;
        if (one_list)
            return token_list(prompt, "'prompt'", &out->batch_tokens[0], &out->batch_lens[0], err);
        for (size_t i = 0; i < n; i++) {
            char what[48];
            snprintf(what, sizeof what, "prompt[%zu]", i);
            json_t *a = json_array_get(prompt, i);
            if (!json_is_array(a))
                return rk_http_errorf(err, 400, "prompt[%zu] must be an array of token ids", i), 1;
            if (token_list(a, what, &out->batch_tokens[i], &out->batch_lens[i], err)) return 1;
        }
        return 0;
    }
    out->batch = calloc(n, sizeof *out->batch);
    if (!out->batch) return rk_http_errorf(err, 500, "out of memory"), 1;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(prompt, i);
        if (!json_is_string(v))
            return rk_http_errorf(err, 400,
                                  "prompt[%zu] must be a string (a batch of strings or of token "
                                  "lists)",
                                  i),
                   1;
        rk_status st = split_prompt(v, lim, out, &out->batch[i]);
        if (st) {
            char what[48];
            snprintf(what, sizeof what, "bad prompt[%zu]", i);
            return from_status(err, st, what), 1;
        }
        out->n_prompts = (int)i + 1;
    }
    return 0;
}

/* With `echo`: a copy of each string prompt (NULL for token ids). */
static int echo_texts(json_t *prompt, rk_api_request *out) {
    size_t n = json_is_array(prompt) ? json_array_size(prompt) : 1;
    if (!(out->prompt_texts = calloc(n ? n : 1, sizeof *out->prompt_texts))) return 1;
    out->n_prompt_texts = (int)n;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_is_array(prompt) ? json_array_get(prompt, i) : prompt;
        if (json_is_string(v) && !(out->prompt_texts[i] = rk_strdup(json_string_value(v))))
            return 1;
    }
    return 0;
}

static int parse_completion(json_t *root, const rk_parse_limits *lim, rk_api_request *out,
                            rk_http_error *err) {
    json_t *prompt = json_object_get(root, "prompt"), *segs = json_object_get(root, "segments");
    int structured = json_object_get(root, "question") || json_object_get(root, "chunks") ||
                     json_object_get(root, "system");
    if (json_object_get(root, "messages"))
        return rk_http_errorf(err, 400, "'messages' belongs to /v1/chat/completions"), 1;
    if (json_object_get(root, "tools") || json_object_get(root, "tool_choice"))
        return rk_http_errorf(err, 400, "'tools' belong to /v1/chat/completions"), 1;
    json_int_t lp = 0;
    if (get_int(root, "logprobs", 0, 20, &lp, err)) return 1;
    out->opt.n_logprobs = (int)lp;
    out->opt.prompt_logprobs = out->echo && lp > 0;
    if (out->echo && (structured || (segs && !json_is_null(segs))))
        return rk_http_errorf(
                   err, 400,
                   "'echo' needs 'prompt' (not 'segments' or 'system'/'chunks'/'question')"),
               1;
    if (out->echo && echo_texts(prompt, out)) return rk_http_errorf(err, 500, "out of memory"), 1;
    if (segs && !json_is_null(segs)) {
        if (structured || (prompt && !json_is_null(prompt)))
            return rk_http_errorf(err, 400,
                                  "give one of 'prompt', 'segments' or "
                                  "'system'/'chunks'/'question'"),
                   1;
        return rk_api_parse_segments(segs, lim, out, err);
    }
    if (prompt && !json_is_null(prompt)) {
        if (structured)
            return rk_http_errorf(err, 400,
                                  "give either 'prompt' or 'system'/'chunks'/'question', "
                                  "not both"),
                   1;
        if (json_is_array(prompt)) return parse_prompt_batch(prompt, lim, out, err);
        if (!json_is_string(prompt))
            return rk_http_errorf(err, 400,
                                  "'prompt' must be a string, an array of strings, an array of "
                                  "token ids or an array of token-id arrays"),
                   1;
        rk_status st = split_prompt(prompt, lim, out, &out->pieces);
        if (st) return from_status(err, st, "bad prompt"), 1;
        out->have_pieces = 1;
        return 0;
    }
    return parse_structured(root, lim, out, err);
}

/* ---------------------------------------------------------------- chat */

/* Message content: a string, null (empty) or an array of text parts
 * {"type": "text", "text"}, joined with "\n"; a part marked "ragkv_chunk": true is one of the
 * message's documents (m->docs), the others are joined into m->content. */
static int message_content(json_t *c, int i, rk_chat_msg *m, rk_http_error *err) {
    char **out = &m->content;
    if (!c || json_is_null(c)) {
        *out = rk_strdup("");
    } else if (json_is_string(c)) {
        *out = rk_strdup(json_string_value(c));
    } else if (json_is_array(c)) {
        size_t total = 0, n_docs = 0;
        for (size_t k = 0; k < json_array_size(c); k++) {
            json_t *part = json_array_get(c, k), *ty = json_object_get(part, "type");
            json_t *tx = json_object_get(part, "text"), *rc = json_object_get(part, "ragkv_chunk");
            if (!json_is_object(part) || !json_is_string(ty) ||
                strcmp(json_string_value(ty), "text") != 0 || !json_is_string(tx))
                return rk_http_errorf(err, 400,
                                      "messages[%d].content parts must be {\"type\": \"text\", "
                                      "\"text\": \"...\"}",
                                      i),
                       1;
            if (rc && !json_is_null(rc) && !json_is_boolean(rc))
                return rk_http_errorf(err, 400,
                                      "messages[%d].content[%zu].ragkv_chunk must be true or false",
                                      i, k),
                       1;
            if (json_is_true(rc))
                n_docs++;
            else
                total += json_string_length(tx) + 1;
        }
        if (n_docs && !(m->docs = calloc(n_docs, sizeof *m->docs)))
            return rk_http_errorf(err, 500, "out of memory"), 1;
        *out = malloc(total + 1);
        if (*out) { /* parts joined with newlines, as separate paragraphs */
            size_t o = 0, n_text = 0;
            for (size_t k = 0; k < json_array_size(c); k++) {
                json_t *part = json_array_get(c, k), *tx = json_object_get(part, "text");
                if (json_is_true(json_object_get(part, "ragkv_chunk"))) {
                    if (!(m->docs[m->n_docs++] = rk_strdup(json_string_value(tx))))
                        return rk_http_errorf(err, 500, "out of memory"), 1;
                    continue;
                }
                if (n_text++) (*out)[o++] = '\n';
                memcpy(*out + o, json_string_value(tx), json_string_length(tx));
                o += json_string_length(tx);
            }
            (*out)[o] = '\0';
        }
    } else {
        return rk_http_errorf(err, 400, "messages[%d].content must be a string or an array", i), 1;
    }
    if (!*out) return rk_http_errorf(err, 500, "out of memory"), 1;
    return 0;
}

/* The first user message's documents: the `chunks` extension (strings or
 * {"id", "text"}) or vLLM's `documents` ({"text" or "content", optional "id"
 * and "title"; a title goes on the text's first line}), not both. */
static int parse_chat_documents(json_t *root, const rk_parse_limits *lim, rk_api_request *out,
                                rk_http_error *err) {
    json_t *ch = json_object_get(root, "chunks"), *docs = json_object_get(root, "documents");
    int has_ch = ch && !json_is_null(ch), has_docs = docs && !json_is_null(docs);
    if (has_ch && has_docs)
        return rk_http_errorf(err, 400, "give 'chunks' or 'documents', not both"), 1;
    if (!has_ch && !has_docs) return 0;
    const char *name = has_ch ? "chunks" : "documents";
    json_t *list = has_ch ? ch : docs;
    if (!json_is_array(list)) return rk_http_errorf(err, 400, "'%s' must be an array", name), 1;
    size_t nc = json_array_size(list);
    if (nc > (size_t)lim->max_chunks + 65536)
        return rk_http_errorf(err, 422, "the request has %zu chunks; at most %d are allowed", nc,
                              lim->max_chunks),
               1;
    out->chat_chunks_given = 1;
    out->chat_chunks = calloc(nc ? nc : 1, sizeof *out->chat_chunks);
    out->chat_chunk_ids = calloc(nc ? nc : 1, sizeof *out->chat_chunk_ids);
    if (!out->chat_chunks || !out->chat_chunk_ids)
        return rk_http_errorf(err, 500, "out of memory"), 1;
    for (size_t i = 0; i < nc; i++) {
        json_t *e = json_array_get(list, i);
        const char *t, *id = NULL, *title = NULL;
        if (has_ch) {
            if (chunk_entry(e, (int)i, &t, &id, err)) return 1;
        } else {
            json_t *tx = json_object_get(e, "text"), *ct = json_object_get(e, "content");
            json_t *d = json_object_get(e, "id"), *ti = json_object_get(e, "title");
            if (!json_is_object(e) || !(json_is_string(tx) || json_is_string(ct)) ||
                (tx && ct && !json_is_null(tx) && !json_is_null(ct)))
                return rk_http_errorf(err, 400,
                                      "documents[%zu] must be an object with a string 'text' "
                                      "(or 'content')",
                                      i),
                       1;
            if ((d && !json_is_null(d) && !json_is_string(d)) ||
                (ti && !json_is_null(ti) && !json_is_string(ti)))
                return rk_http_errorf(err, 400, "documents[%zu].id and .title must be strings", i),
                       1;
            if (json_is_string(d) && json_string_length(d) > 255)
                return rk_http_errorf(err, 400, "documents[%zu].id is longer than 255 bytes", i), 1;
            t = json_string_value(json_is_string(tx) ? tx : ct);
            id = json_string_value(d);
            title = json_string_value(ti);
        }
        if (title && *title && *t) {
            size_t lt = strlen(title), lx = strlen(t);
            char *both = malloc(lt + lx + 2);
            if (both) {
                memcpy(both, title, lt);
                both[lt] = '\n';
                memcpy(both + lt + 1, t, lx + 1);
            }
            out->chat_chunks[i] = both;
        } else {
            out->chat_chunks[i] = rk_strdup(t);
        }
        out->chat_chunk_ids[i] = id ? rk_strdup(id) : NULL;
        out->n_chat_chunks = (int)i + 1;
        if (!out->chat_chunks[i] || (id && !out->chat_chunk_ids[i]))
            return rk_http_errorf(err, 500, "out of memory"), 1;
    }
    return 0;
}

static int parse_chat(json_t *root, const rk_parse_limits *lim, rk_api_request *out,
                      rk_http_error *err) {
    if (json_object_get(root, "prompt"))
        return rk_http_errorf(err, 400, "'prompt' belongs to /v1/completions; send 'messages'"), 1;
    if (out->echo) return rk_http_errorf(err, 400, "'echo' belongs to /v1/completions"), 1;
    int lp = 0;
    json_int_t top = 0;
    if (get_bool(root, "logprobs", &lp, err) || get_int(root, "top_logprobs", 0, 20, &top, err))
        return 1;
    out->opt.n_logprobs = lp ? (top > 0 ? (int)top : 1) : 0;
    json_t *msgs = json_object_get(root, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return rk_http_errorf(err, 400, "'messages' must be a non-empty array"), 1;
    size_t n = json_array_size(msgs);
    if (n > RK_MAX_MESSAGES)
        return rk_http_errorf(err, 422, "'messages' has %zu entries; at most %d are allowed", n,
                              RK_MAX_MESSAGES),
               1;
    out->msgs = calloc(n, sizeof *out->msgs);
    if (!out->msgs) return rk_http_errorf(err, 500, "out of memory"), 1;
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i), *role = json_object_get(m, "role");
        if (!json_is_object(m) || !json_is_string(role))
            return rk_http_errorf(err, 400, "messages[%zu] must be an object with a 'role'", i), 1;
        const char *r = json_string_value(role);
        rk_chat_role cr;
        if (!strcmp(r, "system") || !strcmp(r, "developer"))
            cr = RK_ROLE_SYSTEM;
        else if (!strcmp(r, "user"))
            cr = RK_ROLE_USER;
        else if (!strcmp(r, "assistant"))
            cr = RK_ROLE_ASSISTANT;
        else if (!strcmp(r, "tool"))
            cr = RK_ROLE_TOOL;
        else
            return rk_http_errorf(err, 400,
                                  "messages[%zu].role must be system, user, assistant or tool", i),
                   1;
        out->msgs[i].role = cr;
        out->n_msgs = (int)i + 1;
        if (message_content(json_object_get(m, "content"), (int)i, &out->msgs[i], err) ||
            rk_api_parse_msg_documents(m, (int)i, &out->msgs[i], err))
            return 1;
        if (out->msgs[i].n_docs && cr != RK_ROLE_USER && cr != RK_ROLE_TOOL)
            return rk_http_errorf(err, 400,
                                  "messages[%zu]: only user and tool messages carry documents", i),
                   1;
    }
    int any_user = 0;
    for (size_t i = 0; i < n; i++) any_user |= out->msgs[i].role == RK_ROLE_USER;
    if (!any_user) return rk_http_errorf(err, 400, "'messages' has no user message"), 1;
    for (size_t i = 0; i < n; i++)
        if (rk_api_parse_msg_tool_fields(json_array_get(msgs, i), (int)i, &out->msgs[i], err))
            return 1;
    if (rk_api_parse_tools(root, out, err) || rk_api_parse_chunking(root, out, err)) return 1;
    if (out->msgs[n - 1].role == RK_ROLE_SYSTEM)
        return rk_http_errorf(err, 400,
                              "the last message must be the user's (or the assistant's, "
                              "continued)"),
               1;
    /* Chat messages are split on a separator only when asked: Markdown
     * headings ("## Summary") are text. */
    json_t *sep = json_object_get(root, "separator");
    if (sep && !json_is_null(sep)) {
        out->split_chat = 1;
    } else if (lim->chat_separator && *lim->chat_separator) {
        if (rk_separator_check(lim->chat_separator))
            return rk_http_errorf(err, 500, "the server's chat separator is invalid"), 1;
        snprintf(out->separator, sizeof out->separator, "%s", lim->chat_separator);
        out->split_chat = 1;
    }
    return parse_chat_documents(root, lim, out, err);
}

/* ---------------------------------------------------------------- entry points */

#define MAX_DEPTH 32 /* arrays and objects nested deeper are refused before parsing */

/* Deepest nesting of arrays and objects in len bytes of JSON text (strings
 * skipped), stopping early once it passes MAX_DEPTH. The parser recurses per
 * level, and HTTP worker threads have small stacks. */
static int json_depth(const char *s, size_t len) {
    int depth = 0, max = 0, in_str = 0;
    for (size_t i = 0; i < len && max <= MAX_DEPTH; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = 0;
        } else if (c == '"') {
            in_str = 1;
        } else if (c == '[' || c == '{') {
            if (++depth > max) max = depth;
        } else if ((c == ']' || c == '}') && depth > 0) {
            depth--;
        }
    }
    return max;
}

json_t *rk_api_load_object(const char *body, size_t len, rk_http_error *err) {
    if (json_depth(body, len) > MAX_DEPTH) {
        rk_http_errorf(err, 400, "the body nests arrays and objects deeper than %d levels",
                       MAX_DEPTH);
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        rk_http_errorf(err, 400, "the body is not valid JSON: %s (line %d, column %d)", je.text,
                       je.line, je.column);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        rk_http_errorf(err, 400, "the body must be a JSON object");
        return NULL;
    }
    return root;
}

void rk_api_request_free(rk_api_request *r) {
    if (!r) return;
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->model);
    if (r->have_pieces) {
        if (r->chunk_ids)
            for (int i = 0; i < r->pieces.n_chunks; i++) free(r->chunk_ids[i]);
        rk_split_free(&r->pieces);
    }
    free(r->chunk_ids);
    for (int i = 0; i < r->n_msgs; i++) {
        free(r->msgs[i].content);
        free(r->msgs[i].tool_calls);
        free(r->msgs[i].tool_call_id);
        free(r->msgs[i].reasoning);
        for (int k = 0; k < r->msgs[i].n_docs; k++) free(r->msgs[i].docs[k]);
        free(r->msgs[i].docs);
    }
    for (int i = 0; i < r->n_tools; i++) {
        free(r->tools[i].name);
        free(r->tools[i].description);
        json_decref(r->tools[i].parameters);
    }
    free(r->tools);
    free(r->msgs);
    for (int i = 0; i < r->n_chat_chunks; i++) {
        free(r->chat_chunks[i]);
        free(r->chat_chunk_ids[i]);
    }
    free(r->chat_chunks);
    free(r->chat_chunk_ids);
    rk_grammar_free(r->grammar);
    for (int i = 0; i < r->n_prompts; i++) {
        if (r->batch) rk_split_free(&r->batch[i]);
        if (r->batch_tokens) free(r->batch_tokens[i]);
    }
    for (int i = 0; i < r->n_prompt_texts; i++) free(r->prompt_texts[i]);
    free(r->prompt_texts);
    free(r->batch);
    free(r->batch_tokens);
    free(r->batch_lens);
    memset(r, 0, sizeof *r);
}

rk_status rk_api_parse(const char *body, size_t len, int chat, const rk_parse_limits *lim,
                       rk_api_request *out, rk_http_error *err) {
    memset(out, 0, sizeof *out);
    rk_req_options_default(&out->opt);
    snprintf(out->separator, sizeof out->separator, "##");
    out->chat = chat;
    json_t *root = rk_api_load_object(body, len, err);
    if (!root) return RK_ERR_INVALID;
    int failed = parse_common(root, lim, out, err) ||
                 (chat ? parse_chat(root, lim, out, err) : parse_completion(root, lim, out, err));
    json_t *think =
        json_object_get(json_object_get(root, "chat_template_kwargs"), "enable_thinking");
    out->enable_thinking = json_is_boolean(think) ? json_is_true(think) : -1;
    json_t *effort = json_object_get(root, "reasoning_effort");
    const char *es = json_string_value(effort);
    out->reasoning_effort = !es                     ? 0
                            : !strcmp(es, "low")    ? 1
                            : !strcmp(es, "medium") ? 2
                            : !strcmp(es, "high")   ? 3
                                                    : -1;
    if (!failed && !chat && effort && !json_is_null(effort)) {
        rk_http_errorf(err, 400,
                       "'reasoning_effort' is not supported on completions (chat with the "
                       "harmony template of gpt-oss takes it)");
        failed = 1;
    }
    if (!failed && effort && !json_is_null(effort) && (!es || out->reasoning_effort < 0)) {
        rk_http_errorf(err, 400, "'reasoning_effort' must be \"low\", \"medium\" or \"high\"");
        failed = 1;
    }
    json_decref(root);
    if (failed) {
        rk_api_request_free(out);
        return err->status == 422   ? RK_ERR_LIMIT
               : err->status >= 500 ? RK_ERR_NOMEM
                                    : RK_ERR_INVALID;
    }
    return RK_OK;
}

/* ---------------------------------------------------------------- pre-warm, flush */

void rk_prewarm_request_free(rk_prewarm_request *p) {
    if (!p) return;
    for (int i = 0; i < p->n; i++) {
        free(p->texts[i]);
        free(p->ids[i]);
    }
    free(p->texts);
    free(p->ids);
    free(p->system);
    memset(p, 0, sizeof *p);
}

rk_status rk_prewarm_parse(const char *body, size_t len, rk_prewarm_request *out,
                           rk_http_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root = rk_api_load_object(body, len, err);
    if (!root) return RK_ERR_INVALID;
    rk_status st = RK_OK;
    json_t *ch = json_object_get(root, "chunks"), *sys = json_object_get(root, "system");
    size_t n = json_is_array(ch) ? json_array_size(ch) : 0;
    if (!json_is_array(ch) || n == 0) {
        st = rk_http_errorf(err, 400, "'chunks' must be a non-empty array");
    } else if (n > RK_MAX_PREWARM) {
        st = rk_http_errorf(err, 422, "'chunks' has %zu entries; at most %d per request", n,
                            RK_MAX_PREWARM);
    } else if (sys && !json_is_null(sys) && !json_is_string(sys)) {
        st = rk_http_errorf(err, 400, "'system' must be a string");
    } else if (get_bool(root, "persist", &out->persist, err) ||
               get_choice(root, "chunk_context", "isolated", "system", &out->context_system, err) ||
               get_text(root, "cache_salt", out->cache_salt, sizeof out->cache_salt, err) ||
               get_text(root, "tenant", out->tenant, sizeof out->tenant, err)) {
        st = RK_ERR_INVALID;
    }
    if (!st) {
        out->texts = calloc(n, sizeof *out->texts);
        out->ids = calloc(n, sizeof *out->ids);
        out->system = rk_strdup(json_is_string(sys) ? json_string_value(sys) : "");
        if (!out->texts || !out->ids || !out->system)
            st = rk_http_errorf(err, 500, "out of memory");
    }
    for (size_t i = 0; i < n && !st; i++) {
        const char *t, *id;
        if (chunk_entry(json_array_get(ch, i), (int)i, &t, &id, err)) {
            st = RK_ERR_INVALID;
            break;
        }
        if (!*t) {
            st = rk_http_errorf(err, 400, "chunks[%zu] is empty", i);
            break;
        }
        out->texts[i] = rk_strdup(t);
        out->ids[i] = id ? rk_strdup(id) : NULL;
        out->n = (int)i + 1;
        if (!out->texts[i] || (id && !out->ids[i])) st = rk_http_errorf(err, 500, "out of memory");
    }
    json_decref(root);
    if (st) rk_prewarm_request_free(out);
    return st;
}

rk_status rk_flush_parse(const char *body, size_t len, rk_flush_request *out, rk_http_error *err) {
    memset(out, 0, sizeof *out);
    out->chunks = out->prefix = 1;
    size_t i = 0;
    while (i < len && (body[i] == ' ' || body[i] == '\n' || body[i] == '\r' || body[i] == '\t'))
        i++;
    if (i == len) return RK_OK; /* no body: everything */
    json_t *root = rk_api_load_object(body, len, err);
    if (!root) return RK_ERR_INVALID;
    rk_status st = RK_OK;
    json_t *what = json_object_get(root, "what");
    if (what && !json_is_null(what)) {
        const char *w = json_string_value(what);
        if (w && !strcmp(w, "chunks"))
            out->prefix = 0;
        else if (w && !strcmp(w, "prefix"))
            out->chunks = 0;
        else if (!w || strcmp(w, "all") != 0)
            st = rk_http_errorf(err, 400, "'what' must be \"chunks\", \"prefix\" or \"all\"");
    }
    if (!st && get_bool(root, "disk", &out->disk, err)) st = RK_ERR_INVALID;
    if (!st && get_bool(root, "redis", &out->redis, err)) st = RK_ERR_INVALID;
    json_decref(root);
    return st;
}
