/* cli/serve.c — `ragkv serve`: its settings table, argument parsing,
 * signals, and the main thread's life: start the HTTP service
 * (gateway/server.h), watch the model load, wait for SIGINT or SIGTERM,
 * shut down. */
#include <getopt.h>
#include <jansson.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "config/settings.h"
#include "gateway/server.h"

/* ================================================================ settings */

/* Everything `ragkv serve` can be told: the rk_config fields and the
 * server's own. Each is settable from the JSON config file (by name), the
 * environment (RAGKV_ + the name in upper case) and a flag. */
typedef struct serve_opts {
    rk_server_options srv;
    char log_level[16];
    char model_name_policy[16];
    char reasoning[8];
} serve_opts;

#define OFF(m) offsetof(serve_opts, m)
#define STR(m) OFF(m), sizeof(((serve_opts *)0)->m)

/* The server's own settings; rk_config's come from config/settings.c. */
static const rk_setting k_serve_settings[] = {
    {"model", "model", RK_SET_STR, STR(srv.model), 0, 0, 0, 0,
     "F.gguf  model file (default: the embedded tiny model)"},
    {"host", "host", RK_SET_STR, STR(srv.host), 0, 0, 0, 0,
     "H  address to listen on (default: 127.0.0.1)"},
    {"port", "port", RK_SET_INT, OFF(srv.port), 0, 0, 65535, 0, 0,
     "P  port (default: 8080; 0 = any free port, printed)"},
    {"api_key", "api-key", RK_SET_STR, STR(srv.api_key), 0, 0, 0, 1,
     "KEY  require `Authorization: Bearer KEY` on every route but /health and /ready"},
    {"admin_key", "admin-key", RK_SET_STR, STR(srv.admin_key), 0, 0, 0, 1,
     "KEY  require this key for cache flush and chunk delete"},
    {"api_keys_file", "api-keys-file", RK_SET_STR, STR(srv.api_keys_file), 0, 0, 0, 0,
     "F  JSON keys that name tenants, each with its own cache: {\"keys\": [{\"key\", "
     "\"tenant\", \"salt\"}]} (docs/operations.md)"},
    {"max_body_bytes", "max-body-bytes", RK_SET_LONG, OFF(srv.max_body_bytes), 0, 1, 1LL << 34, 0,
     0, "N  largest request body (default: 1048576; larger: 413)"},
    {"queue", "queue", RK_SET_INT, OFF(srv.queue), 0, 1, 1 << 20, 0, 0,
     "N  requests waiting for the engine at most (default: 64; more: 503)"},
    {"timeout_s", "timeout-s", RK_SET_DOUBLE, OFF(srv.timeout_s), 0, 0.001, 1e7, 0, 0,
     "S  cancel a request waiting or running longer (default: 600)"},
    {"max_batch", "max-batch", RK_SET_INT, OFF(srv.max_batch), 0, 1, 4096, 0, 0,
     "N  requests run together at most (default: 16)"},
    {"log_prompts", "log-prompts", RK_SET_BOOL, OFF(srv.log_prompts), 0, 0, 1, 0, 0,
     "  log prompt text (never logged otherwise)"},
    {"grace_s", "grace-s", RK_SET_DOUBLE, OFF(srv.grace_s), 0, 0, 3600, 0, 0,
     "S  on SIGINT/SIGTERM, let requests finish this long (default: 5)"},
    {"http_threads", "http-threads", RK_SET_INT, OFF(srv.http_threads), 0, 0, 4096, 0, 0,
     "N  requests handled at once, more get 503 (default: 0 = queue + 16); 5 N connections "
     "are served"},
    {"request_timeout_s", "request-timeout-s", RK_SET_DOUBLE, OFF(srv.request_timeout_s), 0, 0.1,
     3600, 0, 0,
     "S  a client must send the body within this long of its headers, and read what is "
     "written to it (default: 10)"},
    {"header_timeout_s", "header-timeout-s", RK_SET_DOUBLE, OFF(srv.header_timeout_s), 0, 0.1, 3600,
     0, 0,
     "S  a connection must send its request headers within this long (at most "
     "request_timeout_s; default: 5)"},
    {"chat_separator", "chat-separator", RK_SET_STR, STR(srv.chat_separator), 0, 0, 0, 0,
     "S  split chat user messages on S into documents and question (default: none; a body's "
     "\"separator\" does it per request)"},
    {"max_connections_per_ip", "max-connections-per-ip", RK_SET_INT,
     OFF(srv.max_connections_per_ip), 0, 0, 1 << 20, 0, 0,
     "N  connections one client address may hold open; requests on more (but /health, /ready "
     "and /metrics) get 503 (default: 0 = no limit; for direct exposure only)"},
    {"served_model_name", "served-model-name", RK_SET_STR, STR(srv.served_model_name), 0, 0, 0, 0,
     "NAME[,ALIAS...]  the model name reported and accepted (default: the model's own)"},
    {"model_name_policy", "model-name-policy", RK_SET_STR, STR(model_name_policy), 0, 0, 0, 0,
     "P  any|strict: a request naming another model is answered (any, the default) or 404"},
    {"reasoning", "reasoning", RK_SET_STR, STR(reasoning), 0, 0, 0, 0,
     "M  auto|on|off: a thinking model's <think> block goes to reasoning_content (auto: when "
     "the model has <think> tokens; off: it stays in content; default: auto)"},
    {"chat_template", "chat-template", RK_SET_STR, STR(srv.chat_template), 0, 0, 0, 0,
     "NAME|F  the chat template: chatml, llama3, llama2, phi3, gemma, harmony, or a Jinja file "
     "read as "
     "the model's tokenizer.chat_template (default: the model's)"},
    {"responses_max", "responses-max", RK_SET_INT, OFF(srv.responses_max), 0, 0, 1 << 24, 0, 0,
     "N  responses kept for previous_response_id and GET /v1/responses/{id}, oldest dropped "
     "first (default: 10000; 0 = none stored)"},
    {"responses_max_bytes", "responses-max-bytes", RK_SET_LONG, OFF(srv.responses_max_bytes), 0,
     1024, 1LL << 40, 0, 0, "N  bytes of stored responses at most (default: 268435456)"},
    {"responses_ttl_s", "responses-ttl-s", RK_SET_DOUBLE, OFF(srv.responses_ttl_s), 0, 1, 1e8, 0, 0,
     "S  a stored response is dropped this long after it was made (default: 3600)"},
    {"cors_origin", "cors-origin", RK_SET_STR, STR(srv.cors_origin), 0, 0, 0, 0,
     "ORIGIN  allow browser calls from ORIGIN, or * for any (default: off)"},
    {"log_level", "log-level", RK_SET_STR, STR(log_level), 0, 0, 0, 0,
     "L  debug|info|warn|error (default: warn)"},
    {"load_delay_s", "load-delay-s", RK_SET_DOUBLE, OFF(srv.load_delay_s), 0, 0, 3600, 0, 0,
     "S  testing aid: wait before loading the model"},
    {"token_delay_s", "token-delay-s", RK_SET_DOUBLE, OFF(srv.token_delay_s), 0, 0, 60, 0, 0,
     "S  testing aid: sleep after every generated token"},
};

