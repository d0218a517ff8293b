/* cli/model.c — `ragkv mkmodel` and `inspect`: write a synthetic GGUF model,
 * describe a GGUF file. */
#include <string.h>

#include "cli/cli.h"
#include "engine/gguf.h"
#include "engine/mkmodel.h"

/* ---------------------------------------------------------------- inspect / mkmodel */

int rk_cli_inspect(int argc, char **argv) {
    if (argc != 2 || argv[1][0] == '-') {
        int h = argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
        fputs("usage: ragkv inspect F.gguf\n"
              "Print the architecture, hyper-parameters, tensors and tokenizer of a GGUF file.\n",
              h ? stdout : stderr);
        return h ? 0 : EXIT_USAGE;
    }
    rk_gguf *g;
    if (rk_gguf_open(argv[1], &g)) return fail("cannot read the model");
    rk_gguf_print_info(g, stdout);
    rk_gguf_close(g);
    return 0;
}

int rk_cli_mkmodel(int argc, char **argv) {
    rk_mkmodel_opts opts;
    rk_mkmodel_opts_default(&opts);
    const char *out = NULL;
    struct option longs[] = {
        {"preset", required_argument, 0, 'p'}, {"vocab", required_argument, 0, 'v'},
        {"seed", required_argument, 0, 's'},   {"type", required_argument, 0, 't'},
        {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
    int c;
    long v;
    optind = 1;
    while ((c = getopt_long(argc, argv, "o:h", longs, NULL)) != -1) {
        switch (c) {
        case 'h':
            fputs("usage: ragkv mkmodel --preset NAME -o F.gguf "
                  "[--type f32|f16|bf16|q8_0|q4_0|q4_k_m|q5_k_m|q6_k] "
                  "[--vocab tokenizer.json] [--seed S]\n"
                  "Write a synthetic GGUF model: random weights, real shapes.\nPresets:\n",
                  stdout);
            size_t n_presets;
            const rk_mkmodel_preset_info *presets = rk_mkmodel_presets(&n_presets);
            for (size_t i = 0; i < n_presets; i++)
                printf("  %-12s %s\n", presets[i].name, presets[i].description);
            return 0;
        case 'p': opts.preset = optarg; break;
        case 'o': out = optarg; break;
        case 'v': opts.vocab_path = optarg; break;
        case 's':
            if (rk_parse_long(optarg, 0, 0x7fffffffffffffffL, &v))
                return usage_error("mkmodel", "bad --seed '%s'", optarg);
            opts.seed = (uint64_t)v;
            break;
        case 't':
            if (rk_mkmodel_parse_wtype(optarg, &opts.wtype))
                return usage_error("mkmodel",
                                   "bad --type '%s' (f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m "
                                   "or q6_k)",
                                   optarg);
            break;
        default: return usage_error("mkmodel", "%s", "unknown option");
        }
    }
    if (!out) return usage_error("mkmodel", "%s", "-o is required");
    if (rk_mkmodel_write(out, &opts)) return fail("cannot write the model");
    return 0;
}
