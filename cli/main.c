/* cli/main.c — the `ragkv` command line: one binary, one subcommand per
 * job. Exit status: 0 success, 1 runtime failure, 2 bad usage. Errors are
 * one line on stderr saying what and where. The subcommands live in
 * cli/generate.c, cli/model.c and cli/store.c; `serve` and `bench` in their
 * own modules. */
#include <string.h>

#include "bench/bench.h"
#include "cli/cli.h"
#include "gateway/server.h"

int rk_cli_common_opt(const char *cmd, int c, common_opts *o) {
    long v;
    switch (c) {
    case OPT_MODEL: o->model = optarg; return 1;
    case OPT_THREADS:
        if (rk_parse_long(optarg, 0, 1024, &v))
            return usage_error(cmd, "bad --threads '%s'", optarg), -1;
        o->cfg.n_threads = (int)v;
        return 1;
    case OPT_BACKEND: snprintf(o->cfg.backend, sizeof o->cfg.backend, "%s", optarg); return 1;
    case OPT_KV_MB:
        if (rk_parse_long(optarg, 1, 1 << 24, &v))
            return usage_error(cmd, "bad --kv-memory-mb '%s'", optarg), -1;
        o->cfg.kv_memory_mb = (int)v;
        return 1;
    case OPT_KV_DTYPE:
        if (strcmp(optarg, "f32") && strcmp(optarg, "f16") && strcmp(optarg, "bf16"))
            return usage_error(cmd, "--kv-dtype is f32, f16 or bf16, not '%s'", optarg), -1;
        snprintf(o->cfg.kv_dtype, sizeof o->cfg.kv_dtype, "%s", optarg);
        return 1;
    case OPT_STORE:
        if (strlen(optarg) >= sizeof o->cfg.store_dir)
            return usage_error(cmd, "--store path too long: '%s'", optarg), -1;
        snprintf(o->cfg.store_dir, sizeof o->cfg.store_dir, "%s", optarg);
        return 1;
    case OPT_STORE_MB:
        if (rk_parse_long(optarg, 0, 1 << 30, &v))
            return usage_error(cmd, "bad --store-budget-mb '%s'", optarg), -1;
        o->cfg.store_budget_mb = (int)v;
        return 1;
    case OPT_BLOCK:
        if (rk_parse_long(optarg, 1, 1 << 20, &v))
            return usage_error(cmd, "bad --block-size '%s'", optarg), -1;
        o->cfg.block_size = (int)v;
        return 1;
    case OPT_LOG: {
        static const char *names[] = {"debug", "info", "warn", "error"};
        for (int i = 0; i < 4; i++)
            if (!strcmp(optarg, names[i])) {
                rk_log_set_level((rk_log_level)i);
                return 1;
            }
        return usage_error(cmd, "bad --log-level '%s'", optarg), -1;
    }
    }
    return 0;
}

/* ---------------------------------------------------------------- main */

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} commands[] = {
    {"serve", rk_serve_main, "run the HTTP service"},
    {"generate", rk_cli_generate, "generate text in-process"},
    {"tokenize", rk_cli_tokenize, "print the token ids of a text"},
    {"detokenize", rk_cli_detokenize, "print the text of token ids"},
    {"mkmodel", rk_cli_mkmodel, "write a synthetic GGUF model"},
    {"inspect", rk_cli_inspect, "describe a GGUF file"},
    {"prewarm", rk_cli_prewarm, "compute chunk KV offline into the store"},
    {"cache", rk_cli_cache, "read a chunk store offline (ls, stats, verify)"},
    {"bench", rk_bench_main, "run the RAG workload benchmark"},
};

static void print_usage(FILE *f) {
    fputs("usage: ragkv COMMAND [options]   (ragkv COMMAND --help for its options)\n\ncommands:\n",
          f);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].what);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        print_usage(stderr);
        return EXIT_USAGE;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        print_usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        puts("ragkv 0.1.0");
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "ragkv: unknown command '%s'\n", argv[1]);
    print_usage(stderr);
    return EXIT_USAGE;
}
