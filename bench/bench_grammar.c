/* bench/bench_grammar.c — the cost of constrained sampling on the Qwen3
 * vocabulary (151,936 ids): building the vocabulary's byte trie, compiling
 * schemas, and per decode step the token mask (first visits of a state and
 * cached ones) plus the masked sampler against the plain one. Generation is
 * simulated by a seeded walk that samples from random logits under the mask,
 * so every figure is the grammar's cost alone, without the model. Prints
 * numbers; asserts nothing. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/setup.h"
#include "config/config.h"
#include "engine/engine.h"
#include "engine/grammar.h"
#include "pipeline/pipeline.h"

#define N_VOCAB 151936

static const char *const k_schemas[][2] = {
    {"json_object", NULL},
    {"person",
     "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
     "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
     "\"email\":{\"type\":\"string\",\"pattern\":\"^[a-z0-9._]+@[a-z]+\\\\.[a-z]{2,3}$\"},"
     "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",\"c\"]},\"maxItems\":4}},"
     "\"required\":[\"name\",\"age\",\"email\",\"tags\"],\"additionalProperties\":false}"},
    {"tree",
     "{\"$defs\":{\"n\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"number\"},"
     "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/n\"}}},"
     "\"required\":[\"v\",\"kids\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/n\"}"},
};

/* Decode tokens per second of one request (16-token prompt, temperature 1,
 * seed 1, up to n tokens) constrained to g (NULL: none), from the first token
 * to the last, sampling and masks included. */
static double decode_rate(rk_service *svc, const rk_grammar *g, int n, int *n_out) {
    int32_t prompt[16];
    for (int i = 0; i < 16; i++) prompt[i] = 100 + 37 * i;
    rk_request r;
    memset(&r, 0, sizeof r);
    rk_req_options_default(&r.opt);
    r.opt.max_tokens = n;
    r.opt.sampling.seed = 1;
    r.opt.stop_at_eog = 0;
    r.opt.prefix_cache = 0;
    r.opt.grammar = g;
    rk_request *rp = &r;
    if (rk_request_prepare_tokens(svc, prompt, 1, prompt + 1, 15, &r) ||
        rk_pipeline_run(svc, &rp, 1, NULL)) {
        printf("decode: %s\n", rk_error_message());
        rk_request_free(&r);
        return 0;
    }
    *n_out = r.n_out;
    double rate = r.n_out > 1 ? (r.n_out - 1) / ((r.t.total_ms - r.t.ttft_ms) / 1e3) : 0;
    rk_request_free(&r);
    return rate;
}

