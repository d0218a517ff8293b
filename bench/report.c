/* bench/report.c — per-mode summaries and invariants, the table and the
 * JSON object. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_internal.h"

/* ---------------------------------------------------------------- summaries */

int rk_bench_cmp_double(const void *a, const void *b) {
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

/* Per turn: TTFT percentiles and the prompt tokens computed and reused. */
static void summarize_turns(const bench *b, mode_result *m, double *v) {
    const workload *w = &b->w;
    static const double qs[3] = {0.5, 0.9, 0.99};
    for (int t = 0; t < b->o.turns; t++) {
        int n = 0;
        m->turn_prompt[t] = m->turn_reused[t] = m->turn_computed[t] = 0;
        for (int j = 0; j < w->n_req; j++) {
            const req_result *x = t ? &m->turn[(size_t)(t - 1) * w->n_req + j] : &m->req[j];
            if (!x->ok) continue;
            v[n++] = x->ttft_ms;
            m->turn_prompt[t] += x->prompt;
            m->turn_reused[t] += x->reused;
            m->turn_computed[t] += x->computed;
        }
        m->turn_ok[t] = n;
        qsort(v, (size_t)n, sizeof *v, rk_bench_cmp_double);
        for (int q = 0; q < 3; q++) m->turn_ttft[t][q] = pct(v, n, qs[q]);
    }
}

/* TPOT over every request (all turns) that generated two tokens or more,
 * the output throughput and request rate over the mode's wall time, and the
 * open loop's late sends. */
static void summarize_generation(bench *b, mode_result *m) {
    const workload *w = &b->w;
    double *v = malloc((size_t)w->n_req * (size_t)b->o.turns * sizeof *v);
    if (!v) {
        rk_bench_add_failure(m, "out of memory summarizing");
        return;
    }
    summarize_turns(b, m, v);
    int n = 0, done = 0;
    m->out_tokens = 0;
    m->n_late = 0;
    m->late_max_ms = 0;
    for (int t = 0; t < b->o.turns; t++)
        for (int j = 0; j < w->n_req; j++) {
            const req_result *x = t ? &m->turn[(size_t)(t - 1) * w->n_req + j] : &m->req[j];
            if (!x->ok) continue;
            done++;
            m->out_tokens += x->n_out;
            if (x->n_out > 1) v[n++] = x->tpot_ms;
        }
    for (int j = 0; j < w->n_req; j++) {
        m->n_late += m->req[j].late_ms > LATE_MS;
        if (m->req[j].late_ms > m->late_max_ms) m->late_max_ms = m->req[j].late_ms;
    }
    qsort(v, (size_t)n, sizeof *v, rk_bench_cmp_double);
    static const double qs[3] = {0.5, 0.9, 0.99};
    for (int q = 0; q < 3; q++) m->tpot[q] = pct(v, n, qs[q]);
    m->rps = m->wall_s > 0 ? done / m->wall_s : 0;
    m->out_tok_s = m->wall_s > 0 ? m->out_tokens / m->wall_s : 0;
    free(v);
}

void rk_bench_summarize(bench *b, int mode) {
    mode_result *m = &b->res[mode];
    const workload *w = &b->w;
    int R = w->n_req, s0 = b->steady_from;
    double *all = malloc((size_t)R * sizeof *all), *st = malloc((size_t)R * sizeof *st),
           *e2e = malloc((size_t)R * sizeof *e2e), *ovh = malloc((size_t)R * sizeof *ovh),
           *prep = malloc((size_t)R * sizeof *prep), *ah = malloc((size_t)R * sizeof *ah);
    if (!all || !st || !e2e || !ovh || !prep || !ah) {
        free(all), free(st), free(e2e), free(ovh), free(prep), free(ah);
        rk_bench_add_failure(m, "out of memory summarizing");
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
    qsort(ah, (size_t)m->n_all_hit, sizeof *ah, rk_bench_cmp_double);
    m->ttft_all_hit_p50 = pct(ah, m->n_all_hit, 0.5);
    qsort(all, (size_t)n, sizeof *all, rk_bench_cmp_double);
    qsort(st, (size_t)ns, sizeof *st, rk_bench_cmp_double);
    qsort(e2e, (size_t)n, sizeof *e2e, rk_bench_cmp_double);
    /* The server's own total (the peer reports none), and what the client saw beyond it. */
    int n_ovh = 0;
    for (int j = 0; j < R; j++)
        if (m->req[j].ok && !isnan(m->req[j].server_total_ms))
            ovh[n_ovh++] = m->req[j].e2e_ms - m->req[j].server_total_ms;
    qsort(ovh, (size_t)n_ovh, sizeof *ovh, rk_bench_cmp_double);
    qsort(prep, (size_t)n, sizeof *prep, rk_bench_cmp_double);
    m->prep_p50 = pct(prep, n, 0.5);
    static const double qs[3] = {0.5, 0.9, 0.99};
    for (int i = 0; i < 3; i++) {
        m->ttft[i] = pct(all, n, qs[i]);
        m->ttft_steady[i] = pct(st, ns, qs[i]);
    }
    m->ttft_mean = n ? mean / n : NAN;
    m->e2e[0] = pct(e2e, n, 0.5);
    m->e2e[1] = pct(e2e, n, 0.99);
    m->http_overhead_p50 = pct(ovh, n_ovh, 0.5);
    double so = 0;
    for (int i = 0; i < n_ovh; i++) so += ovh[i];
    m->http_overhead_mean = n_ovh ? so / n_ovh : NAN;
    summarize_generation(b, m);
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
void rk_bench_check_invariants(bench *b, int mode, int http) {
    mode_result *m = &b->res[mode];
    const workload *w = &b->w;
    if (m->error[0]) rk_bench_add_failure(m, "%s", m->error);
    if (m->n_ok != m->n_run)
        rk_bench_add_failure(m, "%d of %d requests failed", m->n_run - m->n_ok, m->n_run);
    /* The peer reports OpenAI usage alone: no pieces, no chunk lookups. */
    int peer = mode == MODE_PEER;
    int bad_sum = 0, bad_parts = 0, bad_reuse = 0, bad_k = 0, bad_out = 0;
    for (int j = 0; j < w->n_req; j++) {
        const req_result *x = &m->req[j];
        if (!x->ok) continue;
        bad_sum += x->computed + x->reused != x->prompt;
        bad_parts += !peer && x->sys_tokens + x->chunk_tokens + x->q_tokens != x->prompt;
        bad_reuse += !peer && x->sys_cached + x->hit_tokens != x->reused;
        bad_k += !peer && x->n_chunks != w->k;
    }
    /* Every turn: the accounting, and exactly the requested output (EOS is ignored). */
    for (int t = 0; t < b->o.turns; t++) {
        int bad_turn = 0;
        for (int j = 0; j < w->n_req; j++) {
            const req_result *x = t ? &m->turn[(size_t)(t - 1) * w->n_req + j] : &m->req[j];
            if (!x->ok) continue;
            bad_turn += x->computed + x->reused != x->prompt || x->reused < 0;
            bad_out += x->n_out != w->max_out[j];
        }
        if (bad_turn)
            rk_bench_add_failure(m, "turn %d: %d requests with computed + reused != prompt tokens",
                                 t + 1, bad_turn);
        if (t > 0 && m->turn_ok[t] != m->n_ok)
            rk_bench_add_failure(m, "turn %d: %d of %d conversations failed", t + 1,
                                 m->n_ok - m->turn_ok[t], m->n_ok);
    }
    if (bad_out) rk_bench_add_failure(m, "%d requests did not generate their max_tokens", bad_out);
    if (bad_sum)
        rk_bench_add_failure(m, "%d requests with computed + reused != prompt tokens", bad_sum);
    if (m->computed + m->reused != m->prompt)
        rk_bench_add_failure(m, "computed %ld + reused %ld != prompt tokens %ld", m->computed,
                             m->reused, m->prompt);
    if (bad_parts)
        rk_bench_add_failure(m, "%d requests with prompt tokens != system + chunks + question",
                             bad_parts);
    if (bad_reuse)
        rk_bench_add_failure(
            m, "%d requests with reused tokens != cached system + hit chunk tokens", bad_reuse);
    if (bad_k) rk_bench_add_failure(m, "%d requests without exactly k = %d chunks", bad_k, w->k);
    long want = (long)m->n_ok * w->k;
    if (mode == MODE_RAG) {
        if (m->hits + m->misses != m->lookups || m->lookups != want)
            rk_bench_add_failure(m, "hits %ld + misses %ld, lookups %ld != requests x k = %ld",
                                 m->hits, m->misses, m->lookups, want);
        /* The index counts every turn's lookups (in-process turns keep their
         * chunks), not the hits inside an earlier turn's sequence. */
        long all_hits = m->hits, all_misses = m->misses;
        for (int j = 0; j < w->n_req; j++) all_hits -= m->req[j].prefix_hits;
        for (size_t i = 0; i < (size_t)w->n_req * (size_t)w->n_followups; i++)
            if (m->turn[i].ok) {
                all_hits += m->turn[i].hits - m->turn[i].prefix_hits;
                all_misses += m->turn[i].misses;
            }
        if (m->have_index && ((long)m->ix.hits != all_hits || (long)m->ix.misses != all_misses ||
                              m->ix.hits + m->ix.misses != m->ix.lookups))
            rk_bench_add_failure(
                m,
                "chunk index counted %llu lookups (%llu hits, %llu misses); the responses "
                "say %ld (%ld, %ld)",
                (unsigned long long)m->ix.lookups, (unsigned long long)m->ix.hits,
                (unsigned long long)m->ix.misses, all_hits + all_misses, all_hits, all_misses);
    } else {
        if (m->lookups != 0)
            rk_bench_add_failure(m, "%ld chunk lookups in a mode without the chunk cache",
                                 m->lookups);
        if (m->have_index && m->ix.lookups != 0)
            rk_bench_add_failure(m, "the chunk index counted %llu lookups in a mode without it",
                                 (unsigned long long)m->ix.lookups);
    }
    if (mode == MODE_PLAIN && m->reused != 0) {
        if (http)
            rk_bench_add_warning(
                b, "the server reused %ld tokens in plain mode (prefix cache not off?)", m->reused);
        else
            rk_bench_add_failure(m, "plain mode reused %ld tokens", m->reused);
    }
}

/* ---------------------------------------------------------------- output: table */

void rk_bench_fmt_ms(char *out, size_t n, double v) {
    if (isnan(v))
        snprintf(out, n, "-");
    else if (v < 1)
        snprintf(out, n, "%.3f", v);
    else if (v < 100)
        snprintf(out, n, "%.2f", v);
    else
        snprintf(out, n, "%.0f", v);
}

double rk_bench_ratio(double a, double b) { return b > 0 && !isnan(a) && !isnan(b) ? a / b : NAN; }

/* TPOT, throughput, the open loop's late sends and the turns. */
static void print_generation(const bench *b) {
    const bench_opts *o = &b->o;
    printf("\ngeneration %-16s %10s %10s %10s %10s %10s %10s", "", "TPOT p50", "p90", "p99",
           "out tok", "tok/s", "req/s");
    if (o->arrival_rate > 0) printf(" %8s %10s", "late", "late max");
    printf("\n");
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        if (!m->ran) continue;
        char t[3][32];
        for (int q = 0; q < 3; q++) rk_bench_fmt_ms(t[q], 32, m->tpot[q]);
        printf("  %-25s %10s %10s %10s %10ld %10.1f %10.2f", k_mode_names[o->modes[i]], t[0], t[1],
               t[2], m->out_tokens, m->out_tok_s, m->rps);
        if (o->arrival_rate > 0) printf(" %8d %10.1f", m->n_late, m->late_max_ms);
        printf("\n");
    }
    printf("(TPOT = (e2e - TTFT) / (output tokens - 1), requests with 2 or more; tok/s and req/s "
           "over the mode's wall time%s)\n",
           o->arrival_rate > 0 ? "; late = sent more than 10 ms after its arrival time" : "");
    if (o->turns < 2) return;
    printf("\nper turn %-18s %10s %10s %10s %10s %10s %10s\n", "", "TTFT p50", "p90", "p99",
           "prompt", "computed", "cached");
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        if (!m->ran) continue;
        for (int t = 0; t < o->turns; t++) {
            char lab[32], q[3][32];
            snprintf(lab, sizeof lab, "%s turn %d", k_mode_names[o->modes[i]], t + 1);
            for (int k = 0; k < 3; k++) rk_bench_fmt_ms(q[k], 32, m->turn_ttft[t][k]);
            printf("  %-25s %10s %10s %10s %10ld %10ld %10ld\n", lab, q[0], q[1], q[2],
                   m->turn_prompt[t], m->turn_computed[t], m->turn_reused[t]);
        }
    }
}

/* What ran: the model, the workload, the loop, the steady state. */
static void print_header(const bench *b, int http) {
    const workload *w = &b->w;
    const bench_opts *o = &b->o;
    printf("ragkv bench: %s (%s), %s, %d threads\n", b->model_name, b->model_desc,
           http ? o->url : "in-process", o->run.cfg.n_threads);
    double mean_chunk = (double)w->corpus_tokens / w->n_chunks;
    printf("workload: %d chunks of %d..%d tokens (mean %.0f, %ld in all), %d system prompts, "
           "k %d, Zipf s %.2f, question %d tokens,\n          %d requests, concurrency %d, "
           "max_tokens %d..%d, seed %llu%s\n",
           w->n_chunks, o->chunk_min, o->chunk_max, mean_chunk, w->corpus_tokens, w->n_sys, w->k,
           o->zipf, o->question_tokens, w->n_req, o->concurrency, o->max_min, o->max_max,
           (unsigned long long)o->seed, o->prewarm ? ", rag pre-warmed" : "");
    if (o->arrival_rate > 0 && http)
        printf("open loop: Poisson arrivals at %.3g requests/s, up to %d in flight (TTFT counts "
               "from the arrival time)\n",
               o->arrival_rate, MAX_IN_FLIGHT);
    else if (o->arrival_rate > 0)
        printf("open loop: Poisson arrivals at %.3g requests/s into the engine thread, batches of "
               "up to %d (TTFT counts from the arrival time)\n",
               o->arrival_rate, OPEN_MAX_BATCH);
    if (o->turns > 1)
        printf("conversations of %d turns over /v1/chat/completions (the table: turn 1)\n",
               o->turns);
    if (o->peer_url)
        printf("peer: %s (plain OpenAI requests, pieces joined by newlines)\n", o->peer_url);
    printf("steady state: requests %d..%d (the first %d%% left out)\n", b->steady_from + 1,
           w->n_req, o->steady_pct);
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        if (m->ran && m->n_run != w->n_req)
            printf("%s: every %d%s request of the list (%d of %d)\n", k_mode_names[o->modes[i]],
                   o->baseline_every, o->baseline_every == 2 ? "nd" : "th", m->n_run, w->n_req);
    }
    printf("\n");
}

