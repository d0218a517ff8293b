/* bench/eval.c — see eval.h.
 *
 * Layout: options and the --configs syntax; the prompt file; one request run
 * with its hooks; the metrics; the held-out set generator; the table, the
 * JSON object and the SVG plot; rk_eval_main.
 *
 * Every configuration runs on a service of its own, opened from scratch, so
 * its chunk and prefix caches start empty: what one configuration computed
 * never serves another. Within a configuration the teacher-forced run of a
 * prompt comes first and computes its chunks (misses), the free-running run
 * then finds them (hits); ms/request is the free-running run's, a request
 * whose chunks are all cached. The cached KV does not depend on the repair
 * policy (repair writes live blocks only), so the order changes timings, never
 * the distributions. */
#include "bench/eval.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_internal.h"
#include "bench/score.h"
#include "engine/tokenizer.h"
#include "pipeline/pipeline.h"
#include "pipeline/split.h"

#define MAX_CONFIGS  32
#define MAX_TYPES    16   /* record types --task breaks results down by */
#define SPLIT_CHUNKS 4096 /* any number of chunks a prompt file line may hold */

#define DEFAULT_CONFIGS                                                                            \
    "none,first_k:1,first_k:2,first_k:4,first_k:8,first_k:16,deviation:0.02,deviation:0.05,"       \
    "deviation:0.1,deviation:0.15,deviation:0.3"
#define DEFAULT_TASK_CONFIGS                                                                       \
    "plain,none,first_k:2,first_k:4,first_k:8,deviation:0.05,deviation:0.15,deviation:0.3,"        \
    "query:0.05,query:0.15,query:0.3"

/* ---------------------------------------------------------------- options */

typedef enum family {
    FAM_PLAIN,
    FAM_NONE,
    FAM_FIRST_K,
    FAM_DEVIATION,
    FAM_QUERY,
    N_FAMILIES
} family;
static const char *const k_family_names[N_FAMILIES] = {"plain", "none", "first_k", "deviation",
                                                       "query"};

typedef struct eval_config {
    char name[40];
    family fam;
    int k;        /* first_k */
    double ratio; /* deviation, query */
} eval_config;

typedef struct eval_opts {
    const char *model; /* NULL = the embedded model */
    const char *prompts;
    const char *make_set;
    const char *plot;
    const char *task, *calibrate;
    char model_arg[1024], prompts_arg[4096], make_set_arg[4096], plot_arg[4096]; /* "" = none */
    char task_arg[4096], calibrate_arg[4096], chunk_sep[64];
    int chunk_tokens; /* LongBench contexts: cut into pieces of this many tokens (0 = off) */
    double max_loss;  /* --calibrate: accuracy points a configuration may lose against plain */
    int configs_given;
    char context_arg[16]; /* what the cached chunks are computed after */
    rk_chunk_context context;
    int set_size;
    long long seed;
    rk_config cfg;
    char ref_dtype[8]; /* KV type of the reference ("" = cfg.kv_dtype) */
    eval_config configs[MAX_CONFIGS];
    int n_configs;
    int n_tokens;
    int json;
} eval_opts;

static const char *k_help =
    "usage: ragkv eval --prompts FILE [options]\n"
    "       ragkv eval --task FILE.jsonl [--calibrate OUT.json [--max-loss P]] [options]\n"
    "       ragkv eval --make-set FILE --model F.gguf [--set-size N] [--seed S]\n"
    "Compare cached RAG answers with full attention. For every prompt the reference (mode\n"
    "plain) runs greedily for N tokens; every configuration then runs teacher-forced along\n"
    "the reference's tokens (KL(reference || config) over the vocabulary, top-1 agreement,\n"
    "rank of the reference token, at every step) and free running (greedy agreement).\n"
    "With --task, every configuration answers each record greedily (stopping at a newline,\n"
    "the end of generation or -n tokens) and is scored against its answers with LongBench's\n"
    "normalised exact match and token F1, overall and per record type.\n";

static const char *k_extra_help =
    "  --configs LIST        comma-separated configurations (default:\n"
    "                        " DEFAULT_CONFIGS ")\n"
    "                          plain         full attention again (a check: must match exactly)\n"
    "                          none          chunk cache, no repair\n"
    "                          first_k:K     recompute the first K tokens of every chunk (K >= 1)\n"
    "                          deviation:R   recompute the share R (0 < R <= 1) of chunk tokens\n"
    "                                        whose layer-1 K/V deviate most\n"
    "                          query:R       recompute the share R of chunk tokens the question\n"
    "                                        attends to most\n"
    "                        (--task default: " DEFAULT_TASK_CONFIGS ")\n"
    "  -n N                  tokens per request, 1 to 4096 (default: 24)\n";

#define E_OFF(m) offsetof(eval_opts, m)
#define E_STR(m) E_OFF(m), sizeof(((eval_opts *)0)->m)

static const rk_setting k_eval_settings[] = {
    {"model", "model", RK_SET_STR, E_STR(model_arg), 0, 0, 0, 0,
     "F.gguf  model file (default: the embedded `tiny` model)"},
    {"prompts", "prompts", RK_SET_STR, E_STR(prompts_arg), 0, 0, 0, 0,
     "FILE  JSON lines: {\"system\": S, \"chunks\": [C, ...], \"question\": Q} or "
     "{\"prompt\": \"system##chunk##...##question\"}"},
    {"json", "json", RK_SET_BOOL, E_OFF(json), 0, 0, 1, 0, 0,
     "  print one JSON object instead of the table"},
    {"chunk_context", "chunk-context", RK_SET_STR, E_STR(context_arg), 0, 0, 0, 0,
     "CTX  what the cached chunks are computed after: isolated (default), system or "
     "anchor"},
    {"plot", "plot", RK_SET_STR, E_STR(plot_arg), 0, 0, 0, 0,
     "FILE.svg  write quality against recomputed share as SVG"},
    {"n_threads", "threads", RK_SET_INT, E_OFF(cfg.n_threads), 0, 0, 1024, 0, 0,
     "N  compute threads (default: 0 = one per core)"},
    {"kv_memory_mb", "kv-memory-mb", RK_SET_INT, E_OFF(cfg.kv_memory_mb), 0, 1, 1 << 24, 0, 0,
     "N  KV budget in MiB per configuration (default: 256)"},
    {"kv_dtype", "kv-dtype", RK_SET_STR, E_STR(cfg.kv_dtype), 0, 0, 0, 0,
     "T  KV type of every run: f32 (default), f16, bf16, q8_0 or auto (the server's default)"},
    {"reference_kv_dtype", "reference-kv-dtype", RK_SET_STR, E_STR(ref_dtype), 0, 0, 0, 0,
     "T  KV type of the reference alone (default: --kv-dtype): with f32 here and f16 in "
     "--kv-dtype, `plain` measures f16 KV against f32"},
    {"make_set", "make-set", RK_SET_STR, E_STR(make_set_arg), 0, 0, 0, 0,
     "FILE  write a held-out prompt file generated by --model (2-4 chunks of seeded "
     "generations from BOS and a question, the start of another, per prompt), then exit"},
    {"set_size", "set-size", RK_SET_INT, E_OFF(set_size), 0, 1, 100000, 0, 0,
     "N  prompts --make-set writes (default: 60)"},
    {"seed", "seed", RK_SET_LONG, E_OFF(seed), 0, 0, 1 << 30, 0, 0,
     "S  --make-set seed (default: 2026)"},
    {"task", "task", RK_SET_STR, E_STR(task_arg), 0, 0, 0, 0,
     "FILE  JSON lines {\"system\", \"chunks\", \"question\", \"answers\" (or \"answer\"), "
     "\"type\"} or LongBench's {\"input\", \"context\", \"answers\"}: score answers"},
    {"chunk_tokens", "chunk-tokens", RK_SET_INT, E_OFF(chunk_tokens), 0, 1, 1 << 20, 0, 0,
     "N  --task: cut a LongBench context into chunks of N tokens"},
    {"chunk_sep", "chunk-sep", RK_SET_STR, E_STR(chunk_sep), 0, 0, 0, 0,
     "STR  --task: cut a LongBench context into chunks at STR"},
    {"calibrate", "calibrate", RK_SET_STR, E_STR(calibrate_arg), 0, 0, 0, 0,
     "OUT.json  --task: write the cheapest configuration within --max-loss of plain (needs "
     "plain among --configs) for `ragkv serve --repair-calibration`"},
    {"max_loss", "max-loss", RK_SET_DOUBLE, E_OFF(max_loss), 0, 0, 100, 0, 0,
     "P  --calibrate: accuracy points (exact match, overall and per type) a configuration may "
     "lose against plain (default: 1.0)"},
};

