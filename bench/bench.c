/* bench/bench.c — see bench.h.
 *
 * Layout of this file: options; the workload generator (text from the
 * vocabulary, Zipf requests, the hit-rate prediction); the in-process and
 * HTTP runners; summaries and invariants; the table, the JSON object and the
 * SVG plot; rk_bench_main.
 *
 * The hit-rate prediction. Chunk i (rank i = 1..N) has popularity
 * w_i = i^-s / H. A request draws k distinct chunks by successive sampling
 * (draw from w, redraw duplicates), so chunk i is in a given request with
 * probability q_i, for which Rosén's approximation of successive sampling is
 * used: q_i = 1 - exp(-t w_i), t solving sum_i q_i = k. With an unbounded cache
 * a lookup of chunk i in request j hits when chunk i was in one of the b_j
 * requests of earlier batches (b_j = j - 1 at concurrency 1), so the expected
 * per-lookup hit probability of request j is
 *
 *     p_j = sum_i (q_i / k) (1 - (1 - q_i)^b_j)
 *
 * and p, the predicted chunk hit rate, is the mean of p_j over the requests
 * (or over the steady-state ones). Treating a request's k lookups as
 * independent, a request has at least one hit with probability 1 - (1 - p)^k,
 * printed next to the measured fraction. With --prewarm, p = 1. */
#include "bench/bench.h"

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "pipeline/pipeline.h"
#include "pipeline/split.h"

#define EXIT_USAGE    2
#define MAX_FAILURES  16
#define PREWARM_GROUP 16 /* chunks per pre-warm request */

enum { MODE_PLAIN, MODE_PREFIX, MODE_RAG, MODE_ORACLE, N_MODES };
static const char *const k_mode_names[N_MODES] = {"plain", "prefix", "rag", "oracle"};

/* ---------------------------------------------------------------- options */

typedef struct bench_opts {
    const char *model; /* NULL = the embedded model */
    rk_config cfg;
    int kv_mb_given;
    int corpus, k;
    double zipf;
    int chunk_min, chunk_max;
    int question_tokens, system_tokens, n_systems;
    int requests, concurrency, max_tokens;
    int modes[N_MODES], n_modes;
    int prewarm;
    uint64_t seed;
    int json;
    const char *plot;
    const char *url;
    int steady_pct;
    int baseline_every; /* plain, prefix and oracle run every K-th request */
    double http_timeout_s;
    int progress; /* 1 = progress lines even when stderr is not a terminal */
} bench_opts;

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "ragkv bench: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see ragkv bench --help)\n");
    return EXIT_USAGE;
}

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
        for (int m = 0; m < N_MODES; m++)
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
    "oracle (chunk cache off, chunks fresh at their positions).\n"
    "  --model F.gguf          model file (default: the embedded `tiny` model)\n"
    "  --corpus N              chunks in the corpus (default: 200)\n"
    "  --k K                   chunks per request (default: 6)\n"
    "  --zipf S                Zipf exponent of chunk popularity (default: 1.1)\n"
    "  --chunk-tokens MIN:MAX  chunk length in tokens, uniform (default: 256:512)\n"
    "  --question-tokens N     question length in tokens (default: 32)\n"
    "  --system-tokens N       system prompt length in tokens (default: 64)\n"
    "  --systems N             distinct system prompts (default: 3)\n"
    "  --requests N            requests per mode (default: 300)\n"
    "  --concurrency C         in-process: requests per pipeline batch; HTTP: client threads\n"
    "                          (default: 1)\n"
    "  --max-tokens N          tokens generated per request (default: 1: TTFT is the target)\n"
    "  --modes LIST            comma-separated from plain,prefix,rag,oracle\n"
    "                          (default: plain,prefix,rag)\n"
    "  --prewarm               compute every corpus chunk before the rag run (timed apart)\n"
    "  --steady PCT            steady state excludes the first PCT% of requests (default: 20)\n"
    "  --baseline-every K      plain, prefix and oracle run only every K-th request of the list\n"
    "                          (rag runs all): their TTFT depends on the request alone (and the\n"
    "                          cached system prompt), so the sample gives the same percentiles\n"
    "                          in 1/K of the time (default: 1, every request)\n"
    "  --seed S                workload seed (default: 1)\n"
    "  --json                  print one JSON object instead of the table\n"
    "  --progress              a progress line per 5% of requests on stderr even when it is\n"
    "                          not a terminal (on a terminal they are always shown)\n"
    "  --plot FILE.svg         write the TTFT distributions and the rag hit rate as SVG\n"
    "  --url http://127.0.0.1:PORT   drive a running `ragkv serve` instead (loopback only;\n"
    "                          --model then only gives the tokenizer that sizes the workload)\n"
    "  --http-timeout S        seconds to wait for one HTTP response (default: 600)\n"
    "  --threads N             compute threads (default: one per core)\n"
    "  --backend cpu|cuda      compute backend (default: cpu)\n"
    "  --kv-memory-mb N        KV budget in MiB split by the default shares (default: pools\n"
    "                          sized so the whole working set fits)\n"
    "  --block-size N          tokens per KV block (default: 16)\n"
    "  --kv-dtype f32|f16|bf16 KV cache storage (default: f32)\n"
    "  --log-level L           debug|info|warn|error (default: warn)\n";

enum {
    O_MODEL = 1000,
    O_THREADS,
    O_BACKEND,
    O_KV_MB,
    O_BLOCK,
    O_LOG,
    O_CORPUS,
    O_K,
    O_ZIPF,
    O_CHUNK_TOKENS,
    O_QUESTION_TOKENS,
    O_SYSTEM_TOKENS,
    O_SYSTEMS,
    O_REQUESTS,
    O_CONCURRENCY,
    O_MAX_TOKENS,
    O_MODES,
    O_PREWARM,
    O_STEADY,
    O_SEED,
    O_JSON,
    O_PLOT,
    O_URL,
    O_HTTP_TIMEOUT,
    O_PROGRESS,
    O_BASELINE_EVERY,
    O_KV_DTYPE,
};

/* Parse argv into o; returns 0, EXIT_USAGE on a bad option, or -1 after --help. */
static int parse_args(int argc, char **argv, bench_opts *o) {
    memset(o, 0, sizeof *o);
    rk_config_defaults(&o->cfg);
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
    o->max_tokens = 1;
    o->seed = 1;
    o->steady_pct = 20;
    o->baseline_every = 1;
    o->http_timeout_s = 600;
    parse_modes("plain,prefix,rag", o);
    struct option longs[] = {{"model", required_argument, 0, O_MODEL},
                             {"threads", required_argument, 0, O_THREADS},
                             {"backend", required_argument, 0, O_BACKEND},
                             {"kv-memory-mb", required_argument, 0, O_KV_MB},
                             {"block-size", required_argument, 0, O_BLOCK},
                             {"log-level", required_argument, 0, O_LOG},
                             {"corpus", required_argument, 0, O_CORPUS},
                             {"k", required_argument, 0, O_K},
                             {"zipf", required_argument, 0, O_ZIPF},
                             {"chunk-tokens", required_argument, 0, O_CHUNK_TOKENS},
                             {"question-tokens", required_argument, 0, O_QUESTION_TOKENS},
                             {"system-tokens", required_argument, 0, O_SYSTEM_TOKENS},
                             {"systems", required_argument, 0, O_SYSTEMS},
                             {"requests", required_argument, 0, O_REQUESTS},
                             {"concurrency", required_argument, 0, O_CONCURRENCY},
                             {"max-tokens", required_argument, 0, O_MAX_TOKENS},
                             {"modes", required_argument, 0, O_MODES},
                             {"prewarm", no_argument, 0, O_PREWARM},
                             {"steady", required_argument, 0, O_STEADY},
                             {"seed", required_argument, 0, O_SEED},
                             {"json", no_argument, 0, O_JSON},
                             {"plot", required_argument, 0, O_PLOT},
                             {"url", required_argument, 0, O_URL},
                             {"http-timeout", required_argument, 0, O_HTTP_TIMEOUT},
                             {"progress", no_argument, 0, O_PROGRESS},
                             {"baseline-every", required_argument, 0, O_BASELINE_EVERY},
                             {"kv-dtype", required_argument, 0, O_KV_DTYPE},
                             {"help", no_argument, 0, 'h'},
                             {0, 0, 0, 0}};
    int c;
    long v;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        switch (c) {
        case 'h': fputs(k_help, stdout); return -1;
        case O_MODEL: o->model = optarg; break;
        case O_THREADS:
            if (rk_parse_long(optarg, 0, 1024, &v))
                return usage_error("bad --threads '%s'", optarg);
            o->cfg.n_threads = (int)v;
            break;
        case O_BACKEND: snprintf(o->cfg.backend, sizeof o->cfg.backend, "%s", optarg); break;
        case O_KV_MB:
            if (rk_parse_long(optarg, 1, 1 << 24, &v))
                return usage_error("bad --kv-memory-mb '%s'", optarg);
            o->cfg.kv_memory_mb = (int)v;
            o->kv_mb_given = 1;
            break;
        case O_BLOCK:
            if (rk_parse_long(optarg, 1, 1 << 20, &v))
                return usage_error("bad --block-size '%s'", optarg);
            o->cfg.block_size = (int)v;
            break;
        case O_LOG: {
            static const char *names[] = {"debug", "info", "warn", "error"};
            int found = 0;
            for (int i = 0; i < 4; i++)
                if (!strcmp(optarg, names[i])) {
                    rk_log_set_level((rk_log_level)i);
                    found = 1;
                }
            if (!found) return usage_error("bad --log-level '%s'", optarg);
            break;
        }
        case O_CORPUS:
            if (rk_parse_long(optarg, 1, 1000000, &v))
                return usage_error("bad --corpus '%s'", optarg);
            o->corpus = (int)v;
            break;
        case O_K:
            if (rk_parse_long(optarg, 1, 4096, &v)) return usage_error("bad --k '%s'", optarg);
            o->k = (int)v;
            break;
        case O_ZIPF:
            if (rk_parse_double(optarg, 0, 10, &o->zipf))
                return usage_error("bad --zipf '%s' (0 to 10)", optarg);
            break;
        case O_CHUNK_TOKENS:
            if (parse_range(optarg, &o->chunk_min, &o->chunk_max))
                return usage_error("bad --chunk-tokens '%s' (want MIN:MAX, e.g. 256:512)", optarg);
            break;
        case O_QUESTION_TOKENS:
            if (rk_parse_long(optarg, 1, 1 << 20, &v))
                return usage_error("bad --question-tokens '%s'", optarg);
            o->question_tokens = (int)v;
            break;
        case O_SYSTEM_TOKENS:
            if (rk_parse_long(optarg, 1, 1 << 20, &v))
                return usage_error("bad --system-tokens '%s'", optarg);
            o->system_tokens = (int)v;
            break;
        case O_SYSTEMS:
            if (rk_parse_long(optarg, 1, 1000, &v))
                return usage_error("bad --systems '%s'", optarg);
            o->n_systems = (int)v;
            break;
        case O_REQUESTS:
            if (rk_parse_long(optarg, 1, 10000000, &v))
                return usage_error("bad --requests '%s'", optarg);
            o->requests = (int)v;
            break;
        case O_CONCURRENCY:
            if (rk_parse_long(optarg, 1, 4096, &v))
                return usage_error("bad --concurrency '%s'", optarg);
            o->concurrency = (int)v;
            break;
        case O_MAX_TOKENS:
            if (rk_parse_long(optarg, 1, 1 << 20, &v))
                return usage_error("bad --max-tokens '%s' (at least 1)", optarg);
            o->max_tokens = (int)v;
            break;
        case O_MODES:
            if (parse_modes(optarg, o))
                return usage_error("bad --modes '%s' (distinct names from plain,prefix,rag,oracle)",
                                   optarg);
            break;
        case O_PREWARM: o->prewarm = 1; break;
        case O_STEADY:
            if (rk_parse_long(optarg, 0, 99, &v)) return usage_error("bad --steady '%s'", optarg);
            o->steady_pct = (int)v;
            break;
        case O_BASELINE_EVERY:
            if (rk_parse_long(optarg, 1, 1000000, &v))
                return usage_error("bad --baseline-every '%s'", optarg);
            o->baseline_every = (int)v;
            break;
        case O_KV_DTYPE: snprintf(o->cfg.kv_dtype, sizeof o->cfg.kv_dtype, "%s", optarg); break;
        case O_SEED:
            if (rk_parse_long(optarg, 0, 0x7fffffffffffffffL, &v))
                return usage_error("bad --seed '%s'", optarg);
            o->seed = (uint64_t)v;
            break;
        case O_JSON: o->json = 1; break;
        case O_PLOT: o->plot = optarg; break;
        case O_URL: o->url = optarg; break;
        case O_PROGRESS: o->progress = 1; break;
        case O_HTTP_TIMEOUT:
            if (rk_parse_double(optarg, 0.001, 86400, &o->http_timeout_s))
                return usage_error("bad --http-timeout '%s'", optarg);
            break;
        default: return usage_error("%s", "unknown option");
        }
    }
    if (optind < argc) return usage_error("unexpected argument '%s'", argv[optind]);
    if (o->k > o->corpus) return usage_error("%s", "--k is larger than --corpus");
    return 0;
}

