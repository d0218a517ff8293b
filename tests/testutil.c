/* tests/testutil.c — see testutil.h. */
#include "tests/testutil.h"

#include <criterion/criterion.h>

#include "engine/mkmodel.h"
#include "pipeline/pipeline.h"

#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

const char *rk_test_shared_path(const char *rel) {
    static char path[4096];
    snprintf(path, sizeof path, "%s/%s", RK_SHARED_DIR, rel);
    struct stat st;
    if (stat(path, &st) != 0) return NULL;
    return path;
}

int rk_test_light(void) {
    const char *v = getenv("RAGKV_TEST_LIGHT");
    return v && *v && strcmp(v, "0") != 0;
}

char *rk_test_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

char *rk_test_tmpdir(const char *tag) {
    static int counter;
    char path[4096];
    mkdir(RK_TEST_TMP, 0755);
    for (;;) {
        snprintf(path, sizeof path, "%s/%s-%d-%d", RK_TEST_TMP, tag, (int)getpid(), counter++);
        if (mkdir(path, 0755) == 0) break;
    }
    return rk_test_strdup(path);
}

int rk_test_run(const char *cmd, char **out) {
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len < 2048) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) break;
            buf = nb;
            cap *= 2;
        }
    }
    if (buf) buf[len] = '\0';
    int st = pclose(f);
    if (out)
        *out = buf;
    else
        free(buf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

char *rk_test_read_file(const char *path, size_t *out_len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = '\0';
        if (out_len) *out_len = (size_t)n;
    }
    return buf;
}

char *rk_test_model(const char *preset, const char *wtype, unsigned seed) {
    char dir[4096], path[4200], tmp[4300];
    snprintf(dir, sizeof dir, "%s/models", RK_TEST_TMP);
    mkdir(RK_TEST_TMP, 0755);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/%s-%s-%u.gguf", dir, preset, wtype, seed);
    struct stat st;
    if (stat(path, &st) == 0) return rk_test_strdup(path);
    rk_mkmodel_opts o;
    rk_mkmodel_opts_default(&o);
    o.preset = preset;
    o.seed = seed;
    if (strcmp(preset, "tiny") != 0) {
        o.vocab_path = rk_test_shared_path("tokenizers/qwen3/tokenizer.json");
        if (!o.vocab_path) cr_skip_test("missing ../shared/tokenizers/qwen3/tokenizer.json");
        o.vocab_path = rk_test_strdup(o.vocab_path);
    }
    cr_assert_eq(rk_mkmodel_parse_wtype(wtype, &o.wtype), RK_OK);
    /* Another test process may be writing the same model: write under a unique
     * name and rename, which is atomic. */
    snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
    rk_status wst = rk_mkmodel_write(tmp, &o);
    if (strcmp(preset, "tiny") != 0) free((char *)o.vocab_path);
    cr_assert_eq(wst, RK_OK, "mkmodel %s: %s", preset, rk_error_message());
    cr_assert_eq(rename(tmp, path), 0);
    return rk_test_strdup(path);
}

rk_request *rk_test_request(rk_service *svc, const int *prompt, int n_prompt, int n_sys,
                            int max_new) {
    rk_request *r = calloc(1, sizeof *r);
    cr_assert_not_null(r);
    rk_req_options_default(&r->opt);
    r->opt.max_tokens = max_new;
    r->opt.sampling.temperature = 0;
    r->opt.stop_at_eog = 0;
    cr_assert_eq(rk_request_prepare_tokens(svc, prompt, n_sys, prompt + n_sys, n_prompt - n_sys, r),
                 RK_OK, "%s", rk_error_message());
    return r;
}

void rk_test_request_free(rk_request *r) {
    rk_request_free(r);
    free(r);
}

int rk_test_greedy(rk_service *svc, const int *prompt, int n_prompt, int n_sys, int max_new,
                   int *out) {
    rk_request *r = rk_test_request(svc, prompt, n_prompt, n_sys, max_new);
    cr_assert_eq(rk_pipeline_run(svc, &r, 1, NULL), RK_OK, "%s", rk_error_message());
    int n = r->n_out;
    memcpy(out, r->out_tokens, (size_t)n * sizeof *out);
    rk_test_request_free(r);
    return n;
}

char *rk_test_write_tmp(const char *tag, const char *name, const char *text) {
    char *dir = rk_test_tmpdir(tag);
    char *path = malloc(strlen(dir) + strlen(name) + 2);
    cr_assert_not_null(path);
    sprintf(path, "%s/%s", dir, name);
    free(dir);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
    return path;
}

int rk_test_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

void rk_test_redis_start(rk_test_redis *s) {
    char *where = NULL;
    if (rk_test_run("command -v redis-server", &where) != 0 || !where || !where[0]) {
        free(where);
        cr_skip_test("redis-server is not installed (scripts/install-deps.sh installs it)");
    }
    free(where);
    if (!s->port) s->port = rk_test_free_port();
    if (!s->dir) s->dir = rk_test_tmpdir("redis");
    char port[16], log[4200];
    snprintf(port, sizeof port, "%d", s->port);
    snprintf(log, sizeof log, "%s/redis.log", s->dir);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a crashed test */
        FILE *f = freopen(log, "a", stdout);
        (void)f;
        dup2(STDOUT_FILENO, STDERR_FILENO);
        if (s->password)
            execlp("redis-server", "redis-server", "--port", port, "--bind", "127.0.0.1", "--save",
                   "", "--appendonly", "no", "--dir", s->dir, "--daemonize", "no", "--requirepass",
                   s->password, (char *)NULL);
        else
            execlp("redis-server", "redis-server", "--port", port, "--bind", "127.0.0.1", "--save",
                   "", "--appendonly", "no", "--dir", s->dir, "--daemonize", "no", (char *)NULL);
        _exit(127);
    }
    s->pid = pid;
    for (int i = 0; i < 500; i++) {
        redisContext *c =
            redisConnectWithTimeout("127.0.0.1", s->port, (struct timeval){0, 200000});
        redisReply *rep = c && !c->err ? redisCommand(c, "PING") : NULL;
        int up = rep != NULL; /* NOAUTH is an answer too */
        if (rep) freeReplyObject(rep);
        if (c) redisFree(c);
        if (up) return;
        int status;
        cr_assert_eq(waitpid(pid, &status, WNOHANG), 0, "redis-server exited; see %s", log);
        usleep(10000);
    }
    cr_assert_fail("redis-server did not answer PING within 5 s; see %s", log);
}

void rk_test_redis_stop(rk_test_redis *s) {
    if (s->pid > 0) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
        s->pid = 0;
    }
}

void rk_test_redis_free(rk_test_redis *s) {
    rk_test_redis_stop(s);
    free(s->dir);
    s->dir = NULL;
}
