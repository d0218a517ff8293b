/* tests/test_eval.c — teacher forcing in the pipeline, and `ragkv eval` run
 * as a child process: full attention compared with itself is exact (KL 0,
 * every token agrees), the teacher-forced runs follow the reference's tokens,
 * first_k:K recomputes min(K, chunk length) tokens of every chunk, the held-out
 * set generator writes what it says, and a bad --configs is a usage error.
 * --task: LongBench's answer normalisation against hand-worked cases, answer
 * accuracy end to end on stories260K and ragqa (structured and LongBench
 * records), and the calibration file read back as `ragkv serve` reads it. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/score.h"
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

/* ---------------------------------------------------------------- --task */

Test(score, longbench_normalisation_matches_hand_worked_cases) {
    static const char *const cases[][2] = {
        {"The Cat", "cat"},
        {"  Lily.  ", "lily"},
        {"an apple, a pear and the plum!", "apple pear and plum"},
        {"Theatre anthem", "theatre anthem"}, /* articles only as whole words */
        {"A-B", "ab"},                        /* punctuation goes, then no word "a" is left */
        {"a b-a c", "ba c"},                  /* "b-a" becomes "ba" first */
        {"Tom's\tdog\n", "toms dog"},
        {"THE", ""},
        {"", ""},
        {"caf\xc3\xa9 a", "caf\xc3\xa9"}, /* UTF-8 kept, only ASCII lowercased */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *n = rk_score_normalize(cases[i][0], strlen(cases[i][0]));
        cr_assert_not_null(n);
        cr_expect_str_eq(n, cases[i][1], "normalize(\"%s\")", cases[i][0]);
        free(n);
    }
    cr_expect_eq(rk_score_exact(" Lily", "Lily"), 1);
    cr_expect_eq(rk_score_exact("The lily.", "lily"), 1);
    cr_expect_eq(rk_score_exact("Lily Sue", "Lily"), 0);
    /* F1: pred "the red big ball" -> red big ball (3), answer "a big ball"
     * -> big ball (2): 2 shared, precision 2/3, recall 1, F1 0.8. */
    cr_expect_float_eq(rk_score_f1("the red big ball", "a big ball"), 0.8, 1e-12);
    /* Multisets: "ball ball" against "ball": 1 shared, p 1/2, r 1, F1 2/3. */
    cr_expect_float_eq(rk_score_f1("ball ball", "ball"), 2.0 / 3, 1e-12);
    cr_expect_float_eq(rk_score_f1("Lily", "lily!"), 1.0, 1e-12);
    cr_expect_float_eq(rk_score_f1("Tom", "Lily"), 0.0, 1e-12);
    cr_expect_float_eq(rk_score_f1("", ""), 0.0, 1e-12); /* nothing shared: 0, as LongBench */
}

/* Run eval --task on a records file with extra arguments; the JSON object. */
static json_t *run_task(const char *records, const char *args) {
    char *path = rk_test_write_tmp("eval-task", "task.jsonl", records);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s eval --task %s --threads 2 --json %s", RK_BIN, path, args);
    char *out = NULL;
    int rc = rk_test_run(cmd, &out);
    cr_assert_eq(rc, 0, "%s\n%s", cmd, out ? out : "");
    json_t *root = json_loads(out, 0, NULL);
    cr_assert_not_null(root, "%s", out);
    free(out);
    free(path);
    return root;
}

/* Per configuration: one scored answer per record, exact match and F1 the
 * means of the per-record ones, the per-type figures those of their records. */
static void check_task(json_t *root, int records) {
    cr_assert_eq(num(root, "records"), records);
    json_t *c;
    size_t i;
    json_array_foreach(json_object_get(root, "configs"), i, c) {
        json_t *answers = json_object_get(c, "answers");
        cr_assert_eq(json_array_size(answers), (size_t)records);
        double em = 0, f1 = 0;
        json_t *a;
        size_t j;
        json_array_foreach(answers, j, a) {
            cr_assert(json_is_string(json_object_get(a, "prediction")));
            cr_assert_null(strchr(json_string_value(json_object_get(a, "prediction")), '\n'));
            em += num(a, "exact_match");
            f1 += num(a, "f1");
            cr_assert_geq(num(a, "f1"), num(a, "exact_match"));
        }
        cr_assert_float_eq(num(c, "exact_match"), em / records, 1e-6); /* 8 digits of JSON */
        cr_assert_float_eq(num(c, "f1"), f1 / records, 1e-6);
    }
}