/* ---------------------------------------------------------------- random numbers */

typedef struct rng {
    uint64_t s;
} rng;

/* splitmix64: one 64-bit state, good enough for a workload generator. */
static uint64_t rng_next(rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unit(rng *r) { return (double)(rng_next(r) >> 11) * 0x1.0p-53; }

static int rng_below(rng *r, int n) {
    int v = (int)(rng_unit(r) * n);
    return v < n ? v : n - 1;
}

/* ---------------------------------------------------------------- text generation */

/* The pieces text is made of: the decoded bytes of every normal token that
 * is printable ASCII without '#' or '\' (so no text holds a separator or an
 * escape, and any token boundary is a character boundary). */
typedef struct textgen {
    rk_tokenizer *tok;
    char *bytes; /* all pieces, back to back */
    int *offset; /* (n + 1) */
    int n;
} textgen;

static void textgen_free(textgen *g) {
    rk_tokenizer_free(g->tok);
    free(g->bytes);
    free(g->offset);
    memset(g, 0, sizeof *g);
}

static rk_status textgen_init(const char *model_path, textgen *g) {
    memset(g, 0, sizeof *g);
    rk_vocab v = {0};
    rk_gguf *gg = NULL;
    rk_status st;
    if (model_path) {
        if ((st = rk_gguf_open(model_path, &gg))) return st;
        st = rk_vocab_from_gguf(gg, &v);
        rk_gguf_close(gg);
    } else {
        st = rk_vocab_tiny(&v);
    }
    if (st) return st;
    if ((st = rk_tokenizer_create(&v, &g->tok))) goto done;
    size_t cap = 4096, len = 0;
    g->bytes = malloc(cap);
    g->offset = malloc(((size_t)v.n_tokens + 1) * sizeof *g->offset);
    if (!g->bytes || !g->offset) {
        st = rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
        goto done;
    }
    char buf[64];
    for (int32_t id = 0; id < v.n_tokens; id++) {
        if (v.token_types && v.token_types[id] != RK_TOKEN_NORMAL) continue;
        int n = rk_tokenizer_token_bytes(g->tok, id, 0, buf, (int)sizeof buf);
        if (n < 1 || n >= (int)sizeof buf) continue;
        int ok = 1;
        for (int i = 0; i < n && ok; i++)
            ok = buf[i] >= 0x20 && buf[i] <= 0x7e && buf[i] != '#' && buf[i] != '\\';
        if (!ok) continue;
        if (len + (size_t)n > cap) {
            char *nb = realloc(g->bytes, cap * 2);
            if (!nb) {
                st = rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
                goto done;
            }
            g->bytes = nb;
            cap *= 2;
        }
        g->offset[g->n++] = (int)len;
        memcpy(g->bytes + len, buf, (size_t)n);
        len += (size_t)n;
    }
    g->offset[g->n] = (int)len;
    if (g->n < 16)
        st = rk_errorf(
            RK_ERR_UNSUPPORTED,
            "bench: the vocabulary has only %d printable ASCII tokens to build text from", g->n);
done:
    rk_vocab_free(&v);
    if (st) textgen_free(g);
    return st;
}

typedef struct strbuf {
    char *s;
    size_t len, cap;
} strbuf;

static rk_status sb_append(strbuf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *ns = realloc(b->s, cap);
        if (!ns) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
        b->s = ns;
        b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
    return RK_OK;
}

/* Text of about target tokens: random pieces are appended until the text
 * encodes to at least target tokens, then the decoding of its first target
 * tokens (trimmed of surrounding spaces) is kept. *out_tokens is what the
 * kept text encodes to (re-tokenizing may merge across the cut). */
static rk_status gen_text(const textgen *g, rng *r, int target, char **out, int *out_tokens) {
    strbuf b = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    rk_status st = RK_OK;
    *out = NULL;
    for (int round = 0; round < 64; round++) {
        int add = (target - (int)n) + 4;
        for (int i = 0; i < add && !st; i++) {
            int t = rng_below(r, g->n);
            st = sb_append(&b, g->bytes + g->offset[t], (size_t)(g->offset[t + 1] - g->offset[t]));
        }
        free(ids);
        ids = NULL;
        if (st || (st = rk_tokenizer_encode(g->tok, b.s, b.len, 0, &ids, &n))) break;
        if ((int)n < target) continue;
        char *text;
        size_t len;
        if ((st = rk_tokenizer_decode(g->tok, ids, (size_t)target, 0, 0, &text, &len))) break;
        size_t a = 0;
        while (a < len && text[a] == ' ') a++;
        while (len > a && text[len - 1] == ' ') len--;
        memmove(text, text + a, len - a);
        text[len - a] = '\0';
        free(ids);
        ids = NULL;
        if ((st = rk_tokenizer_encode(g->tok, text, len - a, 0, &ids, &n))) {
            free(text);
            break;
        }
        free(ids);
        free(b.s);
        *out = text;
        *out_tokens = (int)n;
        return RK_OK;
    }
    free(ids);
    free(b.s);
    return st ? st : rk_errorf(RK_ERR_INTERNAL, "bench: could not build a %d-token text", target);
}

/* ---------------------------------------------------------------- the workload */

typedef struct workload {
    int n_chunks;
    char **chunk;   /* (n_chunks) chunk texts; chunk i has popularity rank i + 1 */
    int *chunk_tok; /* (n_chunks) their token counts */
    long corpus_tokens;
    int n_sys;
    char **sys; /* (n_sys) */
    int *sys_tok;
    int n_req, k;
    int *req_sys;    /* (n_req) */
    int *req_chunks; /* (n_req, k) */
    char **question; /* (n_req) */
    int *q_tok;
    char **prompt;  /* (n_req) system##chunk##...##question */
    double *weight; /* (n_chunks) Zipf popularity */
    double *incl;   /* (n_chunks) inclusion probability q_i */
    double *p_hit;  /* (n_req) predicted per-lookup hit probability of request j */
    long ideal_misses;
} workload;

static void workload_free(workload *w) {
    for (int i = 0; i < w->n_chunks && w->chunk; i++) free(w->chunk[i]);
    for (int i = 0; i < w->n_sys && w->sys; i++) free(w->sys[i]);
    for (int i = 0; i < w->n_req && w->question; i++) free(w->question[i]);
    for (int i = 0; i < w->n_req && w->prompt; i++) free(w->prompt[i]);
    free(w->chunk);
    free(w->chunk_tok);
    free(w->sys);
    free(w->sys_tok);
    free(w->req_sys);
    free(w->req_chunks);
    free(w->question);
    free(w->q_tok);
    free(w->prompt);
    free(w->weight);
    free(w->incl);
    free(w->p_hit);
    memset(w, 0, sizeof *w);
}

/* Rosén's approximation of successive-sampling inclusion probabilities:
 * q_i = 1 - exp(-t w_i) with sum q_i = k (bisection on t). */
static void inclusion_probabilities(const double *w, int n, int k, double *q) {
    if (k >= n) {
        for (int i = 0; i < n; i++) q[i] = 1;
        return;
    }
    double lo = 0, hi = 1;
    for (;;) {
        double s = 0;
        for (int i = 0; i < n; i++) s += 1 - exp(-hi * w[i]);
        if (s >= k || hi > 1e300) break;
        hi *= 2;
    }
    for (int it = 0; it < 200; it++) {
        double mid = 0.5 * (lo + hi), s = 0;
        for (int i = 0; i < n; i++) s += 1 - exp(-mid * w[i]);
        if (s < k)
            lo = mid;
        else
            hi = mid;
    }
    for (int i = 0; i < n; i++) q[i] = 1 - exp(-hi * w[i]);
}

static rk_status workload_build(const bench_opts *o, const textgen *g, workload *w) {
    memset(w, 0, sizeof *w);
    rng r = {.s = o->seed * 0x2545f4914f6cdd1dull + 17};
    int n = o->corpus, k = o->k, R = o->requests;
    w->n_chunks = n;
    w->n_sys = o->n_systems;
    w->n_req = R;
    w->k = k;
    w->chunk = calloc((size_t)n, sizeof *w->chunk);
    w->chunk_tok = calloc((size_t)n, sizeof *w->chunk_tok);
    w->sys = calloc((size_t)w->n_sys, sizeof *w->sys);
    w->sys_tok = calloc((size_t)w->n_sys, sizeof *w->sys_tok);
    w->req_sys = calloc((size_t)R, sizeof *w->req_sys);
    w->req_chunks = calloc((size_t)R * k, sizeof *w->req_chunks);
    w->question = calloc((size_t)R, sizeof *w->question);
    w->q_tok = calloc((size_t)R, sizeof *w->q_tok);
    w->prompt = calloc((size_t)R, sizeof *w->prompt);
    w->weight = calloc((size_t)n, sizeof *w->weight);
    w->incl = calloc((size_t)n, sizeof *w->incl);
    w->p_hit = calloc((size_t)R, sizeof *w->p_hit);
    double *cdf = calloc((size_t)n, sizeof *cdf);
    unsigned char *seen = calloc((size_t)n, 1);
    rk_status st = RK_OK;
    if (!w->chunk || !w->chunk_tok || !w->sys || !w->sys_tok || !w->req_sys || !w->req_chunks ||
        !w->question || !w->q_tok || !w->prompt || !w->weight || !w->incl || !w->p_hit || !cdf ||
        !seen) {
        st = rk_errorf(RK_ERR_NOMEM, "bench: out of memory for the workload");
        goto done;
    }
    /* The corpus, then the system prompts, then the requests: each from the one seeded stream. */
    for (int i = 0; i < n && !st; i++) {
        int target = o->chunk_min + rng_below(&r, o->chunk_max - o->chunk_min + 1);
        st = gen_text(g, &r, target, &w->chunk[i], &w->chunk_tok[i]);
        w->corpus_tokens += w->chunk_tok[i];
    }
    for (int i = 0; i < w->n_sys && !st; i++)
        st = gen_text(g, &r, o->system_tokens, &w->sys[i], &w->sys_tok[i]);
    if (st) goto done;
    double h = 0;
    for (int i = 0; i < n; i++) h += w->weight[i] = pow(i + 1.0, -o->zipf);
    double c = 0;
    for (int i = 0; i < n; i++) {
        w->weight[i] /= h;
        cdf[i] = c += w->weight[i];
    }
    for (int j = 0; j < R && !st; j++) {
        int *ch = w->req_chunks + (size_t)j * k;
        w->req_sys[j] = rng_below(&r, w->n_sys);
        /* k distinct chunks by successive sampling, then a random order. */
        for (int m = 0; m < k;) {
            double u = rng_unit(&r) * cdf[n - 1];
            int lo = 0, hi = n - 1;
            while (lo < hi) {
                int mid = (lo + hi) / 2;
                if (cdf[mid] > u)
                    hi = mid;
                else
                    lo = mid + 1;
            }
            int dup = 0;
            for (int q = 0; q < m; q++) dup |= ch[q] == lo;
            if (!dup) ch[m++] = lo;
        }
        for (int m = k - 1; m > 0; m--) {
            int q = rng_below(&r, m + 1), t = ch[m];
            ch[m] = ch[q];
            ch[q] = t;
        }
        if ((st = gen_text(g, &r, o->question_tokens, &w->question[j], &w->q_tok[j]))) break;
        strbuf b = {0};
        st = sb_append(&b, w->sys[w->req_sys[j]], strlen(w->sys[w->req_sys[j]]));
        for (int m = 0; m < k && !st; m++) {
            if (!(st = sb_append(&b, "##", 2)))
                st = sb_append(&b, w->chunk[ch[m]], strlen(w->chunk[ch[m]]));
        }
        if (!st && !(st = sb_append(&b, "##", 2)))
            st = sb_append(&b, w->question[j], strlen(w->question[j]));
        if (st) {
            free(b.s);
            break;
        }
        w->prompt[j] = b.s;
    }
    if (st) goto done;

    /* The prediction (see the top of this file) and the ideal miss count:
     * first uses of a chunk, batch by batch (a chunk first used by two
     * requests of one batch misses in both). */
    inclusion_probabilities(w->weight, n, k, w->incl);
    int C = o->concurrency;
    for (int j = 0; j < R; j++) {
        int before = j / C * C;
        double p = 0;
        for (int i = 0; i < n; i++) p += w->incl[i] / k * (1 - pow(1 - w->incl[i], before));
        w->p_hit[j] = o->prewarm ? 1.0 : p;
    }
    for (int j0 = 0; j0 < R; j0 += C) {
        int j1 = j0 + C < R ? j0 + C : R;
        for (int j = j0; j < j1; j++)
            for (int m = 0; m < k; m++) w->ideal_misses += !seen[w->req_chunks[(size_t)j * k + m]];
        for (int j = j0; j < j1; j++)
            for (int m = 0; m < k; m++) seen[w->req_chunks[(size_t)j * k + m]] = 1;
    }
    if (o->prewarm) w->ideal_misses = 0;
done:
    free(cdf);
    free(seen);
    if (st) workload_free(w);
    return st;
}

/* ---------------------------------------------------------------- results */

typedef struct req_result {
    int ok;
    double ttft_ms, e2e_ms;
    double server_total_ms; /* HTTP: the server's own total_ms */
    double prep_ms;         /* in-process: splitting and tokenizing the prompt */
    int prompt, reused, computed;
    int sys_tokens, sys_cached, chunk_tokens, hit_tokens, q_tokens;
    int n_chunks, hits, misses, offs;
} req_result;

typedef struct mode_result {
    int mode, ran;
    req_result *req; /* (n_req) */
    int *run, n_run; /* the requests this mode runs, in list order (see --baseline-every) */
    double wall_s;
    long vmhwm_kb; /* -1 when unknown */
    int hwm_reset; /* the high-water mark was reset before the mode */
    double kv_arena_mib;
    int pool_blocks[RK_POOL_COUNT];
    int have_index;
    rk_chunk_stats ix; /* chunk index counters over the measured run */
    int prewarmed, prewarm_chunks;
    long prewarm_tokens;
    double prewarm_s;
    /* summaries */
    int n_ok;
    double ttft[3], ttft_steady[3], ttft_mean, e2e[2], rps, prep_p50;
    int n_all_hit;           /* requests whose every chunk was a hit */
    double ttft_all_hit_p50; /* their TTFT p50 */
    double http_overhead_p50, http_overhead_mean;
    long prompt, reused, computed, hits, misses, lookups;
    double hit_rate, hit_rate_steady, req_hit, req_hit_steady;
    double pred_hit, pred_hit_steady, pred_req_hit, pred_req_hit_steady, ideal_hit;
    int n_fail;
    char fail[MAX_FAILURES][200];
    char error[256]; /* first runtime error */
} mode_result;

typedef struct bench {
    bench_opts o;
    workload w;
    const char *model_name;
    char model_desc[128];
    int n_layers, n_kv_heads, head_dim; /* in-process only */
    mode_result res[N_MODES];
    int steady_from; /* first steady-state request index */
    char warnings[8][256];
    int n_warnings;
    int progress;
} bench;

static void add_failure(mode_result *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_failure(mode_result *m, const char *fmt, ...) {
    if (m->n_fail >= MAX_FAILURES) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->fail[m->n_fail++], sizeof m->fail[0], fmt, ap);
    va_end(ap);
}

static void add_warning(bench *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_warning(bench *b, const char *fmt, ...) {
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
static int hwm_reset(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return 0;
    int ok = fputs("5", f) >= 0;
    ok = (fclose(f) == 0) && ok;
    return ok;
}

/* VmHWM of this process in kB, or -1. */
static long hwm_read(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = strtol(line + 6, NULL, 10);
    fclose(f);
    return kb;
}

static long mem_available_kb(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "MemAvailable:", 13)) kb = strtol(line + 13, NULL, 10);
    fclose(f);
    return kb;
}

/* ---------------------------------------------------------------- request options */

static void mode_options(const bench_opts *o, int mode, rk_req_options *opt) {
    rk_req_options_default(opt);
    opt->max_tokens = o->max_tokens;
    opt->sampling.temperature = 0; /* greedy: every mode does the same work */
    opt->sampling.seed = o->seed;
    opt->stop_at_eog = 0;
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

static void maybe_progress(const bench *b, int mode, int before, int after, double t0) {
    if (!b->progress) return;
    int n = b->res[mode].n_run, step = n / 20 > 0 ? n / 20 : 1;
    if (after / step != before / step || after == n)
        progress_line(b, mode, after, rk_time_now() - t0);
}

/* ---------------------------------------------------------------- in-process runner */

/* Pool sizes that hold the whole working set: every corpus chunk in the
 * chunk pool, every system prompt in the prefix pool, and a batch of the
 * largest requests (with the oracle's scratch copies when the oracle runs)
 * in the live pool. */
static void size_pools(const bench *b, int bs, int out[RK_POOL_COUNT]) {
    int oracle = 0;
    for (int i = 0; i < b->o.n_modes; i++) oracle |= b->o.modes[i] == MODE_ORACLE;
    const workload *w = &b->w;
    long chunk = 0, prefix = 0, live_req = 0;
    for (int i = 0; i < w->n_chunks; i++) chunk += (w->chunk_tok[i] + bs - 1) / bs;
    for (int i = 0; i < w->n_sys; i++) prefix += (w->sys_tok[i] + 1 + bs - 1) / bs + 1;
    for (int j = 0; j < w->n_req; j++) {
        long toks = w->sys_tok[w->req_sys[j]] + 1 + w->q_tok[j] + b->o.max_tokens, scratch = 0;
        for (int m = 0; m < w->k; m++) {
            int t = w->chunk_tok[w->req_chunks[(size_t)j * w->k + m]];
            toks += t;
            scratch += (t + bs - 1) / bs;
        }
        long need = (toks + bs - 1) / bs + 2 + (oracle ? scratch : 0);
        live_req = need > live_req ? need : live_req;
    }
    /* A pre-warm request: up to PREWARM_GROUP chunks plus a one-token question. */
    long warm = 0, cur = 0;
    for (int i = 0; i < w->n_chunks && b->o.prewarm; i++) {
        cur += w->chunk_tok[i];
        if ((i + 1) % PREWARM_GROUP == 0 || i + 1 == w->n_chunks) {
            long need = (cur + w->sys_tok[0] + 8 + bs - 1) / bs + 2;
            warm = need > warm ? need : warm;
            cur = 0;
        }
    }
    long live = live_req * b->o.concurrency;
    live = (live > warm ? live : warm) + 4;
    out[RK_POOL_LIVE] = (int)live;
    out[RK_POOL_PREFIX] = (int)(prefix * 2 + 4);
    out[RK_POOL_CHUNK] = (int)(chunk + 4);
}

static void fill_from_request(const rk_request *r, req_result *x) {
    x->ok = 1;
    x->prompt = r->prompt_tokens;
    x->reused = r->cached_tokens;
    x->computed = r->computed_tokens;
    x->sys_tokens = r->n_sys;
    x->sys_cached = r->sys_cached;
    x->q_tokens = r->n_question;
    x->n_chunks = r->n_chunks;
    for (int c = 0; c < r->n_chunks; c++) {
        const rk_chunk_report *rep = &r->chunk_reports[c];
        x->chunk_tokens += r->chunk_lens[c];
        if (rep->status == RK_CHUNK_STATUS_HIT) {
            x->hits++;
            x->hit_tokens += rep->tokens;
        } else if (rep->status == RK_CHUNK_STATUS_MISS) {
            x->misses++;
        } else {
            x->offs++;
        }
    }
}

/* Compute every corpus chunk into the chunk cache: requests of up to
 * PREWARM_GROUP chunks that generate nothing. */
static rk_status prewarm_inproc(bench *b, rk_service *svc, mode_result *m) {
    const workload *w = &b->w;
    rk_req_options opt;
    mode_options(&b->o, MODE_RAG, &opt);
    opt.max_tokens = 0;
    opt.prefix_cache = 0;
    double t0 = rk_time_now();
    rk_status st = RK_OK;
    for (int i = 0; i < w->n_chunks && !st; i += PREWARM_GROUP) {
        int n = w->n_chunks - i < PREWARM_GROUP ? w->n_chunks - i : PREWARM_GROUP;
        rk_split pieces;
        st = rk_split_structured(w->sys[0], (const char *const *)w->chunk + i, n, "?",
                                 svc->cfg.max_chunks, &pieces);
        if (st) break;
        rk_request r = {.opt = opt};
        st = rk_request_prepare(svc, &pieces, &r);
        rk_split_free(&pieces);
        if (st) break;
        rk_request *one = &r;
        if (!(st = rk_pipeline_run(svc, &one, 1, NULL))) {
            for (int c = 0; c < r.n_chunks; c++)
                if (r.chunk_reports[c].status == RK_CHUNK_STATUS_MISS) {
                    m->prewarm_chunks++;
                    m->prewarm_tokens += r.chunk_lens[c];
                }
        }
        rk_request_free(&r);
    }
    m->prewarm_s = rk_time_now() - t0;
    m->prewarmed = st == RK_OK;
    return st;
}

static int warned_pools;

static rk_status run_inproc(bench *b, int mode) {
    mode_result *m = &b->res[mode];
    const workload *w = &b->w;
    rk_config cfg = b->o.cfg;
    if (cfg.max_chunks < w->k) cfg.max_chunks = w->k;
    if (cfg.max_chunks < PREWARM_GROUP) cfg.max_chunks = PREWARM_GROUP;
    int cb = 0;
    for (int i = 0; i < w->n_chunks; i++) cb = w->chunk_tok[i] > cb ? w->chunk_tok[i] : cb;
    if (cfg.max_chunk_tokens < cb) cfg.max_chunk_tokens = cb;
    if (!b->o.kv_mb_given) {
        int pools[RK_POOL_COUNT];
        size_pools(b, cfg.block_size, pools);
        cfg.live_blocks = pools[RK_POOL_LIVE];
        cfg.prefix_blocks = pools[RK_POOL_PREFIX];
        cfg.chunk_blocks = pools[RK_POOL_CHUNK];
    }
    m->hwm_reset = hwm_reset();
    rk_service *svc = NULL;
    rk_status st = rk_service_open(&cfg, b->o.model, &svc);
    if (st) return st;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    b->n_layers = hp->n_layers;
    b->n_kv_heads = hp->n_kv_heads;
    b->head_dim = hp->head_dim;
    snprintf(b->model_desc, sizeof b->model_desc, "%s", hp->name[0] ? hp->name : hp->arch_name);
    rk_arena_params ap = {.n_layers = hp->n_layers,
                          .n_kv_heads = hp->n_kv_heads,
                          .head_dim = hp->head_dim,
                          .block_size = rk_arena_block_size(svc->arena),
                          .dtype = rk_arena_kv(svc->arena)->dtype};
    long total_blocks = 0;
    for (int p = 0; p < RK_POOL_COUNT; p++) {
        m->pool_blocks[p] = rk_arena_pool_total(svc->arena, (rk_pool_tag)p);
        total_blocks += m->pool_blocks[p];
    }
    m->kv_arena_mib = (double)total_blocks * (double)rk_arena_block_bytes(&ap) / (1 << 20);
    if (!warned_pools) {
        warned_pools = 1;
        int bs = rk_arena_block_size(svc->arena), need[RK_POOL_COUNT];
        size_pools(b, bs, need);
        if (m->pool_blocks[RK_POOL_CHUNK] < need[RK_POOL_CHUNK] - 4)
            add_warning(b,
                        "the chunk pool holds %d blocks but the corpus needs %d: expect evictions "
                        "(raise --kv-memory-mb, or leave it out to size the pools to fit)",
                        m->pool_blocks[RK_POOL_CHUNK], need[RK_POOL_CHUNK] - 4);
        if (m->pool_blocks[RK_POOL_LIVE] < need[RK_POOL_LIVE] - 4)
            add_warning(b, "the live pool holds %d blocks; a batch may need %d: requests may fail",
                        m->pool_blocks[RK_POOL_LIVE], need[RK_POOL_LIVE] - 4);
        long avail = mem_available_kb();
        if (avail > 0 && m->kv_arena_mib * 1024 > 0.9 * (double)avail)
            add_warning(b, "the KV arena (%.0f MiB) is close to the available memory (%ld MiB)",
                        m->kv_arena_mib, avail / 1024);
    }
    if (mode == MODE_RAG && b->o.prewarm && (st = prewarm_inproc(b, svc, m))) {
        rk_service_close(svc);
        return st;
    }
    rk_chunk_stats s0, s1;
    rk_chunk_index_get_stats(svc->chunks, &s0);

    rk_req_options opt;
    mode_options(&b->o, mode, &opt);
    int C = b->o.concurrency;
    rk_request *reqs = calloc((size_t)C, sizeof *reqs);
    rk_request **ptrs = calloc((size_t)C, sizeof *ptrs);
    int *idx = calloc((size_t)C, sizeof *idx);
    if (!reqs || !ptrs || !idx) {
        free(reqs);
        free(ptrs);
        free(idx);
        rk_service_close(svc);
        return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    }
    double t0 = rk_time_now();
    for (int i0 = 0; i0 < m->n_run; i0 += C) {
        int n = m->n_run - i0 < C ? m->n_run - i0 : C, n_prep = 0;
        double tb = rk_time_now();
        for (int i = i0; i < i0 + n; i++) {
            int j = m->run[i];
            double tr = rk_time_now();
            rk_split pieces;
            rk_request *r = &reqs[n_prep];
            memset(r, 0, sizeof *r);
            r->opt = opt;
            st = rk_split_prompt(w->prompt[j], strlen(w->prompt[j]), "##", cfg.max_chunks, &pieces);
            if (!st) {
                st = rk_request_prepare(svc, &pieces, r);
                rk_split_free(&pieces);
            }
            if (st) {
                if (!m->error[0])
                    snprintf(m->error, sizeof m->error, "request %d: %s", j, rk_error_message());
                continue;
            }
            m->req[j].prep_ms = (rk_time_now() - tr) * 1e3;
            idx[n_prep] = j;
            ptrs[n_prep++] = r;
        }
        double prep_ms = (rk_time_now() - tb) * 1e3;
        st = rk_pipeline_run(svc, ptrs, n_prep, NULL);
        if (st && !m->error[0])
            snprintf(m->error, sizeof m->error, "requests %d..%d: %s", m->run[i0],
                     m->run[i0 + n - 1], rk_error_message());
        for (int q = 0; q < n_prep; q++) {
            req_result *x = &m->req[idx[q]];
            if (!st) {
                fill_from_request(ptrs[q], x);
                /* TTFT as the API reports it (the pipeline's, tokenizing apart);
                 * the latency includes tokenizing the whole batch. */
                x->ttft_ms = ptrs[q]->t.ttft_ms;
                x->e2e_ms = prep_ms + ptrs[q]->t.total_ms;
                x->server_total_ms = x->e2e_ms;
            }
            rk_request_free(ptrs[q]);
        }
        maybe_progress(b, mode, i0, i0 + n, t0);
    }
    m->wall_s = rk_time_now() - t0;
    rk_chunk_index_get_stats(svc->chunks, &s1);
    m->have_index = 1;
    m->ix.lookups = s1.lookups - s0.lookups;
    m->ix.hits = s1.hits - s0.hits;
    m->ix.misses = s1.misses - s0.misses;
    m->ix.evictions = s1.evictions - s0.evictions;
    m->ix.computed_tokens = s1.computed_tokens - s0.computed_tokens;
    m->ix.hit_tokens = s1.hit_tokens - s0.hit_tokens;
    m->vmhwm_kb = hwm_read();
    free(reqs);
    free(ptrs);
    free(idx);
    rk_service_close(svc);
    m->ran = 1;
    return RK_OK;
}

/* ---------------------------------------------------------------- HTTP client */

typedef struct http_target {
    struct sockaddr_in addr;
    char host[64];
    int port;
    double timeout_s;
} http_target;

/* Accept http://HOST:PORT[/] where HOST is localhost or a 127.x.x.x address. */
static rk_status http_parse_url(const char *url, double timeout_s, http_target *t) {
    memset(t, 0, sizeof *t);
    t->timeout_s = timeout_s;
    const char *p = url;
    if (strncmp(p, "http://", 7))
        return rk_errorf(RK_ERR_INVALID, "--url %s: only http://HOST:PORT is supported", url);
    p += 7;
    const char *colon = strchr(p, ':');
    if (!colon || colon == p || (size_t)(colon - p) >= sizeof t->host)
        return rk_errorf(RK_ERR_INVALID, "--url %s: want http://127.0.0.1:PORT", url);
    memcpy(t->host, p, (size_t)(colon - p));
    t->host[colon - p] = '\0';
    char port[16];
    size_t n = strcspn(colon + 1, "/");
    if (n == 0 || n >= sizeof port || (colon[1 + n] && strcmp(colon + 1 + n, "/")))
        return rk_errorf(RK_ERR_INVALID, "--url %s: want http://127.0.0.1:PORT", url);
    memcpy(port, colon + 1, n);
    port[n] = '\0';
    long v;
    if (rk_parse_long(port, 1, 65535, &v))
        return rk_errorf(RK_ERR_INVALID, "--url %s: bad port '%s'", url, port);
    t->port = (int)v;
    const char *ip = !strcmp(t->host, "localhost") ? "127.0.0.1" : t->host;
    t->addr.sin_family = AF_INET;
    t->addr.sin_port = htons((uint16_t)v);
    if (inet_pton(AF_INET, ip, &t->addr.sin_addr) != 1)
        return rk_errorf(RK_ERR_INVALID, "--url %s: '%s' is not an IPv4 address", url, t->host);
    if ((ntohl(t->addr.sin_addr.s_addr) >> 24) != 127)
        return rk_errorf(RK_ERR_INVALID, "--url %s: the benchmark only talks to loopback", url);
    return RK_OK;
}

/* Decode a chunked transfer-encoded body in place; returns its length or -1. */
static long dechunk(char *s, size_t len) {
    size_t in = 0, out = 0;
    for (;;) {
        char *end;
        if (in >= len) return -1;
        errno = 0;
        unsigned long n = strtoul(s + in, &end, 16);
        if (end == s + in || errno) return -1;
        char *crlf = strstr(end, "\r\n");
        if (!crlf) return -1;
        in = (size_t)(crlf - s) + 2;
        if (n == 0) break;
        if (n > len - in) return -1;
        memmove(s + out, s + in, n);
        out += n;
        in += n;
        if (in + 2 > len || s[in] != '\r' || s[in + 1] != '\n') return -1;
        in += 2;
    }
    s[out] = '\0';
    return (long)out;
}

/* One HTTP/1.1 exchange on a fresh connection (Connection: close). On
 * success *out_body is the malloc'ed NUL-terminated body (caller frees). */
static rk_status http_request(const http_target *t, const char *method, const char *path,
                              const char *body, size_t body_len, int *out_status, char **out_body) {
    *out_body = NULL;
    *out_status = 0;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return rk_errorf(RK_ERR_IO, "http: socket: %s", strerror(errno));
    struct timeval tv = {.tv_sec = (time_t)t->timeout_s,
                         .tv_usec =
                             (suseconds_t)((t->timeout_s - (double)(time_t)t->timeout_s) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (const struct sockaddr *)&t->addr, sizeof t->addr)) {
        int e = errno;
        close(fd);
        return rk_errorf(RK_ERR_IO, "http: cannot connect to %s:%d: %s", t->host, t->port,
                         strerror(e));
    }
    char head[512];
    int hn = snprintf(head, sizeof head,
                      "%s %s HTTP/1.1\r\nHost: %s:%d\r\nUser-Agent: ragkv-bench\r\n"
                      "Accept: application/json\r\nConnection: close\r\n",
                      method, path, t->host, t->port);
    if (body)
        hn += snprintf(head + hn, sizeof head - (size_t)hn,
                       "Content-Type: application/json\r\nContent-Length: %zu\r\n", body_len);
    hn += snprintf(head + hn, sizeof head - (size_t)hn, "\r\n");
    const char *parts[2] = {head, body};
    size_t lens[2] = {(size_t)hn, body ? body_len : 0};
    for (int p = 0; p < 2; p++)
        for (size_t off = 0; off < lens[p];) {
            ssize_t k = send(fd, parts[p] + off, lens[p] - off, MSG_NOSIGNAL);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) {
                int e = errno;
                close(fd);
                return rk_errorf(RK_ERR_IO, "http: send to %s:%d: %s", t->host, t->port,
                                 strerror(e));
            }
            off += (size_t)k;
        }
    strbuf in = {0};
    char buf[16384];
    for (;;) {
        ssize_t k = recv(fd, buf, sizeof buf, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            int e = errno;
            close(fd);
            free(in.s);
            return rk_errorf(RK_ERR_IO, "http: no answer from %s:%d: %s", t->host, t->port,
                             e == EAGAIN || e == EWOULDBLOCK ? "timed out" : strerror(e));
        }
        if (k == 0) break;
        if (in.len + (size_t)k > (64u << 20) || sb_append(&in, buf, (size_t)k)) {
            close(fd);
            free(in.s);
            return rk_errorf(RK_ERR_LIMIT, "http: response from %s:%d is too large", t->host,
                             t->port);
        }
    }
    close(fd);
    int status;
    char *hend = in.s ? strstr(in.s, "\r\n\r\n") : NULL;
    if (!hend || sscanf(in.s, "HTTP/1.%*d %d", &status) != 1) {
        free(in.s);
        return rk_errorf(RK_ERR_FORMAT, "http: malformed response from %s:%d", t->host, t->port);
    }
    *hend = '\0';
    char *bstart = hend + 4;
    size_t blen = in.len - (size_t)(bstart - in.s);
    int chunked = 0;
    long clen = -1;
    for (char *line = strstr(in.s, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
        const char *h = line + 2;
        if (!strncasecmp(h, "Transfer-Encoding:", 18) && strstr(h, "chunked")) chunked = 1;
        if (!strncasecmp(h, "Content-Length:", 15)) clen = strtol(h + 15, NULL, 10);
    }
    if (chunked) {
        long n = dechunk(bstart, blen);
        if (n < 0) {
            free(in.s);
            return rk_errorf(RK_ERR_FORMAT, "http: bad chunked body from %s:%d", t->host, t->port);
        }
        blen = (size_t)n;
    } else if (clen >= 0 && (size_t)clen < blen) {
        blen = (size_t)clen;
    }
    char *out = malloc(blen + 1);
    if (!out) {
        free(in.s);
        return rk_errorf(RK_ERR_NOMEM, "http: out of memory");
    }
    memcpy(out, bstart, blen);
    out[blen] = '\0';
    free(in.s);
    *out_status = status;
    *out_body = out;
    return RK_OK;
}

/* POST a JSON value; returns the status and the parsed body (NULL when not JSON). */
static rk_status http_post_json(const http_target *t, const char *path, json_t *body,
                                int *out_status, json_t **out_json, char **out_raw) {
    char *s = json_dumps(body, JSON_COMPACT);
    *out_json = NULL;
    if (out_raw) *out_raw = NULL;
    if (!s) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    char *raw;
    rk_status st = http_request(t, "POST", path, s, strlen(s), out_status, &raw);
    free(s);
    if (st) return st;
    *out_json = json_loads(raw, 0, NULL);
    if (out_raw)
        *out_raw = raw;
    else
        free(raw);
    return RK_OK;
}

/* ---------------------------------------------------------------- HTTP runner */

typedef struct http_job {
    bench *b;
    const http_target *t;
    int mode;
    pthread_mutex_t mu;
    int next, done;
    double t0;
} http_job;

static int json_int_at(json_t *o, const char *a, const char *b2, const char *c) {
    json_t *v = json_object_get(o, a);
    if (b2) v = json_object_get(v, b2);
    if (c) v = json_object_get(v, c);
    return json_is_integer(v) ? (int)json_integer_value(v) : -1;
}

static double json_num_at(json_t *o, const char *a, const char *b2, const char *c) {
    json_t *v = json_object_get(json_object_get(json_object_get(o, a), b2), c);
    return json_is_number(v) ? json_number_value(v) : -1;
}

/* Read a completion object into x; 0 when it has the fields the bench needs. */
static int fill_from_json(json_t *o, req_result *x) {
    x->prompt = json_int_at(o, "usage", "prompt_tokens", NULL);
    x->reused = json_int_at(o, "usage", "prompt_tokens_details", "cached_tokens");
    json_t *t = json_object_get(json_object_get(o, "ragkv"), "timings");
    json_t *pc = json_object_get(t, "prompt_tokens_computed");
    x->computed = json_is_integer(pc) ? (int)json_integer_value(pc) : -1;
    x->sys_tokens = json_int_at(json_object_get(o, "ragkv"), "system", "tokens", NULL);
    x->sys_cached = json_int_at(json_object_get(o, "ragkv"), "system", "cached_tokens", NULL);
    x->q_tokens = json_int_at(json_object_get(o, "ragkv"), "question", "tokens", NULL);
    json_t *chunks = json_object_get(json_object_get(o, "ragkv"), "chunks");
    if (x->prompt < 0 || x->reused < 0 || x->computed < 0 || x->sys_tokens < 0 ||
        x->sys_cached < 0 || x->q_tokens < 0 || !json_is_array(chunks))
        return -1;
    size_t i;
    json_t *c;
    json_array_foreach(chunks, i, c) {
        int tokens = json_int_at(c, "tokens", NULL, NULL);
        const char *status = json_string_value(json_object_get(c, "status"));
        if (tokens < 0 || !status) return -1;
        x->n_chunks++;
        x->chunk_tokens += tokens;
        if (!strcmp(status, "hit")) {
            x->hits++;
            x->hit_tokens += tokens;
        } else if (!strcmp(status, "miss")) {
            x->misses++;
        } else {
            x->offs++;
        }
    }
    return 0;
}

static void *http_worker(void *arg) {
    http_job *job = arg;
    bench *b = job->b;
    mode_result *m = &b->res[job->mode];
    for (;;) {
        pthread_mutex_lock(&job->mu);
        int j = job->next < m->n_run ? m->run[job->next++] : -1;
        pthread_mutex_unlock(&job->mu);
        if (j < 0) break;
        /* The same options as in-process (mode_options): greedy, no early stop. */
        int plain = job->mode == MODE_PLAIN || job->mode == MODE_PREFIX;
        json_t *body = json_pack(
            "{s:s, s:i, s:f, s:i, s:b, s:s, s:s, s:b}", "prompt", b->w.prompt[j], "max_tokens",
            b->o.max_tokens, "temperature", 0.0, "seed", (int)(b->o.seed & 0x7fffffff),
            "ignore_eos", 1, "mode", plain ? "plain" : "rag", "chunk_cache",
            job->mode == MODE_ORACLE ? "off" : "on", "prefix_cache", job->mode != MODE_PLAIN);
        req_result *x = &m->req[j];
        int status = 0;
        json_t *resp = NULL;
        char *raw = NULL;
        double t0 = rk_time_now();
        rk_status st = body ? http_post_json(job->t, "/v1/completions", body, &status, &resp, &raw)
                            : rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
        double e2e = (rk_time_now() - t0) * 1e3;
        json_decref(body);
        char err[256] = "";
        if (st) {
            snprintf(err, sizeof err, "request %d: %s", j, rk_error_message());
        } else if (status != 200 || !resp) {
            snprintf(err, sizeof err, "request %d: HTTP %d: %.180s", j, status, raw ? raw : "");
        } else if (fill_from_json(resp, x)) {
            snprintf(err, sizeof err, "request %d: the response lacks usage or ragkv fields", j);
        } else {
            double ttft = json_num_at(resp, "ragkv", "timings", "ttft_ms");
            double total = json_num_at(resp, "ragkv", "timings", "total_ms");
            double queue = json_num_at(resp, "ragkv", "timings", "queue_ms");
            x->e2e_ms = e2e;
            x->server_total_ms = total;
            /* Client-side TTFT: the latency less what the server spent after its first
             * token. The server's total_ms counts its queue wait, its ttft_ms does not. */
            double after = total - (queue > 0 ? queue : 0) - ttft;
            x->ttft_ms = ttft >= 0 && after >= 0 ? e2e - after : e2e;
            x->ok = 1;
        }
        json_decref(resp);
        free(raw);
        pthread_mutex_lock(&job->mu);
        if (err[0] && !m->error[0]) snprintf(m->error, sizeof m->error, "%s", err);
        int before = job->done++;
        maybe_progress(b, job->mode, before, before + 1, job->t0);
        pthread_mutex_unlock(&job->mu);
    }
    return NULL;
}

static rk_status http_prewarm(bench *b, const http_target *t, mode_result *m) {
    const workload *w = &b->w;
    double t0 = rk_time_now();
    for (int i = 0; i < w->n_chunks; i += PREWARM_GROUP) {
        int n = w->n_chunks - i < PREWARM_GROUP ? w->n_chunks - i : PREWARM_GROUP;
        json_t *arr = json_array();
        for (int c = 0; c < n; c++) json_array_append_new(arr, json_string(w->chunk[i + c]));
        json_t *body = json_pack("{s:o, s:b}", "chunks", arr, "persist", 0);
        if (!body) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
        int status;
        json_t *resp;
        char *raw;
        rk_status st = http_post_json(t, "/v1/chunks", body, &status, &resp, &raw);
        json_decref(body);
        if (st) return st;
        if (status != 200) {
            st = rk_errorf(RK_ERR_IO, "POST /v1/chunks: HTTP %d: %.180s", status, raw ? raw : "");
            json_decref(resp);
            free(raw);
            return st;
        }
        size_t q;
        json_t *e;
        json_t *list = json_object_get(resp, "data"); /* API.md's list, OpenAI style */
        if (!json_is_array(list)) list = json_object_get(resp, "chunks");
        int failed = 0;
        json_array_foreach(list, q, e) {
            const char *s = json_string_value(json_object_get(e, "status"));
            if (s && !strcmp(s, "computed")) {
                m->prewarm_chunks++;
                m->prewarm_tokens += json_int_at(e, "tokens", NULL, NULL);
            }
            failed += !s || !strcmp(s, "failed");
        }
        if (!json_is_array(list) || json_array_size(list) != (size_t)n || failed) {
            json_decref(resp);
            free(raw);
            return rk_errorf(RK_ERR_FORMAT,
                             "POST /v1/chunks: %d of %d chunks not pre-warmed (or no list)", failed,
                             n);
        }
        json_decref(resp);
        free(raw);
    }
    m->prewarm_s = rk_time_now() - t0;
    m->prewarmed = 1;
    return RK_OK;
}

/* Name the served model from GET /v1/models, and warn when the workload was
 * sized with another model's tokenizer (the embedded one against a file, or
 * the other way round). */
static void http_describe_model(bench *b, const http_target *t) {
    int status = 0;
    char *raw = NULL;
    snprintf(b->model_desc, sizeof b->model_desc, "served model");
    if (http_request(t, "GET", "/v1/models", NULL, 0, &status, &raw) || status != 200) {
        free(raw);
        return;
    }
    json_t *root = json_loads(raw, 0, NULL);
    free(raw);
    json_t *m = json_array_get(json_object_get(root, "data"), 0);
    const char *id = json_string_value(json_object_get(m, "id"));
    const char *src = json_string_value(json_object_get(json_object_get(m, "ragkv"), "source"));
    if (id) snprintf(b->model_desc, sizeof b->model_desc, "%s", id);
    if (src && (strcmp(src, "embedded") == 0) != (b->o.model == NULL))
        add_warning(b,
                    "the server serves %s but the workload was sized with the tokenizer of %s: "
                    "token counts differ from the server's",
                    src, b->o.model ? b->o.model : "the embedded model");
    json_decref(root);
}

static rk_status run_http(bench *b, const http_target *t, int mode) {
    mode_result *m = &b->res[mode];
    /* Empty caches: flush both (an admin endpoint; a refusal is reported, not fatal). */
    json_t *body = json_pack("{s:s, s:b}", "what", "all", "disk", 0);
    int status = 0;
    json_t *resp = NULL;
    rk_status st = body ? http_post_json(t, "/v1/cache/flush", body, &status, &resp, NULL)
                        : rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    json_decref(body);
    json_decref(resp);
    if (st) return st;
    if (status != 200)
        add_warning(b, "POST /v1/cache/flush answered %d before %s: caches carry over", status,
                    k_mode_names[mode]);
    m->vmhwm_kb = -1;
    if (mode == MODE_RAG && b->o.prewarm && (st = http_prewarm(b, t, m))) return st;
    int C = b->o.concurrency;
    pthread_t *th = calloc((size_t)C, sizeof *th);
    if (!th) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    http_job job = {.b = b, .t = t, .mode = mode, .t0 = rk_time_now()};
    pthread_mutex_init(&job.mu, NULL);
    int started = 0;
    for (int i = 0; i < C; i++) {
        if (pthread_create(&th[i], NULL, http_worker, &job)) break;
        started++;
    }
    if (started == 0) http_worker(&job);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    m->wall_s = rk_time_now() - job.t0;
    pthread_mutex_destroy(&job.mu);
    free(th);
    m->ran = 1;
    return RK_OK;
}

/* ---------------------------------------------------------------- summaries */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Percentile q in [0, 1] of sorted a[n] by linear interpolation. */
static double pct(const double *a, int n, double q) {
    if (n <= 0) return NAN;
    double pos = q * (n - 1);
    int lo = (int)pos, hi = lo + 1 < n ? lo + 1 : lo;
    return a[lo] + (a[hi] - a[lo]) * (pos - lo);
}

static void summarize(bench *b, int mode) {
    mode_result *m = &b->res[mode];
    const workload *w = &b->w;
    int R = w->n_req, s0 = b->steady_from;
    double *all = malloc((size_t)R * sizeof *all), *st = malloc((size_t)R * sizeof *st),
           *e2e = malloc((size_t)R * sizeof *e2e), *ovh = malloc((size_t)R * sizeof *ovh),
           *prep = malloc((size_t)R * sizeof *prep), *ah = malloc((size_t)R * sizeof *ah);
    if (!all || !st || !e2e || !ovh || !prep || !ah) {
        free(all), free(st), free(e2e), free(ovh), free(prep), free(ah);
        add_failure(m, "out of memory summarizing");
        return;
    }
    int n = 0, ns = 0;
    long hits_s = 0, lookups_s = 0, rh = 0, rh_s = 0;
    double mean = 0;
    for (int j = 0; j < R; j++) {
        const req_result *x = &m->req[j];
        if (!x->ok) continue;
        m->n_ok++;
        all[n] = x->ttft_ms;
        e2e[n] = x->e2e_ms;
        ovh[n] = x->e2e_ms - x->server_total_ms;
        prep[n] = x->prep_ms;
        mean += x->ttft_ms;
        n++;
        m->prompt += x->prompt;
        m->reused += x->reused;
        m->computed += x->computed;
        m->hits += x->hits;
        m->misses += x->misses;
        rh += x->hits > 0;
        if (j >= s0) {
            st[ns++] = x->ttft_ms;
            hits_s += x->hits;
            lookups_s += x->hits + x->misses;
            rh_s += x->hits > 0;
        }
    }
    m->lookups = m->hits + m->misses;
    for (int j = 0; j < R; j++)
        if (m->req[j].ok && m->req[j].n_chunks > 0 && m->req[j].hits == m->req[j].n_chunks)
            ah[m->n_all_hit++] = m->req[j].ttft_ms;
    qsort(ah, (size_t)m->n_all_hit, sizeof *ah, cmp_double);
    m->ttft_all_hit_p50 = pct(ah, m->n_all_hit, 0.5);
    qsort(all, (size_t)n, sizeof *all, cmp_double);
    qsort(st, (size_t)ns, sizeof *st, cmp_double);
    qsort(e2e, (size_t)n, sizeof *e2e, cmp_double);
    qsort(ovh, (size_t)n, sizeof *ovh, cmp_double);
    qsort(prep, (size_t)n, sizeof *prep, cmp_double);
    m->prep_p50 = pct(prep, n, 0.5);
    static const double qs[3] = {0.5, 0.9, 0.99};
    for (int i = 0; i < 3; i++) {
        m->ttft[i] = pct(all, n, qs[i]);
        m->ttft_steady[i] = pct(st, ns, qs[i]);
    }
    m->ttft_mean = n ? mean / n : NAN;
    m->e2e[0] = pct(e2e, n, 0.5);
    m->e2e[1] = pct(e2e, n, 0.99);
    m->rps = m->wall_s > 0 ? m->n_ok / m->wall_s : 0;
    m->http_overhead_p50 = pct(ovh, n, 0.5);
    double so = 0;
    for (int i = 0; i < n; i++) so += ovh[i];
    m->http_overhead_mean = n ? so / n : NAN;
    m->hit_rate = m->lookups ? (double)m->hits / m->lookups : 0;
    m->hit_rate_steady = lookups_s ? (double)hits_s / lookups_s : 0;
    m->req_hit = n ? (double)rh / n : 0;
    m->req_hit_steady = ns ? (double)rh_s / ns : 0;
    double p = 0, ps = 0;
    for (int j = 0; j < R; j++) {
        p += w->p_hit[j];
        if (j >= s0) ps += w->p_hit[j];
    }
    m->pred_hit = p / R;
    m->pred_hit_steady = R > s0 ? ps / (R - s0) : m->pred_hit;
    m->pred_req_hit = 1 - pow(1 - m->pred_hit, w->k);
    m->pred_req_hit_steady = 1 - pow(1 - m->pred_hit_steady, w->k);
    m->ideal_hit = 1 - (double)w->ideal_misses / ((double)R * w->k);
    free(all), free(st), free(e2e), free(ovh), free(prep), free(ah);
}

/* The invariants every run checks (see bench.h); failures go to m->fail. */
static void check_invariants(bench *b, int mode, int http) {
    mode_result *m = &b->res[mode];
    const workload *w = &b->w;
    if (m->error[0]) add_failure(m, "%s", m->error);
    if (m->n_ok != m->n_run)
        add_failure(m, "%d of %d requests failed", m->n_run - m->n_ok, m->n_run);
    int bad_sum = 0, bad_parts = 0, bad_reuse = 0, bad_k = 0;
    for (int j = 0; j < w->n_req; j++) {
        const req_result *x = &m->req[j];
        if (!x->ok) continue;
        bad_sum += x->computed + x->reused != x->prompt;
        bad_parts += x->sys_tokens + x->chunk_tokens + x->q_tokens != x->prompt;
        bad_reuse += x->sys_cached + x->hit_tokens != x->reused;
        bad_k += x->n_chunks != w->k;
    }
    if (bad_sum) add_failure(m, "%d requests with computed + reused != prompt tokens", bad_sum);
    if (m->computed + m->reused != m->prompt)
        add_failure(m, "computed %ld + reused %ld != prompt tokens %ld", m->computed, m->reused,
                    m->prompt);
    if (bad_parts)
        add_failure(m, "%d requests with prompt tokens != system + chunks + question", bad_parts);
    if (bad_reuse)
        add_failure(m, "%d requests with reused tokens != cached system + hit chunk tokens",
                    bad_reuse);
    if (bad_k) add_failure(m, "%d requests without exactly k = %d chunks", bad_k, w->k);
    long want = (long)m->n_ok * w->k;
    if (mode == MODE_RAG) {
        if (m->hits + m->misses != m->lookups || m->lookups != want)
            add_failure(m, "hits %ld + misses %ld, lookups %ld != requests x k = %ld", m->hits,
                        m->misses, m->lookups, want);
        if (m->have_index &&
            ((long)m->ix.lookups != want || (long)m->ix.hits != m->hits ||
             (long)m->ix.misses != m->misses || m->ix.hits + m->ix.misses != m->ix.lookups))
            add_failure(m,
                        "chunk index counted %llu lookups (%llu hits, %llu misses); the responses "
                        "say %ld (%ld, %ld)",
                        (unsigned long long)m->ix.lookups, (unsigned long long)m->ix.hits,
                        (unsigned long long)m->ix.misses, m->lookups, m->hits, m->misses);
    } else {
        if (m->lookups != 0)
            add_failure(m, "%ld chunk lookups in a mode without the chunk cache", m->lookups);
        if (m->have_index && m->ix.lookups != 0)
            add_failure(m, "the chunk index counted %llu lookups in a mode without it",
                        (unsigned long long)m->ix.lookups);
    }
    if (mode == MODE_PLAIN && m->reused != 0) {
        if (http)
            add_warning(b, "the server reused %ld tokens in plain mode (prefix cache not off?)",
                        m->reused);
        else
            add_failure(m, "plain mode reused %ld tokens", m->reused);
    }
}

/* ---------------------------------------------------------------- output: table */

static void fmt_ms(char *out, size_t n, double v) {
    if (isnan(v))
        snprintf(out, n, "-");
    else if (v < 1)
        snprintf(out, n, "%.3f", v);
    else if (v < 100)
        snprintf(out, n, "%.2f", v);
    else
        snprintf(out, n, "%.0f", v);
}

static double ratio(double a, double b) { return b > 0 && !isnan(a) && !isnan(b) ? a / b : NAN; }

static void print_table(bench *b, int http) {
    const workload *w = &b->w;
    const bench_opts *o = &b->o;
    printf("ragkv bench: %s (%s), %s, %d threads\n", b->model_name, b->model_desc,
           http ? o->url : "in-process", o->cfg.n_threads);
    double mean_chunk = (double)w->corpus_tokens / w->n_chunks;
    printf("workload: %d chunks of %d..%d tokens (mean %.0f, %ld in all), %d system prompts, "
           "k %d, Zipf s %.2f, question %d tokens,\n          %d requests, concurrency %d, "
           "max_tokens %d, seed %llu%s\n",
           w->n_chunks, o->chunk_min, o->chunk_max, mean_chunk, w->corpus_tokens, w->n_sys, w->k,
           o->zipf, o->question_tokens, w->n_req, o->concurrency, o->max_tokens,
           (unsigned long long)o->seed, o->prewarm ? ", rag pre-warmed" : "");
    printf("steady state: requests %d..%d (the first %d%% left out)\n", b->steady_from + 1,
           w->n_req, o->steady_pct);
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        if (m->ran && m->n_run != w->n_req)
            printf("%s: every %d%s request of the list (%d of %d)\n", k_mode_names[o->modes[i]],
                   o->baseline_every, o->baseline_every == 2 ? "nd" : "th", m->n_run, w->n_req);
    }
    printf("\n");
    printf("%-7s %10s %10s %10s %10s %10s %8s %10s %10s %10s %8s %8s %8s %8s %9s\n", "mode",
           "TTFT p50", "p90", "p99", "e2e p50", "p99", "req/s", "prompt", "computed", "reused",
           "hit", "(pred)", ">=1 hit", "(pred)", "peak MiB");
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        if (!m->ran) continue;
        char t[5][32];
        fmt_ms(t[0], 32, m->ttft[0]);
        fmt_ms(t[1], 32, m->ttft[1]);
        fmt_ms(t[2], 32, m->ttft[2]);
        fmt_ms(t[3], 32, m->e2e[0]);
        fmt_ms(t[4], 32, m->e2e[1]);
        char hit[4][16] = {"-", "-", "-", "-"};
        if (o->modes[i] == MODE_RAG) {
            snprintf(hit[0], 16, "%.3f", m->hit_rate);
            snprintf(hit[1], 16, "%.3f", m->pred_hit);
            snprintf(hit[2], 16, "%.3f", m->req_hit);
            snprintf(hit[3], 16, "%.3f", m->pred_req_hit);
        }
        char peak[16] = "-";
        if (m->vmhwm_kb >= 0) snprintf(peak, sizeof peak, "%.0f", m->vmhwm_kb / 1024.0);
        printf("%-7s %10s %10s %10s %10s %10s %8.2f %10ld %10ld %10ld %8s %8s %8s %8s %9s\n",
               k_mode_names[o->modes[i]], t[0], t[1], t[2], t[3], t[4], m->rps, m->prompt,
               m->computed, m->reused, hit[0], hit[1], hit[2], hit[3], peak);
    }
    printf("(times in ms; hit = chunk hit rate per lookup, >=1 hit = requests with at least one "
           "hit; pred = the Zipf model)\n");
    if (!http) {
        printf("(TTFT: the pipeline's, as the API reports it; e2e adds splitting and tokenizing, "
               "p50 per request:");
        for (int i = 0; i < o->n_modes; i++)
            if (b->res[o->modes[i]].ran)
                printf(" %s %.2f ms", k_mode_names[o->modes[i]], b->res[o->modes[i]].prep_p50);
        printf(")\n");
    } else {
        printf("(TTFT: client latency less the server's time after its first token)\n");
    }
    printf("\n");
    printf("steady state %-14s %10s %10s %10s %8s %8s\n", "", "TTFT p50", "p90", "p99", "hit",
           "(pred)");
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        if (!m->ran) continue;
        char t[3][32], hit[2][16] = {"-", "-"};
        for (int q = 0; q < 3; q++) fmt_ms(t[q], 32, m->ttft_steady[q]);
        if (o->modes[i] == MODE_RAG) {
            snprintf(hit[0], 16, "%.3f", m->hit_rate_steady);
            snprintf(hit[1], 16, "%.3f", m->pred_hit_steady);
        }
        printf("  %-25s %10s %10s %10s %8s %8s\n", k_mode_names[o->modes[i]], t[0], t[1], t[2],
               hit[0], hit[1]);
    }
    const mode_result *rag = &b->res[MODE_RAG];
    if (rag->ran) {
        printf("\nspeedup of rag (TTFT p50 ratio)       all   steady  all-hit\n");
        for (int other = MODE_PLAIN; other <= MODE_PREFIX; other++) {
            const mode_result *m = &b->res[other];
            if (!m->ran) continue;
            printf("  over %-26s %7.2fx %7.2fx %7.2fx\n", k_mode_names[other],
                   ratio(m->ttft[0], rag->ttft[0]), ratio(m->ttft_steady[0], rag->ttft_steady[0]),
                   ratio(m->ttft[0], rag->ttft_all_hit_p50));
        }
        printf("(all-hit: rag's TTFT p50 over the %d requests whose every chunk hit, against the "
               "other mode's p50 over all requests)\n",
               rag->n_all_hit);
        printf("chunk lookups %ld: %ld hits, %ld misses; an unbounded cache would miss %ld "
               "(hit rate %.3f)",
               rag->lookups, rag->hits, rag->misses, w->ideal_misses, rag->ideal_hit);
        if (rag->have_index) printf("; evictions %llu", (unsigned long long)rag->ix.evictions);
        printf("\n");
        if (rag->prewarmed)
            printf("pre-warm: %d chunks, %ld tokens in %.2f s (%.0f tokens/s), not in the figures "
                   "above\n",
                   rag->prewarm_chunks, rag->prewarm_tokens, rag->prewarm_s,
                   rag->prewarm_s > 0 ? rag->prewarm_tokens / rag->prewarm_s : 0);
    }
    if (http) {
        printf("HTTP overhead (client latency - server total_ms), p50 / mean ms:");
        for (int i = 0; i < o->n_modes; i++) {
            const mode_result *m = &b->res[o->modes[i]];
            if (m->ran)
                printf("  %s %.2f / %.2f", k_mode_names[o->modes[i]], m->http_overhead_p50,
                       m->http_overhead_mean);
        }
        printf("\n");
    } else {
        const mode_result *m = &b->res[o->modes[0]];
        printf("KV arena: %.0f MiB (live %d, prefix %d, chunk %d blocks)%s\n", m->kv_arena_mib,
               m->pool_blocks[0], m->pool_blocks[1], m->pool_blocks[2],
               m->hwm_reset ? "; peak = VmHWM, reset before each mode"
                            : "; peak = process VmHWM so far (could not reset it)");
    }
    int ok = 1;
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        for (int f = 0; f < m->n_fail; f++) {
            printf("INVARIANT FAILED (%s): %s\n", k_mode_names[o->modes[i]], m->fail[f]);
            ok = 0;
        }
    }
    if (ok) printf("invariants: ok\n");
}

