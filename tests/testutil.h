/* tests/testutil.h — helpers shared by the Criterion suites: locating the
 * shared models (skipping visibly when absent), scratch directories, and
 * running the real `ragkv` binary. */
#ifndef RK_TESTUTIL_H
#define RK_TESTUTIL_H

#include <stddef.h>
#include <sys/types.h>

/* Absolute path of a file under ../shared, or NULL when it does not exist.
 * The returned string is static storage reused by the next call. */
const char *rk_test_shared_path(const char *rel);

/* Skip the current test (Criterion cr_skip_test) when the shared file is absent;
 * otherwise store its path (malloc'ed, leaked deliberately: test lifetime) in var. */
#define RK_REQUIRE_SHARED(var, rel)                                                                \
    do {                                                                                           \
        const char *rk__p = rk_test_shared_path(rel);                                              \
        if (!rk__p) cr_skip_test("missing ../shared/%s (tests need the shared data)", rel);        \
        var = rk_test_strdup(rk__p);                                                               \
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

char *rk_test_strdup(const char *s);

/* Create a fresh empty directory under the build tree's testtmp/ and return its
 * path (malloc'ed). */
char *rk_test_tmpdir(const char *tag);

/* Path of a synthetic model (rk_mkmodel preset, weight type "f32"/"f16"/"bf16",
 * seed) under the build tree's testtmp/models/, written on first use and
 * shared by every test afterwards (malloc'ed). Skips the test when the Qwen3
 * vocabulary the preset needs is absent. */
char *rk_test_model(const char *preset, const char *wtype, unsigned seed);

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

#endif
