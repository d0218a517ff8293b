/* bench/bench_chunkcache.c — what the chunk cache buys on one RAG request:
 * TTFT of plain prefill, of the first request (every chunk a miss), of the
 * second (every chunk a hit) and of the oracle (chunks fresh at their live
 * positions), and the reindex time per 4K tokens.
 *
 *   bench_chunkcache [--model F.gguf | --preset NAME --type f32|bf16] [--threads N]
 *                    [--chunks N] [--chunk-tokens N] [--question-tokens N]
 *                    [--backend cpu|cuda] [--kv-dtype T] [--reindex zero-copy|copy]
 *
 * Defaults: qwen3-0.6b in BF16 (written to /tmp first), 8 chunks of about 256
 * tokens, a 32-token question, 2 threads. Not a test: it prints a table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/setup.h"

static const char *const WORDS[] = {
    "cache",     "model",     "token",      "chunk",    "server", "memory", "position",
    "rotation",  "attention", "document",   "question", "answer", "layer",  "block",
    "system",    "prompt",    "value",      "key",      "the",    "of",     "and",
    "retrieval", "latency",   "throughput", "kernel",   "vector", "index"};
#define N_WORDS ((int)(sizeof WORDS / sizeof *WORDS))

typedef struct opts {
    int n_chunks, chunk_tokens, q_tokens;
} opts;

static const rk_setting k_settings[] = {
    {"chunks", "chunks", RK_SET_INT, offsetof(opts, n_chunks), 0, 1, 1024, 0, 0,
     "N  chunks in the prompt (default: 8)"},
    {"chunk_tokens", "chunk-tokens", RK_SET_INT, offsetof(opts, chunk_tokens), 0, 1, 1 << 20, 0, 0,
     "N  tokens per chunk, about (default: 256)"},
    {"question_tokens", "question-tokens", RK_SET_INT, offsetof(opts, q_tokens), 0, 1, 1 << 20, 0,
     0, "N  question length in tokens, about (default: 32)"},
};

static void *or_die(void *p) {
    if (!p) {
        fprintf(stderr, "bench_chunkcache: out of memory\n");
        exit(1);
    }
    return p;
}

/* system##chunk##...##question: a 24-token system prompt, o's chunks and question. */
static char *make_prompt(const rk_tokenizer *tok, const opts *o) {
    unsigned seed = 7;
    size_t extra = (size_t)o->q_tokens * 16 + 64;
    char *prompt = or_die(
        rk_bench_make_context(tok, WORDS, N_WORDS, 24, o->n_chunks, o->chunk_tokens, extra, &seed));
    char *q = or_die(rk_bench_make_text(tok, WORDS, N_WORDS, o->q_tokens, &seed));
    size_t len = strlen(prompt);
    snprintf(prompt + len, extra, "##%s", q);
    free(q);
    return prompt;
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
    static const char *usage =
        "usage: bench_chunkcache [--model F.gguf | --preset NAME --type f32|bf16] [--threads N]\n"
        "                        [--chunks N] [--chunk-tokens N] [--question-tokens N]\n"
        "                        [--backend cpu|cuda] [--kv-dtype T] [--reindex zero-copy|copy]\n"
        "TTFT of one RAG request: plain prefill, every chunk missed, every chunk hit, the\n"
        "oracle; and the reindex time. Defaults: the qwen3-0.6b preset in BF16, 2 threads.\n";
    rk_bench_model m;
    rk_bench_model_defaults(&m);
    snprintf(m.preset, sizeof m.preset, "qwen3-0.6b");
    snprintf(m.type, sizeof m.type, "bf16");
    opts o = {.n_chunks = 8, .chunk_tokens = 256, .q_tokens = 32};
    rk_settings own = {k_settings, sizeof k_settings / sizeof k_settings[0], &o};
    int exit_code;
    if (rk_bench_parse("bench_chunkcache", usage, &m, RK_BENCH_MODEL_ALL, &own, argc, argv,
                       &exit_code))
        return exit_code;
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = 8192;
    cfg.max_chunks = 1024;
    rk_service *svc;
    if (rk_bench_model_open(&m, &cfg, &svc)) {
        fprintf(stderr, "bench_chunkcache: %s\n", rk_error_message());
        rk_bench_model_done(&m);
        return 1;
    }
    int n_chunks = o.n_chunks, q_tokens = o.q_tokens, threads = m.threads;
    char *prompt = make_prompt(rk_model_tokenizer(svc->model), &o);

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
    printf("  reindex (%s): %.2f ms for %d tokens = %.2f ms per 4K tokens\n", m.reindex, reindex_ms,
           chunk_total, reindex_ms * 4096.0 / chunk_total);
    free(prompt);
    rk_service_close(svc);
    rk_bench_model_done(&m);
    return 0;
}
