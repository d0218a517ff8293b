/* config/settings.h — table-driven settings: one descriptor per setting names
 * it in the JSON config file (by name), the environment (RAGKV_<NAME>) and on
 * the command line (--flag), with its type, range and help text. A table is
 * bound to the struct it fills (rk_settings), so one command can read several
 * structs — rk_config and its own options — from one file, one environment
 * and one command line.
 *
 * Precedence is the caller's: defaults, then rk_settings_load_file(), then
 * rk_settings_load_env(), then flags through rk_setting_parse(). */
#ifndef RK_SETTINGS_H
#define RK_SETTINGS_H

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>

#include "config/config.h"

typedef enum rk_setting_type {
    RK_SET_INT,    /* int */
    RK_SET_LONG,   /* long long */
    RK_SET_FLOAT,  /* float */
    RK_SET_DOUBLE, /* double */
    RK_SET_BOOL,   /* int 0/1; the flag takes no value */
    RK_SET_STR,    /* char[size] */
} rk_setting_type;

typedef struct rk_setting {
    const char *name; /* config key; the environment name is RAGKV_<NAME> */
    const char *flag; /* --flag */
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

/* The fields of rk_config, for binding to an rk_config. */
extern const rk_setting rk_config_settings[];
extern const size_t rk_config_n_settings;

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

#endif