/* Parse one configuration of --configs; 0 or -1. */
static int parse_config(const char *s, size_t n, eval_config *c) {
    char buf[40];
    if (n == 0 || n >= sizeof buf) return -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    memset(c, 0, sizeof *c);
    snprintf(c->name, sizeof c->name, "%s", buf);
    if (!strcmp(buf, "plain")) {
        c->fam = FAM_PLAIN;
        return 0;
    }
    float ratio;
    int query;
    if (rk_repair_parse(buf, &c->k, &ratio, &query)) return -1;
    c->ratio = ratio;
    c->fam = c->k ? FAM_FIRST_K : !(ratio > 0) ? FAM_NONE : query ? FAM_QUERY : FAM_DEVIATION;
    return 0;
}

/* Parse --configs into o; RK_ERR_INVALID says why. */
static rk_status parse_configs(const char *s, eval_opts *o) {
    o->n_configs = 0;
    const char *p = s;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        if (o->n_configs == MAX_CONFIGS)
            return rk_errorf(RK_ERR_INVALID, "too many --configs (at most 32): '%s'", s);
        eval_config *c = &o->configs[o->n_configs];
        if (parse_config(p, n, c))
            return rk_errorf(RK_ERR_INVALID,
                             "bad configuration '%.*s' in --configs (want plain, none, first_k:K "
                             "with K >= 1, deviation:R or query:R with 0 < R <= 1)",
                             (int)(n < 60 ? n : 60), p);
        for (int i = 0; i < o->n_configs; i++)
            if (!strcmp(o->configs[i].name, c->name))
                return rk_errorf(RK_ERR_INVALID, "configuration '%s' appears twice in --configs",
                                 c->name);
        o->n_configs++;
        if (!comma) break;
        p = comma + 1;
    }
    return RK_OK;
}

enum { O_CONFIGS = 1 };

static const struct option k_eval_extra[] = {{"configs", required_argument, 0, O_CONFIGS},
                                             {0, 0, 0, 0}};

/* The options a settings table does not express: the configuration list, -n. */
static rk_status eval_extra(void *ctx, int val, const char *arg) {
    eval_opts *o = ctx;
    long v;
    if (val == O_CONFIGS) {
        o->configs_given = 1;
        return parse_configs(arg, o);
    }
    if (val == 'n' && !rk_parse_long(arg, 1, 4096, &v)) {
        o->n_tokens = (int)v;
        return RK_OK;
    }
    return rk_errorf(RK_ERR_INVALID, "-n must be an integer from 1 to 4096, got '%s'", arg);
}

/* Parse argv into o; returns 0, or -1 to exit with *out_exit (0 after --help). */
static int parse_args(int argc, char **argv, eval_opts *o, int *out_exit) {
    memset(o, 0, sizeof *o);
    rk_config_defaults(&o->cfg);
    o->cfg.kv_memory_mb = 256;
    /* f32 KV: the published tables; --kv-dtype measures the others. */
    snprintf(o->cfg.kv_dtype, sizeof o->cfg.kv_dtype, "f32");
    o->n_tokens = 24;
    o->set_size = 60;
    o->seed = 2026;
    o->max_loss = 1.0;
    parse_configs(DEFAULT_CONFIGS, o);
    rk_settings tab = {k_eval_settings, sizeof k_eval_settings / sizeof k_eval_settings[0], o};
    rk_cmdline cl = {.cmd = "eval",
                     .usage = k_help,
                     .tabs = &tab,
                     .n_tabs = 1,
                     .extra = k_eval_extra,
                     .shorts = "n:",
                     .extra_help = k_extra_help,
                     .on_extra = eval_extra,
                     .ctx = o,
                     .first = 1};
    int next = rk_cmdline_parse(&cl, argc, argv, out_exit);
    if (next < 0) return -1;
    *out_exit = EXIT_USAGE;
    if (next < argc)
        return rk_bench_usage_error("eval", "unexpected argument '%s'", argv[next]), -1;
    o->model = o->model_arg[0] ? o->model_arg : NULL;
    o->prompts = o->prompts_arg[0] ? o->prompts_arg : NULL;
    o->make_set = o->make_set_arg[0] ? o->make_set_arg : NULL;
    o->plot = o->plot_arg[0] ? o->plot_arg : NULL;
    o->task = o->task_arg[0] ? o->task_arg : NULL;
    o->calibrate = o->calibrate_arg[0] ? o->calibrate_arg : NULL;
    if (o->task && !o->configs_given) parse_configs(DEFAULT_TASK_CONFIGS, o);
    if (o->task && o->prompts)
        return rk_bench_usage_error("eval", "%s", "--task and --prompts exclude each other"), -1;
    if ((o->calibrate || o->chunk_tokens || o->chunk_sep[0]) && !o->task)
        return rk_bench_usage_error("eval", "%s",
                                    "--calibrate, --chunk-tokens and --chunk-sep need --task"),
               -1;
    if (o->chunk_tokens && o->chunk_sep[0])
        return rk_bench_usage_error("eval", "%s",
                                    "--chunk-tokens and --chunk-sep exclude each other"),
               -1;
    int has_plain = 0;
    for (int i = 0; i < o->n_configs; i++) has_plain |= o->configs[i].fam == FAM_PLAIN;
    if (o->calibrate && !has_plain)
        return rk_bench_usage_error("eval", "%s",
                                    "--calibrate measures loss against plain: put plain in "
                                    "--configs"),
               -1;
    if (o->make_set && !o->model)
        return rk_bench_usage_error("eval", "%s",
                                    "--make-set needs --model (the set is the model's own text)"),
               -1;
    if (!o->make_set && !o->prompts && !o->task)
        return rk_bench_usage_error("eval", "%s", "--prompts FILE or --task FILE is required"), -1;
    static const char *const contexts[] = {"isolated", "system", "anchor"};
    int c = 0;
    while (c < 3 && strcmp(o->context_arg[0] ? o->context_arg : "isolated", contexts[c])) c++;
    if (c == 3)
        return rk_bench_usage_error("eval",
                                    "--chunk-context is isolated, system or anchor, not '%s'",
                                    o->context_arg),
               -1;
    o->context = (rk_chunk_context)c;
    return 0;
}

/* ---------------------------------------------------------------- the prompt file */

typedef struct prompt_set {
    rk_split *p; /* (n) */
    int n, max_chunks;
} prompt_set;

static void prompt_set_free(prompt_set *s) {
    for (int i = 0; i < s->n; i++) rk_split_free(&s->p[i]);
    free(s->p);
    memset(s, 0, sizeof *s);
}

/* One JSON line into pieces; line is its 1-based number for messages. */
static rk_status parse_line(json_t *o, const char *path, int line, rk_split *out) {
    json_t *prompt = json_object_get(o, "prompt");
    if (json_is_string(prompt))
        return rk_split_prompt(json_string_value(prompt), json_string_length(prompt), "##",
                               SPLIT_CHUNKS, out);
    json_t *sys = json_object_get(o, "system"), *chunks = json_object_get(o, "chunks"),
           *q = json_object_get(o, "question");
    if (!json_is_string(q) || (sys && !json_is_string(sys)) || (chunks && !json_is_array(chunks)))
        return rk_errorf(RK_ERR_INVALID,
                         "%s:%d: want {\"prompt\": ...} or {\"system\": ..., \"chunks\": [...], "
                         "\"question\": ...}",
                         path, line);
    size_t n = json_array_size(chunks);
    const char **c = calloc(n ? n : 1, sizeof *c);
    if (!c) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    for (size_t i = 0; i < n; i++) {
        c[i] = json_string_value(json_array_get(chunks, i));
        if (!c[i]) {
            free(c);
            return rk_errorf(RK_ERR_INVALID, "%s:%d: chunk %zu is not a string", path, line, i);
        }
    }
    rk_status st = rk_split_structured(sys ? json_string_value(sys) : NULL, c, (int)n,
                                       json_string_value(q), SPLIT_CHUNKS, out);
    free(c);
    return st;
}

