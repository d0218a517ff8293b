/* bench/setup.h — what the bench_* programs share: their command line (a
 * settings table per program, flags only: each run is what its command line
 * says, so no --config file or RAGKV_<NAME> variable changes it) and the
 * model and service they measure. Not used by `ragkv bench` (bench.h). */
#ifndef RK_BENCH_SETUP_H
#define RK_BENCH_SETUP_H

#include "config/settings.h"
#include "pipeline/pipeline.h"

/* The model a program runs and how: a file, or a preset written to a
 * temporary file (weights of `type`, the Qwen3 vocabulary from ../shared),
 * or neither (the embedded model). */
typedef struct rk_bench_model {
    char model[1024]; /* "" = the preset, or the embedded model without one */
    int threads;
    char preset[32];
    char type[16];
    char backend[16];
    char kv_dtype[8];
    char reindex[12];
    char tmp[256]; /* the preset's file once written; removed by rk_bench_model_done */
} rk_bench_model;

/* The flags of rk_bench_model, in the order programs take a prefix of them:
 * model and threads (RK_BENCH_MODEL_FILE), then preset and type
 * (RK_BENCH_MODEL_PRESET), then backend and kv-dtype (RK_BENCH_MODEL_BACKEND),
 * then reindex (RK_BENCH_MODEL_ALL). Help lines give no defaults: they are
 * each program's, in its usage text. */
enum {
    RK_BENCH_MODEL_FILE = 2,
    RK_BENCH_MODEL_PRESET = 4,
    RK_BENCH_MODEL_BACKEND = 6,
    RK_BENCH_MODEL_ALL = 7
};

/* Defaults: no model or preset, 2 threads, f32 weights, and rk_config's
 * backend, KV type and reindex mode. */
void rk_bench_model_defaults(rk_bench_model *m);

/* Parse a bench program's flags: the first n_model flags of m (NULL: none),
 * and own (a table with its bound struct, or NULL), their defaults already set. Any
 * argument that is not a flag is rejected, and so are a weight type, backend,
 * KV type or reindex mode that is not one. A usage error is one line on stderr
 * naming the flag (with its range); --help prints usage and one line per flag.
 * Returns 0 to go on, or -1 to exit with *out_exit (0 after --help, 2 on a
 * usage error). */
int rk_bench_parse(const char *prog, const char *usage, rk_bench_model *m, int n_model,
                   const rk_settings *own, int argc, char **argv, int *out_exit);

/* The model file to open: m->model, the preset written once to m->tmp, or
 * NULL for the embedded model. */
rk_status rk_bench_model_path(rk_bench_model *m, const char **out);

/* A service on m's model with cfg's settings and m's threads, backend, KV
 * type and reindex mode. */
rk_status rk_bench_model_open(rk_bench_model *m, const rk_config *cfg, rk_service **out);

/* Remove the preset's file, if one was written. */
void rk_bench_model_done(rk_bench_model *m);

/* Text of words drawn from words[] (a seeded LCG) until it tokenizes to about
 * n_tokens; NULL when out of memory. The caller frees it. */
char *rk_bench_make_text(const rk_tokenizer *tok, const char *const *words, int n_words,
                         int n_tokens, unsigned *seed);

/* "system##chunk##...##chunk": a system prompt of about sys_tokens and
 * n_chunks chunks of about chunk_tokens, made as rk_bench_make_text makes
 * text; room is left for a "##question" of up to extra bytes. NULL when out
 * of memory. */
char *rk_bench_make_context(const rk_tokenizer *tok, const char *const *words, int n_words,
                            int sys_tokens, int n_chunks, int chunk_tokens, size_t extra,
                            unsigned *seed);

#endif
