/* bench/bench.c — see bench.h: options, the helpers the runners share, and
 * rk_bench_main. The other files are listed in bench_internal.h. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_internal.h"

/* ---------------------------------------------------------------- options */

int rk_bench_usage_error(const char *cmd, const char *fmt, const char *arg) {
    fprintf(stderr, "ragkv %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see ragkv %s --help)\n", cmd);
    return EXIT_USAGE;
}

#define B_OFF(m) offsetof(bench_opts, m)

/* bench's own settings; the model options are rk_run_opts's (config/settings.c). */
static const rk_setting k_bench_settings[] = {
    {"corpus", "corpus", RK_SET_INT, B_OFF(corpus), 0, 1, 1000000, 0, 0,
     "N  chunks in the corpus (default: 200)"},
    {"k", "k", RK_SET_INT, B_OFF(k), 0, 1, 4096, 0, 0, "K  chunks per request (default: 6)"},
    {"zipf", "zipf", RK_SET_DOUBLE, B_OFF(zipf), 0, 0, 10, 0, 0,
     "S  Zipf exponent of chunk popularity (default: 1.1)"},
    {"question_tokens", "question-tokens", RK_SET_INT, B_OFF(question_tokens), 0, 1, 1 << 20, 0, 0,
     "N  question length in tokens (default: 32)"},
    {"system_tokens", "system-tokens", RK_SET_INT, B_OFF(system_tokens), 0, 1, 1 << 20, 0, 0,
     "N  system prompt length in tokens (default: 64)"},
    {"systems", "systems", RK_SET_INT, B_OFF(n_systems), 0, 1, 1000, 0, 0,
     "N  distinct system prompts (default: 3)"},
    {"requests", "requests", RK_SET_INT, B_OFF(requests), 0, 1, 10000000, 0, 0,
     "N  requests per mode (default: 300)"},
    {"concurrency", "concurrency", RK_SET_INT, B_OFF(concurrency), 0, 1, 4096, 0, 0,
     "C  in-process: requests per pipeline batch; HTTP: client threads (default: 1)"},
    {"arrival_rate", "arrival-rate", RK_SET_DOUBLE, B_OFF(arrival_rate), 0, 0.001, 1e6, 0, 0,
     "R  open loop: Poisson arrivals at R requests/s (HTTP: up to 64 in flight; in-process: "
     "through the engine thread, batches of up to 16)"},
    {"turns", "turns", RK_SET_INT, B_OFF(turns), 0, 1, RK_BENCH_MAX_TURNS, 0, 0,
     "N  each request is a conversation of N turns (HTTP: over /v1/chat/completions)"},
    {"prewarm", "prewarm", RK_SET_BOOL, B_OFF(prewarm), 0, 0, 1, 0, 0,
     "  compute every corpus chunk before the rag run (timed apart)"},
    {"steady", "steady", RK_SET_INT, B_OFF(steady_pct), 0, 0, 99, 0, 0,
     "PCT  steady state excludes the first PCT% of requests (default: 20)"},
    {"baseline_every", "baseline-every", RK_SET_INT, B_OFF(baseline_every), 0, 1, 1000000, 0, 0,
     "K  plain, prefix and oracle run only every K-th request (default: 1)"},
    {"seed", "seed", RK_SET_LONG, B_OFF(seed), 0, 0, 0x7fffffffffffffffLL, 0, 0,
     "S  workload seed (default: 1)"},
    {"json", "json", RK_SET_BOOL, B_OFF(json), 0, 0, 1, 0, 0,
     "  print one JSON object instead of the table"},
    {"progress", "progress", RK_SET_BOOL, B_OFF(progress), 0, 0, 1, 0, 0,
     "  progress lines on stderr even when it is not a terminal"},
    {"http_timeout", "http-timeout", RK_SET_DOUBLE, B_OFF(http_timeout_s), 0, 0.001, 86400, 0, 0,
     "S  seconds to wait for one HTTP response (default: 600)"},
};

static int parse_range(const char *s, int *lo, int *hi) {
    char buf[64];
    const char *colon = strchr(s, ':');
    if (!colon || (size_t)(colon - s) >= sizeof buf) return -1;
    memcpy(buf, s, (size_t)(colon - s));
    buf[colon - s] = '\0';
    long a, b;
    if (rk_parse_long(buf, 1, 1 << 20, &a) || rk_parse_long(colon + 1, 1, 1 << 20, &b) || a > b)
        return -1;
    *lo = (int)a;
    *hi = (int)b;
    return 0;
}

