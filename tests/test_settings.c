/* tests/test_settings.c — config/settings: text parsing with ranges, the JSON
 * config file (unknown keys, wrong types, bad JSON), the environment, the
 * effective settings as JSON with secrets redacted, and the help lines. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "config/settings.h"
#include "tests/testutil.h"

typedef struct own {
    int port;
    char key[8];
} own;

static const rk_setting k_own[] = {
    {"port", "port", RK_SET_INT, offsetof(own, port), 0, 0, 65535, 0, 0, "P  port"},
    {"key", "key", RK_SET_STR, offsetof(own, key), sizeof(((own *)0)->key), 0, 0, 0, 1, "K  key"},
};

static void bind_settings(own *o, rk_config *cfg, rk_settings tabs[2]) {
    memset(o, 0, sizeof *o);
    rk_config_defaults(cfg);
    tabs[0] = (rk_settings){k_own, 2, o};
    tabs[1] = (rk_settings){rk_config_settings, rk_config_n_settings, cfg};
}

Test(settings, text_values_are_range_checked_and_named_in_errors) {
    own o;
    rk_config cfg;
    rk_settings tabs[2];
    bind_settings(&o, &cfg, tabs);
    void *base;
    const rk_setting *f = rk_settings_find(tabs, 2, "max_chunks", &base);
    cr_assert_not_null(f);
    cr_assert_eq(base, &cfg);
    cr_expect_eq(rk_setting_parse(base, f, "12"), RK_OK);
    cr_expect_eq(cfg.max_chunks, 12);
    const char *bad[] = {"", "12x", "-1", "99999999999", "1.5"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_expect_eq(rk_setting_parse(base, f, bad[i]), RK_ERR_INVALID, "'%s'", bad[i]);
        cr_expect(strstr(rk_error_message(), "max_chunks"), "%s", rk_error_message());
    }
    cr_expect_eq(cfg.max_chunks, 12, "a failed parse leaves the value");
    f = rk_settings_find(tabs, 2, "share_chunk", &base);
    cr_expect_eq(rk_setting_parse(base, f, "0.25"), RK_OK);
    cr_expect_float_eq(cfg.share_chunk, 0.25f, 1e-7);
    cr_expect_eq(rk_setting_parse(base, f, "1.5"), RK_ERR_INVALID);
    cr_expect_eq(rk_setting_parse(base, f, "nan"), RK_ERR_INVALID);
    f = rk_settings_find(tabs, 2, "kv_poison", &base);
    cr_expect_eq(rk_setting_parse(base, f, "yes"), RK_OK);
    cr_expect_eq(cfg.kv_poison, 1);
    cr_expect_eq(rk_setting_parse(base, f, "maybe"), RK_ERR_INVALID);
    f = rk_settings_find(tabs, 2, "key", &base);
    cr_assert_eq(base, &o);
    cr_expect_eq(rk_setting_parse(base, f, "1234567"), RK_OK);
    cr_expect_eq(rk_setting_parse(base, f, "12345678"), RK_ERR_INVALID, "too long for char[8]");
    cr_expect_str_eq(o.key, "1234567");
    cr_expect_null(rk_settings_find(tabs, 2, "no_such", NULL));
}

Test(settings, a_repair_policy_is_parsed_and_validated) {
    int k = -1, query = -1;
    float ratio = -1;
    cr_expect_eq(rk_repair_parse("none", &k, &ratio, &query), 0);
    cr_expect(k == 0 && ratio == 0);
    cr_expect_eq(rk_repair_parse("first_k:16", &k, &ratio, &query), 0);
    cr_expect(k == 16 && ratio == 0);
    cr_expect_eq(rk_repair_parse("deviation:0.15", &k, &ratio, &query), 0);
    cr_expect(k == 0 && fabsf(ratio - 0.15f) < 1e-7f && query == 0);
    cr_expect_eq(rk_repair_parse("query:0.05", &k, &ratio, &query), 0);
    cr_expect(k == 0 && fabsf(ratio - 0.05f) < 1e-7f && query == 1);
    const char *bad[] = {"",           "auto",        "first_k:0",     "first_k:",
                         "first_k:2x", "deviation:0", "deviation:1.5", "deviation:-0.1",
                         "deviation",  "None",        "query:0",       "query:2"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        k = 7;
        cr_expect_eq(rk_repair_parse(bad[i], &k, &ratio, &query), -1, "'%s'", bad[i]);
        cr_expect_eq(k, 7, "'%s' left the output", bad[i]);
    }
    rk_config cfg;
    rk_config_defaults(&cfg);
    cr_expect_str_eq(cfg.repair, "none");
    cr_expect_eq(rk_config_validate(&cfg), RK_OK);
    snprintf(cfg.repair, sizeof cfg.repair, "first_k:0");
    cr_expect_eq(rk_config_validate(&cfg), RK_ERR_INVALID);
    cr_expect(strstr(rk_error_message(), "repair"), "%s", rk_error_message());
}

Test(settings, config_file_sets_both_tables_and_rejects_bad_files) {
    own o;
    rk_config cfg;
    rk_settings tabs[2];
    bind_settings(&o, &cfg, tabs);
    char *p = rk_test_write_tmp("settings", "good.json",
                                "{\"port\": 81, \"kv_dtype\": \"bf16\", \"share_live\": 0.5,"
                                " \"prefix_cache\": false}");
    cr_assert_eq(rk_settings_load_file(tabs, 2, p), RK_OK, "%s", rk_error_message());
    cr_expect_eq(o.port, 81);
    cr_expect_str_eq(cfg.kv_dtype, "bf16");
    cr_expect_float_eq(cfg.share_live, 0.5f, 1e-7);
    cr_expect_eq(cfg.prefix_cache, 0);
    free(p);
    struct {
        const char *text, *want;
    } bad[] = {
        {"{\"port\": 70000}", "port must be an integer"},
        {"{\"port\": \"80\"}", "wrong type"},
        {"{\"nope\": 1}", "unknown setting \"nope\""},
        {"[1, 2]", "must be a JSON object"},
        {"{\"port\": 1,", "bad.json"}, /* bad JSON: the message names the file */
        {"{\"port\": 1, \"port\": 2}", "duplicate"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        p = rk_test_write_tmp("settings", "bad.json", bad[i].text);
        cr_expect_neq(rk_settings_load_file(tabs, 2, p), RK_OK, "%s", bad[i].text);
        cr_expect(strstr(rk_error_message(), bad[i].want) && strstr(rk_error_message(), p),
                  "%s: %s", bad[i].text, rk_error_message());
        free(p);
    }
    cr_expect_neq(rk_settings_load_file(tabs, 2, "/nonexistent/ragkv.json"), RK_OK);
}

