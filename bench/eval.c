/* bench/eval.c — see eval.h.
 *
 * Layout: options and the --configs syntax; the prompt file; one request run
 * with its hooks; the service of a run and the evaluation's cleanup; the
 * held-out set generator; rk_eval_main. The reference runs and the metrics
 * are in eval_ref.c, the --task accuracy mode in eval_task.c, the table, the
 * JSON object and the SVG plot in eval_report.c; eval_internal.h holds what
 * they share.
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
#include "bench/eval_internal.h"
#include "engine/tokenizer.h"
#include "pipeline/pipeline.h"
#include "pipeline/split.h"

#define DEFAULT_CONFIGS                                                                            \
    "none,first_k:1,first_k:2,first_k:4,first_k:8,first_k:16,deviation:0.02,deviation:0.05,"       \
    "deviation:0.1,deviation:0.15,deviation:0.3"
#define DEFAULT_TASK_CONFIGS                                                                       \
    "plain,none,first_k:2,first_k:4,first_k:8,deviation:0.05,deviation:0.1,deviation:0.15,"        \
    "deviation:0.3,query:0.05,query:0.1,query:0.15,query:0.3"

/* ---------------------------------------------------------------- options */

const char *const rk_eval_family_names[N_FAMILIES] = {"plain", "none", "first_k", "deviation",
                                                      "query"};

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
    "                                        attends to most or that deviate most, in turn\n"
    "                        (--task default: " DEFAULT_TASK_CONFIGS ")\n"
    "  -n N                  tokens per request, 1 to 4096 (default: 24)\n";

#define E_OFF(m) offsetof(eval_opts, m)
#define E_STR(m) E_OFF(m), sizeof(((eval_opts *)0)->m)