/* Call each(o, path, line number, ctx) for every line of path, a JSON object
 * (blank lines skipped); the first error stops it. */
static rk_status each_json_line(const char *path,
                                rk_status (*each)(json_t *o, const char *path, int line, void *ctx),
                                void *ctx) {
    FILE *f = fopen(path, "r");
    if (!f) return rk_errorf(RK_ERR_IO, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int lineno = 0;
    rk_status st = RK_OK;
    while (!st && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
        if (len == 0) continue;
        json_error_t err;
        json_t *o = json_loadb(line, (size_t)len, 0, &err);
        if (!json_is_object(o))
            st = rk_errorf(RK_ERR_INVALID, "%s:%d: not a JSON object (%s)", path, lineno,
                           o ? "another JSON value" : err.text);
        else
            st = each(o, path, lineno, ctx);
        json_decref(o);
    }
    free(line);
    fclose(f);
    return st;
}

/* Grow *arr (of *cap elements of size each) to hold n + 1. */
static rk_status grow_for(void **arr, int *cap, int n, size_t size) {
    if (n < *cap) return RK_OK;
    int nc = *cap ? 2 * *cap : 64;
    void *np = realloc(*arr, (size_t)nc * size);
    if (!np) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    *arr = np;
    *cap = nc;
    return RK_OK;
}

typedef struct prompt_loader {
    prompt_set *s;
    int cap;
} prompt_loader;

static rk_status add_prompt(json_t *o, const char *path, int line, void *ctx) {
    prompt_loader *l = ctx;
    prompt_set *s = l->s;
    rk_status st = grow_for((void **)&s->p, &l->cap, s->n, sizeof *s->p);
    if (!st && !(st = parse_line(o, path, line, &s->p[s->n]))) {
        if (s->p[s->n].n_chunks > s->max_chunks) s->max_chunks = s->p[s->n].n_chunks;
        s->n++;
    }
    return st;
}

static rk_status load_prompts(const char *path, prompt_set *s) {
    memset(s, 0, sizeof *s);
    prompt_loader l = {s, 0};
    rk_status st = each_json_line(path, add_prompt, &l);
    if (!st && s->n == 0) st = rk_errorf(RK_ERR_INVALID, "%s: no prompts", path);
    if (st) prompt_set_free(s);
    return st;
}

/* ---------------------------------------------------------------- one run */

/* What the hooks see: the tokens to force (NULL = free running) and where
 * to keep each step's log-softmax. */
typedef struct run_ctx {
    const int32_t *force;
    int n_steps, n_vocab;
    double *logp; /* (n_steps, n_vocab), NULL = not kept */
} run_ctx;

static void log_softmax(const float *x, int n, double *out) {
    double mx = x[0], sum = 0;
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < n; i++) sum += exp((double)x[i] - mx);
    double lse = mx + log(sum);
    for (int i = 0; i < n; i++) out[i] = (double)x[i] - lse;
}

static void keep_logits(void *ctx, int req, int step, const float *logits, int n_vocab) {
    (void)req;
    run_ctx *c = ctx;
    if (c->logp && step < c->n_steps && n_vocab == c->n_vocab)
        log_softmax(logits, n_vocab, c->logp + (size_t)step * n_vocab);
}

static int32_t force(void *ctx, int req, int step) {
    (void)req;
    const run_ctx *c = ctx;
    return c->force && step < c->n_steps ? c->force[step] : -1;
}

typedef struct run_out {
    int32_t *tokens; /* (n_steps) */
    int n_out, recomputed, prompt_tokens, chunk_tokens, n_chunks;
    int *chunk_lens; /* (n_chunks) */
    double total_ms;
} run_out;

static void run_out_free(run_out *o) {
    free(o->tokens);
    free(o->chunk_lens);
    memset(o, 0, sizeof *o);
}

static void config_options(const eval_config *c, int n_tokens, rk_chunk_context context,
                           rk_req_options *opt) {
    rk_req_options_default(opt);
    opt->chunk_context = context;
    opt->max_tokens = n_tokens;
    opt->sampling.temperature = 0;
    opt->stop_at_eog = 0; /* every run has N steps to compare */
    /* Each configuration computes its own prompt: an earlier run's sequence
     * (the reference's, forced tokens and all) is not reused. */
    opt->reuse_sequences = 0;
    switch (c->fam) {
    case FAM_PLAIN:
        opt->mode = RK_MODE_PLAIN;
        opt->prefix_cache = 0;
        break;
    case FAM_NONE: break;
    case FAM_FIRST_K: opt->repair_k = c->k; break;
    case FAM_DEVIATION: opt->repair_ratio = (float)c->ratio; break;
    case FAM_QUERY:
        opt->repair_ratio = (float)c->ratio;
        opt->repair_query = 1;
        break;
    default: break;
    }
}

/* Run one prompt under opt; ctx says what to force and keep. */
static rk_status run_prompt(rk_service *svc, const rk_split *p, const rk_req_options *opt,
                            run_ctx *ctx, run_out *out) {
    memset(out, 0, sizeof *out);
    rk_request r = {.opt = *opt};
    rk_status st = rk_request_prepare(svc, p, &r);
    if (st) return st;
    rk_pipeline_hooks h = {.ctx = ctx, .on_logits = keep_logits, .force_token = force};
    rk_request *one = &r;
    if (!(st = rk_pipeline_run(svc, &one, 1, &h))) {
        out->tokens = malloc((size_t)(r.n_out ? r.n_out : 1) * sizeof *out->tokens);
        out->chunk_lens = malloc((size_t)(r.n_chunks ? r.n_chunks : 1) * sizeof *out->chunk_lens);
        if (!out->tokens || !out->chunk_lens) {
            run_out_free(out);
            st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
        } else {
            memcpy(out->tokens, r.out_tokens, (size_t)r.n_out * sizeof *out->tokens);
            out->n_out = r.n_out;
            out->n_chunks = r.n_chunks;
            for (int k = 0; k < r.n_chunks; k++) {
                out->chunk_lens[k] = r.chunk_lens[k];
                out->chunk_tokens += r.chunk_lens[k];
            }
            out->recomputed = r.recomputed_tokens;
            out->prompt_tokens = r.prompt_tokens;
            out->total_ms = r.t.total_ms;
        }
    }
    rk_request_free(&r);
    return st;
}

/* ---------------------------------------------------------------- metrics */

/* One configuration on one prompt. */
typedef struct prompt_result {
    run_out forced, greedy;
    double *kl; /* (n_steps) */
    int *top1;  /* (n_steps) 1 = the config's argmax is the reference token */
    int *rank;  /* (n_steps) 1-based rank of the reference token */
    int agree;  /* greedy positions equal to the reference */
    int prefix; /* greedy tokens equal to the reference before the first difference */
} prompt_result;

typedef struct config_result {
    prompt_result *pr; /* (n_prompts) */
    double first_top1, mean_top1, mean_kl, first_kl, max_kl, mean_rank, greedy_agree, mean_prefix,
        recomputed_share, ms;
    long recomputed, prompt_tokens;
} config_result;

/* Compare the configuration's log-softmax at every step with the reference's. */
static void compare(const double *ref_logp, const int32_t *ref_tok, const double *logp, int steps,
                    int n_vocab, prompt_result *pr) {
    for (int s = 0; s < steps; s++) {
        const double *a = ref_logp + (size_t)s * n_vocab, *b = logp + (size_t)s * n_vocab;
        double kl = 0;
        int above = 0;
        for (int i = 0; i < n_vocab; i++) {
            if (a[i] > -INFINITY) kl += exp(a[i]) * (a[i] - b[i]);
            above += b[i] > b[ref_tok[s]];
        }
        /* Rounding can leave a tiny negative sum where the two agree. */
        pr->kl[s] = kl > 0 ? kl : 0;
        pr->rank[s] = above + 1;
        pr->top1[s] = above == 0;
    }
}

