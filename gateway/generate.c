/* gateway/generate.c — POST /v1/completions and /v1/chat/completions: a
 * request prepared (parsed, rendered, tokenized) on the worker thread,
 * queued for the engine, waited for while its tokens are streamed as
 * Server-Sent Events, and answered in OpenAI's shapes. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/tokenizer.h"
#include "gateway/chat.h"
#include "gateway/gen.h"
#include "gateway/gen_text.h"
#include "gateway/http.h"
#include "gateway/report.h"

static int write_all(gen *g, const char *s, size_t n) {
    if (g->client_gone) return -1;
    if (mg_write(g->rc->conn, s, n) != (int)n) {
        g->client_gone = 1;
        rk_scheduler_cancel(g->rc->S->engine, g->job);
        return -1;
    }
    return 0;
}

static int sse_event(gen *g, json_t *ev) {
    if (g->sink) { /* the sink writes its own events */
        char *s = ev ? g->sink->event(g->sink->ctx, ev) : NULL;
        int rc = s ? write_all(g, s, strlen(s)) : -1;
        free(s);
        return rc;
    }
    char *s = ev ? json_dumps(ev, JSON_COMPACT) : NULL;
    json_decref(ev);
    if (!s) return -1;
    int rc = write_all(g, "data: ", 6) || write_all(g, s, strlen(s)) || write_all(g, "\n\n", 2);
    free(s);
    return rc;
}

/* The stream's end: [DONE], or the sink's last events. */
static void sse_done(gen *g) {
    if (!g->sink) {
        write_all(g, "data: [DONE]\n\n", 14);
        return;
    }
    char *s = g->sink->done(g->sink->ctx);
    if (s) write_all(g, s, strlen(s));
    free(s);
}

/* A whole (unstreamed) answer, through the sink when there is one. */
static void send_final(gen *g, json_t *obj) {
    if (g->sink && obj) obj = g->sink->final(g->sink->ctx, obj);
    rk_gw_send_json(g->rc, 200, obj);
}

static void sse_start(gen *g) {
    if (g->headers_sent) return;
    g->headers_sent = 1;
    mg_disable_connection_keep_alive(g->rc->conn);
    struct mg_connection *c = g->rc->conn;
    g->rc->status = 200;
    mg_response_header_start(c, 200);
    mg_response_header_add(c, "Content-Type", "text/event-stream", -1);
    mg_response_header_add(c, "Cache-Control", "no-cache", -1);
    mg_response_header_add(c, "X-Request-Id", g->rc->id, -1);
    rk_gw_add_cors_headers(g->rc);
    mg_response_header_send(c);
}

/* A streamed completion with `echo`: its prompt, as the first text event. */
static void send_echo(gen *g) {
    if (!g->api.echo || g->api.chat || g->echoed) return;
    g->echoed = 1;
    char *t = rk_gen_echo_text(g);
    if (t) {
        g->echo_len = strlen(t);
        g->echoing = 1;
        sse_event(g, rk_gen_chunk_event(g, t, NULL));
        g->echoing = 0;
    }
    free(t);
}

/* A stream's last events: the choice's finish event, then, when
 * stream_options.include_usage asked for it, the usage event (choices [],
 * as OpenAI sends it). The ragkv report goes in the usage event when there
 * is one, else as a top-level field of the finish event: no event has empty
 * choices unless the client asked for usage. */
static void stream_finish(gen *g) {
    json_t *fin = rk_gen_chunk_event(g, NULL, rk_gen_finish_reason(g));
    rk_request *r = &g->job->req;
    if (!g->api.include_usage) {
        if (fin && json_object_set_new(fin, "ragkv", rk_report_ragkv(r))) {
            json_decref(fin);
            fin = NULL;
        }
        sse_event(g, fin);
        return;
    }
    sse_event(g, fin);
    json_t *o = rk_gen_object_head(g, g->api.chat ? "chat.completion.chunk" : "text_completion");
    if (!o || json_object_set_new(o, "choices", json_array()) ||
        json_object_set_new(o, "usage", rk_report_usage(r)) ||
        json_object_set_new(o, "ragkv", rk_report_ragkv(r))) {
        json_decref(o);
        o = NULL;
    }
    sse_event(g, o);
}

/* Stream the new text, if any. */
static void stream_progress(gen *g) {
    char *t = rk_gt_take(&g->text, 0);
    if (!t) return;
    sse_start(g);
    send_echo(g);
    if (*t) sse_event(g, rk_gen_chunk_event(g, t, NULL));
    free(t);
}

