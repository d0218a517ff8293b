/* bench/eval_report.c — what `ragkv eval` prints: the table and the JSON
 * object of the reference comparison and of --task, and the SVG plot of
 * quality against the share of prompt tokens recomputed. */
#include "bench/eval.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_internal.h"
#include "bench/eval_internal.h"

/* ---------------------------------------------------------------- --task output */

void rk_eval_print_task_table(const eval *e) {
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

json_t *rk_eval_task_json(const eval *e) {
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
            rk_eval_family_names[c->fam], "param", c->fam == FAM_FIRST_K ? (double)c->k : c->ratio,
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

/* ---------------------------------------------------------------- output */

void rk_eval_print_table(const eval *e) {
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

json_t *rk_eval_json(const eval *e) {
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
            "name", c->name, "family", rk_eval_family_names[c->fam], "first_top1", r->first_top1,
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
rk_status rk_eval_write_svg(const eval *e, const char *path) {
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
            snprintf(lab, sizeof lab, "%s: %s", rk_eval_family_names[fam], m == 1 ? name1 : name2);
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
