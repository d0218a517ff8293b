/* bench/bench_internal.h — what the files of `ragkv bench` share (see
 * bench.h for the benchmark itself):
 *
 *   bench.c          options, shared helpers, rk_bench_main
 *   workload.c       the seeded workload: text from the vocabulary, Zipf
 *                    requests, the hit-rate prediction
 *   runner_inproc.c  requests through the pipeline in this process: in
 *                    batches, or (--arrival-rate) through an engine thread: in
 *                    batches, or (--arrival-rate) through an engine thread
 *   runner_http.c    requests against a running `ragkv serve` or, with
 *                    --peer-url, any OpenAI-compatible server: streamed,
 *                    closed-loop or open-loop (--arrival-rate), one turn or
 *                    a conversation (--turns)
 *   httpclient.c     the loopback HTTP client (httpclient.h)
 *   report.c         summaries, invariants, the table and the JSON object
 *   svg.c            the SVG plot
 *   eval*.c          `ragkv eval` (eval.h; its files share eval_internal.h),
 *                    which shares the usage error and the SVG text
 *
 * Private to bench/. One `bench` lives for one run and is used by one thread,
 * except the HTTP runner's workers, which each write their own req_result. */
#ifndef RK_BENCH_INTERNAL_H
#define RK_BENCH_INTERNAL_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#include "bench/bench.h"
#include "bench/httpclient.h"
#include "config/settings.h"
#include "engine/tokenizer.h"
#include "pipeline/pipeline.h"

#define EXIT_USAGE         2
#define MAX_FAILURES       16
#define RK_BENCH_MAX_TURNS 16
#define PREWARM_GROUP      16 /* chunks per pre-warm request */
#define MAX_IN_FLIGHT      64 /* open-loop sender threads (--arrival-rate over HTTP) */
/* Generations the engine thread runs together in an in-process open loop:
 * ragkv serve's default --max-batch. */
#define OPEN_MAX_BATCH 16
#define LATE_MS        10 /* an open-loop request sent later than this after its arrival is late */
/* MODE_PEER is the other server of --peer-url: not a ragkv mode, so --modes
 * does not name it; it runs last, after the ragkv modes, when the URL is given. */
enum { MODE_PLAIN, MODE_PREFIX, MODE_RAG, MODE_ORACLE, MODE_PEER, N_MODES };
#define N_RAGKV_MODES MODE_PEER
static const char *const k_mode_names[N_MODES] = {"plain", "prefix", "rag", "oracle", "peer"};

typedef struct bench_opts {
    rk_run_opts run;
    const char *model; /* run.model, or NULL for the embedded model */
    int kv_mb_given;
    int corpus, k;
    double zipf;
    int chunk_min, chunk_max;
    int question_tokens, system_tokens, n_systems;
    int requests, concurrency;
    int max_min, max_max; /* --max-tokens MIN:MAX: output tokens per request, uniform */
    double arrival_rate;  /* requests/s, open loop; 0 = closed loop (--concurrency clients) */
    int turns;            /* turns per conversation (--turns), 1 = single requests */
    const char *peer_url;
    int modes[N_MODES], n_modes;
    int prewarm;
    long long seed;
    int json;
    const char *plot;
    const char *url;
    int steady_pct;
    int baseline_every; /* plain, prefix and oracle run every K-th request */
    double http_timeout_s;
    int progress; /* 1 = progress lines even when stderr is not a terminal */
} bench_opts;

/* The pieces text is made of: the decoded bytes of every normal token that
 * is printable ASCII without '#' or '\' (so no text holds a separator or an
 * escape, and any token boundary is a character boundary). */
typedef struct textgen {
    rk_tokenizer *tok;
    char *bytes; /* all pieces, back to back */
    int *offset; /* (n + 1) */
    int n;
} textgen;

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
    char **prompt; /* (n_req) system##chunk##...##question */
    int *max_out;  /* (n_req) output tokens of request j (--max-tokens) */
    double
        *arrival_s;  /* (n_req) open-loop send time of request j from the start (--arrival-rate) */
    int n_followups; /* turns - 1 */
    char **followup; /* (n_req, n_followups) the questions of turns 2.. of conversation j */
    double *weight;  /* (n_chunks) Zipf popularity */
    double *incl;    /* (n_chunks) inclusion probability q_i */
    double *p_hit;   /* (n_req) predicted per-lookup hit probability of request j */
    long ideal_misses;
} workload;

