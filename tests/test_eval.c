/* tests/test_eval.c — teacher forcing in the pipeline, and `ragkv eval` run
 * as a child process: full attention compared with itself is exact (KL 0,
 * every token agrees), the teacher-forced runs follow the reference's tokens,
 * first_k:K recomputes min(K, chunk length) tokens of every chunk, the held-out
 * set generator writes what it says, and a bad --configs is a usage error. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline.h"
#include "tests/testutil.h"

#define STEPS 12

/* ---------------------------------------------------------------- the hook */

typedef struct force_log {
    int32_t force[STEPS]; /* -1 = sample */
    int n_vocab;
    float *logits; /* (STEPS, n_vocab) */
} force_log;

static void keep_logits(void *ctx, int req, int step, const float *logits, int n_vocab) {
    force_log *l = ctx;
    (void)req;
    if (!l->logits) l->logits = calloc((size_t)STEPS * n_vocab, sizeof *l->logits);
    cr_assert_not_null(l->logits);
    l->n_vocab = n_vocab;
    if (step < STEPS)
        memcpy(l->logits + (size_t)step * n_vocab, logits, (size_t)n_vocab * sizeof *logits);
}

static int32_t force_some(void *ctx, int req, int step) {
    const force_log *l = ctx;
    (void)req;
    return step < STEPS ? l->force[step] : -1;
}

static void run_forced(rk_service *svc, force_log *l, int32_t *out) {
    static const int prompt[] = {1, 40, 41, 42, 43, 44, 45, 46};
    rk_request *r = rk_test_request(svc, prompt, 8, 1, STEPS);
    rk_pipeline_hooks h = {.ctx = l, .on_logits = keep_logits, .force_token = force_some};
    cr_assert_eq(rk_pipeline_run(svc, &r, 1, &h), RK_OK, "%s", rk_error_message());
    cr_assert_eq(r->n_out, STEPS);
    memcpy(out, r->out_tokens, STEPS * sizeof *out);
    rk_test_request_free(r);
}

static int argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) best = v[i] > v[best] ? i : best;
    return best;
}

/* Forced steps take the forced token, the others sample (greedily) from
 * logits that follow from the tokens forced before them. */
Test(pipeline, force_token_replaces_the_sampled_token) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = 2;
    cfg.kv_memory_mb = 64;
    rk_service *svc;
    cr_assert_eq(rk_service_open(&cfg, NULL, &svc), RK_OK, "%s", rk_error_message());
    force_log *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    cr_assert(a && b);
    int32_t out_a[STEPS], out_b[STEPS];
    for (int s = 0; s < STEPS; s++) {
        a->force[s] = s % 2 ? -1 : 5 + 3 * s;
        b->force[s] = s % 2 ? -1 : 7 + 3 * s;
    }
    a->force[STEPS - 1] = 1 << 30; /* outside the vocabulary: sampled */
    run_forced(svc, a, out_a);
    run_forced(svc, b, out_b);
    for (int s = 0; s < STEPS; s++) {
        if (s % 2 == 0 && s != STEPS - 1)
            cr_assert_eq(out_a[s], a->force[s], "step %d took %d, forced %d", s, out_a[s],
                         a->force[s]);
        else
            cr_assert_eq(out_a[s], argmax(a->logits + (size_t)s * a->n_vocab, a->n_vocab),
                         "step %d did not sample", s);
    }
    /* The forced token is what the next step reads: forcing another one
     * changes the following distribution. */
    cr_assert_neq(
        memcmp(a->logits + a->n_vocab, b->logits + b->n_vocab, (size_t)a->n_vocab * sizeof(float)),
        0);
    cr_assert_eq(memcmp(a->logits, b->logits, (size_t)a->n_vocab * sizeof(float)), 0);
    free(a->logits);
    free(b->logits);
    free(a);
    free(b);
    rk_service_close(svc);
}

/* ---------------------------------------------------------------- ragkv eval */

