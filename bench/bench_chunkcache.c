/* bench/bench_chunkcache.c — what the chunk cache buys on one RAG request:
 * TTFT of plain prefill, of the first request (every chunk a miss), of the
 * second (every chunk a hit) and of the oracle (chunks fresh at their live
 * positions), and the reindex time per 4K tokens.
 *
 *   bench_chunkcache [--model F.gguf | --preset NAME --type f32|bf16] [--threads N]
 *                    [--chunks N] [--chunk-tokens N] [--question-tokens N]
 *
 * Defaults: qwen3-0.6b in BF16 (written to /tmp first), 8 chunks of about 256
 * tokens, a 32-token question, 2 threads. Not a test: it prints a table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/mkmodel.h"
#include "pipeline/pipeline.h"

static const char *WORDS[] = {
    "cache",     "model",     "token",      "chunk",    "server", "memory", "position",
    "rotation",  "attention", "document",   "question", "answer", "layer",  "block",
    "system",    "prompt",    "value",      "key",      "the",    "of",     "and",
    "retrieval", "latency",   "throughput", "kernel",   "vector", "index"};

/* Append words until the text tokenizes to about n tokens. */
static char *make_text(const rk_tokenizer *tok, int n, unsigned *seed) {
    size_t cap = (size_t)n * 16 + 64, len = 0;
    char *s = malloc(cap);
    s[0] = '\0';
    for (;;) {
        *seed = *seed * 1103515245u + 12345u;
        const char *w = WORDS[(*seed >> 16) % (sizeof WORDS / sizeof *WORDS)];
        len += (size_t)snprintf(s + len, cap - len, "%s%s", len ? " " : "", w);
        int32_t *ids;
        size_t k;
        if (rk_tokenizer_encode(tok, s, len, 0, &ids, &k)) return s;
        free(ids);
        if ((int)k >= n || len + 32 > cap) return s;
    }
}

static double run(rk_service *svc, const char *prompt, rk_req_options o, rk_request *out) {
    rk_split sp;
    if (rk_split_prompt(prompt, strlen(prompt), NULL, 1024, &sp)) return -1;
    memset(out, 0, sizeof *out);
    out->opt = o;
    rk_status st = rk_request_prepare(svc, &sp, out);
    rk_split_free(&sp);
    rk_request *one = out;
    if (st || rk_pipeline_run(svc, &one, 1, NULL)) {
        fprintf(stderr, "bench_chunkcache: %s\n", rk_error_message());
        exit(1);
    }
    return out->t.ttft_ms;
}

