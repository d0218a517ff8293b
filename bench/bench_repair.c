/* bench/bench_repair.c — how close each repair policy brings a cached RAG
 * request to the full-attention result, for the tokens it recomputes.
 *
 *   bench_repair [--model F.gguf] [--steps N] [--threads N]
 *
 * Runs a four-piece story prompt on stories260K (a real model; from
 * ../shared) in mode plain (the reference), with the chunks cached and no
 * repair, and with first_k and deviation at matched budgets of recomputed
 * tokens. Prints, per run: tokens recomputed, the largest |logit difference|
 * from the reference at the first generated token and over all steps, and how
 * many greedy tokens agree with the reference before the first difference.
 * Not a test: it prints a table. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/setup.h"
#include "pipeline/split.h"

#define MAX_STEPS 64

static const char *STORY =
    "You are a storyteller.##Lily had a red ball. She liked to play with it in the garden every "
    "day.##Tom had a big dog named Max. Max liked to run and bark at the birds.##The sun was warm "
    "and the sky was blue. The children sang a happy song.##One day";

typedef struct run_out {
    int n_vocab, steps;
    float *logits; /* (steps, n_vocab) */
    int32_t tokens[MAX_STEPS];
    int recomputed, chunk_tokens;
    double repair_ms;
} run_out;

static void keep_logits(void *ctx, int req, int step, const float *logits, int n_vocab) {
    (void)req;
    run_out *o = ctx;
    if (step >= o->steps) return;
    if (!o->logits) o->logits = calloc((size_t)o->steps * n_vocab, sizeof *o->logits);
    if (!o->logits) return;
    o->n_vocab = n_vocab;
    memcpy(o->logits + (size_t)step * n_vocab, logits, (size_t)n_vocab * sizeof *logits);
}

static rk_status run(rk_service *svc, const rk_req_options *opt, run_out *o) {
    rk_split sp;
    rk_status st = rk_split_prompt(STORY, strlen(STORY), "##", 64, &sp);
    if (st) return st;
    rk_request r = {.opt = *opt};
    st = rk_request_prepare(svc, &sp, &r);
    rk_split_free(&sp);
    if (st) return st;
    rk_pipeline_hooks h = {.ctx = o, .on_logits = keep_logits};
    rk_request *one = &r;
    if (!(st = rk_pipeline_run(svc, &one, 1, &h))) {
        memcpy(o->tokens, r.out_tokens, (size_t)r.n_out * sizeof *o->tokens);
        o->recomputed = r.recomputed_tokens;
        o->repair_ms = r.t.repair_ms;
        for (int k = 0; k < r.n_chunks; k++) o->chunk_tokens += r.chunk_lens[k];
    }
    rk_request_free(&r);
    return st;
}

static void report(const char *name, const run_out *ref, const run_out *o) {
    double first = 0, all = 0;
    for (int s = 0; s < o->steps; s++)
        for (int i = 0; i < o->n_vocab; i++) {
            size_t at = (size_t)s * o->n_vocab + i;
            double d = fabs((double)o->logits[at] - ref->logits[at]);
            all = fmax(all, d);
            if (s == 0) first = fmax(first, d);
        }
    int same = 0;
    while (same < o->steps && o->tokens[same] == ref->tokens[same]) same++;
    printf("%-18s %10d %14.4f %14.4f %8d/%d %10.2f\n", name, o->recomputed, first, all, same,
           o->steps, o->repair_ms);
}

static const rk_setting k_steps_setting = {
    "steps", "steps",   RK_SET_INT, 0, 0,
    1,       MAX_STEPS, 0,          0, "N  greedy steps per run (default: 16)"};

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_repair [--model F.gguf] [--steps N] [--threads N]\n"
        "How close each repair policy brings a cached RAG request to full attention.\n"
        "Defaults: the stories260K model (skipped when absent), 2 threads.\n";
    rk_bench_model m;
    rk_bench_model_defaults(&m);
    snprintf(m.model, sizeof m.model, "%s", RK_SHARED_DIR "/models/stories260K.gguf");
    int steps = 16;
    rk_settings own = {&k_steps_setting, 1, &steps};
    int exit_code;
    if (rk_bench_parse("bench_repair", usage, &m, RK_BENCH_MODEL_FILE, &own, argc, argv,
                       &exit_code))
        return exit_code;
    const char *model = m.model;
    if (access(model, R_OK) != 0) {
        printf("bench_repair: skipped (%s is not there)\n", model);
        return 0;
    }
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = 256;
    rk_service *svc;
    if (rk_bench_model_open(&m, &cfg, &svc)) {
        fprintf(stderr, "bench_repair: %s\n", rk_error_message());
        return 1;
    }
    rk_req_options base;
    rk_req_options_default(&base);
    base.max_tokens = steps;
    base.sampling.temperature = 0;
    base.stop_at_eog = 0;
    rk_req_options plain = base;
    plain.mode = RK_MODE_PLAIN;
    plain.prefix_cache = 0;
    run_out ref = {.steps = steps}, none = {.steps = steps};
    int rc = 0;
    if (run(svc, &plain, &ref) || run(svc, &base, &none) || !ref.logits || !none.logits) {
        fprintf(stderr, "bench_repair: %s\n", rk_error_message());
        rc = 1;
        goto out;
    }
    printf("model %s, %d chunk tokens in 3 chunks, %d greedy steps; reference: mode plain\n", model,
           none.chunk_tokens, steps);
    printf("%-18s %10s %14s %14s %10s %10s\n", "repair", "recomputed", "max|dlogit| 1st",
           "max|dlogit| all", "same", "repair ms");
    report("none", &ref, &none);
    static const float ratios[] = {0.05f, 0.1f, 0.15f, 0.25f, 0.5f, 1.0f};
    for (size_t i = 0; i < sizeof ratios / sizeof *ratios && !rc; i++) {
        rk_req_options dev = base, fk = base;
        dev.repair_ratio = ratios[i];
        fk.repair_k = (int)ceilf(ratios[i] * none.chunk_tokens / 3); /* about the same budget */
        run_out a = {.steps = steps}, b = {.steps = steps};
        if (run(svc, &dev, &a) || run(svc, &fk, &b) || !a.logits || !b.logits) {
            fprintf(stderr, "bench_repair: %s\n", rk_error_message());
            rc = 1;
        } else {
            char name[32];
            snprintf(name, sizeof name, "deviation %.2f", ratios[i]);
            report(name, &ref, &a);
            snprintf(name, sizeof name, "first_k %d", fk.repair_k);
            report(name, &ref, &b);
        }
        free(a.logits);
        free(b.logits);
    }
out:
    free(ref.logits);
    free(none.logits);
    rk_service_close(svc);
    return rc;
}
