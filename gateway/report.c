/* gateway/report.c — a finished request as the JSON object POST
 * /v1/completions returns (API.md), shared by the HTTP service and
 * `ragkv generate --json`. */
#include <math.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline.h"
#include "gateway/report.h"

const char *rk_finish_reason_name(rk_finish_reason f) {
    switch (f) {
    case RK_FINISH_STOP: return "stop";
    case RK_FINISH_CANCELLED: return "cancelled";
    case RK_FINISH_LENGTH: break;
    }
    return "length";
}

const char *rk_chunk_status_name(rk_chunk_status s) {
    switch (s) {
    case RK_CHUNK_STATUS_HIT: return "hit";
    case RK_CHUNK_STATUS_MISS: return "miss";
    case RK_CHUNK_STATUS_UNCACHED: return "uncached";
    case RK_CHUNK_STATUS_OFF: break;
    }
    return "off";
}

const char *rk_chunk_source_name(rk_chunk_source s) {
    switch (s) {
    case RK_CHUNK_SOURCE_ARENA: return "arena";
    case RK_CHUNK_SOURCE_DISK: return "disk";
    case RK_CHUNK_SOURCE_REDIS: return "redis";
    case RK_CHUNK_SOURCE_PREFIX: return "prefix";
    case RK_CHUNK_SOURCE_COMPUTED: break;
    }
    return "computed";
}

static json_t *timings_json(const rk_request *r) {
    const rk_req_timings *t = &r->t;
    /* Throughputs: prompt tokens computed per second of prefill work (chunk
     * computation included), generated tokens per second of decoding. */
    double prefill_s = (t->chunk_compute_ms + t->prefill_ms) / 1e3, decode_s = t->decode_ms / 1e3;
    double prompt_tps = prefill_s > 0 ? r->computed_tokens / prefill_s : 0;
    double decode_tps = decode_s > 0 && r->n_out > 1 ? (r->n_out - 1) / decode_s : 0;
    return json_pack("{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:i, s:f, s:f}", "queue_ms",
                     t->queue_ms, "lookup_ms", t->lookup_ms, "chunk_compute_ms",
                     t->chunk_compute_ms, "reindex_ms", t->reindex_ms, "repair_ms", t->repair_ms,
                     "prefill_ms", t->prefill_ms, "ttft_ms", t->ttft_ms, "decode_ms", t->decode_ms,
                     "total_ms", t->total_ms, "prompt_tokens_computed", r->computed_tokens,
                     "prompt_tokens_per_s", prompt_tps, "decode_tokens_per_s", decode_tps);
}

json_t *rk_report_ragkv(const rk_request *r) {
    json_t *chunks = json_array();
    int chunk_hits = 0; /* chunk-cache hits reindexed, less what repair recomputed */
    for (int k = 0; k < r->n_chunks; k++) {
        const rk_chunk_report *c = &r->chunk_reports[k];
        if (c->status == RK_CHUNK_STATUS_HIT && c->source != RK_CHUNK_SOURCE_PREFIX)
            chunk_hits += c->tokens - c->repaired;
        /* How its KV reached the request: attended in place, copied, or
         * neither (plain mode computes the chunk text as prompt; a chunk
         * inside a reused sequence was neither looked up nor moved). */
        const char *reindex = r->opt.mode == RK_MODE_PLAIN || c->source == RK_CHUNK_SOURCE_PREFIX
                                  ? "none"
                              : c->zero_copy ? "zero-copy"
                                             : "copy";
        json_array_append_new(chunks,
                              json_pack("{s:i, s:i, s:s, s:i, s:s, s:s, s:i, s:s, s:f, s:i}",
                                        "index", k, "group", c->group, "key", c->key, "tokens",
                                        c->tokens, "status", rk_chunk_status_name(c->status),
                                        "source", rk_chunk_source_name(c->source), "live_offset",
                                        c->live_offset, "reindex", reindex, "reindex_us",
                                        c->reindex_us, "recomputed_tokens", c->repaired));
    }
    json_t *ids = json_array();
    for (int i = 0; i < r->n_out; i++) json_array_append_new(ids, json_integer(r->out_tokens[i]));
    /* Together they are usage.prompt_tokens_details.cached_tokens. */
    json_t *reused = json_pack("{s:i, s:i, s:i}", "prefix", r->sys_cached, "chunks", chunk_hits,
                               "conversation", r->conv_cached);
    /* The repair policy the request ran with (what "auto" chose, for one). */
    char repair[48] = "none";
    if (r->opt.repair_k > 0)
        snprintf(repair, sizeof repair, "first_k:%d", r->opt.repair_k);
    else if (r->opt.repair_ratio > 0)
        snprintf(repair, sizeof repair, "%s:%g", r->opt.repair_query ? "query" : "deviation",
                 r->opt.repair_ratio);
    /* The texts between chunk groups (none with one group): text g follows group g. */
    json_t *texts = json_array();
    for (int g = 0; g + 1 < r->n_groups; g++)
        json_array_append_new(texts,
                              json_pack("{s:i, s:i}", "after_group", g, "tokens", r->gap_len[g]));
    return json_pack("{s:{s:i, s:i}, s:o, s:o, s:i, s:{s:i}, s:s, s:i, s:i, s:o, s:o, s:o}",
                     "system", "tokens", r->n_sys, "cached_tokens", r->sys_cached, "chunks", chunks,
                     "texts", texts, "empty_chunks_skipped", r->n_empty_chunks, "question",
                     "tokens", r->n_question, "repair", repair, "recomputed_tokens",
                     r->recomputed_tokens, "shared_blocks", r->shared_blocks, "reused", reused,
                     "completion_ids", ids, "timings", timings_json(r));
}