static const char *PROMPTS =
    "{\"system\": \"You are a storyteller.\", \"chunks\": [\"Lily had a red ball. She liked to "
    "play with it in the garden every day.\", \"Tom had a big dog named Max. Max liked to run and "
    "bark at the birds.\"], \"question\": \"One day\"}\n"
    "{\"prompt\": \"##The sun was warm and the sky was blue.##The children sang a happy "
    "song.##Ab##Then\"}\n"
    "\n"
    "{\"system\": \"\", \"chunks\": [\"Sue saw a cat.\", \"The cat was sad because it was "
    "lost in the big town and could not find its home.\", \"Mom smiled.\"], \"question\": "
    "\"The cat\"}\n";

static json_t *run_eval(const char *args, const char *plot) {
    char *path = rk_test_write_tmp("eval", "prompts.jsonl", PROMPTS);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s eval --prompts %s %s --json --threads 2%s%s", RK_BIN, path, args,
             plot ? " --plot " : "", plot ? plot : "");
    free(path);
    char *out = NULL;
    int rc = rk_test_run(cmd, &out);
    cr_assert_eq(rc, 0, "`%s` exited %d; stdout:\n%s", cmd, rc, out ? out : "");
    json_error_t err;
    json_t *root = json_loads(out, 0, &err);
    cr_assert_not_null(root, "eval printed no JSON (%s):\n%s", err.text, out);
    free(out);
    return root;
}

static double num(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "%s is not a number", key);
    return json_number_value(v);
}

static json_t *config(json_t *root, const char *name) {
    json_t *c;
    size_t i;
    json_array_foreach(json_object_get(root, "configs"), i, c) {
        if (!strcmp(json_string_value(json_object_get(c, "name")), name)) return c;
    }
    cr_assert_fail("no configuration %s in the output", name);
    return NULL;
}

/* The checks every eval run must pass: plain against plain is exact, every
 * teacher-forced run took the reference's tokens, first_k accounting. */
static void check_eval(json_t *root, int prompts, int n) {
    cr_assert_eq(num(root, "prompts"), prompts);
    cr_assert_eq(num(root, "tokens"), n);
    json_t *plain = config(root, "plain");
    cr_assert_lt(num(plain, "max_kl"), 1e-6, "plain vs plain: KL %g", num(plain, "max_kl"));
    cr_assert_lt(num(plain, "mean_kl"), 1e-6);
    cr_assert_eq(num(plain, "first_top1"), 1);
    cr_assert_eq(num(plain, "mean_top1"), 1);
    cr_assert_eq(num(plain, "mean_rank"), 1);
    cr_assert_eq(num(plain, "greedy_agreement"), 1);
    cr_assert_eq(num(plain, "mean_common_prefix"), n);
    json_t *refs = json_object_get(root, "reference_tokens"), *c;
    cr_assert_eq(json_array_size(refs), (size_t)prompts);
    size_t i, j;
    json_array_foreach(json_object_get(root, "configs"), i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        json_t *per = json_object_get(c, "per_prompt"), *p;
        cr_assert_eq(json_array_size(per), (size_t)prompts);
        long recomputed = 0, prompt_tokens = 0;
        json_array_foreach(per, j, p) {
            cr_assert(json_equal(json_object_get(p, "forced_tokens"), json_array_get(refs, j)),
                      "%s, prompt %zu: the teacher-forced tokens are not the reference's", name, j);
            long want = 0;
            json_t *len;
            size_t k;
            json_array_foreach(json_object_get(p, "chunk_lens"), k, len) {
                long l = (long)json_integer_value(len);
                if (!strncmp(name, "first_k:", 8)) want += l < atol(name + 8) ? l : atol(name + 8);
            }
            if (strncmp(name, "deviation:", 10))
                cr_assert_eq(num(p, "recomputed"), want, "%s, prompt %zu: %g recomputed, want %ld",
                             name, j, num(p, "recomputed"), want);
            recomputed += (long)num(p, "recomputed");
            prompt_tokens += (long)num(p, "prompt_tokens");
        }
        cr_assert_eq(num(c, "recomputed_tokens"), recomputed);
        cr_assert_eq(num(c, "prompt_tokens"), prompt_tokens);
        cr_assert_float_eq(num(c, "recomputed_share"), (double)recomputed / prompt_tokens, 1e-6);
    }
}