/* ---------------------------------------------------------------- output: JSON */

static json_t *num(double v) { return isnan(v) || isinf(v) ? json_null() : json_real(v); }

static json_t *mode_json(const bench *b, int mode, int http) {
    const mode_result *m = &b->res[mode];
    json_t *fails = json_array();
    for (int f = 0; f < m->n_fail; f++) json_array_append_new(fails, json_string(m->fail[f]));
    json_t *o = json_object();
    json_object_set_new(o, "requests", json_integer(m->n_run));
    json_object_set_new(o, "ok", json_integer(m->n_ok));
    json_object_set_new(o, "wall_s", num(m->wall_s));
    json_object_set_new(o, "requests_per_s", num(m->rps));
    json_object_set_new(o, "ttft_ms",
                        json_pack("{s:o, s:o, s:o, s:o}", "p50", num(m->ttft[0]), "p90",
                                  num(m->ttft[1]), "p99", num(m->ttft[2]), "mean",
                                  num(m->ttft_mean)));
    json_object_set_new(o, "ttft_ms_steady",
                        json_pack("{s:o, s:o, s:o}", "p50", num(m->ttft_steady[0]), "p90",
                                  num(m->ttft_steady[1]), "p99", num(m->ttft_steady[2])));
    json_object_set_new(o, "e2e_ms",
                        json_pack("{s:o, s:o}", "p50", num(m->e2e[0]), "p99", num(m->e2e[1])));
    json_object_set_new(o, "prompt_tokens", json_integer(m->prompt));
    json_object_set_new(o, "computed_tokens", json_integer(m->computed));
    json_object_set_new(o, "reused_tokens", json_integer(m->reused));
    json_t *ch =
        json_pack("{s:I, s:I, s:I, s:o, s:o, s:o, s:o}", "lookups", (json_int_t)m->lookups, "hits",
                  (json_int_t)m->hits, "misses", (json_int_t)m->misses, "hit_rate",
                  num(m->hit_rate), "hit_rate_steady", num(m->hit_rate_steady), "requests_with_hit",
                  num(m->req_hit), "requests_with_hit_steady", num(m->req_hit_steady));
    if (mode == MODE_RAG) {
        json_object_set_new(ch, "all_hit_requests", json_integer(m->n_all_hit));
        json_object_set_new(ch, "all_hit_ttft_ms_p50", num(m->ttft_all_hit_p50));
        json_object_set_new(ch, "predicted_hit_rate", num(m->pred_hit));
        json_object_set_new(ch, "predicted_hit_rate_steady", num(m->pred_hit_steady));
        json_object_set_new(ch, "predicted_requests_with_hit", num(m->pred_req_hit));
        json_object_set_new(ch, "predicted_requests_with_hit_steady", num(m->pred_req_hit_steady));
        json_object_set_new(ch, "unbounded_cache_hit_rate", num(m->ideal_hit));
    }
    json_object_set_new(o, "chunks", ch);
    if (m->have_index)
        json_object_set_new(o, "index",
                            json_pack("{s:I, s:I, s:I, s:I}", "lookups", (json_int_t)m->ix.lookups,
                                      "hits", (json_int_t)m->ix.hits, "misses",
                                      (json_int_t)m->ix.misses, "evictions",
                                      (json_int_t)m->ix.evictions));
    json_object_set_new(o, "peak_rss_mib",
                        m->vmhwm_kb >= 0 ? json_real(m->vmhwm_kb / 1024.0) : json_null());
    json_object_set_new(o, "peak_rss_reset", json_boolean(m->hwm_reset));
    if (!http) {
        json_object_set_new(o, "kv_arena_mib", num(m->kv_arena_mib));
        json_object_set_new(o, "tokenize_ms_p50", num(m->prep_p50));
        json_object_set_new(o, "pool_blocks",
                            json_pack("{s:i, s:i, s:i}", "live", m->pool_blocks[0], "prefix",
                                      m->pool_blocks[1], "chunk", m->pool_blocks[2]));
    } else {
        json_object_set_new(o, "http_overhead_ms",
                            json_pack("{s:o, s:o}", "p50", num(m->http_overhead_p50), "mean",
                                      num(m->http_overhead_mean)));
    }
    json_object_set_new(o, "prewarm",
                        m->prewarmed
                            ? json_pack("{s:i, s:I, s:f}", "chunks", m->prewarm_chunks, "tokens",
                                        (json_int_t)m->prewarm_tokens, "seconds", m->prewarm_s)
                            : json_null());
    json_t *t_each = json_array(), *miss_each = json_array();
    for (int j = 0; j < b->w.n_req; j++) {
        json_array_append_new(t_each, m->req[j].ok ? json_real(m->req[j].ttft_ms) : json_null());
        json_array_append_new(miss_each, json_integer(m->req[j].misses));
    }
    json_object_set_new(o, "each",
                        json_pack("{s:o, s:o}", "ttft_ms", t_each, "chunk_misses", miss_each));
    json_object_set_new(o, "invariants",
                        json_pack("{s:b, s:o}", "ok", m->n_fail == 0, "failures", fails));
    return o;
}

