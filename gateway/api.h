/* gateway/api.h — request bodies of the HTTP API: JSON parsing and
 * validation of completions, chat, pre-warm and flush bodies into pipeline
 * pieces and options, and the one JSON error shape every route answers with.
 *
 * No model is needed: the fuzz target and the corpus test call these
 * directly. Every function here is pure (no globals) and safe from any
 * thread. A parse either fills its output, which then owns its strings (free
 * with the matching _free), or fills err and leaves nothing allocated. */
#ifndef RK_API_H
#define RK_API_H

#include <jansson.h>
#include <stddef.h>

#include "pipeline/pipeline.h"
#include "pipeline/split.h"

/* ---------------------------------------------------------------- errors */

/* An HTTP error as OpenAI's JSON envelope {"error": {"message", "type",
 * "param", "code"}} with the HTTP status added as "status" (docs/api.md):
 * code is OpenAI's string code where it has one for the case, null
 * otherwise; param the request field at fault, given or named by the
 * message, null otherwise. */
typedef struct rk_http_error {
    int status;       /* HTTP status: 400, 401, 404, 405, 408, 409, 413, 422, 500, 501, 503, 505 */
    const char *type; /* constant: "invalid_request_error", "server_error", ... */
    char message[320];
    const char *code;  /* constant OpenAI code ("context_length_exceeded"), or NULL */
    const char *param; /* constant: the request field at fault, or NULL (then the message's) */
} rk_http_error;

/* OpenAI's error code for a prompt and max_tokens beyond the context. */
#define RK_CODE_CONTEXT_LENGTH "context_length_exceeded"

/* OpenAI's error code for a status of a lower layer (RK_ERR_CONTEXT:
 * "context_length_exceeded"), or NULL when it has none. */
const char *rk_http_error_code(rk_status st);

/* Fill err with status, its type name and a formatted message; returns the
 * rk_status that goes with the HTTP status (RK_ERR_INVALID for 4xx, ...). */