static void summarize(const eval_opts *o, int n_prompts, config_result *cr) {
    int N = o->n_tokens;
    double top1 = 0, kl = 0, rank = 0, agree = 0, prefix = 0, first = 0, first_kl = 0, ms = 0;
    cr->max_kl = 0;
    for (int j = 0; j < n_prompts; j++) {
        const prompt_result *pr = &cr->pr[j];
        first += pr->top1[0];
        first_kl += pr->kl[0];
        for (int s = 0; s < N; s++) {
            top1 += pr->top1[s];
            kl += pr->kl[s];
            rank += pr->rank[s];
            cr->max_kl = fmax(cr->max_kl, pr->kl[s]);
        }
        agree += (double)pr->agree / N;
        prefix += pr->prefix;
        ms += pr->greedy.total_ms;
        cr->recomputed += pr->greedy.recomputed;
        cr->prompt_tokens += pr->greedy.prompt_tokens;
    }
    double n = n_prompts, ns = (double)n_prompts * N;
    cr->first_top1 = first / n;
    cr->first_kl = first_kl / n;
    cr->mean_top1 = top1 / ns;
    cr->mean_kl = kl / ns;
    cr->mean_rank = rank / ns;
    cr->greedy_agree = agree / n;
    cr->mean_prefix = prefix / n;
    cr->ms = ms / n;
    cr->recomputed_share = cr->prompt_tokens ? (double)cr->recomputed / cr->prompt_tokens : 0;
}

/* ---------------------------------------------------------------- the evaluation */

/* A --task record: its pieces, accepted answers and type. */
typedef struct task_rec {
    rk_split p;
    char **answers; /* (n_answers) */
    int n_answers;
    int type; /* index into eval.type_names, -1 = none */
} task_rec;

/* One configuration over the --task records. */
typedef struct task_result {
    char **pred; /* (n_tasks) the answer as generated, cut at a newline */
    int *em;     /* (n_tasks) */
    double *f1;  /* (n_tasks) */
    double acc, f1_mean, type_acc[MAX_TYPES], type_f1[MAX_TYPES], share, ms;
    long recomputed, prompt_tokens;
} task_result;

typedef struct eval {
    eval_opts o;
    prompt_set ps;
    task_rec *tasks; /* (n_tasks) --task */
    int n_tasks, n_types;
    char type_names[MAX_TYPES][32];
    int type_count[MAX_TYPES];
    task_result *tres; /* (n_configs) --task */
    int bad_input;     /* --task: the records file was refused (exit 2) */
    char model_desc[96];
    int n_vocab;
    double *ref_logp;  /* (n_prompts, N, n_vocab) */
    run_out *ref;      /* (n_prompts) */
    double ref_ms;     /* mean total_ms of the reference runs */
    config_result *cr; /* (n_configs) */
} eval;

/* The service of the configurations, or with ref set the reference's. */
static rk_status open_service(const eval *e, int ref, rk_service **svc) {
    rk_config cfg = e->o.cfg;
    if (ref && e->o.ref_dtype[0]) snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "%s", e->o.ref_dtype);
    if (cfg.max_chunks < e->ps.max_chunks) cfg.max_chunks = e->ps.max_chunks;
    rk_status st = rk_config_validate(&cfg);
    return st ? st : rk_service_open(&cfg, e->o.model, svc);
}

static rk_status run_reference(eval *e) {
    int N = e->o.n_tokens, P = e->ps.n;
    rk_service *svc;
    rk_status st = open_service(e, 1, &svc);
    if (st) return st;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    e->n_vocab = hp->n_vocab;
    const char *base = e->o.model ? strrchr(e->o.model, '/') : NULL;
    snprintf(e->model_desc, sizeof e->model_desc, "%s",
             !e->o.model ? "ragkv tiny (embedded)"
             : base      ? base + 1
                         : e->o.model);
    e->ref_logp = malloc((size_t)P * N * e->n_vocab * sizeof *e->ref_logp);
    e->ref = calloc((size_t)P, sizeof *e->ref);
    if (!e->ref_logp || !e->ref) st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    eval_config plain = {.fam = FAM_PLAIN};
    rk_req_options opt;
    config_options(&plain, N, e->o.context, &opt);
    double ms = 0;
    for (int j = 0; j < P && !st; j++) {
        run_ctx ctx = {
            .n_steps = N, .n_vocab = e->n_vocab, .logp = e->ref_logp + (size_t)j * N * e->n_vocab};
        st = run_prompt(svc, &e->ps.p[j], &opt, &ctx, &e->ref[j]);
        if (!st && e->ref[j].n_out != N)
            st = rk_errorf(RK_ERR_INTERNAL, "eval: prompt %d gave %d tokens, not %d", j + 1,
                           e->ref[j].n_out, N);
        ms += st ? 0 : e->ref[j].total_ms;
    }
    e->ref_ms = ms / P;
    rk_service_close(svc);
    return st;
}

static rk_status run_config(eval *e, int ci) {
    int N = e->o.n_tokens, P = e->ps.n, V = e->n_vocab;
    config_result *cr = &e->cr[ci];
    cr->pr = calloc((size_t)P, sizeof *cr->pr);
    double *logp = malloc((size_t)N * V * sizeof *logp);
    if (!cr->pr || !logp) {
        free(logp);
        return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    }
    rk_service *svc;
    rk_status st = open_service(e, 0, &svc);
    if (st) {
        free(logp);
        return st;
    }
    rk_req_options opt;
    config_options(&e->o.configs[ci], N, e->o.context, &opt);
    for (int j = 0; j < P && !st; j++) {
        prompt_result *pr = &cr->pr[j];
        const int32_t *ref_tok = e->ref[j].tokens;
        pr->kl = calloc((size_t)N, sizeof *pr->kl);
        pr->top1 = calloc((size_t)N, sizeof *pr->top1);
        pr->rank = calloc((size_t)N, sizeof *pr->rank);
        if (!pr->kl || !pr->top1 || !pr->rank) {
            st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
            break;
        }
        run_ctx forced = {.force = ref_tok, .n_steps = N, .n_vocab = V, .logp = logp};
        run_ctx free_run = {.n_steps = N, .n_vocab = V};
        if ((st = run_prompt(svc, &e->ps.p[j], &opt, &forced, &pr->forced)) ||
            (st = run_prompt(svc, &e->ps.p[j], &opt, &free_run, &pr->greedy)))
            break;
        if (pr->forced.n_out != N || pr->greedy.n_out != N) {
            st = rk_errorf(RK_ERR_INTERNAL, "eval: %s gave fewer than %d tokens",
                           e->o.configs[ci].name, N);
            break;
        }
        compare(e->ref_logp + (size_t)j * N * V, ref_tok, logp, N, V, pr);
        while (pr->prefix < N && pr->greedy.tokens[pr->prefix] == ref_tok[pr->prefix]) pr->prefix++;
        for (int s = 0; s < N; s++) pr->agree += pr->greedy.tokens[s] == ref_tok[s];
    }
    rk_service_close(svc);
    free(logp);
    if (!st) summarize(&e->o, P, cr);
    return st;
}

static void task_rec_free(task_rec *t);

static void eval_free(eval *e) {
    for (int ci = 0; e->cr && ci < e->o.n_configs; ci++) {
        for (int j = 0; e->cr[ci].pr && j < e->ps.n; j++) {
            prompt_result *pr = &e->cr[ci].pr[j];
            run_out_free(&pr->forced);
            run_out_free(&pr->greedy);
            free(pr->kl);
            free(pr->top1);
            free(pr->rank);
        }
        free(e->cr[ci].pr);
    }
    free(e->cr);
    for (int j = 0; e->ref && j < e->ps.n; j++) run_out_free(&e->ref[j]);
    free(e->ref);
    free(e->ref_logp);
    prompt_set_free(&e->ps);
    for (int ci = 0; e->tres && ci < e->o.n_configs; ci++) {
        for (int j = 0; e->tres[ci].pred && j < e->n_tasks; j++) free(e->tres[ci].pred[j]);
        free(e->tres[ci].pred);
        free(e->tres[ci].em);
        free(e->tres[ci].f1);
    }
    free(e->tres);
    for (int j = 0; j < e->n_tasks; j++) task_rec_free(&e->tasks[j]);
    free(e->tasks);
}