json_t *rk_report_usage(const rk_request *r) {
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", r->prompt_tokens,
                     "completion_tokens", r->n_out, "total_tokens", r->prompt_tokens + r->n_out,
                     "prompt_tokens_details", "cached_tokens", r->cached_tokens);
}

/* A log-probability as JSON: null for one JSON cannot hold (NaN or
 * infinite; jansson has no value for them), so that every token keeps its
 * entry. */
static json_t *logprob_json(double v) { return isfinite(v) ? json_real(v) : json_null(); }

/* A token's bytes (at most 255, *n their count) and its text made valid UTF-8
 * (malloc'ed; NULL when out of memory). */
static char *token_text(const rk_tokenizer *tok, int32_t id, char buf[256], int *n) {
    int k = rk_tokenizer_token_bytes(tok, id, 1, buf, 255);
    *n = k < 0 ? 0 : k < 255 ? k : 255;
    return rk_utf8_sanitize(buf, (size_t)*n, NULL);
}

static json_t *bytes_json(const char *buf, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer((unsigned char)buf[i]));
    return a;
}

/* One {token, logprob, bytes} entry of the chat shape (top_logprobs added by the caller). */
static json_t *chat_entry(const rk_tokenizer *tok, int32_t id, float lp) {
    char buf[256];
    int n;
    char *s = token_text(tok, id, buf, &n);
    json_t *e = json_pack("{s:s, s:o, s:o}", "token", s ? s : "", "logprob", logprob_json(lp),
                          "bytes", bytes_json(buf, n));
    free(s);
    return e;
}

/* The completion shape's four lists, appended to entry by entry. */
typedef struct lp_lists {
    json_t *tokens, *lps, *tops, *offsets;
} lp_lists;

static void lists_init(lp_lists *l) {
    l->tokens = json_array();
    l->lps = json_array();
    l->tops = json_array();
    l->offsets = json_array();
}

static json_t *lists_object(lp_lists *l) {
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", l->tokens, "token_logprobs", l->lps,
                     "top_logprobs", l->tops, "text_offset", l->offsets);
}

/* One token's entry: its text, log-probability, top k ({text: logprob}; null
 * when nothing came before it: top_ids[0] < 0) and text offset. */
static void lists_add(lp_lists *l, const rk_tokenizer *tok, int32_t id, float lp,
                      const int32_t *top_ids, const float *top_lps, int k, long offset) {
    char buf[256];
    int n;
    char *s = token_text(tok, id, buf, &n);
    json_array_append_new(l->tokens, json_string(s ? s : ""));
    free(s);
    json_array_append_new(l->lps, logprob_json(lp));
    json_array_append_new(l->offsets, json_integer(offset));
    json_t *top = top_ids[0] < 0 ? json_null() : json_object();
    for (int j = 0; j < k && top_ids[j] >= 0; j++) {
        char *t = token_text(tok, top_ids[j], buf, &n);
        json_object_set_new(top, t ? t : "", logprob_json(top_lps[j]));
        free(t);
    }
    json_array_append_new(l->tops, top);
}

/* Generated tokens [from, to) of r into l; text offsets from base (the
 * bytes before the completion). */
static void add_generated(lp_lists *l, const rk_tokenizer *tok, const rk_request *r, int from,
                          int to, long base) {
    int k = r->opt.n_logprobs, n;
    char buf[256];
    long offset = base; /* bytes of the completion before token i */
    for (int i = 0; i < to; i++) {
        if (i >= from)
            lists_add(l, tok, r->out_tokens[i], r->logprobs[i], r->top_ids + (size_t)i * k,
                      r->top_logprobs + (size_t)i * k, k, offset);
        free(token_text(tok, r->out_tokens[i], buf, &n));
        offset += n;
    }
}