static int parse_modes(const char *s, bench_opts *o) {
    o->n_modes = 0;
    const char *p = s;
    while (*p) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        int found = -1;
        for (int m = 0; m < N_RAGKV_MODES; m++)
            if (strlen(k_mode_names[m]) == n && !strncmp(p, k_mode_names[m], n)) found = m;
        if (found < 0) return -1;
        for (int i = 0; i < o->n_modes; i++)
            if (o->modes[i] == found) return -1;
        o->modes[o->n_modes++] = found;
        if (!comma) break;
        p = comma + 1;
    }
    return o->n_modes > 0 ? 0 : -1;
}

static const char *k_help =
    "usage: ragkv bench [options]\n"
    "Run a seeded RAG workload (a Zipf-popular corpus of chunks, k chunks and a question per\n"
    "request) once per mode over the same request list, each mode from empty caches, and\n"
    "compare TTFT: plain (full prefill), prefix (system prompt cached), rag (chunk cache),\n"
    "oracle (chunk cache off, chunks fresh at their positions). Without --kv-memory-mb the\n"
    "pools are sized so the whole working set fits. With --baseline-every K the baselines'\n"
    "TTFT, which depends on the request alone, is sampled in 1/K of the time.\n"
    "  --chunk-tokens MIN:MAX  chunk length in tokens, uniform (default: 256:512)\n"
    "  --max-tokens N|MIN:MAX  tokens generated per request, uniform per request (default: 1:\n"
    "                          TTFT is the target); with 2 or more, TPOT is reported\n"
    "  --modes LIST            comma-separated from plain,prefix,rag,oracle\n"
    "                          (default: plain,prefix,rag)\n"
    "  --plot FILE.svg         write the TTFT distributions and the rag hit rate as SVG\n"
    "  --url http://127.0.0.1:PORT   drive a running `ragkv serve` instead (loopback only;\n"
    "                          --model then only gives the tokenizer that sizes the workload);\n"
    "                          a comma-separated list of up to 8 drives replicas, request j\n"
    "                          (and its turns) going to the (j mod N)-th\n"
    "  --peer-url http://127.0.0.1:PORT   also run the workload against another OpenAI-\n"
    "                          compatible server (llama-server, vLLM): plain /v1/completions\n"
    "                          requests, pieces joined by newlines; its row is labelled peer\n"
    "In-process, --turns appends each answer and the next question to the question piece\n"
    "(the server renders its chat template instead), and does not go with --arrival-rate.\n";

enum { O_CHUNK_TOKENS = 1, O_MODES, O_PLOT, O_URL, O_MAX_TOKENS, O_PEER_URL };

static const struct option k_bench_extra[] = {
    {"chunk-tokens", required_argument, 0, O_CHUNK_TOKENS},
    {"modes", required_argument, 0, O_MODES},
    {"plot", required_argument, 0, O_PLOT},
    {"url", required_argument, 0, O_URL},
    {"max-tokens", required_argument, 0, O_MAX_TOKENS},
    {"peer-url", required_argument, 0, O_PEER_URL},
    {0, 0, 0, 0}};

/* The options a settings table does not express: a range, a list, free text. */
static rk_status bench_extra(void *ctx, int val, const char *arg) {
    bench_opts *o = ctx;
    switch (val) {
    case O_CHUNK_TOKENS:
        if (parse_range(arg, &o->chunk_min, &o->chunk_max))
            return rk_errorf(RK_ERR_INVALID, "bad --chunk-tokens '%s' (want MIN:MAX, e.g. 256:512)",
                             arg);
        return RK_OK;
    case O_MODES:
        if (parse_modes(arg, o))
            return rk_errorf(RK_ERR_INVALID,
                             "bad --modes '%s' (distinct names from plain,prefix,rag,oracle)", arg);
        return RK_OK;
    case O_PLOT: o->plot = arg; return RK_OK;
    case O_URL: o->url = arg; return RK_OK;
    case O_PEER_URL: o->peer_url = arg; return RK_OK;
    case O_MAX_TOKENS: {
        long n;
        if (!strchr(arg, ':') && !rk_parse_long(arg, 1, 1 << 20, &n)) {
            o->max_min = o->max_max = (int)n;
            return RK_OK;
        }
        if (parse_range(arg, &o->max_min, &o->max_max))
            return rk_errorf(RK_ERR_INVALID,
                             "bad --max-tokens '%s' (want N or MIN:MAX, e.g. 16:64)", arg);
        return RK_OK;
    }
    }
    return rk_errorf(RK_ERR_INVALID, "unknown option");
}