/* ---------------------------------------------------------------- --task */

static void task_rec_free(task_rec *t) {
    rk_split_free(&t->p);
    for (int i = 0; i < t->n_answers; i++) free(t->answers[i]);
    free(t->answers);
    memset(t, 0, sizeof *t);
}

/* The answers of a record: "answers" (a string or an array of strings) or
 * "answer". */
static rk_status task_answers(json_t *o, const char *path, int line, task_rec *t) {
    json_t *a = json_object_get(o, "answers");
    if (!a) a = json_object_get(o, "answer");
    size_t n = json_is_array(a) ? json_array_size(a) : json_is_string(a) ? 1 : 0;
    if (n == 0)
        return rk_errorf(RK_ERR_INVALID,
                         "%s:%d: want \"answers\" (a string or a non-empty array of strings) or "
                         "\"answer\"",
                         path, line);
    t->answers = calloc(n, sizeof *t->answers);
    if (!t->answers) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_is_array(a) ? json_array_get(a, i) : a;
        if (!json_is_string(v))
            return rk_errorf(RK_ERR_INVALID, "%s:%d: answer %zu is not a string", path, line, i);
        if (!(t->answers[i] = strdup(json_string_value(v))))
            return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
        t->n_answers++;
    }
    return RK_OK;
}

/* A LongBench context cut into chunks: at sep, or every n_tok tokens of tok
 * (each piece decoded back to text). *out: malloc'ed strings. */
static rk_status cut_context(const char *ctx, const char *sep, int n_tok, const rk_tokenizer *tok,
                             char ***out, int *n_out) {
    char **c = NULL;
    int n = 0, cap = 0;
    rk_status st = RK_OK;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (!sep && (st = rk_tokenizer_encode(tok, ctx, strlen(ctx), 0, &ids, &n_ids))) return st;
    const char *p = ctx;
    for (size_t at = 0; !st;) {
        char *piece = NULL;
        size_t len;
        if (sep) {
            const char *q = strstr(p, sep);
            len = q ? (size_t)(q - p) : strlen(p);
            piece = strndup(p, len);
            if (!piece) st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
            p = q ? q + strlen(sep) : NULL;
        } else {
            if (at >= n_ids) break;
            size_t m = n_ids - at < (size_t)n_tok ? n_ids - at : (size_t)n_tok;
            st = rk_tokenizer_decode(tok, ids + at, m, 0, 0, &piece, &len);
            at += m;
        }
        if (!st && n == cap) {
            cap = cap ? 2 * cap : 16;
            char **nc = realloc(c, (size_t)cap * sizeof *nc);
            if (!nc)
                st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
            else
                c = nc;
        }
        if (st) {
            free(piece);
            break;
        }
        c[n++] = piece;
        if (sep && !p) break;
    }
    free(ids);
    if (st) {
        for (int i = 0; i < n; i++) free(c[i]);
        free(c);
        return st;
    }
    *out = c;
    *n_out = n;
    return RK_OK;
}

/* One --task line: the structured form, or LongBench's (input, context cut
 * into chunks, no system prompt). */
static rk_status task_line(eval *e, json_t *o, const char *path, int line, const rk_tokenizer *tok,
                           task_rec *t) {
    memset(t, 0, sizeof *t);
    t->type = -1;
    rk_status st = task_answers(o, path, line, t);
    json_t *in = json_object_get(o, "input"), *ctx = json_object_get(o, "context");
    if (!st && json_is_string(in) && json_is_string(ctx)) {
        if (!e->o.chunk_tokens && !e->o.chunk_sep[0])
            st = rk_errorf(RK_ERR_INVALID,
                           "%s:%d: a LongBench record (input, context) needs --chunk-tokens N or "
                           "--chunk-sep STR to cut its context into chunks",
                           path, line);
        char **c = NULL;
        int n = 0;
        if (!st)
            st = cut_context(json_string_value(ctx), e->o.chunk_sep[0] ? e->o.chunk_sep : NULL,
                             e->o.chunk_tokens, tok, &c, &n);
        if (!st)
            st = rk_split_structured(NULL, (const char *const *)c, n, json_string_value(in),
                                     SPLIT_CHUNKS, &t->p);
        for (int i = 0; i < n; i++) free(c[i]);
        free(c);
    } else if (!st) {
        st = parse_line(o, path, line, &t->p);
    }
    json_t *type = json_object_get(o, "type");
    if (!st && type && !json_is_string(type))
        st = rk_errorf(RK_ERR_INVALID, "%s:%d: \"type\" must be a string", path, line);
    if (!st && type) {
        const char *name = json_string_value(type);
        int k = 0;
        while (k < e->n_types && strcmp(e->type_names[k], name)) k++;
        if (k == MAX_TYPES || strlen(name) >= sizeof e->type_names[0])
            st = rk_errorf(RK_ERR_LIMIT, "%s:%d: at most %d types of up to 31 bytes", path, line,
                           MAX_TYPES);
        else {
            if (k == e->n_types) snprintf(e->type_names[e->n_types++], 32, "%s", name);
            t->type = k;
            e->type_count[k]++;
        }
    }
    if (st) task_rec_free(t);
    return st;
}

typedef struct task_loader {
    eval *e;
    const rk_tokenizer *tok;
    int cap;
} task_loader;

static rk_status add_task(json_t *o, const char *path, int line, void *ctx) {
    task_loader *l = ctx;
    eval *e = l->e;
    rk_status st = grow_for((void **)&e->tasks, &l->cap, e->n_tasks, sizeof *e->tasks);
    if (!st && !(st = task_line(e, o, path, line, l->tok, &e->tasks[e->n_tasks]))) {
        int nc = e->tasks[e->n_tasks].p.n_chunks;
        if (nc > e->ps.max_chunks) e->ps.max_chunks = nc;
        e->n_tasks++;
    }
    return st;
}

static rk_status load_tasks(eval *e, const rk_tokenizer *tok) {
    task_loader l = {e, tok, 0};
    rk_status st = each_json_line(e->o.task, add_task, &l);
    if (!st && e->n_tasks == 0) st = rk_errorf(RK_ERR_INVALID, "%s: no records", e->o.task);
    return st;
}

/* Score one generated answer against a record's answers: the best over them. */
static rk_status score_answer(const task_rec *t, const char *pred, int *em, double *f1) {
    *em = 0;
    *f1 = 0;
    for (int i = 0; i < t->n_answers; i++) {
        int x = rk_score_exact(pred, t->answers[i]);
        double y = rk_score_f1(pred, t->answers[i]);
        if (x < 0 || y < 0) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory scoring");
        *em = x > *em ? x : *em;
        *f1 = y > *f1 ? y : *f1;
    }
    return RK_OK;
}

/* Every record under configuration ci on a fresh service: a first run
 * computes (and caches) its chunks, the second, measured one answers. */
static rk_status run_task_config(eval *e, int ci) {
    const eval_config *c = &e->o.configs[ci];
    task_result *tr = &e->tres[ci];
    int P = e->n_tasks;
    tr->pred = calloc((size_t)P, sizeof *tr->pred);
    tr->em = calloc((size_t)P, sizeof *tr->em);
    tr->f1 = calloc((size_t)P, sizeof *tr->f1);
    if (!tr->pred || !tr->em || !tr->f1) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    rk_service *svc;
    rk_status st = open_service(e, 0, &svc);
    if (st) return st;
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int V = rk_model_hparams(svc->model)->n_vocab;
    rk_req_options opt;
    config_options(c, e->o.n_tokens, e->o.context, &opt);
    opt.stop_at_eog = 1;
    double ms = 0, em_t[MAX_TYPES] = {0}, f1_t[MAX_TYPES] = {0}, em = 0, f1 = 0;
    for (int j = 0; j < P && !st; j++) {
        const task_rec *t = &e->tasks[j];
        run_ctx ctx = {.n_steps = e->o.n_tokens, .n_vocab = V};
        run_out warm, out;
        if (c->fam != FAM_PLAIN) {
            if ((st = run_prompt(svc, &t->p, &opt, &ctx, &warm))) break;
            run_out_free(&warm);
        }
        if ((st = run_prompt(svc, &t->p, &opt, &ctx, &out))) break;
        size_t len;
        st = rk_tokenizer_decode(tok, out.tokens, (size_t)out.n_out, 0, 1, &tr->pred[j], &len);
        if (!st) {
            char *nl = strchr(tr->pred[j], '\n');
            if (nl) *nl = '\0';
            st = score_answer(t, tr->pred[j], &tr->em[j], &tr->f1[j]);
        }
        if (!st) {
            em += tr->em[j];
            f1 += tr->f1[j];
            if (t->type >= 0) {
                em_t[t->type] += tr->em[j];
                f1_t[t->type] += tr->f1[j];
            }
            ms += out.total_ms;
            tr->recomputed += out.recomputed;
            tr->prompt_tokens += out.prompt_tokens;
        }
        run_out_free(&out);
    }
    rk_service_close(svc);
    tr->acc = em / P;
    tr->f1_mean = f1 / P;
    for (int k = 0; k < e->n_types; k++) {
        tr->type_acc[k] = em_t[k] / e->type_count[k];
        tr->type_f1[k] = f1_t[k] / e->type_count[k];
    }
    tr->ms = ms / P;
    tr->share = tr->prompt_tokens ? (double)tr->recomputed / tr->prompt_tokens : 0;
    return st;
}