Test(eval, plain_is_exact_and_first_k_accounting_embedded) {
    char *dir = rk_test_tmpdir("eval-plot");
    char plot[512];
    snprintf(plot, sizeof plot, "%s/q.svg", dir);
    json_t *root = run_eval("--configs plain,none,first_k:3,first_k:1000 -n 8", plot);
    check_eval(root, 3, 8);
    /* first_k:1000 covers every chunk token. */
    json_t *all = config(root, "first_k:1000"), *p;
    size_t j;
    json_array_foreach(json_object_get(all, "per_prompt"), j, p) {
        long sum = 0;
        json_t *len;
        size_t k;
        json_array_foreach(json_object_get(p, "chunk_lens"), k, len) sum +=
            (long)json_integer_value(len);
        cr_assert_gt(sum, 0);
        cr_assert_eq(num(p, "recomputed"), sum);
    }
    json_decref(root);
    char *svg = rk_test_read_file(plot, NULL);
    cr_assert_not_null(svg);
    cr_assert_not_null(strstr(svg, "<svg"));
    cr_assert_not_null(strstr(svg, "first_k: greedy agreement"));
    free(svg);
    free(dir);
}

Test(eval, stories260K) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    char args[1024];
    snprintf(args, sizeof args, "--model %s --configs none,plain,first_k:2,deviation:0.1 -n 10",
             model);
    json_t *root = run_eval(args, NULL);
    check_eval(root, 3, 10);
    /* Reusing chunks computed alone does change the distributions: a
     * comparison that found nothing would be measuring nothing. */
    cr_assert_gt(num(config(root, "none"), "mean_kl"), 1e-4);
    cr_assert_gt(num(config(root, "deviation:0.1"), "recomputed_tokens"), 0);
    json_decref(root);
    free(model);
}

Test(eval, make_set_writes_the_held_out_set) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    char *dir = rk_test_tmpdir("eval-set");
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "%s eval --make-set %s/set.jsonl --model %s --set-size 4 --seed 91 --threads 2 && "
             "%s eval --prompts %s/set.jsonl --model %s --configs plain,none -n 4 --threads 2 "
             "--json",
             RK_BIN, dir, model, RK_BIN, dir, model);
    char *out = NULL;
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out ? out : "");
    json_t *root = json_loads(out, 0, NULL);
    cr_assert_not_null(root, "%s", out);
    check_eval(root, 4, 4);
    json_decref(root);
    free(out);
    snprintf(cmd, sizeof cmd, "%s/set.jsonl", dir);
    char *text = rk_test_read_file(cmd, NULL);
    cr_assert_not_null(text);
    int line = 0;
    for (char *s = strtok(text, "\n"); s; s = strtok(NULL, "\n"), line++) {
        json_t *o = json_loads(s, 0, NULL);
        cr_assert_not_null(o, "line %d: %s", line, s);
        size_t n = json_array_size(json_object_get(o, "chunks"));
        cr_assert_eq(n, (size_t)(2 + line % 3), "line %d has %zu chunks", line, n);
        cr_assert_gt(strlen(json_string_value(json_object_get(o, "question"))), 0);
        json_decref(o);
    }
    cr_assert_eq(line, 4);
    free(text);
    free(dir);
    free(model);
}

Test(eval, bad_configs_are_usage_errors) {
    char *path = rk_test_write_tmp("eval-bad", "prompts.jsonl", PROMPTS);
    static const char *bad[] = {"bogus",       "first_k:0",     "first_k:",  "first_k:x",
                                "deviation:0", "deviation:1.5", "none,none", "none,",
                                "''",          "first_k:-2"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "%s eval --prompts %s --configs %s 2>&1", RK_BIN, path, bad[i]);
        char *out = NULL;
        int rc = rk_test_run(cmd, &out);
        cr_assert_eq(rc, 2, "--configs %s exited %d:\n%s", bad[i], rc, out ? out : "");
        cr_assert_not_null(strstr(out, "--configs"), "--configs %s: %s", bad[i], out);
        free(out);
    }
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s eval --configs none 2>&1", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, NULL), 2, "no --prompts must be a usage error");
    free(path);
}