/* The tables `ragkv serve` reads, bound to o: its own, then rk_config's. */
enum { N_TABLES = 2 };
static void bind_settings(serve_opts *o, rk_settings tabs[N_TABLES]) {
    tabs[0] =
        (rk_settings){k_serve_settings, sizeof k_serve_settings / sizeof k_serve_settings[0], o};
    tabs[1] = (rk_settings){rk_config_settings, rk_config_n_settings, &o->srv.cfg};
}

static void opts_defaults(serve_opts *o) {
    memset(o, 0, sizeof *o);
    rk_server_options_default(&o->srv);
    snprintf(o->log_level, sizeof o->log_level, "warn");
    snprintf(o->model_name_policy, sizeof o->model_name_policy, "any");
    snprintf(o->reasoning, sizeof o->reasoning, "auto");
}

/* ================================================================ main */

static const char *k_usage =
    "usage: ragkv serve [--model F.gguf] [--config F.json] [--host H] [--port P] [options]\n"
    "Serve the HTTP API (docs/api.md). Settings come from defaults, then the --config\n"
    "file (JSON, keys as named in --print-config), then RAGKV_<NAME> environment\n"
    "variables, then flags.\n";

/* The one option of `ragkv serve` that is not a setting. */
enum { O_PRINT_CONFIG = 1 };

static rk_status on_serve_option(void *ctx, int val, const char *arg) {
    (void)arg;
    if (val == O_PRINT_CONFIG) *(int *)ctx = 1;
    return RK_OK;
}

/* Parse flags over defaults, config file and environment (every table reads
 * all three). Returns -1 to exit with status *out_exit. */