Test(settings, environment_overrides_and_bad_values_name_the_variable) {
    own o;
    rk_config cfg;
    rk_settings tabs[2];
    bind_settings(&o, &cfg, tabs);
    setenv("RAGKV_MAX_TOKENS", "77", 1);
    setenv("RAGKV_PORT", "90", 1);
    cr_assert_eq(rk_settings_load_env(tabs, 2), RK_OK, "%s", rk_error_message());
    cr_expect_eq(cfg.max_tokens, 77);
    cr_expect_eq(o.port, 90);
    setenv("RAGKV_PORT", "ninety", 1);
    cr_expect_eq(rk_settings_load_env(tabs, 2), RK_ERR_INVALID);
    cr_expect(strstr(rk_error_message(), "RAGKV_PORT"), "%s", rk_error_message());
    unsetenv("RAGKV_PORT");
    unsetenv("RAGKV_MAX_TOKENS");
}

Test(settings, json_lists_every_setting_and_redacts_secrets) {
    own o;
    rk_config cfg;
    rk_settings tabs[2];
    bind_settings(&o, &cfg, tabs);
    snprintf(o.key, sizeof o.key, "s3cret");
    json_t *j = rk_settings_json(tabs, 2);
    cr_assert_not_null(j);
    cr_expect_eq(json_object_size(j), 2 + rk_config_n_settings);
    cr_expect_str_eq(json_string_value(json_object_get(j, "key")), "<set>");
    cr_expect_eq(json_integer_value(json_object_get(j, "block_size")), cfg.block_size);
    cr_expect(json_is_true(json_object_get(j, "store_verify")));
    json_decref(j);
    /* Every rk_config setting has a distinct name and flag and a help text. */
    for (size_t i = 0; i < rk_config_n_settings; i++) {
        cr_expect_not_null(rk_config_settings[i].help);
        for (size_t k = 0; k < i; k++) {
            cr_expect_str_neq(rk_config_settings[i].name, rk_config_settings[k].name);
            if (rk_config_settings[i].flag && rk_config_settings[k].flag)
                cr_expect_str_neq(rk_config_settings[i].flag, rk_config_settings[k].flag);
        }
    }
}

static rk_status take_name(void *ctx, int val, const char *arg) {
    if (val != 'x') return rk_errorf(RK_ERR_INVALID, "unexpected option %d", val);
    *(const char **)ctx = arg;
    return RK_OK;
}