static void print_task_table(const eval *e) {
    printf("ragkv eval --task: %s, %d records, up to %d tokens each (stop at a newline or the end "
           "of generation); exact match (EM) and F1, LongBench-normalised\n",
           e->model_desc, e->n_tasks, e->o.n_tokens);
    printf("%-16s %8s %8s", "config", "EM %", "F1 %");
    for (int k = 0; k < e->n_types; k++) {
        char h[48];
        snprintf(h, sizeof h, "%.20s EM %%", e->type_names[k]);
        printf(" %12s", h);
    }
    printf(" %12s %10s\n", "recomputed %", "ms/request");
    for (int ci = 0; ci < e->o.n_configs; ci++) {
        const task_result *t = &e->tres[ci];
        printf("%-16s %8.2f %8.2f", e->o.configs[ci].name, 100 * t->acc, 100 * t->f1_mean);
        for (int k = 0; k < e->n_types; k++) printf(" %12.2f", 100 * t->type_acc[k]);
        printf(" %12.2f %10.2f\n", 100 * t->share, t->ms);
    }
    if (e->n_types) printf("types: ");
    for (int k = 0; k < e->n_types; k++)
        printf("%s %d%s", e->type_names[k], e->type_count[k], k + 1 < e->n_types ? ", " : "\n");
}

static json_t *task_json(const eval *e) {
    json_t *root = json_pack("{s:s, s:s, s:i, s:i, s:s}", "model", e->model_desc, "task", e->o.task,
                             "records", e->n_tasks, "tokens", e->o.n_tokens, "scoring",
                             "LongBench normalised exact match and token F1, best over answers");
    json_t *types = json_array(), *configs = json_array();
    if (!root || !types || !configs) {
        json_decref(types);
        json_decref(configs);
        json_decref(root);
        return NULL;
    }
    json_object_set_new(root, "types", types);
    json_object_set_new(root, "configs", configs);
    for (int k = 0; k < e->n_types; k++)
        json_array_append_new(
            types, json_pack("{s:s, s:i}", "name", e->type_names[k], "records", e->type_count[k]));
    for (int ci = 0; ci < e->o.n_configs; ci++) {
        const eval_config *c = &e->o.configs[ci];
        const task_result *t = &e->tres[ci];
        json_t *per_type = json_object(), *answers = json_array();
        for (int k = 0; per_type && k < e->n_types; k++)
            json_object_set_new(per_type, e->type_names[k],
                                json_pack("{s:f, s:f, s:i}", "exact_match", t->type_acc[k], "f1",
                                          t->type_f1[k], "records", e->type_count[k]));
        for (int j = 0; answers && j < e->n_tasks; j++)
            json_array_append_new(answers, json_pack("{s:s, s:i, s:f}", "prediction", t->pred[j],
                                                     "exact_match", t->em[j], "f1", t->f1[j]));
        json_t *x = json_pack(
            "{s:s, s:s, s:f, s:f, s:f, s:o, s:f, s:I, s:I, s:f, s:o}", "name", c->name, "family",
            k_family_names[c->fam], "param", c->fam == FAM_FIRST_K ? (double)c->k : c->ratio,
            "exact_match", t->acc, "f1", t->f1_mean, "per_type", per_type, "recomputed_share",
            t->share, "recomputed_tokens", (json_int_t)t->recomputed, "prompt_tokens",
            (json_int_t)t->prompt_tokens, "ms_per_request", t->ms, "answers", answers);
        if (!x) {
            json_decref(root);
            return NULL;
        }
        json_array_append_new(configs, x);
    }
    return root;
}

/* --calibrate: the cheapest configuration (least recomputed share, then
 * least time) whose exact match, overall and for every type, is within
 * max_loss points of plain's; written with what it was chosen from. */