static json_t *bench_json(const bench *b, int http, int all_ok) {
    const workload *w = &b->w;
    const bench_opts *o = &b->o;
    json_t *order = json_array(), *modes = json_object(), *warn = json_array();
    for (int i = 0; i < o->n_modes; i++) {
        json_array_append_new(order, json_string(k_mode_names[o->modes[i]]));
        if (b->res[o->modes[i]].ran)
            json_object_set_new(modes, k_mode_names[o->modes[i]], mode_json(b, o->modes[i], http));
    }
    for (int i = 0; i < b->n_warnings; i++)
        json_array_append_new(warn, json_string(b->warnings[i]));
    json_t *speed = json_object();
    const mode_result *rag = &b->res[MODE_RAG];
    for (int other = MODE_PLAIN; other <= MODE_PREFIX && rag->ran; other++) {
        const mode_result *m = &b->res[other];
        if (!m->ran) continue;
        char key[32];
        snprintf(key, sizeof key, "rag_over_%s", k_mode_names[other]);
        json_object_set_new(
            speed, key,
            json_pack("{s:o, s:o, s:o}", "ttft_p50", num(ratio(m->ttft[0], rag->ttft[0])),
                      "ttft_p50_steady", num(ratio(m->ttft_steady[0], rag->ttft_steady[0])),
                      "ttft_p50_all_hit", num(ratio(m->ttft[0], rag->ttft_all_hit_p50))));
    }
    double mean_chunk = (double)w->corpus_tokens / w->n_chunks;
    json_t *wl = json_pack(
        "{s:i, s:I, s:f, s:i, s:i, s:i, s:f, s:i, s:i, s:i, s:i, s:i, s:I, s:i, s:b, s:i, s:i}",
        "corpus", w->n_chunks, "corpus_tokens", (json_int_t)w->corpus_tokens, "mean_chunk_tokens",
        mean_chunk, "chunk_tokens_min", o->chunk_min, "chunk_tokens_max", o->chunk_max, "k", w->k,
        "zipf", o->zipf, "systems", w->n_sys, "system_tokens", o->system_tokens, "question_tokens",
        o->question_tokens, "requests", w->n_req, "concurrency", o->concurrency, "seed",
        (json_int_t)o->seed, "max_tokens", o->max_tokens, "prewarm", o->prewarm, "steady_from",
        b->steady_from, "baseline_every", o->baseline_every);
    json_t *root = json_object();
    json_object_set_new(root, "model", json_string(b->model_name));
    json_object_set_new(root, "model_name", json_string(b->model_desc));
    json_object_set_new(root, "transport", json_string(http ? "http" : "in-process"));
    if (http) json_object_set_new(root, "url", json_string(o->url));
    json_object_set_new(root, "threads", json_integer(o->cfg.n_threads));
    json_object_set_new(root, "workload", wl);
    json_object_set_new(root, "order", order);
    json_object_set_new(root, "modes", modes);
    json_object_set_new(root, "speedup", speed);
    json_object_set_new(root, "warnings", warn);
    json_object_set_new(root, "invariants_ok", json_boolean(all_ok));
    return root;
}