static const char *STORY_TASK =
    "{\"system\": \"\", \"chunks\": [\"Lily had a red ball.\", \"Tom had a dog.\"], "
    "\"question\": \"Once upon a time\", \"answers\": [\"there was a little girl\", \"x\"], "
    "\"type\": \"a\"}\n"
    "{\"system\": \"Read.\", \"chunks\": [\"The sun was warm.\"], \"question\": \"One day\", "
    "\"answer\": \"Lily went to the park\", \"type\": \"b\"}\n"
    "{\"input\": \"Once upon a time\", \"context\": \"Tom had a dog.|The sky was blue.\", "
    "\"answers\": \"there was\"}\n";

Test(eval, task_runs_end_to_end_on_stories260K) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    char args[1024];
    snprintf(args, sizeof args,
             "--model %s --configs plain,none,deviation:0.2,query:0.2,query:1 -n 6 "
             "--chunk-sep '|'",
             model);
    json_t *root = run_task(STORY_TASK, args);
    check_task(root, 3);
    cr_assert_eq(json_array_size(json_object_get(root, "types")), 2);
    /* query:1 recomputes every chunk token: plain's answers. */
    json_t *a = json_object_get(config(root, "plain"), "answers"),
           *b = json_object_get(config(root, "query:1"), "answers");
    for (size_t j = 0; j < 3; j++)
        cr_assert_str_eq(json_string_value(json_object_get(json_array_get(a, j), "prediction")),
                         json_string_value(json_object_get(json_array_get(b, j), "prediction")));
    cr_assert_gt(num(config(root, "query:0.2"), "recomputed_tokens"), 0);
    json_decref(root);
    /* The LongBench record cut every 3 tokens instead. */
    snprintf(args, sizeof args, "--model %s --configs none -n 4 --chunk-tokens 3", model);
    root = run_task(STORY_TASK, args);
    check_task(root, 3);
    json_decref(root);
    /* A LongBench record needs one of the two ways to cut its context. */
    char *path = rk_test_write_tmp("eval-task", "lb.jsonl", STORY_TASK);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s eval --task %s --model %s 2>&1", RK_BIN, path, model);
    char *out = NULL;
    cr_assert_eq(rk_test_run(cmd, &out), 2, "%s", out ? out : "");
    cr_assert_not_null(strstr(out, "--chunk-tokens"), "%s", out);
    free(out);
    free(path);
    free(model);
}

/* Exact match of cfg's answers, overall (type NULL) or of one type, in
 * points. */
static double em_points(json_t *root, const char *cfg, const char *type) {
    json_t *c = config(root, cfg);
    if (type) c = json_object_get(json_object_get(c, "per_type"), type);
    return 100 * num(c, "exact_match");
}

/* The repair policies on all of ragqa's dev set: isolation costs coref
 * answers, and the ratio policies bring them back within the goal's
 * budgets. deviation:0.05 lost 6.5 points when the first tokens it
 * recomputes were taken in chunk order instead of by their deviation;
 * query:0.1 lost 2.5 with the question's attention alone. */
Test(eval, ratio_policies_keep_ragqa_answers_within_budget, .timeout = 120) {
    char *model, *dev;
    RK_REQUIRE_SHARED(model, "models/ragqa/ragqa.gguf");
    RK_REQUIRE_SHARED(dev, "models/ragqa/dev.jsonl");
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "%s eval --task %s --model %s -n 8 --threads 2 --json --configs "
             "plain,none,deviation:0.05,query:0.05,query:0.1",
             RK_BIN, dev, model);
    char *out = NULL;
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out ? out : "");
    json_t *root = json_loads(out, 0, NULL);
    cr_assert_not_null(root, "%s", out);
    free(out);
    double plain = em_points(root, "plain", NULL), coref = em_points(root, "plain", "coref");
    cr_assert_geq(coref - em_points(root, "none", "coref"), 20);
    const char *at5[] = {"deviation:0.05", "query:0.05"};
    for (int i = 0; i < 2; i++) {
        cr_assert_leq(num(config(root, at5[i]), "recomputed_share"), 0.05);
        cr_assert_geq(em_points(root, at5[i], NULL), plain - 3, "%s", at5[i]);
    }
    cr_assert_leq(num(config(root, "query:0.1"), "recomputed_share"), 0.15);
    cr_assert_geq(em_points(root, "query:0.1", NULL), plain - 1);
    cr_assert_geq(em_points(root, "query:0.1", "coref"), coref - 1.1, "one coref answer of 92");
    json_decref(root);
    free(model);
    free(dev);
}