static rk_status write_calibration(const eval *e, rk_service *svc) {
    const eval_opts *o = &e->o;
    int plain = -1, best = -1;
    for (int ci = 0; ci < o->n_configs; ci++)
        if (o->configs[ci].fam == FAM_PLAIN) plain = ci;
    const task_result *p = &e->tres[plain];
    json_t *cands = json_array();
    for (int ci = 0; ci < o->n_configs; ci++) {
        if (o->configs[ci].fam == FAM_PLAIN) continue;
        const task_result *t = &e->tres[ci];
        double loss = 100 * (p->acc - t->acc);
        int ok = loss <= o->max_loss + 1e-9;
        for (int k = 0; k < e->n_types; k++)
            ok &= 100 * (p->type_acc[k] - t->type_acc[k]) <= o->max_loss + 1e-9;
        json_array_append_new(cands,
                              json_pack("{s:s, s:f, s:f, s:f, s:b}", "name", o->configs[ci].name,
                                        "exact_match", t->acc, "recomputed_share", t->share,
                                        "ms_per_request", t->ms, "within_budget", ok));
        if (ok && (best < 0 || t->share < e->tres[best].share ||
                   (t->share == e->tres[best].share && t->ms < e->tres[best].ms)))
            best = ci;
    }
    if (best < 0) {
        json_decref(cands);
        return rk_errorf(RK_ERR_NOT_FOUND,
                         "--calibrate: no configuration is within %.2f points of plain (%.2f %% "
                         "exact match); nothing written",
                         o->max_loss, 100 * p->acc);
    }
    json_t *root = json_pack(
        "{s:i, s:s, s:s, s:s, s:s, s:i, s:f, s:f, s:{s:s, s:f, s:f, s:f}, s:o}",
        "ragkv_repair_calibration", 1, "policy", o->configs[best].name, "model", e->model_desc,
        "model_fingerprint", rk_model_fingerprint(svc->model), "task", o->task, "records",
        e->n_tasks, "max_loss_points", o->max_loss, "plain_exact_match", p->acc, "chosen", "name",
        o->configs[best].name, "exact_match", e->tres[best].acc, "recomputed_share",
        e->tres[best].share, "ms_per_request", e->tres[best].ms, "candidates", cands);
    if (!root) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    int bad = json_dump_file(root, o->calibrate, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    json_decref(root);
    if (bad) return rk_errorf(RK_ERR_IO, "%s: cannot write the calibration", o->calibrate);
    fprintf(stderr,
            "ragkv eval: calibration: %s (%.2f %% exact match against plain's %.2f %%, "
            "%.2f %% recomputed) written to %s\n",
            o->configs[best].name, 100 * e->tres[best].acc, 100 * p->acc, 100 * e->tres[best].share,
            o->calibrate);
    return RK_OK;
}

/* The whole --task evaluation; the output as the options ask. */
static rk_status run_task(eval *e) {
    rk_service *svc;
    rk_status st = open_service(e, 0, &svc);
    if (st) return st;
    const char *base = e->o.model ? strrchr(e->o.model, '/') : NULL;
    snprintf(e->model_desc, sizeof e->model_desc, "%s",
             !e->o.model ? "ragkv tiny (embedded)"
             : base      ? base + 1
                         : e->o.model);
    if ((st = load_tasks(e, rk_model_tokenizer(svc->model)))) {
        e->bad_input = 1;
    } else {
        e->tres = calloc((size_t)e->o.n_configs, sizeof *e->tres);
        if (!e->tres) st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    }
    for (int ci = 0; ci < e->o.n_configs && !st; ci++) st = run_task_config(e, ci);
    if (!st && e->o.calibrate) st = write_calibration(e, svc);
    rk_service_close(svc);
    return st;
}

/* ---------------------------------------------------------------- the held-out set */

/* Generate text from BOS alone with the model, sampled at temperature 1. */
static rk_status generate(rk_service *svc, unsigned long seed, int n_tokens, char **out) {
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int32_t bos = rk_tokenizer_bos(tok);
    int32_t sys[1] = {bos};
    rk_request r = {0};
    rk_req_options_default(&r.opt);
    r.opt.max_tokens = n_tokens;
    r.opt.prefix_cache = 0;
    r.opt.sampling.seed = seed;
    rk_status st = rk_request_prepare_tokens(svc, sys, bos >= 0, NULL, 0, &r);
    if (st) return st;
    rk_request *one = &r;
    size_t len;
    if (!(st = rk_pipeline_run(svc, &one, 1, NULL)))
        st = rk_tokenizer_decode(tok, r.out_tokens, (size_t)r.n_out, 0, 1, out, &len);
    rk_request_free(&r);
    return st;
}

/* The held-out set: prompt i has 2 + (i mod 3) chunks, chunk c a generation
 * of 48 + 16 ((i + c) mod 4) tokens with seed S * 1000003 + 16 i + c, and a
 * question: the first 6 + (i mod 5) tokens of the generation with seed
 * S * 1000003 + 16 i + 15. Generations stop at the end of a story. */
static rk_status make_set(const eval_opts *o) {
    rk_service *svc;
    rk_config cfg = o->cfg;
    rk_status st = rk_config_validate(&cfg);
    if (st || (st = rk_service_open(&cfg, o->model, &svc))) return st;
    FILE *f = fopen(o->make_set, "w");
    if (!f) {
        rk_service_close(svc);
        return rk_errorf(RK_ERR_IO, "%s: %s", o->make_set, strerror(errno));
    }
    for (int i = 0; i < o->set_size && !st; i++) {
        unsigned long base = (unsigned long)o->seed * 1000003ul + 16ul * (unsigned long)i;
        int n_chunks = 2 + i % 3;
        json_t *chunks = json_array();
        char *text = NULL;
        for (int c = 0; c < n_chunks && !st; c++) {
            if (!(st = generate(svc, base + (unsigned long)c, 48 + 16 * ((i + c) % 4), &text))) {
                json_array_append_new(chunks, json_string(text));
                free(text);
            }
        }
        if (!st && !(st = generate(svc, base + 15, 6 + i % 5, &text))) {
            json_t *line =
                json_pack("{s:s, s:o, s:s}", "system", "", "chunks", chunks, "question", text);
            chunks = NULL; /* the line owns it */
            free(text);
            char *s = line ? json_dumps(line, JSON_COMPACT) : NULL;
            json_decref(line);
            if (!s || fprintf(f, "%s\n", s) < 0)
                st = rk_errorf(RK_ERR_IO, "%s: write failed", o->make_set);
            free(s);
        }
        json_decref(chunks);
    }
    if (fclose(f) && !st) st = rk_errorf(RK_ERR_IO, "%s: write failed", o->make_set);
    rk_service_close(svc);
    return st;
}

/* ---------------------------------------------------------------- output */

static void print_table(const eval *e) {
    const eval_opts *o = &e->o;
    printf("ragkv eval: %s, %d prompts, %d tokens each; reference: mode plain, greedy, %.2f "
           "ms/request\n",
           e->model_desc, e->ps.n, o->n_tokens, e->ref_ms);
    printf("%-16s %9s %9s %10s %9s %9s %9s %12s %10s\n", "config", "top1@1 %", "top1 %", "mean KL",
           "mean rank", "greedy %", "prefix", "recomputed %", "ms/request");
    for (int ci = 0; ci < o->n_configs; ci++) {
        const config_result *c = &e->cr[ci];
        printf("%-16s %9.2f %9.2f %10.3g %9.3f %9.2f %9.2f %12.2f %10.2f\n", o->configs[ci].name,
               100 * c->first_top1, 100 * c->mean_top1, c->mean_kl, c->mean_rank,
               100 * c->greedy_agree, c->mean_prefix, 100 * c->recomputed_share, c->ms);
    }
}

static json_t *int_array(const int32_t *a, const int *b, int n) {
    json_t *arr = json_array();
    for (int i = 0; arr && i < n; i++) json_array_append_new(arr, json_integer(a ? a[i] : b[i]));
    return arr;
}

static json_t *eval_json(const eval *e) {
    const eval_opts *o = &e->o;
    json_t *root = json_pack("{s:s, s:i, s:i, s:s, s:{s:f}}", "model", e->model_desc, "prompts",
                             e->ps.n, "tokens", o->n_tokens, "caches",
                             "fresh service (empty chunk and prefix caches) per configuration",
                             "reference", "ms_per_request", e->ref_ms);
    json_t *refs = json_array(), *configs = json_array();
    if (!root || !refs || !configs) goto fail;
    json_object_set_new(root, "reference_tokens", refs);
    json_object_set_new(root, "configs", configs);
    for (int j = 0; j < e->ps.n; j++)
        json_array_append_new(refs, int_array(e->ref[j].tokens, NULL, o->n_tokens));
    for (int ci = 0; ci < o->n_configs; ci++) {
        const eval_config *c = &o->configs[ci];
        const config_result *r = &e->cr[ci];
        json_t *per = json_array();
        json_t *x = json_pack(
            "{s:s, s:s, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:I, s:I, s:f, s:o}",
            "name", c->name, "family", k_family_names[c->fam], "first_top1", r->first_top1,
            "mean_top1", r->mean_top1, "mean_kl", r->mean_kl, "first_kl", r->first_kl, "max_kl",
            r->max_kl, "mean_rank", r->mean_rank, "greedy_agreement", r->greedy_agree,
            "mean_common_prefix", r->mean_prefix, "recomputed_share", r->recomputed_share,
            "ms_per_request", r->ms, "recomputed_tokens", (json_int_t)r->recomputed,
            "prompt_tokens", (json_int_t)r->prompt_tokens, "param",
            c->fam == FAM_FIRST_K ? (double)c->k : c->ratio, "per_prompt", per);
        if (!x) goto fail;
        json_array_append_new(configs, x);
        for (int j = 0; j < e->ps.n; j++) {
            const prompt_result *pr = &r->pr[j];
            json_t *kl = json_array();
            for (int s = 0; kl && s < o->n_tokens; s++)
                json_array_append_new(kl, json_real(pr->kl[s]));
            json_t *p =
                json_pack("{s:i, s:i, s:o, s:o, s:o, s:o, s:i, s:i}", "recomputed",
                          pr->greedy.recomputed, "prompt_tokens", pr->greedy.prompt_tokens,
                          "chunk_lens", int_array(NULL, pr->greedy.chunk_lens, pr->greedy.n_chunks),
                          "forced_tokens", int_array(pr->forced.tokens, NULL, o->n_tokens),
                          "greedy_tokens", int_array(pr->greedy.tokens, NULL, o->n_tokens), "kl",
                          kl, "agree", pr->agree, "common_prefix", pr->prefix);
            if (!p) goto fail;
            json_array_append_new(per, p);
        }
    }
    return root;
fail:
    json_decref(root);
    return NULL;
}

static int by_share(const void *a, const void *b) {
    const double *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

/* Quality against recomputed share: one colour per policy family, greedy
 * agreement solid, first-token top-1 dashed; `none` starts every family.
 * With --task: exact match overall solid, on the first record type (or F1
 * without types) dashed, plain's exact match a dotted line. */
static rk_status write_svg(const eval *e, const char *path) {
    const eval_opts *o = &e->o;
    int task = e->tres != NULL;
    double xs[MAX_CONFIGS], y1[MAX_CONFIGS], y2[MAX_CONFIGS], plain_y = -1;
    for (int ci = 0; ci < o->n_configs; ci++) {
        const task_result *t = task ? &e->tres[ci] : NULL;
        xs[ci] = task ? t->share : e->cr[ci].recomputed_share;
        y1[ci] = task ? t->acc : e->cr[ci].greedy_agree;
        y2[ci] = task ? (e->n_types ? t->type_acc[0] : t->f1_mean) : e->cr[ci].first_top1;
        if (task && o->configs[ci].fam == FAM_PLAIN) plain_y = t->acc;
    }
    char name1[48], name2[48];
    snprintf(name1, sizeof name1, "%s", task ? "exact match" : "greedy agreement");
    snprintf(name2, sizeof name2, "%.30s%s",
             !task        ? "first-token top-1"
             : e->n_types ? e->type_names[0]
                          : "F1",
             task && e->n_types ? " exact match" : "");
    FILE *f = fopen(path, "w");
    if (!f) return rk_errorf(RK_ERR_IO, "%s: %s", path, strerror(errno));
    const double W = 720, H = 480, l = 80, r = 690, top = 60, bottom = 400;
    double xmax = 0.1, ymin = 1;
    for (int ci = 0; ci < o->n_configs; ci++) {
        if (o->configs[ci].fam == FAM_PLAIN) continue;
        xmax = fmax(xmax, xs[ci]);
        ymin = fmin(ymin, fmin(y1[ci], y2[ci]));
    }
    if (plain_y >= 0) ymin = fmin(ymin, plain_y);
    xmax = ceil(xmax * 10 - 1e-9) / 10;
    ymin = floor(ymin * 10 - 1e-9) / 10;
    if (ymin >= 1) ymin = 0.9;
#define PX(v) (l + (v) / xmax * (r - l))
#define PY(v) (bottom - ((v)-ymin) / (1 - ymin) * (bottom - top))
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
            "viewBox=\"0 0 %.0f %.0f\" font-family=\"Helvetica, Arial, sans-serif\">\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            W, H, W, H);
    char title[200];
    snprintf(title, sizeof title, "ragkv eval: %s, %d %s, %d tokens", e->model_desc,
             task ? e->n_tasks : e->ps.n, task ? "records" : "prompts", o->n_tokens);
    rk_bench_svg_text(f, W / 2, 28, "middle", 15, title);
    fprintf(f,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#444\"/>\n",
            l, top, r - l, bottom - top);
    for (int q = 0; q <= 5; q++) {
        double xv = xmax * q / 5, yv = ymin + (1 - ymin) * q / 5;
        char lab[16];
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                PX(xv), top, PX(xv), bottom);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", l,
                PY(yv), r, PY(yv));
        snprintf(lab, sizeof lab, "%.0f", 100 * xv);
        rk_bench_svg_text(f, PX(xv), bottom + 18, "middle", 12, lab);
        snprintf(lab, sizeof lab, "%.0f", 100 * yv);
        rk_bench_svg_text(f, l - 6, PY(yv) + 4, "end", 12, lab);
    }
    rk_bench_svg_text(f, (l + r) / 2, bottom + 40, "middle", 13,
                      "recomputed chunk tokens (% of prompt tokens)");
    fprintf(f,
            "<text x=\"24\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\" "
            "transform=\"rotate(-90 24 %.1f)\">%s (%%)</text>\n",
            (top + bottom) / 2, (top + bottom) / 2,
            task ? "answer accuracy" : "agreement with full attention");
    static const char *const colors[N_FAMILIES] = {"#888", "#000", "#1f77b4", "#ff7f0e", "#2ca02c"};
    int legend = 0;
    if (plain_y >= 0) {
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-width=\"1.5\" stroke-dasharray=\"2,3\"/>\n",
                l, PY(plain_y), r, PY(plain_y), colors[FAM_PLAIN]);
        double ly = bottom - 16 - 18 * legend++;
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-width=\"1.5\" stroke-dasharray=\"2,3\"/>\n",
                r - 230, ly - 4, r - 200, ly - 4, colors[FAM_PLAIN]);
        rk_bench_svg_text(f, r - 194, ly, "start", 12, "plain: exact match");
    }
    double pts[MAX_CONFIGS + 1][3];
    for (family fam = FAM_FIRST_K; fam < N_FAMILIES; fam++) {
        int n = 0;
        for (int ci = 0; ci < o->n_configs; ci++)
            if (o->configs[ci].fam == fam || o->configs[ci].fam == FAM_NONE) {
                pts[n][0] = xs[ci];
                pts[n][1] = y1[ci];
                pts[n++][2] = y2[ci];
            }
        int own = 0;
        for (int ci = 0; ci < o->n_configs; ci++) own += o->configs[ci].fam == fam;
        if (!own) continue;
        qsort(pts, (size_t)n, sizeof pts[0], by_share);
        for (int m = 1; m <= 2; m++) {
            fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"",
                    colors[fam], m == 2 ? " stroke-dasharray=\"6,4\"" : "");
            for (int i = 0; i < n; i++) fprintf(f, "%.1f,%.1f ", PX(pts[i][0]), PY(pts[i][m]));
            fputs("\"/>\n", f);
            for (int i = 0; i < n; i++)
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", PX(pts[i][0]),
                        PY(pts[i][m]), colors[fam]);
            char lab[96];
            snprintf(lab, sizeof lab, "%s: %s", k_family_names[fam], m == 1 ? name1 : name2);
            double ly = bottom - 16 - 18 * legend++;
            fprintf(f,
                    "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                    "stroke-width=\"2\"%s/>\n",
                    r - 230, ly - 4, r - 200, ly - 4, colors[fam],
                    m == 2 ? " stroke-dasharray=\"6,4\"" : "");
            rk_bench_svg_text(f, r - 194, ly, "start", 12, lab);
        }
    }
