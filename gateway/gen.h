/* gateway/gen.h — one generation of /v1/completions or /v1/chat/completions
 * as generate.c drives it, and the OpenAI objects gen_objects.c makes of it
 * (private to those two files). */
#ifndef RK_GATEWAY_GEN_H
#define RK_GATEWAY_GEN_H

#include <jansson.h>

#include "gateway/chat.h"
#include "gateway/gen_text.h"
#include "gateway/http.h"

typedef struct gen {
    req_ctx *rc;
    rk_api_request api;
    rk_job *job;
    rk_service *svc;
    rk_gen_text text;
    char id[48]; /* "cmpl-..." or "chatcmpl-..." */
    long created;
    int headers_sent, client_gone, timed_out;
    /* Chat with tools (tool_choice not none): the answer is held back until
     * it is whole, then parsed for calls (tool_calls: NULL when none). */
    int tools_active;
    json_t *tool_calls;
    char *tool_content;
    int events;    /* content events sent */
    int text_done; /* the last text was taken: every token's text has gone out */
    int lp_sent;   /* tokens whose log-probabilities went out in an event */
    int fd;        /* the connection's socket (watched for a client gone), -1 if not found,
                    * -2 not looked for yet */
    int index;     /* its choice's index (n > 1, a batch of prompts) */
    /* A thinking model's answer: its <think> block goes to reasoning_content
     * (think splits the stream; reasoning: the whole thinking of an answer
     * held back for tool calls). */
    int thinking;
    rk_think_split think;
    char *reasoning;
    /* Another route's shape (responses.c): objects and events pass through it. */
    const rk_gw_sink *sink;
    int echoed; /* a streamed completion with `echo`: its prompt went out */
    /* ... in the event being made (echoing), the log-probabilities of its
     * prompt's tokens with it; echo_len: its bytes, before the completion's */
    int echoing;
    size_t echo_len;
} gen;

/* The fields every response object and stream event starts with. */
json_t *rk_gen_object_head(gen *g, const char *object);
/* Tokens whose text has gone out entirely (the stream's text lags the
 * tokens while a stop string may still begin). */
int rk_gen_tokens_sent(gen *g);
/* One streamed event in OpenAI's chunk shape: a piece of text with the
 * log-probabilities of the tokens it completes; or, with fr set, the
 * choice's last event: no text, the finish_reason. */
json_t *rk_gen_chunk_event(gen *g, const char *text, const char *fr);
/* With tool calls, the thinking held back with the answer, as one event
 * (NULL when there was none). */
json_t *rk_gen_reasoning_event(gen *g);
/* The OpenAI finish reason of g's answer. */
const char *rk_gen_finish_reason(gen *g);
/* A completion's prompt as given, for `echo` (malloc'ed). */
char *rk_gen_echo_text(gen *g);
/* The whole response of a request that was not streamed; text is its answer. */
json_t *rk_gen_final_object(gen *g, const char *text);

#endif