/* Parse argv into o; returns 0, or -1 to exit with *out_exit (0 after --help). */
static int parse_args(int argc, char **argv, bench_opts *o, int *out_exit) {
    memset(o, 0, sizeof *o);
    rk_run_opts_defaults(&o->run);
    int kv_mb_default = o->run.cfg.kv_memory_mb;
    o->run.cfg.kv_memory_mb = 0; /* below its range: still 0 after parsing = not given */
    o->corpus = 200;
    o->k = 6;
    o->zipf = 1.1;
    o->chunk_min = 256;
    o->chunk_max = 512;
    o->question_tokens = 32;
    o->system_tokens = 64;
    o->n_systems = 3;
    o->requests = 300;
    o->concurrency = 1;
    o->max_min = o->max_max = 1;
    o->turns = 1;
    o->seed = 1;
    o->steady_pct = 20;
    o->baseline_every = 1;
    o->http_timeout_s = 600;
    parse_modes("plain,prefix,rag", o);
    rk_settings own = {k_bench_settings, sizeof k_bench_settings / sizeof k_bench_settings[0], o};
    rk_cmdline cl = {
        .cmd = "bench", .usage = k_help, .extra = k_bench_extra, .on_extra = bench_extra, .ctx = o};
    if (rk_run_parse(&cl, &o->run, &own, 1, argc, argv, out_exit)) return -1;
    o->kv_mb_given = o->run.cfg.kv_memory_mb != 0;
    if (!o->kv_mb_given) o->run.cfg.kv_memory_mb = kv_mb_default;
    o->model = o->run.model[0] ? o->run.model : NULL;
    *out_exit = EXIT_USAGE;
    if (rk_run_opts_apply(&o->run))
        return rk_bench_usage_error("bench", "%s", rk_error_message()), -1;
    if (o->k > o->corpus)
        return rk_bench_usage_error("bench", "%s", "--k is larger than --corpus"), -1;
    if (o->turns > 1 && o->arrival_rate > 0 && !o->url)
        return rk_bench_usage_error("bench", "%s",
                                    "in-process, --turns and --arrival-rate do not go together"),
               -1;
    if (o->peer_url) o->modes[o->n_modes++] = MODE_PEER;
    return 0;
}

void rk_bench_add_failure(mode_result *m, const char *fmt, ...) {
    if (m->n_fail >= MAX_FAILURES) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->fail[m->n_fail++], sizeof m->fail[0], fmt, ap);
    va_end(ap);
}

void rk_bench_add_warning(bench *b, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "ragkv bench: warning: %s\n", msg);
    if (b->n_warnings < 8) snprintf(b->warnings[b->n_warnings++], sizeof b->warnings[0], "%s", msg);
}

/* ---------------------------------------------------------------- memory */

/* Reset this process's RSS high-water mark (Linux >= 4.0); 1 on success. */
int rk_bench_hwm_reset(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return 0;
    int ok = fputs("5", f) >= 0;
    ok = (fclose(f) == 0) && ok;
    return ok;
}

/* The number after "field:" in a /proc file (kB there), or -1. */
static long proc_kb(const char *path, const char *field) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    size_t n = strlen(field);
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') kb = strtol(line + n + 1, NULL, 10);
    fclose(f);
    return kb;
}

/* VmHWM of this process in kB, or -1. */
long rk_bench_hwm_read(void) { return proc_kb("/proc/self/status", "VmHWM"); }

long rk_bench_mem_available_kb(void) { return proc_kb("/proc/meminfo", "MemAvailable"); }

/* ---------------------------------------------------------------- request options */

void rk_bench_mode_options(const bench_opts *o, int mode, rk_req_options *opt) {
    rk_req_options_default(opt);
    opt->max_tokens = o->max_max;
    opt->sampling.temperature = 0; /* greedy: every mode does the same work */
    opt->sampling.seed = o->seed;
    opt->stop_at_eog = 0;
    /* Each mode measures its own cache (the prefix cache: system prompts
     * only); a conversation's later turns are meant to reuse earlier ones. */
    opt->reuse_sequences = o->turns > 1;
    switch (mode) {
    case MODE_PLAIN:
        opt->mode = RK_MODE_PLAIN;
        opt->prefix_cache = 0;
        break;
    case MODE_PREFIX:
        opt->mode = RK_MODE_PLAIN;
        opt->prefix_cache = 1;
        break;
    case MODE_RAG: break;
    case MODE_ORACLE: opt->chunk_cache = 0; break;
    }
}