/* Has the client gone (closed or reset its connection)? Checked every
 * 100 ms while waiting; cancels the job when so. */
static void check_client(gen *g) {
    if (g->fd == -2) /* looked for only by requests that last: it costs a scan */
        g->fd = rk_gw_conn_fd(mg_get_request_info(g->rc->conn));
    if (g->client_gone || !rk_gw_peer_gone(g->fd)) return;
    g->client_gone = 1;
    rk_scheduler_cancel(g->rc->S->engine, g->job);
}

/* Wait for the job, streaming as it goes, and watching the connection so
 * that a client gone stops its generation at the next step; sets
 * g->timed_out. */
static void wait_job(gen *g, double deadline) {
    server *S = g->rc->S;
    int seen = 0, done = 0, n;
    double next_check = rk_time_now() + 0.1;
    while (!done) {
        double until = g->timed_out || g->client_gone ? 0 : deadline;
        int polling = until > 0 && g->fd != -1 && next_check < until;
        if (polling) until = next_check;
        int to = rk_job_wait(g->job, seen, until, &n, &done);
        if (polling && rk_time_now() >= next_check) {
            /* Tokens may have been published meanwhile without waking us. */
            check_client(g);
            next_check = rk_time_now() + 0.1;
            if (to) continue;
        }
        if (to) {
            g->timed_out = 1;
            rk_scheduler_cancel(S->engine, g->job);
            continue;
        }
        if (n > seen && !done) {
            /* Tokens 0..n-1 are final; the engine may append more meanwhile. */
            rk_gt_feed(&g->text, g->job->req.out_tokens, n);
            seen = n;
            if (g->text.stop_at >= 0) rk_scheduler_cancel(S->engine, g->job);
            if (g->api.stream && !g->client_gone && !g->tools_active) stream_progress(g);
        }
    }
}

static void log_generation(gen *g) {
    rk_request *r = &g->job->req;
    int hits = 0, misses = 0;
    for (int k = 0; k < r->n_chunks; k++) {
        hits += r->chunk_reports[k].status == RK_CHUNK_STATUS_HIT;
        misses += r->chunk_reports[k].status == RK_CHUNK_STATUS_MISS;
    }
    snprintf(g->rc->detail, sizeof g->rc->detail,
             " prompt_tokens=%d cached_tokens=%d completion_tokens=%d chunks=%d hits=%d misses=%d "
             "finish=%s queue_ms=%.2f ttft_ms=%.2f engine_ms=%.2f%s",
             r->prompt_tokens, r->cached_tokens, r->n_out, r->n_chunks, hits, misses,
             rk_gen_finish_reason(g), r->t.queue_ms, r->t.ttft_ms, r->t.total_ms,
             g->client_gone ? " client_gone=1" : "");
}

/* A job that did not run (timeout, shutdown) or failed: its error, as an
 * event when the stream has started, else as the answer. */
static void respond_failure(gen *g) {
    rk_job *j = g->job;
    req_ctx *rc = g->rc;
    int status = !j->ran ? 503 : rk_http_status_of(j->status);
    char msg[400];
    if (g->timed_out && !j->ran)
        snprintf(msg, sizeof msg, "the request waited longer than the timeout (%g s)",
                 rc->S->o.timeout_s);
    else if (!j->ran && atomic_load(&rc->S->stopping))
        snprintf(msg, sizeof msg, "the server is shutting down");
    else if (j->status == RK_ERR_EXHAUSTED)
        snprintf(msg, sizeof msg, "out of KV memory, try again: %s", j->error);
    else
        snprintf(msg, sizeof msg, "%s", j->error[0] ? j->error : rk_status_str(j->status));
    rk_http_error e = {.status = status,
                       .type = rk_http_error_type(status),
                       .code = j->ran ? rk_http_error_code(j->status) : NULL};
    if (e.code) e.param = g->api.chat ? "messages" : "prompt";
    snprintf(e.message, sizeof e.message, "%.319s", msg);
    if (g->headers_sent) { /* mid-stream: an error event, then the end */
        sse_event(g, rk_gw_error_body(&e));
        sse_done(g);
    } else if (!g->client_gone) {
        rk_gw_send_error(rc, &e);
    } else {
        rc->status = 499; /* nothing was answered: the client closed the request */
    }
}