#undef PX
#undef PY
    fputs("</svg>\n", f);
    int bad = ferror(f);
    if (fclose(f) || bad) return rk_errorf(RK_ERR_IO, "%s: write failed", path);
    return RK_OK;
}

/* ---------------------------------------------------------------- main */

int rk_eval_main(int argc, char **argv) {
    eval e;
    memset(&e, 0, sizeof e);
    int rc;
    if (parse_args(argc, argv, &e.o, &rc)) return rc;
    if (e.o.cfg.n_threads == 0) e.o.cfg.n_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    rk_status st;
    if (e.o.make_set) {
        if ((st = make_set(&e.o))) {
            fprintf(stderr, "ragkv eval: %s\n", rk_error_message());
            return EXIT_FAILURE;
        }
        return 0;
    }
    if (e.o.task) {
        if ((st = run_task(&e))) {
            fprintf(stderr, "ragkv eval: %s\n", rk_error_message());
            rc = e.bad_input ? EXIT_USAGE : EXIT_FAILURE;
            eval_free(&e);
            return rc;
        }
    } else if ((st = load_prompts(e.o.prompts, &e.ps))) {
        fprintf(stderr, "ragkv eval: %s\n", rk_error_message());
        return EXIT_USAGE;
    } else {
        e.cr = calloc((size_t)e.o.n_configs, sizeof *e.cr);
        if (!e.cr)
            st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
        else
            st = run_reference(&e);
        for (int ci = 0; ci < e.o.n_configs && !st; ci++) st = run_config(&e, ci);
    }
    rc = 0;
    if (st) {
        fprintf(stderr, "ragkv eval: %s\n", rk_error_message());
        rc = EXIT_FAILURE;
    } else if (e.o.json) {
        json_t *root = e.o.task ? task_json(&e) : eval_json(&e);
        char *s = root ? json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(8)) : NULL;
        json_decref(root);
        if (s)
            puts(s);
        else {
            fprintf(stderr, "ragkv eval: out of memory writing JSON\n");
            rc = EXIT_FAILURE;
        }
        free(s);
    } else if (e.o.task) {
        print_task_table(&e);
    } else {
        print_table(&e);
    }
    if (!st && e.o.plot && write_svg(&e, e.o.plot)) {
        fprintf(stderr, "ragkv eval: cannot write the plot: %s\n", rk_error_message());
        rc = EXIT_FAILURE;
    }
    eval_free(&e);
    return rc;
}