/* ---------------------------------------------------------------- output: SVG */

static const char *const k_colors[N_MODES] = {"#d62728", "#ff7f0e", "#2ca02c", "#1f77b4"};

static void svg_text(FILE *f, double x, double y, const char *anchor, int size, const char *s) {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" font-size=\"%d\">", x, y, anchor,
            size);
    for (const char *p = s; *p; p++) {
        if (*p == '<')
            fputs("&lt;", f);
        else if (*p == '>')
            fputs("&gt;", f);
        else if (*p == '&')
            fputs("&amp;", f);
        else
            fputc(*p, f);
    }
    fputs("</text>\n", f);
}

static rk_status write_svg(const bench *b, const char *path, int http) {
    const bench_opts *o = &b->o;
    const workload *w = &b->w;
    FILE *f = fopen(path, "w");
    if (!f) return rk_errorf(RK_ERR_IO, "%s: %s", path, strerror(errno));
    const double W = 1040, H = 470, top = 70, bottom = 400;
    const double l1 = 70, r1 = 490, l2 = 590, r2 = 1010;
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
            "viewBox=\"0 0 %.0f %.0f\" font-family=\"Helvetica, Arial, sans-serif\">\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            W, H, W, H);
    char title[256];
    snprintf(title, sizeof title,
             "ragkv bench: %s, %s, %d chunks of %d-%d tokens, k %d, Zipf %.2f, %d requests",
             b->model_desc, http ? "HTTP" : "in-process", w->n_chunks, o->chunk_min, o->chunk_max,
             w->k, o->zipf, w->n_req);
    svg_text(f, W / 2, 28, "middle", 15, title);

    /* Panel 1: TTFT CDF per mode on a log axis. */
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        for (int j = 0; m->ran && j < w->n_req; j++)
            if (m->req[j].ok && m->req[j].ttft_ms > 0) {
                lo = fmin(lo, m->req[j].ttft_ms);
                hi = fmax(hi, m->req[j].ttft_ms);
            }
    }
    if (!(lo < INFINITY)) lo = 0.1, hi = 1;
    double dlo = floor(log10(lo)), dhi = ceil(log10(hi));
    if (dhi <= dlo) dhi = dlo + 1;
