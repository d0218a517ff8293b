/* cli/cli.h — what the `ragkv` subcommands share: error and usage lines,
 * the options every model-running subcommand takes, and the subcommands
 * themselves for the dispatch table in cli/main.c. Private to cli/. */
#ifndef RK_CLI_H
#define RK_CLI_H

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>

#include "pipeline/pipeline.h"

#define EXIT_USAGE 2

static inline int fail(const char *what) {
    const char *msg = rk_error_message();
    fprintf(stderr, "ragkv: %s%s%s\n", what, *msg ? ": " : "", msg);
    return EXIT_FAILURE;
}

static inline int usage_error(const char *cmd, const char *fmt, const char *arg) {
    fprintf(stderr, "ragkv %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see ragkv %s --help)\n", cmd);
    return EXIT_USAGE;
}

/* ---------------------------------------------------------------- common options */

/* Options every model-running subcommand takes. */
typedef struct common_opts {
    const char *model;
    rk_config cfg;
} common_opts;

enum {
    OPT_MODEL = 1000,
    OPT_THREADS,
    OPT_BACKEND,
    OPT_KV_MB,
    OPT_LOG,
    OPT_BLOCK,
    OPT_STORE,
    OPT_STORE_MB,
    OPT_KV_DTYPE,
};

#define COMMON_LONG_OPTS                                                                           \
    {"model", required_argument, 0, OPT_MODEL}, {"threads", required_argument, 0, OPT_THREADS},    \
        {"backend", required_argument, 0, OPT_BACKEND},                                            \
        {"kv-memory-mb", required_argument, 0, OPT_KV_MB},                                         \
        {"block-size", required_argument, 0, OPT_BLOCK},                                           \
        {"store", required_argument, 0, OPT_STORE},                                                \
        {"kv-dtype", required_argument, 0, OPT_KV_DTYPE},                                          \
        {"store-budget-mb", required_argument, 0, OPT_STORE_MB},                                   \
        {"log-level", required_argument, 0, OPT_LOG}, {                                            \
        "help", no_argument, 0, 'h'                                                                \
    }

static const char COMMON_HELP[] =
    "  --model F.gguf        model file (default: the embedded `tiny` model)\n"
    "  --threads N           compute threads (default: one per core)\n"
    "  --backend cpu|cuda    compute backend (default: cpu)\n"
    "  --kv-memory-mb N      KV cache budget in MiB (default: 1024)\n"
    "  --block-size N        tokens per KV block, power of two 8..64 (default: 16)\n"
    "  --kv-dtype T          KV storage type: f32 (default), f16 or bf16\n"
    "  --store DIR           persistent chunk store (the disk tier); created if missing\n"
    "  --store-budget-mb N   payload MiB kept on disk, least recently used evicted (0 = no limit)\n"
    "  --log-level L         debug|info|warn|error (default: warn)\n";

/* Handle one common option; returns 1 if handled, 0 if not common, -1 on bad value. */
int rk_cli_common_opt(const char *cmd, int c, common_opts *o);

static inline rk_status open_service(common_opts *o, rk_service **out) {
    rk_status st = rk_config_validate(&o->cfg);
    if (st) return st;
    return rk_service_open(&o->cfg, o->model, out);
}

/* ---------------------------------------------------------------- subcommands */

/* Each takes the arguments after `ragkv` (argv[0] is the subcommand's name)
 * and returns the exit status: 0 success, 1 runtime failure, 2 bad usage. */
int rk_cli_generate(int argc, char **argv);
int rk_cli_tokenize(int argc, char **argv);
int rk_cli_detokenize(int argc, char **argv);
int rk_cli_inspect(int argc, char **argv);
int rk_cli_mkmodel(int argc, char **argv);
int rk_cli_prewarm(int argc, char **argv);
int rk_cli_cache(int argc, char **argv);

#endif
