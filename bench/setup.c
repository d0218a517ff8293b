/* bench/setup.c — see setup.h. */
#include "bench/setup.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/mkmodel.h"

#define M_OFF(m) offsetof(rk_bench_model, m)
#define M_STR(m) M_OFF(m), sizeof(((rk_bench_model *)0)->m)

static const rk_setting k_model_settings[] = {
    {"model", "model", RK_SET_STR, M_STR(model), 0, 0, 0, 0, "F.gguf  model file"},
    {"threads", "threads", RK_SET_INT, M_OFF(threads), 0, 0, 1024, 0, 0,
     "N  compute threads (0 = one per core)"},
    {"preset", "preset", RK_SET_STR, M_STR(preset), 0, 0, 0, 0,
     "NAME  without --model: write this `ragkv mkmodel` preset to a temporary file"},
    {"type", "type", RK_SET_STR, M_STR(type), 0, 0, 0, 0,
     "T  the preset's weights: f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k, q3_k_m, q2_k, "
     "iq4_xs or mxfp4"},
    {"backend", "backend", RK_SET_STR, M_STR(backend), 0, 0, 0, 0, "cpu|cuda  compute backend"},
    {"kv_dtype", "kv-dtype", RK_SET_STR, M_STR(kv_dtype), 0, 0, 0, 0,
     "T  KV storage type: f32, f16, bf16 or q8_0"},
    {"reindex", "reindex", RK_SET_STR, M_STR(reindex), 0, 0, 0, 0,
     "MODE  cached chunks: zero-copy (attended in place) or copy"},
};

void rk_bench_model_defaults(rk_bench_model *m) {
    memset(m, 0, sizeof *m);
    rk_config cfg;
    rk_config_defaults(&cfg);
    m->threads = 2;
    snprintf(m->type, sizeof m->type, "f32");
    snprintf(m->backend, sizeof m->backend, "%s", cfg.backend);
    snprintf(m->kv_dtype, sizeof m->kv_dtype, "%s", cfg.kv_dtype);
    snprintf(m->reindex, sizeof m->reindex, "%s", cfg.reindex);
}

/* The values a settings range cannot check. */
static rk_status model_check(const rk_bench_model *m) {
    rk_ggml_type t;
    rk_config cfg;
    rk_config_defaults(&cfg);
    snprintf(cfg.backend, sizeof cfg.backend, "%s", m->backend);
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "%s", m->kv_dtype);
    snprintf(cfg.reindex, sizeof cfg.reindex, "%s", m->reindex);
    if (rk_mkmodel_parse_wtype(m->type, &t))
        return rk_errorf(RK_ERR_INVALID,
                         "--type must be f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k, q3_k_m, "
                         "q2_k, iq4_xs or mxfp4, got '%s'",
                         m->type);
    return rk_config_validate(&cfg);
}

int rk_bench_parse(const char *prog, const char *usage, rk_bench_model *m, int n_model,
                   const rk_settings *own, int argc, char **argv, int *out_exit) {
    rk_settings tabs[2];
    int n_tabs = 0;
    if (m) tabs[n_tabs++] = (rk_settings){k_model_settings, (size_t)n_model, m};
    if (own) tabs[n_tabs++] = *own;
    rk_cmdline cl = {.cmd = prog, .prog = prog, .usage = usage, .first = 1};
    cl.tabs = tabs;
    cl.n_tabs = n_tabs;
    int next = rk_cmdline_parse(&cl, argc, argv, out_exit);
    if (next < 0) return -1;
    *out_exit = 2;
    if (next < argc) {
        fprintf(stderr, "%s: unexpected argument: %s (see %s --help)\n", prog, argv[next], prog);
        return -1;
    }
    if (m && model_check(m)) {
        fprintf(stderr, "%s: %s (see %s --help)\n", prog, rk_error_message(), prog);
        return -1;
    }
    return 0;
}

rk_status rk_bench_model_path(rk_bench_model *m, const char **out) {
    *out = m->model[0] ? m->model : NULL;
    if (m->model[0] || !m->preset[0]) return RK_OK;
    if (!m->tmp[0]) {
        rk_mkmodel_opts o;
        rk_mkmodel_opts_default(&o);
        o.preset = m->preset;
        o.vocab_path = RK_SHARED_DIR "/tokenizers/qwen3/tokenizer.json";
        rk_status st = rk_mkmodel_parse_wtype(m->type, &o.wtype); /* checked by rk_bench_parse */
        if (st) return st;
        char path[sizeof m->tmp];
        snprintf(path, sizeof path, "/tmp/ragkv-bench-%s-%s-%d.gguf", m->preset, m->type,
                 (int)getpid());
        fprintf(stderr, "writing %s ...\n", path);
        if ((st = rk_mkmodel_write(path, &o))) {
            remove(path);
            return st;
        }
        snprintf(m->tmp, sizeof m->tmp, "%s", path);
    }
    *out = m->tmp;
    return RK_OK;
}

rk_status rk_bench_model_open(rk_bench_model *m, const rk_config *cfg, rk_service **out) {
    const char *path;
    rk_status st = rk_bench_model_path(m, &path);
    if (st) return st;
    rk_config c = *cfg;
    c.n_threads = m->threads;
    snprintf(c.backend, sizeof c.backend, "%s", m->backend);
    snprintf(c.kv_dtype, sizeof c.kv_dtype, "%s", m->kv_dtype);
    snprintf(c.reindex, sizeof c.reindex, "%s", m->reindex);
    return rk_service_open(&c, path, out);
}

void rk_bench_model_done(rk_bench_model *m) {
    if (m->tmp[0]) remove(m->tmp);
    m->tmp[0] = '\0';
}

char *rk_bench_make_text(const rk_tokenizer *tok, const char *const *words, int n_words,
                         int n_tokens, unsigned *seed) {
    size_t cap = (size_t)n_tokens * 16 + 64, len = 0;
    char *s = malloc(cap);
    if (!s) return NULL;
    s[0] = '\0';
    for (;;) {
        *seed = *seed * 1103515245u + 12345u;
        const char *w = words[(*seed >> 16) % (unsigned)n_words];
        len += (size_t)snprintf(s + len, cap - len, "%s%s", len ? " " : "", w);
        int32_t *ids;
        size_t k;
        if (rk_tokenizer_encode(tok, s, len, 0, &ids, &k)) return s;
        free(ids);
        if ((int)k >= n_tokens || len + 32 > cap) return s;
    }
}

char *rk_bench_make_context(const rk_tokenizer *tok, const char *const *words, int n_words,
                            int sys_tokens, int n_chunks, int chunk_tokens, size_t extra,
                            unsigned *seed) {
    size_t cap = (size_t)(n_chunks + 1) * ((size_t)chunk_tokens * 16 + 64) +
                 (size_t)sys_tokens * 16 + 64 + extra,
           len = 0;
    char *out = malloc(cap);
    char *piece = out ? rk_bench_make_text(tok, words, n_words, sys_tokens, seed) : NULL;
    if (piece) len += (size_t)snprintf(out + len, cap - len, "%s", piece);
    for (int k = 0; k < n_chunks && piece; k++) {
        free(piece);
        piece = rk_bench_make_text(tok, words, n_words, chunk_tokens, seed);
        if (piece) len += (size_t)snprintf(out + len, cap - len, "##%s", piece);
    }
    if (!piece) {
        free(out);
        return NULL;
    }
    free(piece);
    return out;
}