static const rk_setting k_eval_settings[] = {
    {"model", "model", RK_SET_STR, E_STR(model_arg), 0, 0, 0, 0,
     "F.gguf  model file (default: the embedded `tiny` model)"},
    {"prompts", "prompts", RK_SET_STR, E_STR(prompts_arg), 0, 0, 0, 0,
     "FILE  JSON lines: {\"system\": S, \"chunks\": [C, ...], \"question\": Q}, "
     "{\"prompt\": \"system##chunk##...##question\"} or {\"segments\": [{\"text\": T}, "
     "{\"chunks\": [C, ...]}, ...]} (chunk groups anywhere, as a completion's segments)"},
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

static void prompt_set_free(prompt_set *s) {
    for (int i = 0; i < s->n; i++) rk_split_free(&s->p[i]);
    free(s->p);
    memset(s, 0, sizeof *s);
}

/* A line's "segments" (texts and chunk groups in order, as a completion
 * body's) into pieces. */
static rk_status parse_segments(json_t *segs, const char *path, int line, rk_split *out) {
    size_t n = json_array_size(segs), n_chunks = 0;
    for (size_t i = 0; i < n; i++)
        n_chunks += json_array_size(json_object_get(json_array_get(segs, i), "chunks"));
    rk_segment *list = calloc(n ? n : 1, sizeof *list);
    const char **c = calloc(n_chunks ? n_chunks : 1, sizeof *c);
    rk_status st = list && c ? RK_OK : rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    for (size_t i = 0, at = 0; i < n && !st; i++) {
        json_t *s = json_array_get(segs, i), *t = json_object_get(s, "text"),
               *ch = json_object_get(s, "chunks");
        if (json_is_string(t)) {
            list[i].text = json_string_value(t);
            continue;
        }
        if (!json_is_array(ch)) {
            st = rk_errorf(RK_ERR_INVALID, "%s:%d: segment %zu is not {\"text\"} or {\"chunks\"}",
                           path, line, i);
            break;
        }
        list[i].chunks = c + at;
        for (size_t k = 0; k < json_array_size(ch) && !st; k++, at++) {
            c[at] = json_string_value(json_array_get(ch, k));
            if (!c[at])
                st = rk_errorf(RK_ERR_INVALID, "%s:%d: segment %zu chunk %zu is not a string", path,
                               line, i, k);
            list[i].n_chunks++;
        }
    }
    if (!st) st = rk_split_segments(list, (int)n, SPLIT_CHUNKS, out);
    free(list);
    free(c);
    return st;
}

/* One JSON line into pieces; line is its 1-based number for messages. */
rk_status rk_eval_parse_line(json_t *o, const char *path, int line, rk_split *out) {
    json_t *prompt = json_object_get(o, "prompt"), *segs = json_object_get(o, "segments");
    if (json_is_string(prompt))
        return rk_split_prompt(json_string_value(prompt), json_string_length(prompt), "##",
                               SPLIT_CHUNKS, out);
    if (json_is_array(segs)) return parse_segments(segs, path, line, out);
    json_t *sys = json_object_get(o, "system"), *chunks = json_object_get(o, "chunks"),
           *q = json_object_get(o, "question");
    if (!json_is_string(q) || (sys && !json_is_string(sys)) || (chunks && !json_is_array(chunks)))
        return rk_errorf(RK_ERR_INVALID,
                         "%s:%d: want {\"prompt\": ...}, {\"segments\": [...]} or {\"system\": "
                         "..., \"chunks\": [...], \"question\": ...}",
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
rk_status rk_eval_each_json_line(const char *path,
                                 rk_status (*each)(json_t *o, const char *path, int line,
                                                   void *ctx),
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
rk_status rk_eval_grow_for(void **arr, int *cap, int n, size_t size) {
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
    rk_status st = rk_eval_grow_for((void **)&s->p, &l->cap, s->n, sizeof *s->p);
    if (!st && !(st = rk_eval_parse_line(o, path, line, &s->p[s->n]))) {
        if (s->p[s->n].n_chunks > s->max_chunks) s->max_chunks = s->p[s->n].n_chunks;
        s->n++;
    }
    return st;
}

static rk_status load_prompts(const char *path, prompt_set *s) {
    memset(s, 0, sizeof *s);
    prompt_loader l = {s, 0};
    rk_status st = rk_eval_each_json_line(path, add_prompt, &l);
    if (!st && s->n == 0) st = rk_errorf(RK_ERR_INVALID, "%s: no prompts", path);
    if (st) prompt_set_free(s);
    return st;
}

/* ---------------------------------------------------------------- one run */

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

void rk_eval_run_out_free(run_out *o) {
    free(o->tokens);
    free(o->chunk_lens);
    memset(o, 0, sizeof *o);
}

void rk_eval_config_options(const eval_config *c, int n_tokens, rk_chunk_context context,
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
rk_status rk_eval_run_prompt(rk_service *svc, const rk_split *p, const rk_req_options *opt,
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
            rk_eval_run_out_free(out);
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

/* ---------------------------------------------------------------- the evaluation */

/* The service of the configurations, or with ref set the reference's. */
rk_status rk_eval_open_service(const eval *e, int ref, rk_service **svc) {
    rk_config cfg = e->o.cfg;
    if (ref && e->o.ref_dtype[0]) snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "%s", e->o.ref_dtype);
    if (cfg.max_chunks < e->ps.max_chunks) cfg.max_chunks = e->ps.max_chunks;
    rk_status st = rk_config_validate(&cfg);
    return st ? st : rk_service_open(&cfg, e->o.model, svc);
}

static void eval_free(eval *e) {
    for (int ci = 0; e->cr && ci < e->o.n_configs; ci++) {
        for (int j = 0; e->cr[ci].pr && j < e->ps.n; j++) {
            prompt_result *pr = &e->cr[ci].pr[j];
            rk_eval_run_out_free(&pr->forced);
            rk_eval_run_out_free(&pr->greedy);
            free(pr->kl);
            free(pr->top1);
            free(pr->rank);
        }
        free(e->cr[ci].pr);
    }
    free(e->cr);
    for (int j = 0; e->ref && j < e->ps.n; j++) rk_eval_run_out_free(&e->ref[j]);
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
    for (int j = 0; j < e->n_tasks; j++) rk_eval_task_rec_free(&e->tasks[j]);
    free(e->tasks);
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
        if ((st = rk_eval_run_task(&e))) {
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
            st = rk_eval_run_reference(&e);
        for (int ci = 0; ci < e.o.n_configs && !st; ci++) st = rk_eval_run_config(&e, ci);
    }
    rc = 0;
    if (st) {
        fprintf(stderr, "ragkv eval: %s\n", rk_error_message());
        rc = EXIT_FAILURE;
    } else if (e.o.json) {
        json_t *root = e.o.task ? rk_eval_task_json(&e) : rk_eval_json(&e);
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
        rk_eval_print_task_table(&e);
    } else {
        rk_eval_print_table(&e);
    }
    if (!st && e.o.plot && rk_eval_write_svg(&e, e.o.plot)) {
        fprintf(stderr, "ragkv eval: cannot write the plot: %s\n", rk_error_message());
        rc = EXIT_FAILURE;
    }
    eval_free(&e);
    return rc;
}