typedef struct req_result {
    int ok;
    double ttft_ms, e2e_ms;
    double server_total_ms; /* HTTP: the server's own total_ms */
    double prep_ms;         /* in-process: splitting and tokenizing the prompt */
    double tpot_ms;         /* (e2e - TTFT) / (n_out - 1); NaN when n_out < 2 */
    double late_ms;         /* open loop: how late it was sent after its arrival time */
    int n_out;              /* tokens generated */
    int prompt, reused, computed;
    int sys_tokens, sys_cached, chunk_tokens, hit_tokens, q_tokens;
    int n_chunks, hits, misses, offs;
    int prefix_hits; /* of hits: inside an earlier request's sequence, never looked up */
} req_result;

typedef struct mode_result {
    int mode, ran;
    req_result *req;  /* (n_req) */
    int *run, n_run;  /* the requests this mode runs, in list order (see --baseline-every) */
    req_result *turn; /* (n_followups, n_req): turns 2.. of each conversation, turn-major */
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
    double tpot[3];   /* over the requests with n_out >= 2 */
    long out_tokens;  /* generated, every turn */
    double out_tok_s; /* out_tokens / wall_s */
    int n_late;       /* open loop: requests sent more than LATE_MS after their arrival */
    double late_max_ms;
    int turn_ok[RK_BENCH_MAX_TURNS];
    double turn_ttft[RK_BENCH_MAX_TURNS][3];
    long turn_prompt[RK_BENCH_MAX_TURNS], turn_reused[RK_BENCH_MAX_TURNS],
        turn_computed[RK_BENCH_MAX_TURNS];
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
    int warned_pools; /* the pool-size warning was given */
} bench;

/* ---------------------------------------------------------------- bench.c */

/* A usage error of `ragkv cmd`: one line on stderr; returns EXIT_USAGE. */
int rk_bench_usage_error(const char *cmd, const char *fmt, const char *arg);
void rk_bench_add_failure(mode_result *m, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* A warning: printed on stderr now, and kept (the first 8) for the report. */
void rk_bench_add_warning(bench *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Reset this process's RSS high-water mark (Linux >= 4.0); 1 on success. */
int rk_bench_hwm_reset(void);
/* VmHWM of this process in kB, or -1. */
long rk_bench_hwm_read(void);
/* MemAvailable in kB, or -1. */
long rk_bench_mem_available_kb(void);
/* The request options of a mode. */
void rk_bench_mode_options(const bench_opts *o, int mode, rk_req_options *opt);
/* A progress line when a 5% step was crossed between before and after. */
void rk_bench_maybe_progress(const bench *b, int mode, int before, int after, double t0);

/* ---------------------------------------------------------------- workload.c */

/* The model's tokenizer and its pieces (model_path NULL = the embedded
 * model). textgen_free accepts a zeroed textgen. */
rk_status rk_bench_textgen_init(const char *model_path, textgen *g);
void rk_bench_textgen_free(textgen *g);
/* Build the seeded workload of o; on failure w holds nothing. */
rk_status rk_bench_workload_build(const bench_opts *o, const textgen *g, workload *w);
void rk_bench_workload_free(workload *w);

/* ---------------------------------------------------------------- runners */

/* Run the request list once in mode, from empty caches, into b->res[mode]. */
rk_status rk_bench_run_inproc(bench *b, int mode);
/* Replicas --url names at most (requests go round-robin among them). */
#define RK_BENCH_MAX_REPLICAS 8

/* Run the request list against the n_t servers t: request j (all its turns)
 * goes to t[j % n_t]; every one's caches are flushed first (and pre-warmed
 * with --prewarm). Mode MODE_PEER sends plain OpenAI requests (--peer-url). */
rk_status rk_bench_run_http(bench *b, const rk_http_target *t, int n_t, int mode);
/* Fill b's model description from the server's /v1/models. */
void rk_bench_http_describe_model(bench *b, const rk_http_target *t);

/* ---------------------------------------------------------------- report.c */

/* qsort order of doubles, ascending. */
int rk_bench_cmp_double(const void *a, const void *b);
/* Percentiles, rates and hit counts of mode from its request results. */
void rk_bench_summarize(bench *b, int mode);
/* Check mode's invariants; a broken one is a failure of the mode. */
void rk_bench_check_invariants(bench *b, int mode, int http);
/* v milliseconds as table text ("-" when NaN). */
void rk_bench_fmt_ms(char *out, size_t n, double v);
/* a / b, NaN when either is NaN or b is not positive. */
double rk_bench_ratio(double a, double b);
void rk_bench_print_table(bench *b, int http);
/* The whole result as one JSON object (NULL when out of memory). */
json_t *rk_bench_json(const bench *b, int http, int all_ok);

/* ---------------------------------------------------------------- svg.c */

rk_status rk_bench_write_svg(const bench *b, const char *path, int http);
/* One <text> element at (x, y), s escaped. */
void rk_bench_svg_text(FILE *f, double x, double y, const char *anchor, int size, const char *s);

#endif
