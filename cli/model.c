/* cli/model.c — `ragkv mkmodel` and `inspect`: write a synthetic GGUF model,
 * describe a GGUF file. */

#include "cli/cli.h"
#include "engine/gguf.h"
#include "engine/mkmodel.h"

/* ---------------------------------------------------------------- inspect / mkmodel */

int rk_cli_inspect(int argc, char **argv) {
    rk_cmdline cl = {.cmd = "inspect",
                     .usage = "usage: ragkv inspect F.gguf\n"
                              "Print the architecture, hyper-parameters, tensors and tokenizer of "
                              "a GGUF file.\n",
                     .first = 1};
    int exit_code, next = rk_cmdline_parse(&cl, argc, argv, &exit_code);
    if (next < 0) return exit_code;
    if (argc - next != 1) return usage_error("inspect", "%s", "one F.gguf is required");
    rk_gguf *g;
    if (rk_gguf_open(argv[next], &g)) return fail("cannot read the model");
    rk_gguf_print_info(g, stdout);
    rk_gguf_close(g);
    return 0;
}

typedef struct mkmodel_args {
    char preset[64], vocab[4096], type[16];
    long long seed;
} mkmodel_args;

#define MK_OFF(m) offsetof(mkmodel_args, m)
#define MK_STR(m) MK_OFF(m), sizeof(((mkmodel_args *)0)->m)

static const rk_setting k_mkmodel_settings[] = {
    {"preset", "preset", RK_SET_STR, MK_STR(preset), 0, 0, 0, 0,
     "NAME  the shapes to write (below; default: tiny)"},
    {"type", "type", RK_SET_STR, MK_STR(type), 0, 0, 0, 0,
     "T  2-D weights: f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k, q3_k_m, q2_k, iq4_xs "
     "or mxfp4 (experts MXFP4, the rest Q8_0) (default: f32)"},
    {"vocab", "vocab", RK_SET_STR, MK_STR(vocab), 0, 0, 0, 0,
     "F.json  the preset's tokenizer.json: Qwen3's (default "
     "../shared/tokenizers/qwen3/tokenizer.json), Gemma 3's (default "
     "../shared/tokenizers/gemma3/tokenizer.json), gpt-oss's or o200k's (gpt-oss presets)"},
    {"seed", "seed", RK_SET_LONG, MK_OFF(seed), 0, 0, 0x7fffffffffffffffLL, 0, 0,
     "S  weights seed (default: 42)"},
};

/* -o F.gguf, the one option that is not a setting: where to write. */
static rk_status mkmodel_extra(void *ctx, int val, const char *arg) {
    if (val != 'o') return rk_errorf(RK_ERR_INVALID, "unknown option");
    *(const char **)ctx = arg;
    return RK_OK;
}

int rk_cli_mkmodel(int argc, char **argv) {
    rk_mkmodel_opts opts;
    rk_mkmodel_opts_default(&opts);
    mkmodel_args a = {.preset = "tiny", .type = "f32", .seed = (long long)opts.seed};
    const char *out = NULL;
    rk_settings tab = {k_mkmodel_settings, sizeof k_mkmodel_settings / sizeof k_mkmodel_settings[0],
                       &a};
    rk_cmdline cl = {.cmd = "mkmodel",
                     .usage = "usage: ragkv mkmodel --preset NAME -o F.gguf [--type T] "
                              "[--vocab tokenizer.json] [--seed S]\n"
                              "Write a synthetic GGUF model: random weights, real shapes.\n"
                              "  -o F.gguf             the file to write (required)\n",
                     .tabs = &tab,
                     .n_tabs = 1,
                     .shorts = "o:",
                     .on_extra = mkmodel_extra,
                     .ctx = &out,
                     .first = 1};
    int exit_code, next = rk_cmdline_parse(&cl, argc, argv, &exit_code);
    if (next < 0) {
        if (exit_code == 0) { /* after --help: the presets */
            size_t n_presets;
            const rk_mkmodel_preset_info *presets = rk_mkmodel_presets(&n_presets);
            fputs("Presets:\n", stdout);
            for (size_t i = 0; i < n_presets; i++)
                printf("  %-12s %s\n", presets[i].name, presets[i].description);
        }
        return exit_code;
    }
    if (next < argc) return usage_error("mkmodel", "unexpected argument '%s'", argv[next]);
    if (!out) return usage_error("mkmodel", "%s", "-o is required");
    if (rk_mkmodel_parse_wtype(a.type, &opts.wtype))
        return usage_error("mkmodel",
                           "--type must be f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k, "
                           "q3_k_m, q2_k, iq4_xs or mxfp4, "
                           "got '%s'",
                           a.type);
    opts.preset = a.preset;
    opts.vocab_path = a.vocab[0] ? a.vocab : NULL;
    opts.seed = (uint64_t)a.seed;
    if (rk_mkmodel_write(out, &opts)) return fail("cannot write the model");
    return 0;
}