Test(settings, command_line_applies_file_then_environment_then_flags) {
    rk_run_opts run;
    rk_run_opts_defaults(&run);
    own o = {0};
    const char *name = NULL;
    rk_settings own_tab = {k_own, 2, &o};
    struct option extra[] = {{"name", required_argument, 0, 'x'}, {0, 0, 0, 0}};
    rk_cmdline cl = {
        .cmd = "test", .usage = "", .extra = extra, .on_extra = take_name, .ctx = &name};
    char *cfg = rk_test_write_tmp("cmdline", "c.json", "{\"block_size\": 32, \"n_threads\": 3}");
    char *argv[] = {"test",   "--config", cfg,      "--threads", "5",
                    "--port", "81",       "--name", "n1",        NULL};
    setenv("RAGKV_BLOCK_SIZE", "64", 1);
    int exit_code = -7;
    cr_assert_eq(rk_run_parse(&cl, &run, &own_tab, 1, 9, argv, &exit_code), 0);
    unsetenv("RAGKV_BLOCK_SIZE");
    cr_expect_eq(run.cfg.block_size, 64, "the environment overrides the file");
    cr_expect_eq(run.cfg.n_threads, 5, "a flag overrides the file");
    cr_expect_eq(o.port, 81);
    cr_expect_str_eq(name, "n1");
    cr_expect_eq(rk_run_opts_apply(&run), RK_OK);
    /* A bad value names its flag and is a usage error; so is a positional argument. */
    char *bad[] = {"test", "--threads", "2000", NULL};
    cr_expect_eq(rk_run_parse(&cl, &run, &own_tab, 1, 3, bad, &exit_code), -1);
    cr_expect_eq(exit_code, 2);
    char *extra_arg[] = {"test", "stray", NULL};
    cr_expect_eq(rk_run_parse(&cl, &run, &own_tab, 1, 2, extra_arg, &exit_code), -1);
    cr_expect_eq(exit_code, 2);
    snprintf(run.log_level, sizeof run.log_level, "loud");
    cr_expect_eq(rk_run_opts_apply(&run), RK_ERR_INVALID);
    cr_expect_eq(rk_log_level_parse("error"), RK_LOG_ERROR);
    free(cfg);
}

Test(settings, a_flags_only_command_line_takes_no_config_file) {
    own o = {0};
    rk_settings tab = {k_own, 2, &o};
    rk_cmdline cl = {.prog = "bench_x", .usage = "", .tabs = &tab, .n_tabs = 1, .first = 1};
    char *cfg = rk_test_write_tmp("cmdline-flags", "c.json", "{}");
    char *argv[] = {"bench_x", "--port", "7", "--config", cfg, NULL};
    int exit_code = -7;
    cr_expect_eq(rk_cmdline_parse(&cl, 5, argv, &exit_code), -1,
                 "--config is no flag of a command without shared tables");
    cr_expect_eq(exit_code, 2);
    cr_expect_eq(rk_cmdline_parse(&cl, 3, argv, &exit_code), 3);
    cr_expect_eq(o.port, 7);
    char *bad[] = {"bench_x", "--port", "65536", NULL};
    cr_expect_eq(rk_cmdline_parse(&cl, 3, bad, &exit_code), -1);
    cr_expect_eq(exit_code, 2);
    free(cfg);
}

Test(settings, help_lines_wrap_at_80_columns) {
    static const rk_setting k_long[] = {
        {"long", "long", RK_SET_INT, 0, 0, 0, 1, 0, 0,
         "N  a help text long enough to need three lines at eighty columns, so that the words "
         "after the first break are indented under the text and none of them is lost or cut"},
    };
    int v = 0;
    rk_settings tab = {k_long, 1, &v};
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    rk_settings_print_help(f, &tab, 1);
    rewind(f);
    char line[256], all[1024] = "";
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        size_t len = strcspn(line, "\n");
        cr_expect_leq(len, 80, "line %d is %zu columns: %s", n, len, line);
        if (n > 0) cr_expect(!strncmp(line, "                        ", 24), "indent: %s", line);
        line[len] = '\0';
        const char *text = n == 0 ? strstr(line, "a help") : line + strspn(line, " ");
        cr_assert_not_null(text, "%s", line);
        strcat(all, n ? " " : "");
        strcat(all, text);
        n++;
    }
    fclose(f);
    cr_expect_geq(n, 3);
    cr_expect_str_eq(all, k_long[0].help + 3);
}

