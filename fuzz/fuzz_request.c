/* fuzz/fuzz_request.c — libFuzzer target over the HTTP request parsers: the
 * completion and chat bodies (with every chat template rendered), pre-warm and
 * flush bodies, and the prompt splitter. No model is needed. Each input is
 * checked against the parsers' invariants; a violation aborts (a crash to
 * libFuzzer). tests/test_request_corpus.c includes this file and replays
 * fuzz/corpus/ through rk_fuzz_request_check under Criterion.
 *
 *   make fuzz                 (FUZZ_SECONDS=60 by default; scripts/fuzz.sh) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/chat.h"

#define FUZZ_MAX_CHUNKS 8
#define FUZZ_MAX_TOKENS 4096

static int is_error_status(int s) {
    return s == 400 || s == 404 || s == 413 || s == 422 || s == 500 || s == 501;
}

/* A failed parse must explain itself with an error status and a message. */
static const char *check_error(const rk_http_error *e) {
    if (!is_error_status(e->status)) return "a parse failed with an unexpected HTTP status";
    if (!e->type || !e->type[0] || !e->message[0]) return "a parse failed without a message";
    if (!memchr(e->message, '\0', sizeof e->message)) return "an error message is not terminated";
    return NULL;
}

static const char *check_split(const rk_split *s, int max_chunks) {
    if (s->n_chunks < 0 || s->n_chunks > max_chunks) return "more chunks than allowed";
    if (s->n_empty_chunks < 0) return "a negative count of empty chunks";
    if (!s->system.s || !s->question.s) return "a missing system or question piece";
    if (strlen(s->system.s) != s->system.len || strlen(s->question.s) != s->question.len)
        return "a piece length that does not match its text";
    for (int i = 0; i < s->n_chunks; i++) {
        if (!s->chunks[i].s || s->chunks[i].len == 0) return "an empty chunk was kept";
        if (strlen(s->chunks[i].s) != s->chunks[i].len) return "a chunk length mismatch";
    }
    if (s->n_chunks > 0 && s->question.len == 0) return "chunks without a question";
    return NULL;
}

static const char *check_request(const rk_api_request *r) {
    const rk_req_options *o = &r->opt;
    if (o->max_tokens < 0 || o->max_tokens > FUZZ_MAX_TOKENS) return "max_tokens out of range";
    if (o->n_logprobs < 0 || o->n_logprobs > 20) return "logprobs out of range";
    if (!(o->sampling.temperature >= 0) || !(o->sampling.top_p > 0 && o->sampling.top_p <= 1))
        return "a sampling parameter out of range";
    if (o->sampling.top_k < 0) return "a negative top_k";
    if (r->n_stop < 0 || r->n_stop > RK_MAX_STOP) return "too many stop strings";
    for (int i = 0; i < r->n_stop; i++) {
        size_t n = strlen(r->stop[i]);
        if (n == 0 || n > RK_STOP_MAX_BYTES) return "a stop string of a bad length";
    }
    if (rk_separator_check(r->separator)) return "an invalid separator was accepted";
    if (r->n_choices < 1 || r->n_choices * (r->n_prompts ? r->n_prompts : 1) > RK_MAX_CHOICES)
        return "a choice count out of range";
    if (!(o->sampling.presence_penalty >= -2 && o->sampling.presence_penalty <= 2) ||
        !(o->sampling.frequency_penalty >= -2 && o->sampling.frequency_penalty <= 2) ||
        !(o->sampling.repetition_penalty > 0) || o->sampling.n_logit_bias < 0 ||
        o->sampling.n_logit_bias > RK_MAX_LOGIT_BIAS)
        return "a penalty or logit_bias out of range";
    for (int i = 0; i < r->n_prompts; i++) {
        const char *bad = r->batch ? check_split(&r->batch[i], FUZZ_MAX_CHUNKS) : NULL;
        if (bad) return bad;
        if (r->batch_tokens && (!r->batch_tokens[i] || r->batch_lens[i] < 1))
            return "an empty token prompt";
    }
    if (!r->chat && !r->have_pieces && r->n_prompts == 0)
        return "a completion parsed without pieces";
    return r->have_pieces ? check_split(&r->pieces, FUZZ_MAX_CHUNKS) : NULL;
}

const char *rk_fuzz_request_check(const uint8_t *data, size_t size);

/* Run every parser over the input; NULL when every invariant holds, else what broke. */
const char *rk_fuzz_request_check(const uint8_t *data, size_t size) {
    const char *body = (const char *)data, *bad = NULL;
    rk_parse_limits lim = {.max_chunks = FUZZ_MAX_CHUNKS, .max_tokens = FUZZ_MAX_TOKENS};
    for (int chat = 0; chat <= 1 && !bad; chat++) {
        rk_api_request r;
        rk_http_error err = {0};
        if (rk_api_parse(body, size, chat, &lim, &r, &err) != RK_OK) {
            bad = check_error(&err);
            continue;
        }
        bad = check_request(&r);
        for (int t = RK_CHAT_CHATML; chat && !bad && t <= RK_CHAT_LLAMA2; t++) {
            rk_http_error e2 = {0};
            if (rk_chat_render((rk_chat_template)t, &r, FUZZ_MAX_CHUNKS, &e2) == RK_OK)
                bad = r.have_pieces ? check_split(&r.pieces, FUZZ_MAX_CHUNKS)
                                    : "a chat rendered without pieces";
            else
                bad = check_error(&e2);
            if (!bad && r.have_pieces && r.pieces.question.len == 0)
                bad = "a chat question piece without its template";
        }
        rk_api_request_free(&r);
    }
    if (!bad) {
        rk_prewarm_request p;
        rk_http_error err = {0};
        if (rk_prewarm_parse(body, size, &p, &err) == RK_OK) {
            if (p.n < 1 || p.n > RK_MAX_PREWARM || !p.system) bad = "a bad pre-warm request";
            for (int i = 0; i < p.n && !bad; i++)
                if (!p.texts[i] || !p.texts[i][0]) bad = "an empty pre-warm chunk was kept";
            rk_prewarm_request_free(&p);
        } else {
            bad = check_error(&err);
        }
    }
    if (!bad) {
        rk_flush_request f;
        rk_http_error err = {0};
        if (rk_flush_parse(body, size, &f, &err) == RK_OK) {
            if (!f.chunks && !f.prefix) bad = "a flush of nothing";
        } else {
            bad = check_error(&err);
        }
    }
    static const char *seps[] = {"##", "|", "<doc>"};
    for (int k = 0; k < 3 && !bad; k++) {
        rk_split s;
        rk_status st = rk_split_prompt(body, size, seps[k], FUZZ_MAX_CHUNKS, &s);
        if (st == RK_OK) {
            /* Embedded NUL bytes end a piece's C string early: compare up to them. */
            if (memchr(body, '\0', size) == NULL) bad = check_split(&s, FUZZ_MAX_CHUNKS);
            rk_split_free(&s);
        } else if (st != RK_ERR_INVALID && st != RK_ERR_LIMIT) {
            bad = "the splitter failed with an unexpected status";
        }
    }
    return bad;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *bad = rk_fuzz_request_check(data, size);
    if (bad) {
        fprintf(stderr, "invariant broken: %s\n", bad);
        abort();
    }
    return 0;
}