/* With tools: the whole answer, its thinking split off (calls are looked
 * for after it), and its tool calls parsed (g->tool_calls, g->tool_content).
 * Returns the answer (malloc'ed, may be NULL). */
static char *take_tool_answer(gen *g) {
    char *all = rk_gt_take(&g->text, 1);
    /* harmony: a call is known by its message's header, which the split
     * below drops, so the calls are parsed from the answer with its tags */
    int harmony = g->rc->S->tmpl == RK_CHAT_HARMONY;
    if (harmony)
        g->tool_calls =
            rk_chat_tool_calls(RK_CHAT_HARMONY, &g->api, all ? all : "", g->id, &g->tool_content);
    if (g->thinking && all) {
        rk_strbuf think = {0}, answer = {0};
        rk_think_split_text_as(rk_think_kind(&g->think), all, &think, &answer);
        g->reasoning = rk_strbuf_take(&think);
        free(all);
        all = answer.s ? rk_strbuf_take(&answer) : rk_strdup("");
        g->thinking = 0; /* what is sent from here on is the answer */
    }
    if (!harmony)
        g->tool_calls =
            rk_chat_tool_calls(g->rc->S->tmpl, &g->api, all ? all : "", g->id, &g->tool_content);
    return all;
}

/* A stream's tool calls: the text before them (with the role), then the
 * calls whole (one fragment each, with their index), then the end. */
static void stream_tool_calls(gen *g) {
    sse_start(g);
    sse_event(g, rk_gen_reasoning_event(g));
    sse_event(g, rk_gen_chunk_event(g, g->tool_content, NULL));
    json_t *frag = json_array();
    for (size_t k = 0; frag && k < json_array_size(g->tool_calls); k++) {
        json_t *c = json_deep_copy(json_array_get(g->tool_calls, k));
        if (c) json_object_set_new(c, "index", json_integer((json_int_t)k));
        json_array_append_new(frag, c);
    }
    json_t *ev = rk_gen_object_head(g, "chat.completion.chunk");
    if (ev)
        json_object_set_new(ev, "choices",
                            json_pack("[{s:i, s:{s:o}, s:n, s:n}]", "index", g->index, "delta",
                                      "tool_calls", frag, "logprobs", "finish_reason"));
    else
        json_decref(frag);
    sse_event(g, ev);
    g->text_done = 1;
    stream_finish(g);
    sse_done(g);
}

static void respond_generation(gen *g) {
    rk_job *j = g->job;
    req_ctx *rc = g->rc;
    if (!j->ran || j->status) {
        respond_failure(g);
        return;
    }
    rk_gt_feed(&g->text, j->req.out_tokens, j->req.n_out);
    if (g->text.stop_at >= 0 && g->text.stop_tokens < j->req.n_out)
        j->req.n_out = g->text.stop_tokens; /* usage, ids and logprobs end at the stop */
    char *all = g->tools_active ? take_tool_answer(g) : NULL; /* parsed before it is logged */
    log_generation(g);
    if (g->client_gone) {
        if (!g->headers_sent) rc->status = 499; /* nothing was answered */
        free(all);
        return;
    }
    if (g->timed_out && !g->api.stream) {
        free(all);
        rk_gw_send_errorf(rc, 503,
                          "the request ran longer than the timeout (%g s) and was cancelled",
                          rc->S->o.timeout_s);
        return;
    }
    if (g->tools_active) {
        if (g->tool_calls && g->api.stream) {
            free(all);
            stream_tool_calls(g);
            return;
        }
        if (all && g->api.stream && (*all || g->reasoning)) { /* no call: the text as usual */
            sse_start(g);
            sse_event(g, rk_gen_reasoning_event(g));
            sse_event(g, rk_gen_chunk_event(g, all, NULL));
        } else if (!g->api.stream) {
            json_t *obj = rk_gen_final_object(g, all ? all : "");
            free(all);
            send_final(g, obj);
            return;
        }
        free(all);
    }
    if (g->api.stream) {
        sse_start(g);
        send_echo(g);
        char *rest = rk_gt_take(&g->text, 1);
        g->text_done = 1;
        /* The rest, if any; the role goes with the first event; log-probabilities
         * of tokens that brought no text of their own (the one that completed a
         * stop string) go in an event with empty text. */
        if ((rest && *rest) || (g->api.chat && !g->events) ||
            (g->api.opt.n_logprobs > 0 && g->lp_sent < j->req.n_out))
            sse_event(g, rk_gen_chunk_event(g, rest ? rest : "", NULL));
        free(rest);
        stream_finish(g);
        sse_done(g);
        return;
    }
    char *text = rk_gt_take(&g->text, 1);
    json_t *obj = rk_gen_final_object(g, text ? text : "");
    free(text);
    send_final(g, obj);
}