static int parse_args(int argc, char **argv, serve_opts *o, int *print_config, int *out_exit) {
    static const struct option extra[] = {{"print-config", no_argument, 0, O_PRINT_CONFIG},
                                          {0, 0, 0, 0}};
    rk_settings tabs[N_TABLES];
    opts_defaults(o);
    bind_settings(o, tabs);
    rk_cmdline cl = {.cmd = "serve",
                     .usage = k_usage,
                     .tabs = tabs,
                     .n_tabs = N_TABLES,
                     .n_shared = N_TABLES,
                     .extra = extra,
                     .extra_help =
                         "  --print-config        print the effective settings as JSON and exit\n",
                     .on_extra = on_serve_option,
                     .ctx = print_config,
                     .first = 1};
    int next = rk_cmdline_parse(&cl, argc, argv, out_exit);
    if (next < 0) return -1;
    *out_exit = EXIT_USAGE;
    if (next < argc) {
        fprintf(stderr, "ragkv serve: unexpected argument '%s' (see ragkv serve --help)\n",
                argv[next]);
        return -1;
    }
    if (rk_log_level_parse(o->log_level) < 0) {
        fprintf(stderr, "ragkv serve: log_level must be debug, info, warn or error, got '%s'\n",
                o->log_level);
        return -1;
    }
    if (strcmp(o->model_name_policy, "any") && strcmp(o->model_name_policy, "strict")) {
        fprintf(stderr, "ragkv serve: model_name_policy must be any or strict, got '%s'\n",
                o->model_name_policy);
        return -1;
    }
    o->srv.model_name_strict = !strcmp(o->model_name_policy, "strict");
    if (strcmp(o->reasoning, "auto") && strcmp(o->reasoning, "on") && strcmp(o->reasoning, "off")) {
        fprintf(stderr, "ragkv serve: reasoning must be auto, on or off, got '%s'\n", o->reasoning);
        return -1;
    }
    o->srv.reasoning = !strcmp(o->reasoning, "on") ? 1 : !strcmp(o->reasoning, "off") ? 0 : -1;
    if (rk_config_validate(&o->srv.cfg)) {
        fprintf(stderr, "ragkv serve: %s\n", rk_error_message());
        return -1;
    }
    /* A calibration's policy replaces --repair: "auto" is what it chose. */
    rk_config *cfg = &o->srv.cfg;
    if (cfg->repair_calibration[0] &&
        rk_repair_calibration_load(cfg->repair_calibration, cfg->repair, sizeof cfg->repair)) {
        fprintf(stderr, "ragkv serve: %s\n", rk_error_message());
        return -1;
    }
    return 0;
}

/* --print-config: the effective settings as JSON on stdout; the exit code. */
static int print_settings(serve_opts *o) {
    rk_settings tabs[N_TABLES];
    bind_settings(o, tabs);
    json_t *j = rk_settings_json(tabs, N_TABLES);
    rk_kv_plan kv; /* the KV sizes resolved against the model and this machine */
    if (j && rk_kv_plan_for_model(&o->srv.cfg, o->srv.model[0] ? o->srv.model : NULL, &kv) == RK_OK)
        json_object_set_new(j, "kv_resolved", rk_kv_plan_json(&kv));
    else if (j)
        fprintf(stderr, "ragkv serve: KV sizes not resolved: %s\n", rk_error_message());
    char *s =
        j ? json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(7)) : NULL;
    json_decref(j);
    if (s) puts(s);
    free(s);
    return s ? 0 : EXIT_FAILURE;
}

/* The signal that asked us to stop, or 0. A handler, not sigwait: a thread
 * a library starts before main (OpenBLAS starts its pool when it is
 * loaded) does not block SIGTERM, and the kernel may hand a process-wide
 * signal to any thread that does not block it; with the default action
 * that kills the server in the middle of its shutdown. A handler runs
 * wherever the signal lands. */
static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int sig) { stop_signal = sig; }

/* Wait for SIGINT or SIGTERM, watching the model load: 0, or EXIT_FAILURE
 * when the model could not be loaded. */
static int wait_for_signal(rk_server *S) {
    while (!stop_signal) {
        struct timespec tick = {0, 100 * 1000 * 1000};
        nanosleep(&tick, NULL); /* a signal cuts it short */
        char msg[320];
        if (!stop_signal && rk_server_poll(S, msg, sizeof msg) == RK_SCHEDULER_FAILED) {
            fprintf(stderr, "ragkv serve: cannot start: %s\n", msg);
            return EXIT_FAILURE;
        }
    }
    RK_LOG_INFO("signal %d: shutting down", (int)stop_signal);
    return 0;
}

int rk_serve_main(int argc, char **argv) {
    serve_opts *o = calloc(1, sizeof *o);
    if (!o) {
        fprintf(stderr, "ragkv serve: out of memory\n");
        return EXIT_FAILURE;
    }
    int print_config = 0, exit_code = 0;
    if (parse_args(argc, argv, o, &print_config, &exit_code)) {
        free(o);
        return exit_code;
    }
    if (print_config) {
        exit_code = print_settings(o);
        free(o);
        return exit_code;
    }
    rk_log_set_level((rk_log_level)rk_log_level_parse(o->log_level));

    /* Signals: the threads started from here on block them, so their
     * system calls are not interrupted; the main thread takes them. */
    struct sigaction sa = {0};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);

    rk_server *S = NULL;
    int rc = EXIT_FAILURE, port;
    if (rk_server_start(&o->srv, &S, &port)) {
        fprintf(stderr, "ragkv serve: %s\n", rk_error_message());
    } else {
        pthread_sigmask(SIG_UNBLOCK, &sigs, NULL);
        rc = wait_for_signal(S);
        rk_server_stop(S);
    }
    free(o);
    return rc;
}