#define X1(v) (l1 + (log10(v) - dlo) / (dhi - dlo) * (r1 - l1))
#define Y(v)  (bottom - (v) * (bottom - top))
    svg_text(f, (l1 + r1) / 2, top - 12, "middle", 13, "TTFT distribution (CDF)");
    fprintf(f,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#444\"/>\n",
            l1, top, r1 - l1, bottom - top);
    for (double d = dlo; d <= dhi + 1e-9; d++) {
        double x = l1 + (d - dlo) / (dhi - dlo) * (r1 - l1);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", x,
                top, x, bottom);
        for (int s = 2; s < 10 && d < dhi; s++) {
            double xs = l1 + (d + log10(s) - dlo) / (dhi - dlo) * (r1 - l1);
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\"/>\n",
                    xs, bottom, xs, bottom - 4);
        }
        char lab[32];
        double v = pow(10, d);
        if (v >= 1)
            snprintf(lab, sizeof lab, "%.0f", v);
        else
            snprintf(lab, sizeof lab, "%g", v);
        svg_text(f, x, bottom + 18, "middle", 12, lab);
    }
    svg_text(f, (l1 + r1) / 2, bottom + 38, "middle", 13, "time to first token (ms, log scale)");
    for (int q = 0; q <= 4; q++) {
        double y = Y(q / 4.0);
        char lab[16];
        snprintf(lab, sizeof lab, "%.2f", q / 4.0);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", l1,
                y, r1, y);
        svg_text(f, l1 - 6, y + 4, "end", 12, lab);
    }
    fprintf(f,
            "<text x=\"20\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\" "
            "transform=\"rotate(-90 20 %.1f)\">fraction of requests</text>\n",
            (top + bottom) / 2, (top + bottom) / 2);
    double *v = malloc((size_t)w->n_req * sizeof *v);
    if (!v) {
        fclose(f);
        return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    }
    int n_legend = 0;
    for (int i = 0; i < o->n_modes; i++) {
        int mode = o->modes[i];
        const mode_result *m = &b->res[mode];
        if (!m->ran) continue;
        n_legend++;
        int n = 0;
        for (int j = 0; j < w->n_req; j++)
            if (m->req[j].ok && m->req[j].ttft_ms > 0) v[n++] = m->req[j].ttft_ms;
        if (n == 0) continue;
        qsort(v, (size_t)n, sizeof *v, cmp_double);
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"",
                k_colors[mode]);
        fprintf(f, "%.1f,%.1f ", X1(v[0]), Y(0));
        for (int j = 0; j < n; j++)
            fprintf(f, "%.1f,%.1f %.1f,%.1f ", X1(v[j]), Y((double)j / n), X1(v[j]),
                    Y((double)(j + 1) / n));
        fputs("\"/>\n", f);
    }
    /* The legend after the curves, so its box covers them. */
    double lx = r1 - (o->baseline_every > 1 ? 225 : 200); /* wider for "n N" */
    fprintf(f,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%d\" height=\"%d\" fill=\"white\" "
            "fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n",
            lx, bottom - 28 - 18 * (n_legend - 1), (int)(r1 - lx - 10), 18 * n_legend + 8);
    for (int i = 0, legend = 0; i < o->n_modes; i++) {
        int mode = o->modes[i];
        const mode_result *m = &b->res[mode];
        if (!m->ran) continue;
        double ly = bottom - 12 - 18 * (n_legend - 1 - legend++);
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-width=\"3\"/>\n",
                lx + 8, ly - 4, lx + 30, ly - 4, k_colors[mode]);
        char lab[64], ms[32];
        fmt_ms(ms, sizeof ms, m->ttft[0]);
        if (m->n_run != w->n_req) /* a --baseline-every sample */
            snprintf(lab, sizeof lab, "%s (p50 %s ms, n %d)", k_mode_names[mode], ms, m->n_run);
        else
            snprintf(lab, sizeof lab, "%s (p50 %s ms)", k_mode_names[mode], ms);
        svg_text(f, lx + 36, ly, "start", 12, lab);
    }

    /* Panel 2: the rag hit rate over time, running mean, with the prediction. */
    const mode_result *rag = &b->res[MODE_RAG];
    int R = w->n_req;