/* ---------------------------------------------------------------- progress */

static void progress_line(const bench *b, int mode, int done, double elapsed) {
    const mode_result *m = &b->res[mode];
    long hits = 0, lookups = 0;
    for (int i = 0; i < done; i++) {
        const req_result *x = &m->req[m->run[i]];
        hits += x->hits;
        lookups += x->hits + x->misses;
    }
    fprintf(stderr, "bench: %-6s %6d/%d requests, %8.1f s", k_mode_names[mode], done, m->n_run,
            elapsed);
    if (lookups) fprintf(stderr, ", chunk hit rate %.3f", (double)hits / lookups);
    fputc('\n', stderr);
}

void rk_bench_maybe_progress(const bench *b, int mode, int before, int after, double t0) {
    if (!b->progress) return;
    int n = b->res[mode].n_run, step = n / 20 > 0 ? n / 20 : 1;
    if (after / step != before / step || after == n)
        progress_line(b, mode, after, rk_time_now() - t0);
}

/* ---------------------------------------------------------------- main */

/* --url's comma-separated list of replicas into t (RK_BENCH_MAX_REPLICAS at
 * most). */
static rk_status parse_urls(const char *list, double timeout_s, rk_http_target *t, int *out_n) {
    char one[512];
    *out_n = 0;
    for (const char *p = list;; p++) {
        size_t len = strcspn(p, ",");
        if (*out_n == RK_BENCH_MAX_REPLICAS)
            return rk_errorf(RK_ERR_INVALID, "--url names more than %d replicas",
                             RK_BENCH_MAX_REPLICAS);
        if (len == 0 || len >= sizeof one)
            return rk_errorf(RK_ERR_INVALID, "bad --url list '%.200s'", list);
        memcpy(one, p, len);
        one[len] = '\0';
        rk_status st = rk_http_parse_url(one, timeout_s, &t[(*out_n)++]);
        if (st) return st;
        p += len;
        if (!*p) return RK_OK;
    }
}

/* Wait while the server at t answers 503 (loading its model), up to the HTTP
 * timeout; anything but a final 200 from /ready is an error. A server
 * without /ready (404: the reference engine) is asked /health instead. */
static rk_status wait_ready(const rk_http_target *t, const char *url, double timeout_s) {
    int status = 0;
    double t_wait = rk_time_now();
    rk_status st;
    const char *path = "/ready";
    for (;;) {
        char *body = NULL;
        st = rk_http_request(t, "GET", path, NULL, 0, &status, &body);
        free(body);
        if (!st && status == 404 && !strcmp(path, "/ready")) {
            path = "/health";
            continue;
        }
        if (st || status != 503 || rk_time_now() - t_wait > timeout_s) break;
        usleep(100000);
    }
    if (!st && status != 200) st = rk_errorf(RK_ERR_IO, "%s%s answered %d", url, path, status);
    return st;
}

/* Each mode's results, and the requests it runs (see --baseline-every). */
static rk_status alloc_results(bench *b) {
    for (int i = 0; i < N_MODES; i++) {
        mode_result *m = &b->res[i];
        m->mode = i;
        m->vmhwm_kb = -1;
        m->req = calloc((size_t)b->w.n_req, sizeof *m->req);
        m->run = calloc((size_t)b->w.n_req, sizeof *m->run);
        m->turn = calloc((size_t)b->w.n_req * (size_t)b->w.n_followups + 1, sizeof *m->turn);
        if (!m->req || !m->run || !m->turn) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
        int every = i == MODE_RAG || i == MODE_PEER ? 1 : b->o.baseline_every;
        for (int j = 0; j < b->w.n_req; j += every) m->run[m->n_run++] = j;
    }
    return RK_OK;
}

/* The table or JSON object, and the plot, of a finished run; the exit status:
 * 1 when an invariant failed. */
