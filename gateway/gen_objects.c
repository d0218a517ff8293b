/* gateway/gen_objects.c — the OpenAI objects of a generation: stream
 * events, the final response object, the echoed prompt (generate.c sends
 * them). */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer.h"
#include "gateway/gen.h"
#include "gateway/report.h"

/* The fields every response object and stream event starts with. */
json_t *rk_gen_object_head(gen *g, const char *object) {
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", g->id, "object", object, "created",
                          (json_int_t)g->created, "model", g->rc->S->model_name,
                          "system_fingerprint", rk_model_fingerprint(g->svc->model));
    if (o && g->api.stream && g->api.include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

/* Tokens whose text has gone out entirely (the stream's text lags the
 * tokens while a stop string may still begin). */
int rk_gen_tokens_sent(gen *g) {
    if (g->text_done) return g->job->req.n_out;
    int k = g->lp_sent;
    while (k < g->text.decoded && g->text.tok_end[k] <= g->text.sent) k++;
    return k;
}

/* One streamed event in OpenAI's chunk shape: a piece of text (delta or
 * text) with the log-probabilities of the tokens it completes, and
 * finish_reason null; or, with fr set, the last event of the choice: no
 * text, the finish_reason. */
json_t *rk_gen_chunk_event(gen *g, const char *text, const char *fr) {
    int chat = g->api.chat, upto = fr ? g->job->req.n_out : rk_gen_tokens_sent(g);
    json_t *lp = json_null();
    const rk_tokenizer *tok = rk_model_tokenizer(g->svc->model);
    if (!fr && g->api.opt.n_logprobs > 0 && g->echoing) { /* the prompt's tokens alone */
        json_decref(lp);
        lp = rk_report_echo_logprobs(tok, &g->job->req, text, strlen(text), 0, 0);
    } else if (!fr && g->api.opt.n_logprobs > 0) {
        json_decref(lp);
        lp = g->api.echo && !chat
                 ? rk_report_echo_logprobs(tok, &g->job->req, NULL, g->echo_len, g->lp_sent, upto)
                 : rk_report_logprobs(tok, &g->job->req, g->lp_sent, upto, chat);
        g->lp_sent = upto;
    }
    json_t *choice;
    if (chat) {
        json_t *delta = json_object();
        if (!g->events) json_object_set_new(delta, "role", json_string("assistant"));
        if (!fr && g->thinking) {
            rk_strbuf r = {0}, c = {0};
            rk_think_feed(&g->think, text, strlen(text), g->text_done, &r, &c);
            if (r.len) json_object_set_new(delta, "reasoning_content", json_string(r.s));
            if (c.len || !r.len) json_object_set_new(delta, "content", json_string(c.s ? c.s : ""));
            rk_strbuf_free(&r);
            rk_strbuf_free(&c);
        } else if (!fr) {
            json_object_set_new(delta, "content", json_string(text));
        }
        choice = json_pack("{s:i, s:o, s:o, s:o}", "index", g->index, "delta", delta, "logprobs",
                           lp, "finish_reason", fr ? json_string(fr) : json_null());
    } else {
        choice = json_pack("{s:i, s:s, s:o, s:o}", "index", g->index, "text", fr ? "" : text,
                           "logprobs", lp, "finish_reason", fr ? json_string(fr) : json_null());
    }
    g->events++;
    json_t *ev = rk_gen_object_head(g, chat ? "chat.completion.chunk" : "text_completion");
    if (!ev || !choice || json_object_set_new(ev, "choices", json_pack("[o]", choice))) {
        json_decref(ev);
        return NULL;
    }
    return ev;
}

/* With tool calls, the thinking held back with the answer, as one event
 * (NULL, which sse_event skips, when there was none). */
json_t *rk_gen_reasoning_event(gen *g) {
    if (!g->reasoning || !*g->reasoning) return NULL;
    json_t *ev = rk_gen_object_head(g, "chat.completion.chunk");
    json_t *delta = json_pack("{s:s}", "reasoning_content", g->reasoning);
    if (!g->events) json_object_set_new(delta, "role", json_string("assistant"));
    g->events++;
    if (ev && delta)
        json_object_set_new(ev, "choices",
                            json_pack("[{s:i, s:o, s:n, s:n}]", "index", g->index, "delta", delta,
                                      "logprobs", "finish_reason"));
    else
        json_decref(delta);
    return ev;
}

const char *rk_gen_finish_reason(gen *g) {
    if (g->tool_calls) return "tool_calls";
    if (g->text.stop_at >= 0) return "stop";
    return rk_finish_reason_name(g->job->req.finish_reason);
}

/* A completion's prompt as given, for `echo` (malloc'ed): its string, or its
 * token ids decoded. */
char *rk_gen_echo_text(gen *g) {
    int p = g->api.n_prompts ? g->index / g->api.n_choices : 0;
    if (p < g->api.n_prompt_texts && g->api.prompt_texts[p])
        return rk_strdup(g->api.prompt_texts[p]);
    char *t = NULL;
    size_t tl = 0;
    if (g->api.batch_tokens && p < g->api.n_prompts &&
        !rk_tokenizer_decode(rk_model_tokenizer(g->svc->model), g->api.batch_tokens[p],
                             (size_t)g->api.batch_lens[p], 0, 0, &t, &tl)) {
        char *s = rk_utf8_sanitize(t, tl, NULL);
        free(t);
        return s;
    }
    return rk_strdup("");
}

/* The whole response of a request that was not streamed. */
json_t *rk_gen_final_object(gen *g, const char *text) {
    rk_request *r = &g->job->req;
    const rk_tokenizer *tok = rk_model_tokenizer(g->svc->model);
    char *echoed = NULL; /* `echo`: the prompt and the text */
    json_t *lp = NULL;
    if (g->api.echo && !g->api.chat) {
        char *e = rk_gen_echo_text(g);
        size_t el = e ? strlen(e) : 0, tl = strlen(text);
        if (e) lp = rk_report_echo_logprobs(tok, r, e, el, 0, r->n_out);
        if (e && (echoed = malloc(el + tl + 1))) {
            memcpy(echoed, e, el);
            memcpy(echoed + el, text, tl + 1);
            text = echoed;
        }
        free(e);
    }
    const char *fr = rk_gen_finish_reason(g);
    if (!lp) lp = rk_report_logprobs(tok, r, 0, r->n_out, g->api.chat);
    rk_strbuf think = {0}, answer = {0};
    if (g->thinking && !g->tool_calls) { /* (with calls, the answer was split before) */
        rk_think_split_text_as(rk_think_kind(&g->think), text, &think, &answer);
        text = answer.s ? answer.s : "";
    }
    const char *reasoning = g->tool_calls ? g->reasoning : think.s;
    json_t *choice;
    if (g->api.chat && g->tool_calls) /* content: the text before the calls, or null */
        choice = json_pack(
            "{s:i, s:{s:s, s:o, s:O, s:n}, s:o, s:s}", "index", g->index, "message", "role",
            "assistant", "content", *g->tool_content ? json_string(g->tool_content) : json_null(),
            "tool_calls", g->tool_calls, "refusal", "logprobs", lp, "finish_reason", fr);
    else
        choice = g->api.chat ? json_pack("{s:i, s:{s:s, s:s, s:n}, s:o, s:s}", "index", g->index,
                                         "message", "role", "assistant", "content", text, "refusal",
                                         "logprobs", lp, "finish_reason", fr)
                             : json_pack("{s:i, s:s, s:o, s:s}", "index", g->index, "text", text,
                                         "logprobs", lp, "finish_reason", fr);
    if (choice && reasoning && *reasoning)
        json_object_set_new(json_object_get(choice, "message"), "reasoning_content",
                            json_string(reasoning));
    rk_strbuf_free(&think);
    rk_strbuf_free(&answer);
    free(echoed);
    json_t *o = rk_gen_object_head(g, g->api.chat ? "chat.completion" : "text_completion");
    if (!o || !choice || json_object_set_new(o, "choices", json_pack("[o]", choice)) ||
        json_object_set_new(o, "usage", rk_report_usage(r)) ||
        json_object_set_new(o, "ragkv", rk_report_ragkv(r))) {
        json_decref(o);
        return NULL;
    }
    return o;
}