/* ---------------------------------------------------------------- preparing a generation */

typedef struct prep_gen {
    server *S;
    gen *g;
    const char *body;
    size_t len;
    int chat;
    rk_http_error err; /* status 0: prepared */
} prep_gen;

/* Tokenize prompt number `prompt` of g's request (-1: its pieces) into a
 * new job for g, sampling with seed; fills err on failure. */
static void prepare_job(gen *g, int prompt, uint64_t seed, rk_http_error *err) {
    rk_service *svc = g->svc;
    g->job = malloc(sizeof *g->job);
    if (!g->job || rk_job_init(g->job)) {
        free(g->job);
        g->job = NULL;
        rk_http_errorf(err, 500, "out of memory");
        return;
    }
    g->job->req.opt = g->api.opt;
    g->job->req.opt.sampling.seed = seed;
    rk_error_clear();
    rk_status st;
    if (prompt < 0) {
        st = rk_request_prepare(svc, &g->api.pieces, &g->job->req);
    } else if (g->api.batch) {
        st = rk_request_prepare(svc, &g->api.batch[prompt], &g->job->req);
    } else { /* token ids as written, after BOS where a text prompt has one */
        const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
        int32_t bos = rk_tokenizer_bos(tok);
        int with_bos = rk_tokenizer_add_bos(tok) && bos >= 0;
        st = rk_request_prepare_tokens(svc, &bos, with_bos, g->api.batch_tokens[prompt],
                                       g->api.batch_lens[prompt], &g->job->req);
    }
    if (st && g->job->req.context_exceeded) { /* OpenAI's answer to a prompt too long */
        rk_http_errorf(err, 400, "%s", rk_error_message());
        err->code = RK_CODE_CONTEXT_LENGTH;
        err->param = g->api.chat ? "messages" : "prompt";
        return;
    }
    if (st) {
        if (prompt >= 0)
            rk_http_errorf(err, rk_http_status_of(st), "prompt[%d]: %s", prompt,
                           rk_error_message());
        else
            rk_http_errorf(err, rk_http_status_of(st), "%s", rk_error_message());
        return;
    }
    /* The grammar's first state and mask are made here, on the HTTP worker,
     * not by the engine thread when the request joins. */
    if ((st = rk_request_prepare_grammar(svc, &g->job->req))) {
        rk_http_errorf(err, st == RK_ERR_LIMIT ? 400 : rk_http_status_of(st),
                       "the output's grammar cannot be used: %s", rk_error_message());
        return;
    }
    if (prompt < 0 && g->api.chunk_ids && g->job->req.n_chunks == g->api.pieces.n_chunks)
        g->job->chunk_ids = g->api.chunk_ids;
}