rk_status rk_http_errorf(rk_http_error *err, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The HTTP status for a failure of a lower layer: 400 for bad input, 404,
 * 422 for a limit, 503 when busy or out of room, 500 otherwise. */
int rk_http_status_of(rk_status st);

/* OpenAI's type name for an HTTP error status: "invalid_request_error" for
 * 4xx, "authentication_error" (401), "permission_error" (403),
 * "rate_limit_error" (429), "service_unavailable_error" (503),
 * "server_error" for other 5xx. */
const char *rk_http_error_type(int status);

/* The request field an error message is about, copied into buf[cap], or
 * NULL: messages about a field start with its quoted name ("'stop' must
 * be ...", "'repair.policy' ...") or with an indexed path ("messages[2].role
 * must be ...", "prompt[1]: ..."). */
const char *rk_http_error_param(const char *message, char *buf, size_t cap);

/* ---------------------------------------------------------------- request bodies */

#define RK_MAX_STOP       4    /* stop strings per request */
#define RK_STOP_MAX_BYTES 256  /* bytes per stop string */
#define RK_MAX_MESSAGES   512  /* chat messages per request */
#define RK_MAX_PREWARM    4096 /* chunks per POST /v1/chunks */
#define RK_MAX_CHOICES    32   /* choices per request: n × prompts in a batch */

/* Limits the parser enforces (the service's own limits on tokens are checked
 * later, when the pieces are tokenized). */
typedef struct rk_parse_limits {
    int max_chunks; /* chunks per request */
    int max_tokens; /* largest max_tokens accepted */
    /* Tokens of context a request may use, prompt and max_tokens together
     * (max_context or the model's); 0 = unknown. A max_tokens over the
     * largest accepted that also leaves no room for a prompt is refused as
     * OpenAI refuses a request over the context (400
     * context_length_exceeded), not as a server limit (422). */
    int context;
    /* The service's repair policy (config `repair`), for a request that names
     * none or "auto": as rk_req_options takes it. */
    int repair_k;
    float repair_ratio;
    /* The separator a chat body's user messages are split on when the body
     * names none (`--chat-separator`); NULL or "" = chat messages are not
     * split unless the body sets "separator". */
    const char *chat_separator;
    int repair_query;
    /* Where compiled grammars are kept by content (NULL: compile each). */
    rk_grammar_cache *grammar_cache;
} rk_parse_limits;

typedef enum rk_chat_role {
    RK_ROLE_SYSTEM = 0,
    RK_ROLE_USER = 1,
    RK_ROLE_ASSISTANT = 2,
    RK_ROLE_TOOL = 3, /* a tool's result */
} rk_chat_role;

typedef struct rk_chat_msg {
    rk_chat_role role;
    char *content; /* malloc'ed, NUL-terminated (text parts joined) */
    /* Its documents: content parts marked "ragkv_chunk": true, then its
     * `documents` field, in order (malloc'ed, as the array); a user or
     * tool message's, a chunk group where it stands. */
    char **docs;
    int n_docs;
    /* Assistant messages: the calls it made, as JSON text of an array of
     * {"name", "arguments" (an object), "id" (when given)}; malloc'ed, NULL
     * when none. */
    char *tool_calls;
    /* Tool messages: the tool_call_id it answers (malloc'ed, NULL when none). */
    char *tool_call_id;
    /* Assistant messages: the thinking the answer came with (its
     * reasoning_content; malloc'ed, NULL when none); Gemma 4 writes it
     * before the calls of a message after the last user message. */
    char *reasoning;
    /* A rendering's own system message, written as it stands (harmony's
     * developer message with tools); never set by the parser. */
    int verbatim;
} rk_chat_msg;

#define RK_MAX_TOOLS 128

/* tool_choice: none (tools described, never parsed), auto (the model
 * chooses; a call it writes is parsed), required (constrained to one or
 * more calls), a named function (constrained to calls of it). */
typedef enum rk_tool_choice {
    RK_TOOLS_NONE = 0,
    RK_TOOLS_AUTO = 1,
    RK_TOOLS_REQUIRED = 2,
    RK_TOOLS_NAMED = 3,
} rk_tool_choice;

typedef struct rk_api_tool {
    char *name;         /* malloc'ed */
    char *description;  /* malloc'ed, NULL when none */
    json_t *parameters; /* a reference, NULL when none (any object) */
} rk_api_tool;

/* A validated POST /v1/completions or /v1/chat/completions body. */
typedef struct rk_api_request {
    int chat;           /* 1: a chat body (messages), 0: a completion body */
    rk_req_options opt; /* sampling, limits and the ragkv extensions */
    int seed_given;     /* opt.sampling.seed came from the body */
    int stream;
    int include_usage;       /* stream_options.include_usage: a usage event before [DONE] */
    char *stop[RK_MAX_STOP]; /* malloc'ed stop strings */
    int n_stop;
    char *model;                          /* NULL when absent */
    char separator[RK_SEPARATOR_MAX + 1]; /* "##" unless given */
    /* Chat: user messages are split on separator (the body set "separator",
     * or the server has a chat separator); completions always split. */
    int split_chat;
    rk_split pieces;   /* completion: filled by the parser; chat: by render */
    int have_pieces;   /* pieces holds strings (free them) */
    char **chunk_ids;  /* (pieces.n_chunks) ids given as {"id", "text"}, or NULL */
    rk_chat_msg *msgs; /* (n_msgs) chat only */
    int n_msgs;
    /* (n_chat_chunks) a chat body's documents: the `chunks` extension or the
     * top-level `documents` array (vLLM's), both the first user message's. */
    char **chat_chunks;
    char **chat_chunk_ids;
    /* `n`: choices per prompt (1 unless given); each has its own index and
     * seed (the request's + its number among its prompt's choices). */
    int n_choices;
    /* A completion's `prompt` as an array: a batch of n_prompts prompts, one
     * choice (n_choices) each. Strings are split (batch); token-id lists are
     * taken as written (batch_tokens, batch_lens). 0: the one prompt is in
     * pieces. */
    int n_prompts;
    /* `echo` (completions): the answer's text starts with its prompt, as
     * given: prompt_texts[i] for a string prompt i (NULL for token ids,
     * decoded when answered). */
    int echo;
    char **prompt_texts; /* (n_prompt_texts) */
    int n_prompt_texts;
    rk_split *batch;
    int32_t **batch_tokens;
    int *batch_lens;
    int n_chat_chunks;
    int chat_chunks_given;
    /* response_format json_object / json_schema or the `grammar` extension,
     * compiled; opt.grammar points at it. NULL: unconstrained. */
    rk_grammar *grammar;
    /* Chat `tools` (function definitions), tool_choice (tool_named: the index
     * of the named one) and parallel_tool_calls (default 1). */
    rk_api_tool *tools;
    int n_tools;
    rk_tool_choice tool_choice;
    int tool_named;
    int parallel_tool_calls;
    int parallel_given;
    /* `cache_salt` (vLLM's field): "" when absent. The gateway turns it, with
     * the caller's tenant, into opt.salt (rk_cache_scope). */
    char cache_salt[RK_CACHE_SALT_MAX + 1];
    /* chat_template_kwargs.enable_thinking: -1 when absent, else 0 or 1. */
    int enable_thinking;
    /* `reasoning_effort`: 0 absent, 1 "low", 2 "medium", 3 "high" (the
     * harmony template's "Reasoning: " line; other templates refuse it). */
    int reasoning_effort;
    /* Render the answer's turn with an empty thinking block (a thinking
     * model asked not to think): set by the caller before rk_chat_render. */
    int no_thinking;
    /* Render the request to think (Gemma 4's <|think|> in its system turn):
     * set by the caller before rk_chat_render. */
    int thinking;
    /* The day of the request, "YYYY-MM-DD" (the harmony template's "Current
     * date: " line; empty: no such line): set by the caller before
     * rk_chat_render. */
    char today[16];
    /* `chunking.tool_results`: a tool message's content is passages (a
     * JSON array of them, or its text split on the separator), a chunk
     * group where the message stands. */
    int chunk_tool_results;
} rk_api_request;

/* Structured output (structured.c), for rk_api_parse: each reads its fields
 * of root into out and returns 0, or fills err (400 naming the field) and
 * returns 1; what out gained is freed by rk_api_request_free either way.
 * response_format and the `grammar` extension; a chat body's tools,
 * tool_choice and parallel_tool_calls; message i's (m's) tool_calls,
 * tool_call_id and reasoning_content (or reasoning) into msg, its role set. */
int rk_api_parse_response_format(json_t *root, rk_grammar_cache *cache, rk_api_request *out,
                                 rk_http_error *err);
int rk_api_parse_tools(json_t *root, rk_api_request *out, rk_http_error *err);
int rk_api_parse_msg_tool_fields(json_t *m, int i, rk_chat_msg *msg, rk_http_error *err);

/* Chat documents where they stand (chat_docs.c), for rk_api_parse: message
 * i's `documents` field (strings or {"text" or "content"}; a user or tool
 * message's) appended to msg->docs, and the body's `chunking` object
 * ({"tool_results": true}: every tool message's content is passages,
 * out->chunk_tool_results). Each returns 0, or fills err and returns 1. */
int rk_api_parse_msg_documents(json_t *m, int i, rk_chat_msg *msg, rk_http_error *err);
int rk_api_parse_chunking(json_t *root, rk_api_request *out, rk_http_error *err);

/* A completion body's `segments` (segments.c): texts and chunk groups in
 * order, into out->pieces (and out->chunk_ids when a chunk named an id).
 * Returns 0, or fills err (400 for a malformed list, 422 over a limit)
 * and returns 1; what out gained is freed by rk_api_request_free. */
int rk_api_parse_segments(json_t *segs, const rk_parse_limits *lim, rk_api_request *out,
                          rk_http_error *err);

/* Parse and validate a request body of len bytes (need not be
 * NUL-terminated). chat selects the chat shape. On success *out owns its
 * strings (rk_api_request_free); on failure err says why (400 malformed,
 * 422 over a limit, ...) and nothing is left allocated. */
rk_status rk_api_parse(const char *body, size_t len, int chat, const rk_parse_limits *lim,
                       rk_api_request *out, rk_http_error *err);

/* A request body of len bytes as a JSON object (a new reference), or NULL
 * with err (400: not JSON, not an object, arrays and objects nested deeper
 * than 32 levels, which are refused before parsing). */
json_t *rk_api_load_object(const char *body, size_t len, rk_http_error *err);

/* Free what a parsed request owns and zero it; accepts a zeroed request. */
void rk_api_request_free(rk_api_request *r);

/* A validated POST /v1/chunks body (pre-warm). */
typedef struct rk_prewarm_request {
    char **texts; /* (n) malloc'ed chunk texts, non-empty */
    char **ids;   /* (n) document ids, NULL entries when none was given */
    int n;
    int persist;
    int context_system;                     /* chunk_context "system": computed after `system` */
    char *system;                           /* malloc'ed system prompt ("" when absent) */
    char cache_salt[RK_CACHE_SALT_MAX + 1]; /* "" when absent */
    char tenant[64];                        /* the tenant to pre-warm for; "" when absent */
} rk_prewarm_request;

rk_status rk_prewarm_parse(const char *body, size_t len, rk_prewarm_request *out,
                           rk_http_error *err);
void rk_prewarm_request_free(rk_prewarm_request *p);

/* What POST /v1/cache/flush asks for. */
typedef struct rk_flush_request {
    int chunks, prefix; /* flush the chunk cache, the prefix cache */
    int disk;           /* also the store */
    int redis;          /* also this model's keys in the shared Redis tier */
} rk_flush_request;

/* Parse a flush body (an empty body means {"what": "all"}). */
rk_status rk_flush_parse(const char *body, size_t len, rk_flush_request *out, rk_http_error *err);

#endif