#define X2(j) (l2 + (double)(j) / (R > 1 ? R : 1) * (r2 - l2))
    svg_text(f, (l2 + r2) / 2, top - 12, "middle", 13, "rag chunk hit rate over the run");
    fprintf(f,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#444\"/>\n",
            l2, top, r2 - l2, bottom - top);
    for (int q = 0; q <= 4; q++) {
        double y = Y(q / 4.0);
        char lab[16];
        snprintf(lab, sizeof lab, "%.2f", q / 4.0);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", l2,
                y, r2, y);
        svg_text(f, l2 - 6, y + 4, "end", 12, lab);
    }
    double step = pow(10, floor(log10(R > 1 ? R : 2)));
    if (R / step < 3) step /= 2;
    for (double t = 0; t <= R + 1e-9; t += step) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                X2(t), top, X2(t), bottom);
        char lab[16];
        snprintf(lab, sizeof lab, "%.0f", t);
        svg_text(f, X2(t), bottom + 18, "middle", 12, lab);
    }
    svg_text(f, (l2 + r2) / 2, bottom + 38, "middle", 13, "requests");
    fprintf(f,
            "<text x=\"%.1f\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\" "
            "transform=\"rotate(-90 %.1f %.1f)\">hit rate</text>\n",
            l2 - 45, (top + bottom) / 2, l2 - 45, (top + bottom) / 2);
    if (rag->ran) {
        double xs = X2(b->steady_from);
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888\" "
                "stroke-dasharray=\"2,3\"/>\n",
                xs, top, xs, bottom);
        svg_text(f, xs + 4, bottom - 6, "start", 11, "steady state");
        int win = R / 10 > 5 ? R / 10 : 5;
        /* windowed mean (thin), cumulative mean (thick), predicted cumulative mean (dashed) */
        for (int pass = 0; pass < 3; pass++) {
            const char *style = pass == 0   ? "stroke=\"#2ca02c\" stroke-opacity=\"0.45\" "
                                              "stroke-width=\"1.2\""
                                : pass == 1 ? "stroke=\"#2ca02c\" stroke-width=\"2.5\""
                                            : "stroke=\"#000\" stroke-width=\"1.5\" "
                                              "stroke-dasharray=\"6,4\"";
            fprintf(f, "<polyline fill=\"none\" %s points=\"", style);
            long h = 0, l = 0;
            double pc = 0;
            for (int j = 0; j < R; j++) {
                const req_result *x = &rag->req[j];
                h += x->hits;
                l += x->hits + x->misses;
                pc += w->p_hit[j];
                double y;
                if (pass == 0) {
                    long wh = 0, wl = 0;
                    for (int q = j - win + 1 < 0 ? 0 : j - win + 1; q <= j; q++) {
                        wh += rag->req[q].hits;
                        wl += rag->req[q].hits + rag->req[q].misses;
                    }
                    y = wl ? (double)wh / wl : 0;
                } else if (pass == 1) {
                    y = l ? (double)h / l : 0;
                } else {
                    y = pc / (j + 1);
                }
                fprintf(f, "%.1f,%.1f ", X2(j + 1), Y(y));
            }
            fputs("\"/>\n", f);
        }
        const char *labels[3] = {"running mean (all requests so far)", "", "Zipf model prediction"};
        char wl[64];
        snprintf(wl, sizeof wl, "mean over the last %d requests", win);
        labels[1] = wl;
        const char *styles[3] = {"stroke=\"#2ca02c\" stroke-width=\"3\"",
                                 "stroke=\"#2ca02c\" stroke-opacity=\"0.45\" stroke-width=\"1.5\"",
                                 "stroke=\"#000\" stroke-width=\"1.5\" stroke-dasharray=\"6,4\""};
        for (int q = 0; q < 3; q++) {
            double ly = bottom - 60 + 18 * q;
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" %s/>\n", r2 - 250,
                    ly - 4, r2 - 226, ly - 4, styles[q]);
            svg_text(f, r2 - 220, ly, "start", 12, labels[q]);
        }
    } else {
        svg_text(f, (l2 + r2) / 2, (top + bottom) / 2, "middle", 13, "(no rag run)");
    }