/* Parse, check, render (chat), tokenize: everything before queueing. */
static void prep_generation(void *arg) {
    prep_gen *p = arg;
    server *S = p->S;
    gen *g = p->g;
    rk_http_error *err = &p->err;
    rk_parse_limits lim = {.max_chunks = S->o.cfg.max_chunks,
                           .max_tokens = S->o.cfg.max_tokens,
                           .context = g->svc->cfg.max_context > 0
                                          ? g->svc->cfg.max_context
                                          : rk_model_hparams(g->svc->model)->n_ctx,
                           .chat_separator = S->o.chat_separator,
                           .grammar_cache = g->svc->grammar_cache};
    (void)rk_repair_parse(S->o.cfg.repair, &lim.repair_k, &lim.repair_ratio,
                          &lim.repair_query); /* validated */
    if (rk_api_parse(p->body, p->len, p->chat, &lim, &g->api, err)) return;
    rk_service *svc = g->svc;
    if (rk_gw_check_model(S, svc, g->api.model, err)) return;
    const rk_sampler_params *sp = &g->api.opt.sampling;
    int n_vocab = rk_model_hparams(svc->model)->n_vocab;
    for (int i = 0; i < sp->n_logit_bias; i++)
        if (sp->logit_bias[i].token >= n_vocab) {
            rk_http_errorf(err, 400, "'logit_bias': token %d is not in the vocabulary (0 to %d)",
                           sp->logit_bias[i].token, n_vocab - 1);
            return;
        }
    /* A thinking model thinks unless asked not to; a grammar, a schema or a
     * required tool call constrains the answer from its first token, so
     * there it answers without thinking. */
    if (p->chat && S->thinks) {
        int constrained = g->api.grammar || g->api.tool_choice >= RK_TOOLS_REQUIRED;
        g->api.no_thinking = g->api.enable_thinking == 0 || constrained;
        g->thinking = !g->api.no_thinking;
        g->api.thinking = g->thinking; /* Gemma 4's <|think|> */
        /* harmony has no answer without its channels, and Gemma 4's thought
         * channel never goes to the answer: split them always */
        g->think.harmony = S->tmpl == RK_CHAT_HARMONY;
        g->think.gemma4 = S->tmpl == RK_CHAT_GEMMA4;
        if (g->think.harmony || g->think.gemma4) g->thinking = 1;
    }
    if (p->chat) { /* the day, in the server's time zone, as the templates' strftime_now */
        time_t now = time(NULL);
        struct tm day;
        if (localtime_r(&now, &day)) strftime(g->api.today, sizeof g->api.today, "%Y-%m-%d", &day);
    }
    if (p->chat && rk_chat_render(S->tmpl, &g->api, S->o.cfg.max_chunks, err)) return;
    if (!g->api.seed_given) g->api.opt.sampling.seed = rk_gw_random(S);
    /* The caller's tenant owns what the request caches, under its salt (and
     * the request's cache_salt inside it). */
    g->api.opt.owner = g->rc->tenant;
    g->api.opt.salt = rk_cache_scope(rk_tenants_salt(S->tenants, g->rc->tenant), g->api.cache_salt);
    prepare_job(g, g->api.n_prompts ? 0 : -1, g->api.opt.sampling.seed, err);
}

/* ---------------------------------------------------------------- several choices */

/* A request with several choices (`n` > 1, or `prompt` as a batch) runs one
 * job per choice; they share the connection, so its state (headers sent,
 * client gone) is kept here and lent to the choice that writes. */
typedef struct choices {
    gen **gs; /* (n) gs[0] is the request's own gen; the others share its api */
    int n, per_prompt;
    int headers_sent, client_gone;
    int *opened; /* (n) a streamed chat choice's role was sent */
} choices;

static void lend(choices *cs, gen *g) {
    g->headers_sent = cs->headers_sent;
    g->client_gone = cs->client_gone;
}

/* After g wrote: a client gone cancels every choice. */
static void take_back(choices *cs, gen *g) {
    cs->headers_sent = g->headers_sent;
    if (g->client_gone && !cs->client_gone)
        for (int c = 0; c < cs->n; c++)
            if (cs->gs[c]->job) rk_scheduler_cancel(g->rc->S->engine, cs->gs[c]->job);
    cs->client_gone |= g->client_gone;
}

/* Before a streamed choice's first event: the stream's headers, and for a
 * chat the choice's role (an event of its own, so every choice gets one). */
static void open_choice(choices *cs, int c) {
    gen *g = cs->gs[c];
    if (cs->opened[c] || cs->client_gone) return;
    cs->opened[c] = 1;
    lend(cs, g);
    sse_start(g);
    if (g->api.chat) sse_event(g, rk_gen_chunk_event(g, "", NULL)); /* the role, no text */
    send_echo(g);
    take_back(cs, g);
}

/* Choice c of the request of g0: its own job (prompt c / per_prompt, seed
 * the request's + c % per_prompt) and text, the rest g0's. */
static gen *make_choice(gen *g0, int c, int per_prompt, rk_http_error *err) {
    gen *g = malloc(sizeof *g);
    if (!g) {
        rk_http_errorf(err, 500, "out of memory");
        return NULL;
    }
    *g = *g0; /* api: a shallow copy, freed with g0's */
    g->job = NULL;
    g->index = c;
    g->events = g->text_done = g->lp_sent = g->echoed = g->echoing = 0;
    g->echo_len = 0;
    g->think = (rk_think_split){.harmony = g0->think.harmony, .gemma4 = g0->think.gemma4};
    g->reasoning = NULL;
    g->fd = -1; /* choice 0 watches the connection */
    g->text = (rk_gen_text){.tok = g0->text.tok,
                            .stop_at = -1,
                            .max_stop = g0->text.max_stop,
                            .stop = g0->text.stop,
                            .n_stop = g0->text.n_stop,
                            .specials = g0->text.specials};
    prepare_job(g, g0->api.n_prompts ? c / per_prompt : -1,
                g0->api.opt.sampling.seed + (uint64_t)(c % per_prompt), err);
    if (g->job) {
        g->job->notify_tokens = g0->job->notify_tokens;
        g->text.skip_space = g->job->req.n_question == 0 && g->job->req.n_sys == 1;
    }
    return g;
}

