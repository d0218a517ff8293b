/* config/settings.h — table-driven settings: one descriptor per setting names
 * it in the JSON config file (by name), the environment (RAGKV_<NAME>) and on
 * the command line (--flag), with its type, range and help text. A table is
 * bound to the struct it fills (rk_settings), so one command can read several
 * structs — rk_config and its own options — from one file, one environment
 * and one command line.
 *
 * Precedence is the caller's: defaults, then rk_settings_load_file(), then
 * rk_settings_load_env(), then flags through rk_setting_parse().
 *
 * Ownership: setting tables are static data; an rk_settings borrows the
 * struct it binds (base) and writes only into it, within each field's size.
 * Nothing here allocates for the caller except rk_settings_json (a new
 * reference). Errors are RK_ERR_* with the message naming the setting (and
 * the file and line) in rk_error_message().
 *
 * Threads: these run at start-up, on one thread, before the structs they
 * fill are shared. No call locks: two threads must not fill the same struct,
 * and rk_settings_load_env reads the environment (getenv), which another
 * thread must not change meanwhile. */
#ifndef RK_SETTINGS_H
#define RK_SETTINGS_H

#include <getopt.h>
#include <jansson.h>
#include <stddef.h>
#include <stdio.h>

#include "config/config.h"

typedef enum rk_setting_type {
    RK_SET_INT,    /* int */
    RK_SET_AUTO,   /* int, or the word "auto", which stands for 0 (shown as "auto") */
    RK_SET_LONG,   /* long long */
    RK_SET_FLOAT,  /* float */
    RK_SET_DOUBLE, /* double */
    RK_SET_BOOL,   /* int 0/1; the flag takes no value */
    RK_SET_STR,    /* char[size] */
} rk_setting_type;

typedef struct rk_setting {
    const char *name; /* config key; the environment name is RAGKV_<NAME> */
    const char *flag; /* --flag; NULL: none (environment and config file only) */
    rk_setting_type type;
    size_t off;       /* offset in the bound struct */
    size_t size;      /* RK_SET_STR: buffer size */
    double lo, hi;    /* numeric range, inclusive */
    int invert;       /* RK_SET_BOOL: the flag sets 0 (--no-...) */
    int secret;       /* redacted by rk_settings_json() (RK_SECRET_URL: the password) */
    const char *help; /* "ARG  text" (a flag with a value) or "  text" */
} rk_setting;

/* rk_setting.secret for a URL whose password alone is secret. */
#define RK_SECRET_URL 2

/* A table bound to the struct its offsets point into. */
typedef struct rk_settings {
    const rk_setting *fields;
    size_t n;
    void *base;
} rk_settings;

/* The fields of rk_config, for binding to an rk_config. The first
 * RK_CONFIG_N_RUN_SETTINGS (backend, threads, block size, KV type and budget,
 * the memory the budget's "auto" sizes from, store and its budget) are the ones every model-running
 * command takes; the rest tune the server's pools and limits. */
extern const rk_setting rk_config_settings[];
extern const size_t rk_config_n_settings;
#define RK_CONFIG_N_RUN_SETTINGS 8

/* Set f in base from text (a flag value or environment variable). Numbers
 * must parse whole and lie in [lo, hi]; booleans are 1/0, true/false or
 * yes/no; strings must fit. RK_ERR_INVALID names the setting. */
rk_status rk_setting_parse(void *base, const rk_setting *f, const char *text);

/* The setting called name across the tables, with the struct it fills. */
const rk_setting *rk_settings_find(const rk_settings *tabs, int n_tabs, const char *name,
                                   void **base);

/* Apply a JSON object file: every key must name a setting of the right type.
 * RK_ERR_IO/RK_ERR_FORMAT/RK_ERR_INVALID with the path (and line) in the message. */
rk_status rk_settings_load_file(const rk_settings *tabs, int n_tabs, const char *path);

/* Apply every RAGKV_<NAME> variable that is set. */
rk_status rk_settings_load_env(const rk_settings *tabs, int n_tabs);

/* The effective settings as one JSON object, in table order; secrets that are
 * set show as "<set>". NULL when out of memory. */
json_t *rk_settings_json(const rk_settings *tabs, int n_tabs);

/* One help line per setting: "  --flag ARG   text". */
void rk_settings_print_help(FILE *f, const rk_settings *tabs, int n_tabs);

/* Index of the log level called name (debug, info, warn, error), -1 if none. */
int rk_log_level_parse(const char *name);

/* ---------------------------------------------------------------- model-running commands */

/* What every command that loads a model takes (generate, tokenize, prewarm,
 * bench, ...): the model file, the log level and rk_config's run settings. */
typedef struct rk_run_opts {
    rk_config cfg;
    char model[1024];   /* "" = the embedded tiny model */
    char log_level[16]; /* checked by rk_run_opts_apply */
} rk_run_opts;

enum { RK_RUN_N_TABLES = 2 };

void rk_run_opts_defaults(rk_run_opts *o);

/* Bind o's tables: tabs[0] the model and log level, tabs[1] rk_config's run settings. */
void rk_run_bind(rk_run_opts *o, rk_settings tabs[RK_RUN_N_TABLES]);

/* Check the log level and the configuration (rk_config_validate), then set
 * the process log level. RK_ERR_INVALID names the bad setting. */
rk_status rk_run_opts_apply(const rk_run_opts *o);

/* ---------------------------------------------------------------- the command line */

/* One command's command line: the flags of its tables, plus options of its
 * own that are not settings (free text, choices, short aliases). */
typedef struct rk_cmdline {
    const char *cmd;         /* "generate": names the command in messages */
    const char *prog;        /* a program of its own ("bench_radix"): messages name it instead */
    const char *usage;       /* --help prints this, the table flags, then extra_help */
    const rk_settings *tabs; /* every table's flag is accepted */
    int n_tabs;
    int n_shared; /* the first n_shared tables also read --config and RAGKV_<NAME>; with none,
                   * there is no --config */
    const struct option *extra; /* the command's own options ({0}-terminated) or NULL; */
    const char *shorts;         /* their short letters for getopt ("n:"), or NULL */
    const char *extra_help;     /* help lines of the extra options, or NULL */
    /* Called in command-line order for each extra option, with its val and
     * argument; a status other than RK_OK is a usage error (the message set). */
    rk_status (*on_extra)(void *ctx, int val, const char *arg);
    void *ctx;
    int first; /* argv index of the first option: 1, or 2 after a sub-subcommand */
} rk_cmdline;

/* Parse argv: defaults are already in the bound structs; the --config file
 * and the environment apply to the shared tables, then every flag in order.
 * Extra options' vals must lie below 2000. Returns the index of the first
 * argument that is not an option; or -1 to exit with *out_exit: 0 after
 * --help (printed), 2 on a usage error (one line on stderr, naming the flag). */
int rk_cmdline_parse(const rk_cmdline *cl, int argc, char **argv, int *out_exit);

/* The command line of a model-running command: the run options (read from
 * --config and RAGKV_<NAME> as well), the command's own tables (flags only;
 * at most RK_RUN_MAX_OWN) and cl's extra options. cl gives cmd, usage and the
 * extras; its tables are filled in here. Positional arguments are usage
 * errors. Returns 0 to go on, -1 to exit with *out_exit. The caller then
 * checks and applies run with rk_run_opts_apply. */
enum { RK_RUN_MAX_OWN = 2 };
int rk_run_parse(rk_cmdline *cl, rk_run_opts *run, const rk_settings *own, int n_own, int argc,
                 char **argv, int *out_exit);

#endif
