/* gateway/server.h — `ragkv serve`: the HTTP service of API.md on CivetWeb.
 *
 *   server.c     flags, configuration, routing, authentication, responses,
 *                streaming (Server-Sent Events), shutdown
 *   http_json.c  request bodies: JSON parsing and validation into pipeline
 *                pieces and options (no model needed: the fuzz target and the
 *                corpus test call it directly)
 *   chat.c       chat templates (ChatML, Llama-3, Llama-2) rendered into pieces
 *   engine.c     the engine thread that alone owns the service (engine.h)
 *   stats.c      counters, histograms, /v1/stats JSON and /metrics text (stats.h)
 *
 * CivetWeb worker threads parse, validate and tokenize (the tokenizer is
 * immutable and safe for concurrent readers), then queue the request for the
 * engine thread and wait on the request's own reply channel. */
#ifndef RK_SERVER_H
#define RK_SERVER_H

#include <stddef.h>

#include "pipeline/pipeline.h"
#include "pipeline/split.h"

/* Entry point of `ragkv serve` (argv[0] is "serve"). Returns the process exit
 * status: 0 after a clean shutdown (SIGINT/SIGTERM), 1 on a runtime failure,
 * 2 on bad usage. */
int rk_serve_main(int argc, char **argv);

/* ---------------------------------------------------------------- errors */

/* An HTTP error as the JSON envelope {"error": {"code", "type", "message"}}. */
typedef struct rk_http_error {
    int status;       /* HTTP status: 400, 401, 404, 405, 408, 409, 413, 422, 500, 501, 503, 505 */
    const char *type; /* constant: "invalid_request", "not_found", ... */
    char message[320];
    /* The body's `code`: NULL = the HTTP status; else OpenAI's code for the
     * error ("context_length_exceeded", see rk_http_error_code). */
    const char *code;
} rk_http_error;

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

/* The type name of an HTTP error status ("invalid_request" for 400). */
const char *rk_http_error_type(int status);

/* ---------------------------------------------------------------- request bodies */

#define RK_MAX_STOP       4    /* stop strings per request */
#define RK_STOP_MAX_BYTES 256  /* bytes per stop string */
#define RK_MAX_MESSAGES   512  /* chat messages per request */
#define RK_MAX_PREWARM    4096 /* chunks per POST /v1/chunks */

/* Limits the parser enforces (the service's own limits on tokens are checked
 * later, when the pieces are tokenized). */
typedef struct rk_parse_limits {
    int max_chunks; /* chunks per request */
    int max_tokens; /* largest max_tokens accepted */
    /* The service's repair policy (config `repair`), for a request that names
     * none or "auto": as rk_req_options takes it. */
    int repair_k;
    float repair_ratio;
} rk_parse_limits;

typedef enum rk_chat_role {
    RK_ROLE_SYSTEM = 0,
    RK_ROLE_USER = 1,
    RK_ROLE_ASSISTANT = 2,
} rk_chat_role;

typedef struct rk_chat_msg {
    rk_chat_role role;
    char *content; /* malloc'ed, NUL-terminated (text parts joined) */
} rk_chat_msg;

/* A validated POST /v1/completions or /v1/chat/completions body. */
typedef struct rk_api_request {
    int chat;           /* 1: a chat body (messages), 0: a completion body */
    rk_req_options opt; /* sampling, limits and the ragkv extensions */
    int seed_given;     /* opt.sampling.seed came from the body */
    int stream;
    char *stop[RK_MAX_STOP]; /* malloc'ed stop strings */
    int n_stop;
    char *model;                          /* NULL when absent */
    char separator[RK_SEPARATOR_MAX + 1]; /* "##" unless given */
    rk_split pieces;                      /* completion: filled by the parser; chat: by render */
    int have_pieces;                      /* pieces holds strings (free them) */
    char **chunk_ids;  /* (pieces.n_chunks) ids given as {"id", "text"}, or NULL */
    rk_chat_msg *msgs; /* (n_msgs) chat only */
    int n_msgs;
    char **chat_chunks; /* (n_chat_chunks) the `chunks` extension of a chat body */
    char **chat_chunk_ids;
    int n_chat_chunks;
    int chat_chunks_given;
} rk_api_request;

/* Parse and validate a request body of len bytes (need not be
 * NUL-terminated). chat selects the chat shape. On success *out owns its
 * strings (rk_api_request_free); on failure err says why (400 malformed,
 * 422 over a limit, ...) and nothing is left allocated. */
rk_status rk_api_parse(const char *body, size_t len, int chat, const rk_parse_limits *lim,
                       rk_api_request *out, rk_http_error *err);

/* Free what a parsed request owns and zero it; accepts a zeroed request. */
void rk_api_request_free(rk_api_request *r);

/* A validated POST /v1/chunks body (pre-warm). */
typedef struct rk_prewarm_request {
    char **texts; /* (n) malloc'ed chunk texts, non-empty */
    char **ids;   /* (n) document ids, NULL entries when none was given */
    int n;
    int persist;
    int context_system; /* chunk_context "system": computed after `system` */
    char *system;       /* malloc'ed system prompt ("" when absent) */
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

/* ---------------------------------------------------------------- chat templates */

typedef enum rk_chat_template {
    RK_CHAT_CHATML = 0, /* <|im_start|>role\n...<|im_end|> (Qwen2, Qwen3) */
    RK_CHAT_LLAMA3 = 1, /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    RK_CHAT_LLAMA2 = 2, /* [INST] <<SYS>>...<</SYS>> ... [/INST] */
} rk_chat_template;

/* Name of a template: "chatml", "llama3", "llama2". */
const char *rk_chat_template_name(rk_chat_template t);

/* Choose a template: from the GGUF tokenizer.chat_template text when given
 * (NULL when absent), else from the architecture name ("qwen2", "qwen3":
 * ChatML) and the vocabulary (has_llama3_tokens: <|start_header_id|> exists),
 * else Llama-2. */
rk_chat_template rk_chat_template_detect(const char *jinja, const char *arch,
                                         int has_llama3_tokens);

/* Render a parsed chat request into req->pieces around the document turn
 * (the first user message with documents, else the last one): the system
 * piece is the template's system part, the turns before it and its opening;
 * the chunks are its documents, raw text; the question piece is the rest of
 * it, every later turn and the assistant prefix, so a follow-up's layout
 * extends the previous turn's. User messages are split on req->separator
 * unless the `chunks` extension gave the first one's chunks. */
rk_status rk_chat_render(rk_chat_template t, rk_api_request *req, int max_chunks,
                         rk_http_error *err);

#endif
