/* bench/svg.c — the SVG plot: TTFT distributions per mode and the rag hit
 * rate over the request list. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_internal.h"

/* ---------------------------------------------------------------- output: SVG */

static const char *const k_colors[N_MODES] = {"#d62728", "#ff7f0e", "#2ca02c", "#1f77b4",
                                              "#9467bd"};

void rk_bench_svg_text(FILE *f, double x, double y, const char *anchor, int size, const char *s) {
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

/* A panel's box, and its title above it. */
static void frame(FILE *f, double left, double right, double top, double bottom,
                  const char *title) {
    rk_bench_svg_text(f, (left + right) / 2, top - 12, "middle", 13, title);
    fprintf(f,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
            "stroke=\"#444\"/>\n",
            left, top, right - left, bottom - top);
}

/* A [0, 1] y axis from bottom to top: grid lines from left to right at each
 * quarter, labelled on the left. */
static void unit_axis(FILE *f, double left, double right, double top, double bottom) {
    for (int q = 0; q <= 4; q++) {
        double y = bottom - q / 4.0 * (bottom - top);
        char lab[16];
        snprintf(lab, sizeof lab, "%.2f", q / 4.0);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                left, y, right, y);
        rk_bench_svg_text(f, left - 6, y + 4, "end", 12, lab);
    }
}

/* The legend of panel 1 in its lower right corner (after the curves, so its
 * box covers them): a line per mode that ran. */
static void ttft_legend(FILE *f, const bench *b, double r1, double bottom, int n_legend) {
    const bench_opts *o = &b->o;
    const workload *w = &b->w;
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
        rk_bench_fmt_ms(ms, sizeof ms, m->ttft[0]);
        if (m->n_run != w->n_req) /* a --baseline-every sample */
            snprintf(lab, sizeof lab, "%s (p50 %s ms, n %d)", k_mode_names[mode], ms, m->n_run);
        else
            snprintf(lab, sizeof lab, "%s (p50 %s ms)", k_mode_names[mode], ms);
        rk_bench_svg_text(f, lx + 36, ly, "start", 12, lab);
    }
}

/* Panel 1: TTFT CDF per mode on a log axis, from l1 to r1. */
static rk_status ttft_panel(FILE *f, const bench *b, double l1, double r1, double top,
                            double bottom) {
    const bench_opts *o = &b->o;
    const workload *w = &b->w;
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
    frame(f, l1, r1, top, bottom, "TTFT distribution (CDF)");
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
        rk_bench_svg_text(f, x, bottom + 18, "middle", 12, lab);
    }
    rk_bench_svg_text(f, (l1 + r1) / 2, bottom + 38, "middle", 13,
                      "time to first token (ms, log scale)");
    unit_axis(f, l1, r1, top, bottom);
    fprintf(f,
            "<text x=\"20\" y=\"%.1f\" font-size=\"13\" text-anchor=\"middle\" "
            "transform=\"rotate(-90 20 %.1f)\">fraction of requests</text>\n",
            (top + bottom) / 2, (top + bottom) / 2);
    double *v = malloc((size_t)w->n_req * sizeof *v);
    if (!v) {
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
        qsort(v, (size_t)n, sizeof *v, rk_bench_cmp_double);
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"",
                k_colors[mode]);
        fprintf(f, "%.1f,%.1f ", X1(v[0]), Y(0));
        for (int j = 0; j < n; j++)
            fprintf(f, "%.1f,%.1f %.1f,%.1f ", X1(v[j]), Y((double)j / n), X1(v[j]),
                    Y((double)(j + 1) / n));
        fputs("\"/>\n", f);
    }
    free(v);
    ttft_legend(f, b, r1, bottom, n_legend);
#undef X1
#undef Y
    return RK_OK;
}

/* Panel 2: the rag hit rate over time, running mean, with the prediction,
 * from l2 to r2. */
static void hit_panel(FILE *f, const bench *b, double l2, double r2, double top, double bottom) {
    const workload *w = &b->w;
    const mode_result *rag = &b->res[MODE_RAG];
    int R = w->n_req;
#define X2(j) (l2 + (double)(j) / (R > 1 ? R : 1) * (r2 - l2))
#define Y(v)  (bottom - (v) * (bottom - top))
    frame(f, l2, r2, top, bottom, "rag chunk hit rate over the run");
    unit_axis(f, l2, r2, top, bottom);
    double step = pow(10, floor(log10(R > 1 ? R : 2)));
    if (R / step < 3) step /= 2;
    for (double t = 0; t <= R + 1e-9; t += step) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n",
                X2(t), top, X2(t), bottom);
        char lab[16];
        snprintf(lab, sizeof lab, "%.0f", t);
        rk_bench_svg_text(f, X2(t), bottom + 18, "middle", 12, lab);
    }
    rk_bench_svg_text(f, (l2 + r2) / 2, bottom + 38, "middle", 13, "requests");
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
        rk_bench_svg_text(f, xs + 4, bottom - 6, "start", 11, "steady state");
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
            rk_bench_svg_text(f, r2 - 220, ly, "start", 12, labels[q]);
        }
    } else {
        rk_bench_svg_text(f, (l2 + r2) / 2, (top + bottom) / 2, "middle", 13, "(no rag run)");
    }
#undef X2
#undef Y
}

rk_status rk_bench_write_svg(const bench *b, const char *path, int http) {
    const bench_opts *o = &b->o;
    const workload *w = &b->w;
    FILE *f = fopen(path, "w");
    if (!f) return rk_errorf(RK_ERR_IO, "%s: %s", path, strerror(errno));
    const double W = 1040, H = 470, top = 70, bottom = 400;
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
    rk_bench_svg_text(f, W / 2, 28, "middle", 15, title);

    rk_status st = ttft_panel(f, b, 70, 490, top, bottom);
    if (!st) hit_panel(f, b, 590, 1010, top, bottom);
    fputs("</svg>\n", f);
    int bad = ferror(f);
    if (fclose(f) || bad) return st ? st : rk_errorf(RK_ERR_IO, "%s: write failed", path);
    return st;
}
