/* cli/cli.h — what the `ragkv` subcommands share: error and usage lines,
 * parsing a model-running subcommand's command line (the tables and the
 * parser are config/settings.h's), and the subcommands themselves for the
 * dispatch table in cli/main.c. Private to cli/. */
#ifndef RK_CLI_H
#define RK_CLI_H

#include <stdio.h>
#include <stdlib.h>

#include "config/settings.h"
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

/* ---------------------------------------------------------------- model options */

/* rk_run_parse, then rk_run_opts_apply (a failure there is a usage error).
 * Returns 0 to go on, or -1 to exit with *out_exit. */
int rk_cli_parse_run(rk_cmdline *cl, rk_run_opts *run, const rk_settings *own, int n_own, int argc,
                     char **argv, int *out_exit);

/* The service of o: its model, or the embedded one. */
static inline rk_status open_service(rk_run_opts *o, rk_service **out) {
    return rk_service_open(&o->cfg, o->model[0] ? o->model : NULL, out);
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
/* `ragkv serve` (cli/serve.c). */
int rk_serve_main(int argc, char **argv);

#endif