/* With --model or --preset: decode with and without a schema on that model. */
static void bench_decode(rk_bench_model *m, int n) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = 2048;
    rk_service *svc;
    if (rk_bench_model_open(m, &cfg, &svc)) {
        printf("decode: %s\n", rk_error_message());
        return;
    }
    json_t *j = json_loads(k_schemas[1][1], 0, NULL);
    rk_grammar *person = NULL, *obj = NULL;
    if (rk_grammar_from_schema(j, &person) || rk_grammar_json_object(&obj)) {
        printf("decode: %s\n", rk_error_message());
    } else {
        const rk_grammar_vocab *gv;
        (void)rk_service_grammar_vocab(svc, &gv); /* built once, outside the timing */
        int n0 = 0, n1 = 0, n2 = 0;
        double plain = decode_rate(svc, NULL, n, &n0);
        double with_obj = decode_rate(svc, obj, n, &n1);
        double with_schema = decode_rate(svc, person, n, &n2);
        double plain2 = decode_rate(svc, NULL, n, &n0);
        printf("decode on %s, %d threads: unconstrained %.2f / %.2f tok/s (%d tokens), "
               "json_object %.2f tok/s (%d tokens), schema 'person' %.2f tok/s (%d tokens)\n",
               m->model[0] ? m->model : m->preset, m->threads, plain, plain2, n0, with_obj, n1,
               with_schema, n2);
    }
    json_decref(j);
    rk_grammar_free(person);
    rk_grammar_free(obj);
    rk_service_close(svc);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_grammar [--model F.gguf | --preset NAME --type T] [--threads N]\n"
        "Per-token mask cost of constrained sampling on the Qwen3 vocabulary (schemas and\n"
        "json_object); with a model, decode tok/s with and without a schema on it.\n";
    rk_bench_model model;
    rk_bench_model_defaults(&model);
    int exit_code;
    if (rk_bench_parse("bench_grammar", usage, &model, RK_BENCH_MODEL_PRESET, NULL, argc, argv,
                       &exit_code))
        return exit_code;
    rk_vocab v;
    if (rk_vocab_from_hf_json(RK_SHARED_DIR "/tokenizers/qwen3/tokenizer.json", N_VOCAB, &v) !=
        RK_OK) {
        printf("qwen3 vocabulary: %s (skipped)\n", rk_error_message());
        return 0;
    }
    rk_tokenizer *tok;
    if (rk_tokenizer_create(&v, &tok) != RK_OK) return 1;
    rk_vocab_free(&v);
    double t0 = rk_time_now();
    rk_grammar_vocab *gv;
    if (rk_grammar_vocab_create(tok, &gv) != RK_OK) return 1;
    printf("vocabulary trie: %d ids, built in %.1f ms (once per model)\n", rk_grammar_vocab_n(gv),
           (rk_time_now() - t0) * 1e3);

    enum { STEPS = 400, SEEDS = 3 };
    float *logits = malloc((size_t)N_VOCAB * sizeof *logits);
    double *times = malloc((size_t)STEPS * SEEDS * sizeof *times);
    if (!logits || !times) return 1;
    printf("%-12s %9s %7s %9s %9s %9s %9s %8s %10s %10s %12s\n", "grammar", "compile", "tokens",
           "mean ms", "p50 ms", "p99 ms", "max ms", "states", "bytes", "budget ms", "finished");
    for (size_t k = 0; k < sizeof k_schemas / sizeof *k_schemas; k++) {
        rk_grammar *g;
        double c0 = rk_time_now();
        rk_status st;
        if (k_schemas[k][1]) {
            json_t *j = json_loads(k_schemas[k][1], 0, NULL);
            st = rk_grammar_from_schema(j, &g);
            json_decref(j);
        } else {
            st = rk_grammar_json_object(&g);
        }
        double compile_ms = (rk_time_now() - c0) * 1e3;
        if (st != RK_OK) {
            printf("%s: %s\n", k_schemas[k][0], rk_error_message());
            return 1;
        }
        int n_times = 0, finished = 0, states = 0;
        double budget_ms = 0;
        size_t bytes = 0;
        for (int seed = 1; seed <= SEEDS; seed++) {
            rk_sampler smp;
            rk_sampler_params p = {.temperature = 1, .top_p = 1, .seed = (uint64_t)seed};
            if (rk_sampler_init(&smp, &p, N_VOCAB) != RK_OK) return 1;
            rk_grammar_state *s;
            if (rk_grammar_state_create(g, gv, &s) != RK_OK) return 1;
            unsigned r = (unsigned)seed;
            for (int step = 0; step < STEPS; step++) {
                for (int i = 0; i < N_VOCAB; i++) logits[i] = (float)rand_r(&r) / RAND_MAX * 4;
                double m0 = rk_time_now();
                const uint64_t *m;
                if (rk_grammar_state_mask(s, &m) != RK_OK) {
                    printf("mask: %s\n", rk_error_message());
                    return 1;
                }
                double m1 = rk_time_now();
                /* The mask a request 64 tokens before max_tokens draws from. */
                const uint64_t *bm;
                int n_ok;
                double b0 = rk_time_now();
                if (rk_grammar_state_mask_budget(s, 64, &bm, &n_ok) != RK_OK) return 1;
                budget_ms += (rk_time_now() - b0) * 1e3;
                int32_t id = rk_sampler_sample_masked(&smp, logits, m);
                double m2 = rk_time_now();
                if (id < 0 || rk_grammar_state_accept(s, id) != RK_OK) return 1;
                (void)m2;
                times[n_times++] = (m1 - m0) * 1e3; /* the mask alone */
                if (rk_tokenizer_is_eog(tok, id)) {
                    finished++;
                    break;
                }
                bytes += (size_t)rk_tokenizer_token_bytes(tok, id, 0, NULL, 0);
            }
            states += rk_grammar_state_n_states(s);
            rk_grammar_state_free(s);
            rk_sampler_free(&smp);
        }
        double sum = 0;
        for (int i = 0; i < n_times; i++) sum += times[i];
        qsort(times, (size_t)n_times, sizeof *times, cmp_double);
        printf("%-12s %7.2fms %7d %9.3f %9.3f %9.3f %9.2f %8d %10zu %10.3f %9d/%d\n",
               k_schemas[k][0], compile_ms, n_times, sum / n_times, times[n_times / 2],
               times[(int)(n_times * 0.99)], times[n_times - 1], states / SEEDS, bytes,
               budget_ms / n_times, finished, SEEDS);
        rk_grammar_free(g);
    }

    /* The sampler with and without a mask (a mask allowing every third id). */
    uint64_t *all = malloc(((size_t)N_VOCAB + 63) / 64 * sizeof *all);
    if (!all) return 1;
    for (int w = 0; w < (N_VOCAB + 63) / 64; w++) all[w] = 0x4924924924924924ull;
    rk_sampler smp;
    rk_sampler_params p = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .seed = 7};
    if (rk_sampler_init(&smp, &p, N_VOCAB) != RK_OK) return 1;
    double best_plain = 1e9, best_masked = 1e9;
    for (int rep = 0; rep < 20; rep++) {
        double a = rk_time_now();
        (void)rk_sampler_sample(&smp, logits);
        double b = rk_time_now();
        (void)rk_sampler_sample_masked(&smp, logits, all);
        double c = rk_time_now();
        best_plain = fmin(best_plain, b - a);
        best_masked = fmin(best_masked, c - b);
    }
    printf("sampler (T 0.8, top-k 40, top-p 0.95), best of 20: plain %.3f ms, masked %.3f ms\n",
           best_plain * 1e3, best_masked * 1e3);
    rk_sampler_free(&smp);
    free(all);
    free(logits);
    free(times);
    rk_grammar_vocab_free(gv);
    rk_tokenizer_free(tok);
    if (model.model[0] || model.preset[0]) bench_decode(&model, 48);
    rk_bench_model_done(&model);
    return 0;
}