int main(int argc, char **argv) {
    const char *model = NULL, *preset = "qwen3-0.6b", *type = "bf16", *backend = "cpu",
               *kv_dtype = "f32";
    int threads = 2, n_chunks = 8, chunk_tokens = 256, q_tokens = 32;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--preset"))
            preset = v;
        else if (!strcmp(a, "--type"))
            type = v;
        else if (!strcmp(a, "--threads"))
            threads = atoi(v);
        else if (!strcmp(a, "--backend"))
            backend = v;
        else if (!strcmp(a, "--kv-dtype"))
            kv_dtype = v;
        else if (!strcmp(a, "--chunks"))
            n_chunks = atoi(v);
        else if (!strcmp(a, "--chunk-tokens"))
            chunk_tokens = atoi(v);
        else if (!strcmp(a, "--question-tokens"))
            q_tokens = atoi(v);
        else {
            fprintf(stderr, "bench_chunkcache: unknown option %s\n", a);
            return 2;
        }
    }
    char tmp[256] = "";
    if (!model) {
        snprintf(tmp, sizeof tmp, "/tmp/ragkv-bench-cc-%s-%s-%d.gguf", preset, type, (int)getpid());
        rk_mkmodel_opts o;
        rk_mkmodel_opts_default(&o);
        o.preset = preset;
        o.vocab_path = RK_SHARED_DIR "/tokenizers/qwen3/tokenizer.json";
        if (rk_mkmodel_parse_wtype(type, &o.wtype) || rk_mkmodel_write(tmp, &o)) {
            fprintf(stderr, "bench_chunkcache: %s\n", rk_error_message());
            return 1;
        }
        model = tmp;
    }
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = threads;
    snprintf(cfg.backend, sizeof cfg.backend, "%s", backend);
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "%s", kv_dtype);
    cfg.kv_memory_mb = 8192;
    cfg.max_chunks = 1024;
    rk_service *svc;
    if (rk_service_open(&cfg, model, &svc)) {
        fprintf(stderr, "bench_chunkcache: %s\n", rk_error_message());
        if (*tmp) remove(tmp);
        return 1;
    }
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    unsigned seed = 7;
    size_t cap = (size_t)(n_chunks + 2) * ((size_t)chunk_tokens * 16 + 64), len = 0;
    char *prompt = malloc(cap);
    char *sys = make_text(tok, 24, &seed);
    len += (size_t)snprintf(prompt + len, cap - len, "%s", sys);
    free(sys);
    for (int k = 0; k < n_chunks; k++) {
        char *c = make_text(tok, chunk_tokens, &seed);
        len += (size_t)snprintf(prompt + len, cap - len, "##%s", c);
        free(c);
    }
    char *q = make_text(tok, q_tokens, &seed);
    snprintf(prompt + len, cap - len, "##%s", q);
    free(q);

    rk_req_options rag;
    rk_req_options_default(&rag);
    rag.max_tokens = 1;
    rag.sampling.temperature = 0;
    rk_req_options plain = rag, oracle = rag;
    plain.mode = RK_MODE_PLAIN;
    plain.prefix_cache = 0;
    oracle.chunk_cache = 0;
    rk_request r;
    double t_plain = run(svc, prompt, plain, &r);
    int prompt_tokens = r.prompt_tokens;
    rk_request_free(&r);
    double t_miss = run(svc, prompt, rag, &r);
    rk_request_free(&r);
    double t_hit = run(svc, prompt, rag, &r);
    double reindex_ms = r.t.reindex_ms;
    int chunk_total = 0;
    for (int k = 0; k < r.n_chunks; k++) chunk_total += r.chunk_lens[k];
    int hits = 0;
    for (int k = 0; k < r.n_chunks; k++) hits += r.chunk_reports[k].status == RK_CHUNK_STATUS_HIT;
    int computed = r.computed_tokens;
    rk_request_free(&r);
    double t_oracle = run(svc, prompt, oracle, &r);
    rk_request_free(&r);

    const rk_hparams *hp = rk_model_hparams(svc->model);
    printf("%s (%s, %s weights), %d threads; %d chunks (%d tokens in all) + %d-token question, "
           "%d prompt tokens\n",
           hp->name, hp->arch_name, rk_dtype_name(hp->wtype), threads, n_chunks, chunk_total,
           q_tokens, prompt_tokens);
    printf("  %-34s %10.1f ms\n", "plain prefill (no cache)", t_plain);
    printf("  %-34s %10.1f ms\n", "first request (every chunk missed)", t_miss);
    printf("  %-34s %10.1f ms   (%d/%d chunks hit, %d tokens computed)\n",
           "second request (every chunk hit)", t_hit, hits, n_chunks, computed);
    printf("  %-34s %10.1f ms\n", "oracle (chunks fresh, no cache)", t_oracle);
    printf("  all-hit TTFT = 1/%.1f of plain prefill\n", t_plain / t_hit);
    printf("  reindex: %.2f ms for %d tokens = %.2f ms per 4K tokens\n", reindex_ms, chunk_total,
           reindex_ms * 4096.0 / chunk_total);
    free(prompt);
    rk_service_close(svc);
    if (*tmp) remove(tmp);
    return 0;
}