static int report(bench *b, int http) {
    const bench_opts *o = &b->o;
    const mode_result *rag = &b->res[MODE_RAG], *plain = &b->res[MODE_PLAIN];
    if (rag->ran && plain->ran && !(rk_bench_ratio(plain->ttft[0], rag->ttft[0]) > 1))
        rk_bench_add_failure(&b->res[MODE_RAG],
                             "rag is not faster than plain (TTFT p50 %.3f vs %.3f ms)",
                             rag->ttft[0], plain->ttft[0]);
    int all_ok = 1;
    for (int i = 0; i < o->n_modes; i++) all_ok &= b->res[o->modes[i]].n_fail == 0;
    if (o->json) {
        json_t *root = rk_bench_json(b, http, all_ok);
        char *s = root ? json_dumps(root, JSON_INDENT(2) | JSON_REAL_PRECISION(6)) : NULL;
        json_decref(root);
        if (s) {
            puts(s);
            free(s);
        } else {
            fprintf(stderr, "ragkv bench: out of memory writing JSON\n");
            all_ok = 0;
        }
    } else {
        rk_bench_print_table(b, http);
    }
    if (o->plot && rk_bench_write_svg(b, o->plot, http)) {
        fprintf(stderr, "ragkv bench: cannot write the plot: %s\n", rk_error_message());
        all_ok = 0;
    }
    if (!all_ok && o->json)
        for (int i = 0; i < o->n_modes; i++)
            for (int f = 0; f < b->res[o->modes[i]].n_fail; f++)
                fprintf(stderr, "ragkv bench: invariant failed (%s): %s\n",
                        k_mode_names[o->modes[i]], b->res[o->modes[i]].fail[f]);
    return all_ok ? 0 : EXIT_FAILURE;
}

int rk_bench_main(int argc, char **argv) {
    bench *b = calloc(1, sizeof *b);
    if (!b) {
        fprintf(stderr, "ragkv bench: out of memory\n");
        return EXIT_FAILURE;
    }
    int rc;
    if (parse_args(argc, argv, &b->o, &rc)) {
        free(b);
        return rc;
    }
    bench_opts *o = &b->o;
    int http = o->url != NULL, n_targets = 0;
    rk_http_target targets[RK_BENCH_MAX_REPLICAS], peer;
    rk_status st = RK_OK;
    textgen g = {0};
    b->model_name = o->model ? o->model : "embedded";
    snprintf(b->model_desc, sizeof b->model_desc, "%s", o->model ? "" : "ragkv tiny");
    b->progress = o->progress || isatty(STDERR_FILENO);
    if (o->run.cfg.n_threads == 0) o->run.cfg.n_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if ((http && (st = parse_urls(o->url, o->http_timeout_s, targets, &n_targets))) ||
        (o->peer_url && (st = rk_http_parse_url(o->peer_url, o->http_timeout_s, &peer)))) {
        fprintf(stderr, "ragkv bench: %s\n", rk_error_message());
        free(b);
        return EXIT_USAGE;
    }
    double t_gen = rk_time_now();
    if ((st = rk_bench_textgen_init(o->model, &g)) ||
        (st = rk_bench_workload_build(o, &g, &b->w))) {
        fprintf(stderr, "ragkv bench: cannot build the workload: %s\n", rk_error_message());
        rk_bench_textgen_free(&g);
        free(b);
        return EXIT_FAILURE;
    }
    rk_bench_textgen_free(&g);
    if (b->progress)
        fprintf(stderr,
                "bench: workload of %d requests over %d chunks (%ld tokens) built in %.1f s\n",
                b->w.n_req, b->w.n_chunks, b->w.corpus_tokens, rk_time_now() - t_gen);
    b->steady_from = (int)((long)b->w.n_req * o->steady_pct / 100);
    if (b->steady_from >= b->w.n_req) b->steady_from = 0;
    st = alloc_results(b);
    for (int i = 0; i < n_targets && !st; i++)
        st = wait_ready(&targets[i], o->url, o->http_timeout_s);
    if (!st && http) rk_bench_http_describe_model(b, &targets[0]);
    if (!st && o->peer_url) st = wait_ready(&peer, o->peer_url, o->http_timeout_s);
    for (int i = 0; i < o->n_modes && !st; i++) {
        int mode = o->modes[i];
        st = mode == MODE_PEER ? rk_bench_run_http(b, &peer, 1, mode)
             : http            ? rk_bench_run_http(b, targets, n_targets, mode)
                               : rk_bench_run_inproc(b, mode);
        if (st) break;
        rk_bench_summarize(b, mode);
        rk_bench_check_invariants(b, mode, http);
    }
    if (st) {
        fprintf(stderr, "ragkv bench: %s\n", rk_error_message());
        rc = EXIT_FAILURE;
    } else {
        rc = report(b, http);
    }
    for (int i = 0; i < N_MODES; i++) {
        free(b->res[i].req);
        free(b->res[i].run);
        free(b->res[i].turn);
    }
    rk_bench_workload_free(&b->w);
    free(b);
    return rc;
}
