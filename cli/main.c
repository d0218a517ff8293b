/* cli/main.c — the `ragkv` command line: one binary, one subcommand per
 * job. Exit status: 0 success, 1 runtime failure, 2 bad usage. Errors are
 * one line on stderr saying what and where. The subcommands live in
 * cli/generate.c, cli/model.c and cli/store.c; `serve` and `bench` in their
 * own modules. */
#include <string.h>

#include "bench/bench.h"
#include "bench/eval.h"
#include "cli/cli.h"

int rk_cli_parse_run(rk_cmdline *cl, rk_run_opts *run, const rk_settings *own, int n_own, int argc,
                     char **argv, int *out_exit) {
    if (rk_run_parse(cl, run, own, n_own, argc, argv, out_exit)) return -1;
    if (rk_run_opts_apply(run)) {
        *out_exit = usage_error(cl->cmd, "%s", rk_error_message());
        return -1;
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
    {"cache", rk_cli_cache,
     "inspect or rebuild a chunk store offline (ls, stats, verify, rebuild)"},
    {"bench", rk_bench_main, "run the RAG workload benchmark"},
    {"eval", rk_eval_main, "measure cached RAG answers against full attention"},
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