/* Wait for every choice, streaming each one's text as it comes (events carry
 * the choice's index). */
static void wait_choices(choices *cs, double deadline) {
    server *S = cs->gs[0]->rc->S;
    int left = cs->n;
    int *seen = calloc((size_t)cs->n, sizeof *seen), *done = calloc((size_t)cs->n, sizeof *done);
    if (!seen || !done) { /* cancel everything and wait without streaming */
        for (int c = 0; c < cs->n; c++) rk_scheduler_cancel(S->engine, cs->gs[c]->job);
        for (int c = 0; c < cs->n; c++) {
            int n, d = 0;
            while (!d) rk_job_wait(cs->gs[c]->job, 0, 0, &n, &d);
        }
        free(seen);
        free(done);
        return;
    }
    while (left > 0) {
        int timed_out = rk_time_now() > deadline;
        for (int c = 0; c < cs->n; c++) {
            gen *g = cs->gs[c];
            if (done[c]) continue;
            if (timed_out && !g->timed_out) {
                g->timed_out = 1;
                rk_scheduler_cancel(S->engine, g->job);
            }
            int n, d;
            double poll = rk_time_now() + 0.005;
            rk_job_wait(g->job, seen[c], timed_out ? 0 : poll, &n, &d);
            if (d) {
                done[c] = 1;
                left--;
                continue;
            }
            if (n > seen[c]) {
                rk_gt_feed(&g->text, g->job->req.out_tokens, n);
                seen[c] = n;
                if (g->text.stop_at >= 0) rk_scheduler_cancel(S->engine, g->job);
                if (g->api.stream && !cs->client_gone) {
                    open_choice(cs, c);
                    lend(cs, g);
                    stream_progress(g);
                    take_back(cs, g);
                }
            }
        }
    }
    free(seen);
    free(done);
}

/* Answer a request with several choices: one failed choice answers for all
 * (an error, or an error event mid-stream); otherwise every choice with its
 * index, and usage summed over them (prompt tokens over the prompts, as
 * OpenAI counts them; each choice carries its own `ragkv` report). */
static void respond_choices(choices *cs) {
    req_ctx *rc = cs->gs[0]->rc;
    for (int c = 0; c < cs->n; c++) {
        gen *g = cs->gs[c];
        rk_job *j = g->job;
        if (!j->ran || j->status || (g->timed_out && !g->api.stream)) {
            lend(cs, g);
            respond_generation(g);
            return;
        }
    }
    json_t *list = json_array(), *first = NULL;
    json_int_t prompt = 0, completion = 0, cached = 0;
    if (cs->gs[0]->api.stream) {
        if (cs->client_gone) {
            json_decref(list);
            return;
        }
        gen *g0 = cs->gs[0];
        lend(cs, g0);
        sse_start(g0);
        take_back(cs, g0);
    }
    for (int c = 0; c < cs->n; c++) {
        gen *g = cs->gs[c];
        rk_job *j = g->job;
        rk_gt_feed(&g->text, j->req.out_tokens, j->req.n_out);
        if (g->text.stop_at >= 0 && g->text.stop_tokens < j->req.n_out)
            j->req.n_out = g->text.stop_tokens;
        log_generation(g);
        json_t *usage = rk_report_usage(&j->req);
        if (c % cs->per_prompt == 0) {
            prompt += json_integer_value(json_object_get(usage, "prompt_tokens"));
            cached += json_integer_value(
                json_object_get(json_object_get(usage, "prompt_tokens_details"), "cached_tokens"));
        }
        json_decref(usage);
        completion += j->req.n_out;
        if (g->api.stream) { /* the rest of the choice's text, then its finish event */
            open_choice(cs, c);
            lend(cs, g);
            char *rest = rk_gt_take(&g->text, 1);
            g->text_done = 1;
            if ((rest && *rest) || (g->api.opt.n_logprobs > 0 && g->lp_sent < j->req.n_out))
                sse_event(g, rk_gen_chunk_event(g, rest ? rest : "", NULL));
            free(rest);
            json_t *ev = rk_gen_chunk_event(g, NULL, rk_gen_finish_reason(g));
            json_t *choice = json_array_get(json_object_get(ev, "choices"), 0);
            if (choice) json_object_set_new(choice, "ragkv", rk_report_ragkv(&j->req));
            sse_event(g, ev);
            take_back(cs, g);
            continue;
        }
        char *text = rk_gt_take(&g->text, 1);
        json_t *obj = rk_gen_final_object(g, text ? text : "");
        free(text);
        if (!obj) continue;
        json_t *choice = json_array_get(json_object_get(obj, "choices"), 0);
        json_object_set(choice, "ragkv", json_object_get(obj, "ragkv"));
        json_array_append(list, choice);
        if (!first)
            first = obj;
        else
            json_decref(obj);
    }
    if (cs->gs[0]->api.stream) { /* usage, summed, in an event of its own when asked */
        json_decref(list);
        gen *g0 = cs->gs[0];
        lend(cs, g0);
        if (g0->api.include_usage) {
            json_t *ev =
                rk_gen_object_head(g0, g0->api.chat ? "chat.completion.chunk" : "text_completion");
            if (ev) {
                json_object_set_new(ev, "choices", json_array());
                json_object_set_new(ev, "usage",
                                    json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", prompt,
                                              "completion_tokens", completion, "total_tokens",
                                              prompt + completion, "prompt_tokens_details",
                                              "cached_tokens", cached));
            }
            sse_event(g0, ev);
        }
        write_all(g0, "data: [DONE]\n\n", 14);
        take_back(cs, g0);
        return;
    }
    if (!first) {
        json_decref(list);
        rk_gw_send_errorf(rc, 500, "out of memory");
        return;
    }
    json_object_set_new(first, "choices", list);
    json_object_del(first, "ragkv");
    json_object_set_new(first, "usage",
                        json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", prompt,
                                  "completion_tokens", completion, "total_tokens",
                                  prompt + completion, "prompt_tokens_details", "cached_tokens",
                                  cached));
    rk_gw_send_json(rc, 200, first);
}

