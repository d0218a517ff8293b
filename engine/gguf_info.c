/* engine/gguf_info.c — the human-readable summary of a GGUF file that
 * `ragkv inspect` prints: header, metadata (arrays summarised), tokenizer,
 * tensor table and totals (see rk_gguf_print_info in engine/gguf.h). */
#include <inttypes.h>
#include <stdio.h>

#include "engine/gguf_internal.h"

/* Print s (len bytes) quoted, escaping control bytes, cut after max bytes. */
static void print_quoted(FILE *out, const char *s, size_t len, size_t max) {
    fputc('"', out);
    size_t n = len < max ? len : max;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\')
            fprintf(out, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", out);
        else if (ch == '\t')
            fputs("\\t", out);
        else if (ch < 0x20 || ch == 0x7f)
            fprintf(out, "\\x%02x", ch);
        else
            fputc(ch, out);
    }
    fputc('"', out);
    if (n < len) fputs("...", out);
}

static void print_num(FILE *out, uint32_t type, const uint8_t *p) {
    rk_gguf_num v = rk_gguf_decode_num(type, p);
    if (type == RK_GGUF_BOOL)
        fputs(v.u ? "true" : "false", out);
    else if (v.is_float)
        fprintf(out, "%.9g", v.f);
    else if (v.is_signed)
        fprintf(out, "%" PRId64, v.i);
    else
        fprintf(out, "%" PRIu64, v.u);
}

static void print_kv_value(FILE *out, const rk_gguf_kv *kv) {
    if (kv->type == RK_GGUF_STRING) {
        print_quoted(out, kv->str, kv->str_len, 72);
        return;
    }
    if (kv->type != RK_GGUF_ARRAY) {
        print_num(out, kv->type, kv->scalar);
        return;
    }
    fprintf(out, "%s[%" PRIu64 "]", rk_gguf_value_type_name(kv->arr_type), kv->arr_n);
    uint64_t show = kv->arr_n < 5 ? kv->arr_n : 5;
    for (uint64_t i = 0; i < show; i++) {
        fputs(i ? ", " : ": ", out);
        if (kv->arr_type == RK_GGUF_STRING)
            print_quoted(out, kv->arr_strs[i], kv->arr_lens[i], 24);
        else
            print_num(out, kv->arr_type,
                      (const uint8_t *)kv->arr + i * rk_gguf_scalar_size(kv->arr_type));
    }
    if (show < kv->arr_n) fputs(", ...", out);
}

/* Print the text of token id from tokenizer.ggml.tokens, or nothing. */
static void print_token_text(FILE *out, const rk_gguf *g, uint32_t id) {
    const char *const *toks;
    const uint32_t *lens;
    size_t n;
    if (rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, &lens, &n) == RK_OK) {
        if (id < n) {
            fputc(' ', out);
            print_quoted(out, toks[id], lens[id], 32);
        } else {
            fputs(" (not a token: unset)", out);
        }
    }
    rk_error_clear();
}

/* Print a human-readable summary of the file to out: header, every metadata
 * pair (arrays summarised), a tokenizer summary, the tensor table and totals. */
void rk_gguf_print_info(const rk_gguf *g, FILE *out) {
    fprintf(out, "file:         %s\n", g->name);
    fprintf(out, "size:         %zu bytes\n", g->size);
    fprintf(out, "gguf version: %" PRIu32 "\n", g->version);
    fprintf(out, "alignment:    %zu (data section at offset %zu)\n", g->alignment, g->data_offset);
    const char *arch = NULL;
    if (rk_gguf_get_str(g, "general.architecture", &arch, NULL) != RK_OK) arch = NULL;
    rk_error_clear();
    fprintf(out, "architecture: %s\n", arch ? arch : "(none)");

    fprintf(out, "\nmetadata (%" PRId64 " keys):\n", g->n_kv);
    for (int64_t i = 0; i < g->n_kv; i++) {
        const rk_gguf_kv *kv = &g->kvs[i];
        fprintf(out, "  %-44s %-7s ", kv->key, rk_gguf_value_type_name(kv->type));
        print_kv_value(out, kv);
        fputc('\n', out);
    }

    const char *model = NULL, *pre = NULL;
    const char *const *toks;
    const uint32_t *lens;
    size_t n_tok = 0, n_merges = 0;
    if (rk_gguf_get_str(g, "tokenizer.ggml.model", &model, NULL) != RK_OK) model = NULL;
    if (rk_gguf_get_str(g, "tokenizer.ggml.pre", &pre, NULL) != RK_OK) pre = NULL;
    if (rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, &lens, &n_tok) != RK_OK) n_tok = 0;
    if (rk_gguf_get_arr_str(g, "tokenizer.ggml.merges", &toks, &lens, &n_merges) != RK_OK)
        n_merges = 0;
    rk_error_clear();
    if (model || n_tok) {
        fprintf(out, "\ntokenizer: model %s, pre %s, %zu tokens, %zu merges\n",
                model ? model : "(none)", pre ? pre : "(none)", n_tok, n_merges);
        static const char *ids[] = {"bos", "eos", "unknown", "padding"};
        for (size_t k = 0; k < sizeof ids / sizeof ids[0]; k++) {
            char key[64];
            snprintf(key, sizeof key, "tokenizer.ggml.%s_token_id", ids[k]);
            uint32_t id;
            if (rk_gguf_get_u32(g, key, &id) != RK_OK) {
                rk_error_clear();
                continue;
            }
            fprintf(out, "  %-8s %" PRIu32, ids[k], id);
            print_token_text(out, g, id);
            fputc('\n', out);
        }
    }

    fprintf(out, "\ntensors (%" PRId64 "):\n", g->n_tensors);
    fprintf(out, "  %-40s %-6s %-28s %14s %6s\n", "name", "type", "shape (ne[0] first)", "bytes",
            "bpw");
    uint64_t n_params = 0, n_bytes = 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const rk_gguf_tensor *t = &g->tensors[i];
        char shape[96];
        int len = 0;
        uint64_t ne = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            len += snprintf(shape + len, sizeof shape - (size_t)len, "%s%" PRId64, d ? " x " : "",
                            t->ne[d]);
            ne *= (uint64_t)t->ne[d];
        }
        n_params += ne;
        n_bytes += t->n_bytes;
        fprintf(out, "  %-40s %-6s %-28s %14zu %6.2f\n", t->name, rk_ggml_type_name(t->type), shape,
                t->n_bytes, (double)t->n_bytes * 8.0 / (double)ne);
    }
    fprintf(out,
            "\ntotal: %" PRIu64 " parameters (%.3f M), %" PRIu64
            " bytes of tensor data (%.2f MiB), %.2f bits per weight\n",
            n_params, (double)n_params / 1e6, n_bytes, (double)n_bytes / (1024.0 * 1024.0),
            n_params ? (double)n_bytes * 8.0 / (double)n_params : 0.0);
}