#undef X1
#undef X2
#undef Y
    fputs("</svg>\n", f);
    free(v);
    int bad = ferror(f);
    if (fclose(f) || bad) return rk_errorf(RK_ERR_IO, "%s: write failed", path);
    return RK_OK;
}

/* ---------------------------------------------------------------- main */

int rk_bench_main(int argc, char **argv) {
    bench *b = calloc(1, sizeof *b);
    if (!b) {
        fprintf(stderr, "ragkv bench: out of memory\n");
        return EXIT_FAILURE;
    }
    int rc = parse_args(argc, argv, &b->o);
    if (rc) {
        free(b);
        return rc < 0 ? 0 : rc;
    }
    bench_opts *o = &b->o;
    int http = o->url != NULL;
    http_target target;
    rk_status st = RK_OK;
    textgen g = {0};
    warned_pools = 0;
    b->model_name = o->model ? o->model : "embedded";
    snprintf(b->model_desc, sizeof b->model_desc, "%s", o->model ? "" : "ragkv tiny");
    b->progress = o->progress || isatty(STDERR_FILENO);
    if (o->cfg.n_threads == 0) o->cfg.n_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (http && (st = http_parse_url(o->url, o->http_timeout_s, &target))) {
        fprintf(stderr, "ragkv bench: %s\n", rk_error_message());
        free(b);
        return EXIT_USAGE;
    }
    if ((st = rk_config_validate(&o->cfg))) {
        fprintf(stderr, "ragkv bench: %s\n", rk_error_message());
        free(b);
        return EXIT_USAGE;
    }
    double t_gen = rk_time_now();
    if ((st = textgen_init(o->model, &g)) || (st = workload_build(o, &g, &b->w))) {
        fprintf(stderr, "ragkv bench: cannot build the workload: %s\n", rk_error_message());
        textgen_free(&g);
        free(b);
        return EXIT_FAILURE;
    }
    textgen_free(&g);
    if (b->progress)
        fprintf(stderr,
                "bench: workload of %d requests over %d chunks (%ld tokens) built in %.1f s\n",
                b->w.n_req, b->w.n_chunks, b->w.corpus_tokens, rk_time_now() - t_gen);
    b->steady_from = (int)((long)b->w.n_req * o->steady_pct / 100);
    if (b->steady_from >= b->w.n_req) b->steady_from = 0;
    for (int i = 0; i < N_MODES && !st; i++) {
        mode_result *m = &b->res[i];
        m->mode = i;
        m->vmhwm_kb = -1;
        m->req = calloc((size_t)b->w.n_req, sizeof *m->req);
        m->run = calloc((size_t)b->w.n_req, sizeof *m->run);
        if (!m->req || !m->run) {
            st = rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
            break;
        }
        int every = i == MODE_RAG ? 1 : o->baseline_every;
        for (int j = 0; j < b->w.n_req; j += every) m->run[m->n_run++] = j;
    }
    if (!st && http) {
        /* The server answers 503 while it loads its model: wait for it, up to
         * the HTTP timeout. */
        int status = 0;
        double t_wait = rk_time_now();
        for (;;) {
            char *body = NULL;
            st = http_request(&target, "GET", "/health", NULL, 0, &status, &body);
            free(body);
            if (st || status != 503 || rk_time_now() - t_wait > o->http_timeout_s) break;
            usleep(100000);
        }
        if (!st && status != 200)
            st = rk_errorf(RK_ERR_IO, "%s/health answered %d", o->url, status);
        if (!st) http_describe_model(b, &target);
    }
    for (int i = 0; i < o->n_modes && !st; i++) {
        int mode = o->modes[i];
        st = http ? run_http(b, &target, mode) : run_inproc(b, mode);
        if (st) break;
        summarize(b, mode);
        check_invariants(b, mode, http);
    }
    if (st) {
        fprintf(stderr, "ragkv bench: %s\n", rk_error_message());
        rc = EXIT_FAILURE;
    } else {
        const mode_result *rag = &b->res[MODE_RAG], *plain = &b->res[MODE_PLAIN];
        if (rag->ran && plain->ran && !(ratio(plain->ttft[0], rag->ttft[0]) > 1))
            add_failure(&b->res[MODE_RAG],
                        "rag is not faster than plain (TTFT p50 %.3f vs %.3f ms)", rag->ttft[0],
                        plain->ttft[0]);
        int all_ok = 1;
        for (int i = 0; i < o->n_modes; i++) all_ok &= b->res[o->modes[i]].n_fail == 0;
        if (o->json) {
            json_t *root = bench_json(b, http, all_ok);
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
            print_table(b, http);
        }
        if (o->plot && (st = write_svg(b, o->plot, http))) {
            fprintf(stderr, "ragkv bench: cannot write the plot: %s\n", rk_error_message());
            all_ok = 0;
        }
        if (!all_ok && o->json)
            for (int i = 0; i < o->n_modes; i++)
                for (int f = 0; f < b->res[o->modes[i]].n_fail; f++)
                    fprintf(stderr, "ragkv bench: invariant failed (%s): %s\n",
                            k_mode_names[o->modes[i]], b->res[o->modes[i]].fail[f]);
        rc = all_ok ? 0 : EXIT_FAILURE;
    }
    for (int i = 0; i < N_MODES; i++) {
        free(b->res[i].req);
        free(b->res[i].run);
    }
    workload_free(&b->w);
    free(b);
    return rc;
}