/* The table of every mode over all requests, and what its times count. */
static void print_modes(const bench *b, int http) {
    const bench_opts *o = &b->o;
    printf("%-7s %10s %10s %10s %10s %10s %8s %10s %10s %10s %8s %8s %8s %8s %9s\n", "mode",
           "TTFT p50", "p90", "p99", "e2e p50", "p99", "req/s", "prompt", "computed", "reused",
           "hit", "(pred)", ">=1 hit", "(pred)", "peak MiB");
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        if (!m->ran) continue;
        char t[5][32];
        rk_bench_fmt_ms(t[0], 32, m->ttft[0]);
        rk_bench_fmt_ms(t[1], 32, m->ttft[1]);
        rk_bench_fmt_ms(t[2], 32, m->ttft[2]);
        rk_bench_fmt_ms(t[3], 32, m->e2e[0]);
        rk_bench_fmt_ms(t[4], 32, m->e2e[1]);
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
    if (!http && o->arrival_rate > 0) {
        printf("(TTFT: from the arrival time to the first token: tokenizing, the queue wait and "
               "the engine's time; e2e: to the last token)\n");
    } else if (!http) {
        printf("(TTFT: the pipeline's, as the API reports it; e2e adds splitting and tokenizing, "
               "p50 per request:");
        for (int i = 0; i < o->n_modes; i++)
            if (b->res[o->modes[i]].ran && o->modes[i] != MODE_PEER)
                printf(" %s %.2f ms", k_mode_names[o->modes[i]], b->res[o->modes[i]].prep_p50);
        printf(")\n");
    } else {
        printf("(TTFT: from sending the request to the first streamed text; e2e: to the end of "
               "the stream)\n");
    }
    if (!http && o->peer_url)
        printf("(peer TTFT: from sending the request to the first streamed text)\n");
    printf("\n");
}

