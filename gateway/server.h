/* gateway/server.h — `ragkv serve`'s HTTP service (API.md) on CivetWeb.
 *
 *   server.c     CivetWeb set-up, routing, authentication, limits, the small
 *                routes (health, models, stats, metrics) and shutdown
 *   generate.c   completions and chat: preparing a request, waiting for the
 *                engine, Server-Sent Events, the response objects
 *   gen_text.c   a generation's text as its tokens are decoded, stop strings
 *   responses.c  POST /v1/responses on the chat path, stored responses
 *                (responses.h; responses_input.c, responses_store.c)
 *   chunks.c     the chunk and cache routes: pre-warm, list, get, delete, flush
 *   respond.c    response headers and bodies, errors, reading a request body
 *   conns.c      sockets: a client gone, connections per client address,
 *                deadlines on headers and bodies
 *   framing.c    where a request ends: the checks against request smuggling
 *   tokenize.c   POST /tokenize and /detokenize
 *   http_json.c  request bodies (api.h)       chat.c   chat templates (chat.h)
 *   report.c     finished requests as JSON (report.h)
 *   stats.c      counters, /v1/stats and /metrics (stats.h)
 *   tenants.c    the keys file: keys that name tenants (tenants.h)
 *
 * Threads. rk_server_start starts the engine thread (pipeline/scheduler.h)
 * and CivetWeb's workers. A worker reads and validates a body, tokenizes (the
 * tokenizer is immutable, safe for concurrent readers) and queues a job for
 * the engine thread, then waits on the job's own reply channel; cache
 * commands are functions queued the same way, so only the engine thread
 * touches the arena, the radix tree and the chunk index. The owner (cli/serve.c)
 * calls the functions below from one thread. */
#ifndef RK_SERVER_H
#define RK_SERVER_H

#include <stddef.h>

#include "config/config.h"
#include "pipeline/scheduler.h"

/* Everything the HTTP service is told, besides rk_config: the fields the
 * `ragkv serve` settings table fills (cli/serve.c documents each). */
typedef struct rk_server_options {
    rk_config cfg;
    char model[1024]; /* "" = the embedded tiny model */
    char host[256];
    int port; /* 0 = any free port */
    char api_key[256];
    char admin_key[256];
    char api_keys_file[1024]; /* "" = none; tenants.h describes the file */
    long long max_body_bytes;
    int queue;        /* requests waiting for the engine at most */
    double timeout_s; /* a request waiting or running longer is cancelled */
    int max_batch;    /* requests run together at most */
    int log_prompts;  /* prompt text may be logged */
    double grace_s;   /* shutdown: requests may finish this long */
    int http_threads; /* requests handled at once; 0 = queue + 16 */
    double request_timeout_s;
    /* Request headers must arrive within this long of a thread taking the
     * connection (or of the previous answer on it); at most
     * request_timeout_s, which bounds a body after its headers and each
     * write. */
    double header_timeout_s;
    /* Chat user messages are split on this separator when the body names
     * none ("" = not split: chat documents come as chunks, documents or
     * ragkv_chunk parts). */
    char chat_separator[32];
    /* Connections one client address may hold open at once; the requests
     * of one beyond (but /health, /ready and /metrics) are answered 503 and it is
     * closed. 0 = no limit. */
    int max_connections_per_ip;
    /* NAME[,ALIAS...]: the model name reported (the first) and the names
     * requests may give; "" = the model's own name. */
    char served_model_name[512];
    int model_name_strict; /* 1: another `model` is 404; 0: answered as the served one */
    /* A thinking model's <think> block in message.reasoning_content: 1 on,
     * 0 off (left in content), -1 auto (when the vocabulary has <think> and
     * </think> and the template is ChatML). */
    int reasoning;
    char cors_origin[256]; /* "" = no CORS headers; "*" or one origin */
    /* Stored responses (POST /v1/responses with store): at most this many,
     * this many bytes of JSON, each kept this long; lost on restart. */
    int responses_max;
    /* The chat template: a name (chatml, llama3, llama2, phi3, gemma) or a
     * Jinja file read as the GGUF's tokenizer.chat_template would be; "" =
     * the model's own. Resolved when the server starts (an unknown name, an
     * unreadable file or one no template is recognised in fails it). */
    char chat_template[1024];
    long long responses_max_bytes;
    double responses_ttl_s;
    double load_delay_s;  /* testing aid: wait before loading the model */
    double token_delay_s; /* testing aid: sleep after every generated token */
} rk_server_options;

typedef struct rk_server rk_server; /* opaque */

/* Fill o with the defaults (rk_config's included). */
void rk_server_options_default(rk_server_options *o);

/* Read o->api_keys_file (a malformed one fails here, naming the entry),
 * start the engine thread (which loads the model in the background) and
 * listen on o->host:o->port; *out_port gets the port bound (o's, or the one
 * chosen for port 0), which is also printed to stderr. o is copied. Returns
 * RK_OK with the server in *out (stop it with rk_server_stop), or an error
 * (the address in use, out of memory) with nothing left running. */
rk_status rk_server_start(const rk_server_options *o, rk_server **out, int *out_port);

/* The engine's state: RK_SCHEDULER_LOADING, _READY (logged once, with the
 * served model), _FAILED (msg says why) or _STOPPING. Call it to watch the
 * model load. */
rk_scheduler_state rk_server_poll(rk_server *S, char *msg, size_t cap);

/* Shut down and free S (NULL is ignored): new requests get 503, in-flight
 * ones have grace_s to finish, then are cancelled and write their last
 * answer (a stream's final event, a queued request's 503); CivetWeb is
 * stopped, joining its workers, then the engine. */
void rk_server_stop(rk_server *S);

#endif