/* Run a request with several choices; g0 is prepared with choice 0's job.
 * With n > 1, each prompt's first choice runs alone until its first token:
 * its system prompt is then in the prefix cache and its chunks in the chunk
 * cache, and the other choices of the prompt reuse them. */
static void handle_choices(gen *g0, double deadline) {
    req_ctx *rc = g0->rc;
    server *S = rc->S;
    int per = g0->api.n_choices, n = per * (g0->api.n_prompts ? g0->api.n_prompts : 1);
    choices cs = {.n = n, .per_prompt = per};
    cs.gs = calloc((size_t)n, sizeof *cs.gs);
    cs.opened = calloc((size_t)n, sizeof *cs.opened);
    int *submitted = calloc((size_t)n, sizeof *submitted);
    rk_http_error err = {0};
    if (!cs.gs || !cs.opened || !submitted) rk_http_errorf(&err, 500, "out of memory");
    if (cs.gs) cs.gs[0] = g0;
    if (per > 1) g0->job->notify_tokens = 1;
    for (int c = 1; c < n && !err.status; c++) cs.gs[c] = make_choice(g0, c, per, &err);
    /* Each prompt's first choice, then (n > 1) the others after its first token. */
    rk_status st = RK_OK;
    for (int round = 0; round < 2 && !err.status && !st; round++) {
        for (int c = 0; c < n && !st; c++) {
            if ((c % per == 0) != (round == 0)) continue;
            if (round == 1 && per > 1 && c % per == 1) {
                int nt, d;
                rk_job_wait(cs.gs[c - 1]->job, 0, deadline, &nt, &d);
            }
            if (!(st = rk_scheduler_submit(S->engine, cs.gs[c]->job))) submitted[c] = 1;
        }
    }
    if (st) {
        for (int c = 0; c < n; c++)
            if (submitted[c]) rk_scheduler_cancel(S->engine, cs.gs[c]->job);
        for (int c = 0; c < n; c++) {
            int nt, d = !submitted[c];
            while (!d) rk_job_wait(cs.gs[c]->job, 0, 0, &nt, &d);
        }
        if (st == RK_ERR_BUSY)
            rk_gw_send_errorf(rc, 503, "%s; try again", rk_error_message());
        else
            rk_gw_send_not_ready(rc);
    } else if (err.status) {
        rk_gw_send_error(rc, &err);
    } else {
        wait_choices(&cs, deadline);
        respond_choices(&cs);
    }
    for (int c = 1; cs.gs && c < n; c++) {
        gen *g = cs.gs[c];
        if (!g) continue;
        if (g->job) {
            rk_job_destroy(g->job);
            free(g->job);
        }
        rk_strbuf_free(&g->text.raw);
        rk_strbuf_free(&g->think.pending);
        free(g->reasoning);
        free(g->text.tok_end);
        free(g);
    }
    free(cs.gs);
    free(cs.opened);
    free(submitted);
}

