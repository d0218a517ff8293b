/* bench/workload.c — the seeded workload: text from the model's vocabulary,
 * system prompts, chunks and Zipf-popular requests, and the hit-rate
 * prediction.
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
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_internal.h"

#include "engine/gguf.h"

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

void rk_bench_textgen_free(textgen *g) {
    rk_tokenizer_free(g->tok);
    free(g->bytes);
    free(g->offset);
    memset(g, 0, sizeof *g);
}

rk_status rk_bench_textgen_init(const char *model_path, textgen *g) {
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
    if (st) rk_bench_textgen_free(g);
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

void rk_bench_workload_free(workload *w) {
    for (int i = 0; i < w->n_chunks && w->chunk; i++) free(w->chunk[i]);
    for (int i = 0; i < w->n_sys && w->sys; i++) free(w->sys[i]);
    for (int i = 0; i < w->n_req && w->question; i++) free(w->question[i]);
    for (int i = 0; i < w->n_req && w->prompt; i++) free(w->prompt[i]);
    for (int i = 0; i < w->n_req * w->n_followups && w->followup; i++) free(w->followup[i]);
    free(w->followup);
    free(w->max_out);
    free(w->arrival_s);
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

/* k distinct chunks of n drawn by popularity (cdf, by successive sampling),
 * then put in a random order. */
static void pick_chunks(rng *r, const double *cdf, int n, int k, int *ch) {
    for (int m = 0; m < k;) {
        double u = rng_unit(r) * cdf[n - 1];
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
        int q = rng_below(r, m + 1), t = ch[m];
        ch[m] = ch[q];
        ch[q] = t;
    }
}

/* Request j's prompt: system##chunk##...##question. */
static rk_status join_prompt(workload *w, int j) {
    const int *ch = w->req_chunks + (size_t)j * w->k;
    strbuf b = {0};
    rk_status st = sb_append(&b, w->sys[w->req_sys[j]], strlen(w->sys[w->req_sys[j]]));
    for (int m = 0; m < w->k && !st; m++) {
        if (!(st = sb_append(&b, "##", 2)))
            st = sb_append(&b, w->chunk[ch[m]], strlen(w->chunk[ch[m]]));
    }
    if (!st && !(st = sb_append(&b, "##", 2)))
        st = sb_append(&b, w->question[j], strlen(w->question[j]));
    if (st) {
        free(b.s);
        return st;
    }
    w->prompt[j] = b.s;
    return RK_OK;
}

/* The prediction (see the top of this file) and the ideal miss count: first
 * uses of a chunk, batch by batch (a chunk first used by two requests of one
 * batch misses in both). seen: n_chunks zeroed bytes. */
static void predict(const bench_opts *o, workload *w, unsigned char *seen) {
    int n = w->n_chunks, k = w->k, R = w->n_req, C = o->concurrency;
    inclusion_probabilities(w->weight, n, k, w->incl);
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
}

rk_status rk_bench_workload_build(const bench_opts *o, const textgen *g, workload *w) {
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
    w->max_out = calloc((size_t)R, sizeof *w->max_out);
    w->arrival_s = calloc((size_t)R, sizeof *w->arrival_s);
    w->n_followups = o->turns - 1;
    w->followup = calloc((size_t)R * (size_t)w->n_followups + 1, sizeof *w->followup);
    double *cdf = calloc((size_t)n, sizeof *cdf);
    unsigned char *seen = calloc((size_t)n, 1);
    rk_status st = RK_OK;
    if (!w->chunk || !w->chunk_tok || !w->sys || !w->sys_tok || !w->req_sys || !w->req_chunks ||
        !w->question || !w->q_tok || !w->prompt || !w->weight || !w->incl || !w->p_hit || !cdf ||
        !seen || !w->max_out || !w->arrival_s || !w->followup) {
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
        pick_chunks(&r, cdf, n, k, ch);
        if ((st = gen_text(g, &r, o->question_tokens, &w->question[j], &w->q_tok[j])) ||
            (st = join_prompt(w, j)))
            break;
    }
    /* Follow-up questions last, so that a workload without them is the same. */
    for (int i = 0; i < R * w->n_followups && !st; i++) {
        int tok;
        st = gen_text(g, &r, o->question_tokens, &w->followup[i], &tok);
    }
    if (st) goto done;
    /* Output lengths and arrival times from streams of their own, for the
     * same reason (and so that the lengths do not depend on the rate):
     * uniform in [max_min, max_max], and a Poisson process (exponential gaps
     * of mean 1/rate) starting at 0. */
    rng r_len = {.s = o->seed * 0x9e3779b97f4a7c15ull + 101};
    rng r_arr = {.s = o->seed * 0xd1b54a32d192ed03ull + 202};
    double t = 0;
    for (int j = 0; j < R; j++) {
        w->max_out[j] = o->max_min + rng_below(&r_len, o->max_max - o->max_min + 1);
        w->arrival_s[j] = t;
        if (o->arrival_rate > 0) t += -log(1 - rng_unit(&r_arr)) / o->arrival_rate;
    }

    predict(o, w, seen);
done:
    free(cdf);
    free(seen);
    if (st) rk_bench_workload_free(w);
    return st;
}