/* The table of every mode over the steady state. */
static void print_steady(const bench *b) {
    const bench_opts *o = &b->o;
    printf("steady state %-14s %10s %10s %10s %8s %8s\n", "", "TTFT p50", "p90", "p99", "hit",
           "(pred)");
    for (int i = 0; i < o->n_modes; i++) {
        const mode_result *m = &b->res[o->modes[i]];
        if (!m->ran) continue;
        char t[3][32], hit[2][16] = {"-", "-"};
        for (int q = 0; q < 3; q++) rk_bench_fmt_ms(t[q], 32, m->ttft_steady[q]);
        if (o->modes[i] == MODE_RAG) {
            snprintf(hit[0], 16, "%.3f", m->hit_rate_steady);
            snprintf(hit[1], 16, "%.3f", m->pred_hit_steady);
        }
        printf("  %-25s %10s %10s %10s %8s %8s\n", k_mode_names[o->modes[i]], t[0], t[1], t[2],
               hit[0], hit[1]);
    }
}

/* What rag saved against the other modes, and its cache. */
static void print_rag(const bench *b) {
    const workload *w = &b->w;
    const mode_result *rag = &b->res[MODE_RAG];
    if (rag->ran) {
        printf("\nspeedup of rag (TTFT p50 ratio)       all   steady  all-hit\n");
        for (int other = MODE_PLAIN; other <= MODE_PREFIX; other++) {
            const mode_result *m = &b->res[other];
            if (!m->ran) continue;
            printf("  over %-26s %7.2fx %7.2fx %7.2fx\n", k_mode_names[other],
                   rk_bench_ratio(m->ttft[0], rag->ttft[0]),
                   rk_bench_ratio(m->ttft_steady[0], rag->ttft_steady[0]),
                   rk_bench_ratio(m->ttft[0], rag->ttft_all_hit_p50));
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
}

/* HTTP overhead or the KV arena, and the invariants. */
static void print_footer(const bench *b, int http) {
    const bench_opts *o = &b->o;
    if (http) {
        printf("HTTP overhead (client latency - server total_ms), p50 / mean ms:");
        for (int i = 0; i < o->n_modes; i++) {
            const mode_result *m = &b->res[o->modes[i]];
            if (m->ran && o->modes[i] != MODE_PEER)
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

void rk_bench_print_table(bench *b, int http) {
    print_header(b, http);
    print_modes(b, http);
    print_steady(b);
    print_generation(b);
    print_rag(b);
    print_footer(b, http);
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
    json_object_set_new(o, "tpot_ms",
                        json_pack("{s:o, s:o, s:o}", "p50", num(m->tpot[0]), "p90", num(m->tpot[1]),
                                  "p99", num(m->tpot[2])));
    json_object_set_new(o, "output_tokens", json_integer(m->out_tokens));
    json_object_set_new(o, "output_tokens_per_s", num(m->out_tok_s));
    if (b->o.arrival_rate > 0)
        json_object_set_new(
            o, "open_loop",
            json_pack("{s:i, s:o}", "late", m->n_late, "late_max_ms", num(m->late_max_ms)));
    if (b->o.turns > 1) {
        json_t *turns = json_array();
        for (int t = 0; t < b->o.turns; t++)
            json_array_append_new(
                turns, json_pack("{s:i, s:i, s:{s:o, s:o, s:o}, s:I, s:I, s:I}", "turn", t + 1,
                                 "ok", m->turn_ok[t], "ttft_ms", "p50", num(m->turn_ttft[t][0]),
                                 "p90", num(m->turn_ttft[t][1]), "p99", num(m->turn_ttft[t][2]),
                                 "prompt_tokens", (json_int_t)m->turn_prompt[t], "computed_tokens",
                                 (json_int_t)m->turn_computed[t], "cached_tokens",
                                 (json_int_t)m->turn_reused[t]));
        json_object_set_new(o, "turns", turns);
    }
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
    } else if (mode != MODE_PEER) {
        json_object_set_new(o, "http_overhead_ms",
                            json_pack("{s:o, s:o}", "p50", num(m->http_overhead_p50), "mean",
                                      num(m->http_overhead_mean)));
    }
    json_object_set_new(o, "prewarm",
                        m->prewarmed
                            ? json_pack("{s:i, s:I, s:f}", "chunks", m->prewarm_chunks, "tokens",
                                        (json_int_t)m->prewarm_tokens, "seconds", m->prewarm_s)
                            : json_null());
    json_t *t_each = json_array(), *miss_each = json_array(), *out_each = json_array(),
           *tpot_each = json_array();
    for (int j = 0; j < b->w.n_req; j++) {
        const req_result *x = &m->req[j];
        json_array_append_new(t_each, x->ok ? json_real(x->ttft_ms) : json_null());
        json_array_append_new(miss_each, json_integer(x->misses));
        json_array_append_new(out_each, x->ok ? json_integer(x->n_out) : json_null());
        json_array_append_new(tpot_each, x->ok ? num(x->tpot_ms) : json_null());
    }
    json_object_set_new(o, "each",
                        json_pack("{s:o, s:o, s:o, s:o}", "ttft_ms", t_each, "chunk_misses",
                                  miss_each, "output_tokens", out_each, "tpot_ms", tpot_each));
    json_object_set_new(o, "invariants",
                        json_pack("{s:b, s:o}", "ok", m->n_fail == 0, "failures", fails));
    return o;
}

json_t *rk_bench_json(const bench *b, int http, int all_ok) {
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
            json_pack("{s:o, s:o, s:o}", "ttft_p50", num(rk_bench_ratio(m->ttft[0], rag->ttft[0])),
                      "ttft_p50_steady",
                      num(rk_bench_ratio(m->ttft_steady[0], rag->ttft_steady[0])),
                      "ttft_p50_all_hit", num(rk_bench_ratio(m->ttft[0], rag->ttft_all_hit_p50))));
    }
    double mean_chunk = (double)w->corpus_tokens / w->n_chunks;
    json_t *wl = json_pack(
        "{s:i, s:I, s:f, s:i, s:i, s:i, s:f, s:i, s:i, s:i, s:i, s:i, s:I, s:i, s:b, s:i, s:i}",
        "corpus", w->n_chunks, "corpus_tokens", (json_int_t)w->corpus_tokens, "mean_chunk_tokens",
        mean_chunk, "chunk_tokens_min", o->chunk_min, "chunk_tokens_max", o->chunk_max, "k", w->k,
        "zipf", o->zipf, "systems", w->n_sys, "system_tokens", o->system_tokens, "question_tokens",
        o->question_tokens, "requests", w->n_req, "concurrency", o->concurrency, "seed",
        (json_int_t)o->seed, "max_tokens", o->max_max, "prewarm", o->prewarm, "steady_from",
        b->steady_from, "baseline_every", o->baseline_every);
    json_object_set_new(wl, "max_tokens_min", json_integer(o->max_min));
    json_object_set_new(wl, "arrival_rate",
                        o->arrival_rate > 0 ? json_real(o->arrival_rate) : json_null());
    json_object_set_new(wl, "turns", json_integer(o->turns));
    json_t *root = json_object();
    if (o->peer_url) json_object_set_new(root, "peer_url", json_string(o->peer_url));
    json_object_set_new(root, "model", json_string(b->model_name));
    json_object_set_new(root, "model_name", json_string(b->model_desc));
    json_object_set_new(root, "transport", json_string(http ? "http" : "in-process"));
    if (http) json_object_set_new(root, "url", json_string(o->url));
    json_object_set_new(root, "threads", json_integer(o->run.cfg.n_threads));
    json_object_set_new(root, "workload", wl);
    json_object_set_new(root, "order", order);
    json_object_set_new(root, "modes", modes);
    json_object_set_new(root, "speedup", speed);
    json_object_set_new(root, "warnings", warn);
    json_object_set_new(root, "invariants_ok", json_boolean(all_ok));
    return root;
}