json_t *rk_report_logprobs(const rk_tokenizer *tok, const rk_request *r, int from, int to,
                           int chat) {
    int k = r->opt.n_logprobs;
    if (k <= 0) return json_null();
    if (to > r->n_out) to = r->n_out;
    if (from < 0) from = 0;
    if (chat) {
        json_t *content = json_array();
        for (int i = from; i < to; i++) {
            json_t *e = chat_entry(tok, r->out_tokens[i], r->logprobs[i]), *tops = json_array();
            for (int j = 0; j < k; j++)
                json_array_append_new(tops, chat_entry(tok, r->top_ids[(size_t)i * k + j],
                                                       r->top_logprobs[(size_t)i * k + j]));
            json_object_set_new(e, "top_logprobs", tops);
            json_array_append_new(content, e);
        }
        return json_pack("{s:o, s:n}", "content", content, "refusal");
    }
    lp_lists l;
    lists_init(&l);
    add_generated(&l, tok, r, from, to, 0);
    return lists_object(&l);
}

/* The question's tokens into l (the prompt's entries after its system
 * tokens: BOS alone for an echoed prompt), their text offsets in echo. The
 * tokens' bytes concatenated may hold more than echo before it (the space
 * a SentencePiece tokenizer puts before the first word): offsets are taken
 * back by what comes before echo, and kept inside it. */
static void add_prompt(lp_lists *l, const rk_tokenizer *tok, const rk_request *r, const char *echo,
                       size_t echo_len) {
    int k = r->opt.n_logprobs, nq = r->n_question;
    long e_len = (long)echo_len, total = 0, shift = 0;
    rk_strbuf d = {0};
    char buf[1024];
    for (int i = 0; i < nq; i++) {
        int n = rk_tokenizer_token_bytes(tok, r->question[i], 0, buf, sizeof buf);
        if (n > 0) rk_strbuf_putn(&d, buf, n < (int)sizeof buf ? (size_t)n : sizeof buf);
        total += n > 0 ? n : 0;
    }
    if (d.s && (long)d.len == total && total >= e_len && !memcmp(d.s + total - e_len, echo, e_len))
        shift = total - e_len;
    rk_strbuf_free(&d);
    long at = 0;
    for (int i = 0; i < nq; i++) {
        size_t j = (size_t)(r->n_sys + i);
        long off = at - shift < 0 ? 0 : at - shift > e_len ? e_len : at - shift;
        lists_add(l, tok, r->question[i], r->prompt_logprobs[j], r->prompt_top_ids + j * k,
                  r->prompt_top_logprobs + j * k, k, off);
        int n = rk_tokenizer_token_bytes(tok, r->question[i], 0, buf, sizeof buf);
        at += n > 0 ? n : 0;
    }
}

json_t *rk_report_echo_logprobs(const rk_tokenizer *tok, const rk_request *r, const char *echo,
                                size_t echo_len, int from, int to) {
    if (r->opt.n_logprobs <= 0) return json_null();
    if (to > r->n_out) to = r->n_out;
    if (from < 0) from = 0;
    lp_lists l;
    lists_init(&l);
    if (echo && r->prompt_logprobs) add_prompt(&l, tok, r, echo, echo_len);
    add_generated(&l, tok, r, from, to, (long)echo_len);
    return lists_object(&l);
}

rk_status rk_report_text(const rk_tokenizer *tok, const rk_request *r, char **out) {
    char *raw = NULL;
    size_t len = 0;
    int skip = r->n_sys + r->n_question > 0 && r->n_question == 0 && r->n_sys == 1;
    rk_status st = rk_tokenizer_decode(tok, r->out_tokens, (size_t)r->n_out, 0, skip, &raw, &len);
    if (st) return st;
    *out = rk_utf8_sanitize(raw, len, NULL);
    free(raw);
    return *out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "report: out of memory");
}

json_t *rk_report_completion(const rk_tokenizer *tok, const rk_request *r, const char *id,
                             long created, const char *model) {
    char *text = NULL;
    if (rk_report_text(tok, r, &text)) return NULL;
    json_t *choice = json_pack("{s:i, s:s, s:s, s:o}", "index", 0, "text", text, "finish_reason",
                               rk_finish_reason_name(r->finish_reason), "logprobs",
                               rk_report_logprobs(tok, r, 0, r->n_out, 0));
    free(text);
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o, s:o}", "id", id, "object", "text_completion",
                     "created", (json_int_t)created, "model", model, "choices", choice, "usage",
                     rk_report_usage(r), "ragkv", rk_report_ragkv(r));
}

/* ---------------------------------------------------------------- text */

char *rk_utf8_sanitize(const char *text, size_t n, size_t *out_len) {
    char *out = malloc(n * 3 + 1); /* each invalid byte may become 3 bytes */
    if (!out) return NULL;
    const unsigned char *s = (const unsigned char *)text;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int len = rk_utf8_decode(s + i, n - i, &cp);
        if (len > 0 && cp != 0) {
            memcpy(out + o, s + i, (size_t)len);
            o += (size_t)len;
            i += (size_t)len;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3); /* U+FFFD */
            o += 3;
            i++;
        }
    }
    out[o] = '\0';
    if (out_len) *out_len = o;
    return out;
}
