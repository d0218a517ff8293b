/* bench/eval_ref.c — `ragkv eval` against the reference: the full-attention
 * reference runs (the oracle, greedy, its log-softmax kept at every step),
 * every configuration's teacher-forced and free-running runs along them, and
 * the metrics (KL divergence, top-1 agreement, rank of the reference token,
 * greedy agreement and common prefix) with their means. */
#include "bench/eval.h"

#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_internal.h"
#include "bench/eval_internal.h"

/* ---------------------------------------------------------------- metrics */

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

/* ---------------------------------------------------------------- the runs */

rk_status rk_eval_run_reference(eval *e) {
    int N = e->o.n_tokens, P = e->ps.n;
    rk_service *svc;
    rk_status st = rk_eval_open_service(e, 1, &svc);
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
    rk_eval_config_options(&plain, N, e->o.context, &opt);
    double ms = 0;
    for (int j = 0; j < P && !st; j++) {
        run_ctx ctx = {
            .n_steps = N, .n_vocab = e->n_vocab, .logp = e->ref_logp + (size_t)j * N * e->n_vocab};
        st = rk_eval_run_prompt(svc, &e->ps.p[j], &opt, &ctx, &e->ref[j]);
        if (!st && e->ref[j].n_out != N)
            st = rk_errorf(RK_ERR_INTERNAL, "eval: prompt %d gave %d tokens, not %d", j + 1,
                           e->ref[j].n_out, N);
        ms += st ? 0 : e->ref[j].total_ms;
    }
    e->ref_ms = ms / P;
    rk_service_close(svc);
    return st;
}

rk_status rk_eval_run_config(eval *e, int ci) {
    int N = e->o.n_tokens, P = e->ps.n, V = e->n_vocab;
    config_result *cr = &e->cr[ci];
    cr->pr = calloc((size_t)P, sizeof *cr->pr);
    double *logp = malloc((size_t)N * V * sizeof *logp);
    if (!cr->pr || !logp) {
        free(logp);
        return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    }
    rk_service *svc;
    rk_status st = rk_eval_open_service(e, 0, &svc);
    if (st) {
        free(logp);
        return st;
    }
    rk_req_options opt;
    rk_eval_config_options(&e->o.configs[ci], N, e->o.context, &opt);
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
        if ((st = rk_eval_run_prompt(svc, &e->ps.p[j], &opt, &forced, &pr->forced)) ||
            (st = rk_eval_run_prompt(svc, &e->ps.p[j], &opt, &free_run, &pr->greedy)))
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