int rk_gw_handle_generate(req_ctx *rc, int chat) {
    char *body;
    size_t len;
    if (rk_gw_read_body(rc, &body, &len)) return 0;
    return rk_gw_generate(rc, chat, body, len, NULL);
}

int rk_gw_generate(req_ctx *rc, int chat, char *body, size_t len, const rk_gw_sink *sink) {
    server *S = rc->S;
    double deadline = rc->t0 + S->o.timeout_s;
    gen g;
    memset(&g, 0, sizeof g);
    g.rc = rc;
    g.sink = sink;
    g.fd = -1;
    g.text.stop_at = -1;
    g.svc = rk_gw_ready_service(S);
    if (S->o.log_prompts) /* the only place prompt text may reach the log */
        RK_LOG_INFO("id=%s body: %.*s", rc->id, (int)(len < 4000 ? len : 4000), body);
    if (!g.svc) {
        free(body);
        rk_gw_send_not_ready(rc);
        goto done;
    }
    if (!rk_service_generates(g.svc)) {
        free(body);
        rk_gw_send_errorf(
            rc, 400,
            "this model does not generate text: its file declares pooling type %d "
            "(%s model); use %s, or serve it with --pooling none to generate",
            (int)rk_model_hparams(g.svc->model)->pooling,
            rk_service_pooling(g.svc) == RK_POOLING_RANK ? "a reranking" : "an embedding",
            rk_service_pooling(g.svc) == RK_POOLING_RANK ? "/v1/rerank" : "/v1/embeddings");
        goto done;
    }
    prep_gen p = {.S = S, .g = &g, .body = body, .len = len, .chat = chat};
    prep_generation(&p);
    free(body);
    if (p.err.status) {
        rk_gw_send_error(rc, &p.err);
        goto done;
    }
    if (sink && sink->prompt) { /* what would run, not run */
        sink->prompt(sink->ctx, &g.api, &g.job->req);
        goto done;
    }
    g.job->notify_tokens = g.api.stream || g.api.n_stop > 0;
    g.tools_active = g.api.chat && g.api.n_tools > 0 && g.api.tool_choice != RK_TOOLS_NONE;
    g.text.tok = rk_model_tokenizer(g.svc->model);
    g.text.specials = (g.think.harmony || g.think.gemma4) && g.thinking;
    g.text.skip_space = g.job->req.n_question == 0 && g.job->req.n_sys == 1;
    g.text.stop = g.api.stop;
    g.text.n_stop = g.api.n_stop;
    for (int k = 0; k < g.api.n_stop; k++) {
        size_t l = strlen(g.api.stop[k]);
        if (l > g.text.max_stop) g.text.max_stop = l;
    }
    snprintf(g.id, sizeof g.id, "%s-%s", chat ? "chatcmpl" : "cmpl", rc->id + 4);
    g.fd = -2;
    g.created = (long)time(NULL);
    if (sink && g.api.n_choices * (g.api.n_prompts ? g.api.n_prompts : 1) > 1) {
        rk_gw_send_errorf(rc, 400, "one answer per request here: 'n' must be 1");
        goto done;
    }
    if (g.api.n_choices * (g.api.n_prompts ? g.api.n_prompts : 1) > 1) {
        handle_choices(&g, deadline);
        goto done;
    }
    rk_status st = rk_scheduler_submit(S->engine, g.job);
    if (st) {
        if (st == RK_ERR_BUSY)
            rk_gw_send_errorf(rc, 503, "%s; try again", rk_error_message());
        else
            rk_gw_send_not_ready(rc);
        goto done;
    }
    wait_job(&g, deadline);
    respond_generation(&g);
done:
    if (g.job) {
        rk_job_destroy(g.job);
        free(g.job);
    }
    rk_strbuf_free(&g.text.raw);
    rk_strbuf_free(&g.think.pending);
    free(g.reasoning);
    json_decref(g.tool_calls);
    free(g.tool_content);
    free(g.text.tok_end);
    rk_api_request_free(&g.api);
    return 0;
}