Test(settings, kv_memory_mb_takes_auto_as_text_json_and_environment) {
    own o;
    rk_config cfg;
    rk_settings tabs[2];
    bind_settings(&o, &cfg, tabs);
    cr_expect_eq(cfg.kv_memory_mb, 0, "auto is the default");
    cr_expect_str_eq(cfg.kv_dtype, "auto");
    void *base;
    const rk_setting *f = rk_settings_find(tabs, 2, "kv_memory_mb", &base);
    cr_assert_not_null(f);
    cr_expect_eq(rk_setting_parse(base, f, "512"), RK_OK);
    cr_expect_eq(cfg.kv_memory_mb, 512);
    cr_expect_eq(rk_setting_parse(base, f, "auto"), RK_OK);
    cr_expect_eq(cfg.kv_memory_mb, 0);
    const char *bad[] = {"0", "Auto", "", "-5", "16777217", "12x"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_expect_eq(rk_setting_parse(base, f, bad[i]), RK_ERR_INVALID, "'%s'", bad[i]);
        cr_expect(strstr(rk_error_message(), "auto"), "%s", rk_error_message());
    }
    json_t *j = rk_settings_json(tabs, 2);
    cr_expect_str_eq(json_string_value(json_object_get(j, "kv_memory_mb")), "auto");
    json_decref(j);
    char *path =
        rk_test_write_tmp("kvauto", "c.json", "{\"kv_memory_mb\": 300, \"memory_limit_mb\": 2048}");
    cr_assert_eq(rk_settings_load_file(tabs, 2, path), RK_OK, "%s", rk_error_message());
    cr_expect_eq(cfg.kv_memory_mb, 300);
    cr_expect_eq(cfg.memory_limit_mb, 2048);
    free(path);
    path = rk_test_write_tmp("kvauto", "c.json", "{\"kv_memory_mb\": \"auto\"}");
    cr_assert_eq(rk_settings_load_file(tabs, 2, path), RK_OK, "%s", rk_error_message());
    cr_expect_eq(cfg.kv_memory_mb, 0);
    free(path);
    setenv("RAGKV_MEMORY_LIMIT_MB", "4096", 1);
    setenv("RAGKV_KV_MEMORY_MB", "auto", 1);
    cfg.kv_memory_mb = 7;
    cr_expect_eq(rk_settings_load_env(tabs, 2), RK_OK, "%s", rk_error_message());
    unsetenv("RAGKV_MEMORY_LIMIT_MB");
    unsetenv("RAGKV_KV_MEMORY_MB");
    cr_expect_eq(cfg.memory_limit_mb, 4096);
    cr_expect_eq(cfg.kv_memory_mb, 0);
    cr_expect_eq(rk_config_validate(&cfg), RK_OK, "%s", rk_error_message());
}

Test(settings, available_memory_is_meminfo_bounded_by_a_cgroup_limit) {
    char *meminfo = rk_test_write_tmp("meminfo", "meminfo",
                                      "MemTotal:       24684096 kB\n"
                                      "MemFree:        23681688 kB\n"
                                      "MemAvailable:    8388608 kB\n");
    char *dir = rk_test_tmpdir("cgroup");
    rk_memory_info mi;
    /* No cgroup files: MemAvailable alone. */
    cr_assert_eq(rk_memory_detect(meminfo, dir, &mi), RK_OK, "%s", rk_error_message());
    cr_expect_eq(mi.bytes, (uint64_t)8 << 30);
    cr_expect_str_eq(mi.source, "MemAvailable");
    cr_expect_eq(mi.cgroup, 0);
    /* v2 "max": no limit. */
    char path[1200];
    snprintf(path, sizeof path, "%s/memory.max", dir);
    FILE *f = fopen(path, "w");
    fputs("max\n", f);
    fclose(f);
    cr_assert_eq(rk_memory_detect(meminfo, dir, &mi), RK_OK);
    cr_expect_eq(mi.bytes, (uint64_t)8 << 30);
    /* A v2 limit of 3 GiB with 1 GiB used leaves 2 GiB, under MemAvailable. */
    f = fopen(path, "w");
    fprintf(f, "%llu\n", 3ULL << 30);
    fclose(f);
    snprintf(path, sizeof path, "%s/memory.current", dir);
    f = fopen(path, "w");
    fprintf(f, "%llu\n", 1ULL << 30);
    fclose(f);
    cr_assert_eq(rk_memory_detect(meminfo, dir, &mi), RK_OK);
    cr_expect_eq(mi.bytes, (uint64_t)2 << 30);
    cr_expect_str_eq(mi.source, "cgroup");
    /* A limit above MemAvailable does not raise it. */
    f = fopen(path, "w");
    fprintf(f, "%d\n", 0);
    fclose(f);
    snprintf(path, sizeof path, "%s/memory.max", dir);
    f = fopen(path, "w");
    fprintf(f, "%llu\n", 64ULL << 30);
    fclose(f);
    cr_assert_eq(rk_memory_detect(meminfo, dir, &mi), RK_OK);
    cr_expect_eq(mi.bytes, (uint64_t)8 << 30);
    cr_expect_str_eq(mi.source, "MemAvailable");
    /* Nothing readable at all: a clear error, not a guess. */
    snprintf(path, sizeof path, "%s/none", dir);
    cr_expect_eq(rk_memory_detect(path, path, &mi), RK_ERR_IO);
    cr_expect(strstr(rk_error_message(), "kv_memory_mb"), "%s", rk_error_message());
    free(meminfo);
    free(dir);
}