Test(eval, task_on_ragqa_scores_answers_and_calibrates, .timeout = 120) {
    char *model, *dev;
    RK_REQUIRE_SHARED(model, "models/ragqa/ragqa.gguf");
    RK_REQUIRE_SHARED(dev, "models/ragqa/dev.jsonl");
    char *dir = rk_test_tmpdir("eval-ragqa");
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "head -24 %s > %s/dev24.jsonl && %s eval --task %s/dev24.jsonl --model %s -n 8 "
             "--threads 2 --json --configs plain,none,first_k:2,query:0.15 --calibrate "
             "%s/cal.json --max-loss 100 --plot %s/acc.svg",
             dev, dir, RK_BIN, dir, model, dir, dir);
    char *out = NULL;
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out ? out : "");
    json_t *root = json_loads(out, 0, NULL);
    cr_assert_not_null(root, "%s", out);
    free(out);
    check_task(root, 24);
    /* The trained model answers most questions with full attention, and
     * chunks computed alone cost it coreference answers. */
    json_t *plain = config(root, "plain"), *none = config(root, "none");
    cr_assert_geq(num(plain, "exact_match"), 0.7);
    double coref_plain =
               num(json_object_get(json_object_get(plain, "per_type"), "coref"), "exact_match"),
           coref_none =
               num(json_object_get(json_object_get(none, "per_type"), "coref"), "exact_match");
    cr_assert_gt(coref_plain, coref_none);
    json_decref(root);
    /* Within a budget of 100 points every configuration qualifies: the
     * cheapest is none. The file reads back as serve reads it. */
    char path[1024], policy[24] = "unchanged";
    snprintf(path, sizeof path, "%s/cal.json", dir);
    cr_assert_eq(rk_repair_calibration_load(path, policy, sizeof policy), RK_OK, "%s",
                 rk_error_message());
    cr_assert_str_eq(policy, "none");
    json_t *cal = json_load_file(path, 0, NULL);
    cr_assert_str_eq(json_string_value(json_object_get(cal, "policy")), "none");
    cr_assert_eq(json_array_size(json_object_get(cal, "candidates")), 3);
    json_decref(cal);
    /* A tight budget picks a repairing policy or none at all. */
    snprintf(cmd, sizeof cmd,
             "%s eval --task %s/dev24.jsonl --model %s -n 8 --threads 2 --configs "
             "plain,none,first_k:1000 --calibrate %s/cal2.json --max-loss 0",
             RK_BIN, dir, model, dir);
    cr_assert_eq(rk_test_run(cmd, NULL), 0);
    snprintf(path, sizeof path, "%s/cal2.json", dir);
    cr_assert_eq(rk_repair_calibration_load(path, policy, sizeof policy), RK_OK);
    cr_assert_str_eq(policy, "first_k:1000", "first_k:1000 recomputes all: plain's answers");
    /* ragkv serve takes it as its policy (what "auto" serves). */
    snprintf(cmd, sizeof cmd, "%s serve --repair-calibration %s --print-config", RK_BIN, path);
    char *printed = NULL;
    cr_assert_eq(rk_test_run(cmd, &printed), 0, "%s", printed ? printed : "");
    json_t *settings = json_loads(printed, 0, NULL);
    cr_assert_not_null(settings, "%s", printed);
    cr_assert_str_eq(json_string_value(json_object_get(settings, "repair")), "first_k:1000");
    json_decref(settings);
    free(printed);
    /* What is not a calibration is refused, and the output left alone. */
    char *bad = rk_test_write_tmp("eval-ragqa", "bad.json", "{\"policy\": \"none\"}");
    cr_assert_eq(rk_repair_calibration_load(bad, policy, sizeof policy), RK_ERR_INVALID);
    free(bad);
    bad = rk_test_write_tmp("eval-ragqa", "bad2.json",
                            "{\"ragkv_repair_calibration\": 1, \"policy\": \"query:7\"}");
    cr_assert_eq(rk_repair_calibration_load(bad, policy, sizeof policy), RK_ERR_INVALID);
    snprintf(cmd, sizeof cmd, "%s serve --repair-calibration %s --print-config 2>&1", RK_BIN, bad);
    printed = NULL;
    cr_assert_eq(rk_test_run(cmd, &printed), 2, "%s", printed ? printed : "");
    cr_assert_not_null(strstr(printed, "repair calibration"), "%s", printed);
    free(printed);
    free(bad);
    cr_assert_eq(rk_repair_calibration_load("/nonexistent/cal.json", policy, sizeof policy),
                 RK_ERR_IO);
    cr_assert_str_eq(policy, "first_k:1000");
    snprintf(path, sizeof path, "%s/acc.svg", dir);
    char *svg = rk_test_read_file(path, NULL);
    cr_assert_not_null(svg);
    cr_assert_not_null(strstr(svg, "query: exact match"));
    free(svg);
    free(dir);
    free(dev);
    free(model);
}
