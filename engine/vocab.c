/* engine/vocab.c — vocabularies as plain arrays (rk_vocab): read from GGUF
 * metadata, read from a Hugging Face tokenizer.json, or built in (the `tiny`
 * model's vocabulary).
 *
 * GGUF keys read (as llama.cpp writes them):
 *   tokenizer.ggml.model            string  "llama" | "gpt2" | "gemma4" (required)
 *   tokenizer.ggml.pre              string  gpt2 pre-tokenizer name     (default "default")
 *   tokenizer.ggml.tokens           [string] token texts                (required)
 *   tokenizer.ggml.scores           [f32]   one per token               (optional)
 *   tokenizer.ggml.token_type       [i32]   one per token, RK_TOKEN_*   (optional: NORMAL)
 *   tokenizer.ggml.merges           [string] "left right", by rank      (required for gpt2, gemma4)
 *   tokenizer.ggml.{bos,eos,unknown,padding}_token_id  u32 (0xFFFFFFFF = none)
 *   tokenizer.ggml.add_bos_token    bool    (default: llama 1, gpt2 0; gemma4 always 1,
 *                                            as the reference engine overrides it) */
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer.h"
#include "engine/tokenizer_internal.h"

/* Upper bound on vocabulary sizes accepted from files (the largest real ones
 * are ~260k). */
#define VOCAB_MAX_TOKENS (1 << 24)

void rk_vocab_free(rk_vocab *v) {
    if (!v) return;
    if (v->tokens)
        for (int32_t i = 0; i < v->n_tokens; i++) free(v->tokens[i]);
    free(v->tokens);
    free(v->scores);
    free(v->token_types);
    if (v->merges)
        for (int32_t i = 0; i < v->n_merges; i++) free(v->merges[i]);
    free(v->merges);
    memset(v, 0, sizeof *v);
}

static char *dup_n(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

/* Start an empty vocabulary of n tokens: zeroed token pointers, types NORMAL,
 * no scores, no special ids. */
static rk_status vocab_init(rk_vocab *v, const char *model, int32_t n) {
    memset(v, 0, sizeof *v);
    snprintf(v->model, sizeof v->model, "%s", model);
    v->bos_id = v->eos_id = v->unk_id = v->pad_id = -1;
    v->tokens = calloc((size_t)n, sizeof *v->tokens);
    v->token_types = malloc((size_t)n * sizeof *v->token_types);
    if (!v->tokens || !v->token_types) {
        free(v->tokens);
        free(v->token_types);
        memset(v, 0, sizeof *v);
        return rk_errorf(RK_ERR_NOMEM, "vocabulary: out of memory for %d tokens", (int)n);
    }
    v->n_tokens = n;
    for (int32_t i = 0; i < n; i++) v->token_types[i] = RK_TOKEN_NORMAL;
    return RK_OK;
}

/* True when s is exactly "<0xHH>" with two upper- or lower-case hex digits. */
static int is_byte_token(const char *s) {
    return strlen(s) == 6 && memcmp(s, "<0x", 3) == 0 && isxdigit((unsigned char)s[3]) &&
           isxdigit((unsigned char)s[4]) && s[5] == '>';
}

/* ================================================================ GGUF */

/* Read an optional token id key into *out (-1 when absent or 0xFFFFFFFF /
 * -1); an id outside [0, n) is a format error. */
static rk_status gguf_token_id(const rk_gguf *g, const char *key, int32_t n, int32_t *out) {
    *out = -1;
    int64_t k = rk_gguf_find_key(g, key);
    if (k < 0) return RK_OK;
    rk_gguf_type ty = rk_gguf_kv_type(g, k);
    int64_t val;
    if (ty == RK_GGUF_INT8 || ty == RK_GGUF_INT16 || ty == RK_GGUF_INT32 || ty == RK_GGUF_INT64) {
        int32_t x;
        rk_status st = rk_gguf_get_i32(g, key, &x);
        if (st != RK_OK) return st;
        val = x;
    } else {
        uint64_t x;
        rk_status st = rk_gguf_get_u64(g, key, &x);
        if (st != RK_OK) return st;
        if (x == UINT32_MAX || x == UINT64_MAX) return RK_OK; /* "no such token" */
        val = x > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)x;
    }
    if (val == -1) return RK_OK;
    if (val < 0 || val >= n)
        return rk_errorf(RK_ERR_FORMAT, "%s = %lld is outside the vocabulary (%d tokens)", key,
                         (long long)val, (int)n);
    *out = (int32_t)val;
    return RK_OK;
}

/* Copy an optional short string key into buf (cap bytes); "" when absent. */
static rk_status gguf_short_str(const rk_gguf *g, const char *key, char *buf, size_t cap) {
    const char *s;
    size_t len;
    buf[0] = '\0';
    rk_status st = rk_gguf_get_str(g, key, &s, &len);
    if (st == RK_ERR_NOT_FOUND) return RK_OK;
    if (st != RK_OK) return st;
    if (len >= cap || strlen(s) != len)
        return rk_errorf(RK_ERR_FORMAT, "%s: value too long or contains NUL (%zu bytes)", key, len);
    memcpy(buf, s, len + 1);
    return RK_OK;
}

/* Copy n GGUF strings into fresh ones at *out (what names them, for errors). */
static rk_status copy_strings(const char *const *strs, const uint32_t *lens, size_t n,
                              const char *what, char **out) {
    for (size_t i = 0; i < n; i++) {
        if (strlen(strs[i]) != lens[i])
            return rk_errorf(RK_ERR_FORMAT, "%s[%zu] contains a NUL byte", what, i);
        if (!(out[i] = dup_n(strs[i], lens[i])))
            return rk_errorf(RK_ERR_NOMEM, "vocabulary: out of memory copying %s", what);
    }
    return RK_OK;
}

/* The optional token types (0 = undefined = normal); without them, llama
 * byte tokens are recognised by their spelling so that they decode to their
 * byte. */
static rk_status read_token_types(const rk_gguf *g, rk_vocab *v, size_t n, int gpt2) {
    int32_t *types = NULL;
    size_t n_arr;
    rk_status st = rk_gguf_get_arr_i32(g, "tokenizer.ggml.token_type", &types, &n_arr);
    if (st == RK_ERR_NOT_FOUND) {
        for (size_t i = 0; !gpt2 && i < n; i++)
            if (is_byte_token(v->tokens[i])) v->token_types[i] = RK_TOKEN_BYTE;
        return RK_OK;
    }
    if (st != RK_OK) return st;
    if (n_arr != n)
        st = rk_errorf(RK_ERR_FORMAT, "tokenizer.ggml.token_type has %zu entries for %zu tokens",
                       n_arr, n);
    for (size_t i = 0; !st && i < n; i++) {
        if (types[i] < 0 || types[i] > RK_TOKEN_BYTE)
            st = rk_errorf(RK_ERR_FORMAT, "tokenizer.ggml.token_type[%zu] = %d is not a type", i,
                           (int)types[i]);
        else
            v->token_types[i] = types[i] == 0 ? RK_TOKEN_NORMAL : types[i];
    }
    free(types);
    return st;
}

/* A gpt2 or gemma4 vocabulary's merges, by rank. */
static rk_status read_merges(const rk_gguf *g, rk_vocab *v) {
    const char *const *strs;
    const uint32_t *lens;
    size_t n;
    rk_status st = rk_gguf_get_arr_str(g, "tokenizer.ggml.merges", &strs, &lens, &n);
    if (st == RK_ERR_NOT_FOUND)
        return rk_errorf(RK_ERR_FORMAT, "%s vocabulary without tokenizer.ggml.merges", v->model);
    if (st != RK_OK) return st;
    if (n > VOCAB_MAX_TOKENS)
        return rk_errorf(RK_ERR_FORMAT, "tokenizer.ggml.merges has %zu entries", n);
    if (!(v->merges = calloc(n ? n : 1, sizeof *v->merges)))
        return rk_errorf(RK_ERR_NOMEM, "vocabulary: out of memory for merges");
    v->n_merges = (int32_t)n;
    return copy_strings(strs, lens, n, "tokenizer.ggml.merges", v->merges);
}

/* The special token ids and whether BOS is added. */
static rk_status read_specials(const rk_gguf *g, rk_vocab *v, int32_t n, int gpt2) {
    rk_status st;
    if ((st = gguf_token_id(g, "tokenizer.ggml.bos_token_id", n, &v->bos_id)) != RK_OK ||
        (st = gguf_token_id(g, "tokenizer.ggml.eos_token_id", n, &v->eos_id)) != RK_OK ||
        (st = gguf_token_id(g, "tokenizer.ggml.unknown_token_id", n, &v->unk_id)) != RK_OK ||
        (st = gguf_token_id(g, "tokenizer.ggml.padding_token_id", n, &v->pad_id)) != RK_OK)
        return st;
    v->add_bos = gpt2 ? 0 : 1;
    v->add_space_prefix = !gpt2;
    int flag;
    st = rk_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &flag);
    if (st == RK_OK) v->add_bos = flag != 0;
    if (st && st != RK_ERR_NOT_FOUND) return st;
    st = rk_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &flag);
    if (st == RK_OK) v->add_space_prefix = !gpt2 && flag;
    if (st && st != RK_ERR_NOT_FOUND) return st;
    const char *arch;
    v->special_rstrip = !gpt2 && rk_gguf_get_str(g, "general.architecture", &arch, NULL) == RK_OK &&
                        !strcmp(arch, "phi3");
    return RK_OK;
}

rk_status rk_vocab_from_gguf(const rk_gguf *g, rk_vocab *out) {
    memset(out, 0, sizeof *out);
    rk_vocab v;
    char model[16];
    rk_status st = gguf_short_str(g, "tokenizer.ggml.model", model, sizeof model);
    if (st != RK_OK) return st;
    if (!model[0]) return rk_errorf(RK_ERR_FORMAT, "GGUF has no tokenizer.ggml.model");
    if (strcmp(model, "llama") != 0 && strcmp(model, "gpt2") != 0 && strcmp(model, "gemma4") != 0)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "tokenizer.ggml.model \"%s\" is not supported (supported: llama, gpt2, "
                         "gemma4)",
                         model);
    int gpt2 = strcmp(model, "gpt2") == 0, gemma4 = strcmp(model, "gemma4") == 0;

    const char *const *strs;
    const uint32_t *lens;
    size_t n;
    st = rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &strs, &lens, &n);
    if (st == RK_ERR_NOT_FOUND)
        return rk_errorf(RK_ERR_FORMAT, "GGUF has no tokenizer.ggml.tokens");
    if (st != RK_OK) return st;
    if (n == 0 || n > VOCAB_MAX_TOKENS)
        return rk_errorf(RK_ERR_FORMAT, "tokenizer.ggml.tokens has %zu entries (1..%d allowed)", n,
                         VOCAB_MAX_TOKENS);
    if ((st = vocab_init(&v, model, (int32_t)n)) != RK_OK) return st;

    st = gguf_short_str(g, "tokenizer.ggml.pre", v.pre, sizeof v.pre);
    if (gpt2 && !v.pre[0]) snprintf(v.pre, sizeof v.pre, "default");
    if (!gpt2) v.pre[0] = '\0';
    if (!st) st = copy_strings(strs, lens, n, "tokenizer.ggml.tokens", v.tokens);
    size_t n_scores;
    if (!st) {
        st = rk_gguf_get_arr_f32(g, "tokenizer.ggml.scores", &v.scores, &n_scores);
        if (st == RK_ERR_NOT_FOUND) {
            v.scores = NULL;
            st = RK_OK;
        } else if (st == RK_OK && n_scores != n) {
            st = rk_errorf(RK_ERR_FORMAT, "tokenizer.ggml.scores has %zu entries for %zu tokens",
                           n_scores, n);
        }
    }
    if (!st) st = read_token_types(g, &v, n, gpt2);
    if (!st && (gpt2 || gemma4)) st = read_merges(g, &v);
    if (!st) st = read_specials(g, &v, (int32_t)n, gpt2);
    if (gemma4) { /* text is spelled as SentencePiece's, never with a leading U+2581 */
        v.add_bos = 1;
        v.add_space_prefix = 0;
    }
    if (st) {
        rk_vocab_free(&v);
        return st;
    }
    *out = v;
    return RK_OK;
}

/* ================================================================ Hugging Face tokenizer.json */

/* What is read: model.vocab (text -> id), model.merges ("a b" strings or
 * ["a", "b"] pairs, by rank), added_tokens (id, content, special: special ones
 * become CONTROL, the others USER_DEFINED) and the pre-tokenizer regex, which
 * must be one ragkv implements. The normalizer is not applied: Qwen's is NFC,
 * and ragkv encodes the text as given, so text that is not in NFC may encode
 * differently from Hugging Face (the decoded bytes are exact either way). */

/* Name the gpt2 pre-tokenizer of a tokenizer.json "pre_tokenizer" object: a
 * Split with a known regex (possibly inside a Sequence), or a ByteLevel
 * pre-tokenizer that uses the GPT-2 regex. NULL when not recognised. */
static const char *hf_pre_name(const json_t *pre) {
    if (!json_is_object(pre)) return NULL;
    const char *type = json_string_value(json_object_get(pre, "type"));
    if (!type) return NULL;
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(pre, "pretokenizers");
        size_t i;
        const json_t *item;
        json_array_foreach(list, i, item) {
            const char *name = hf_pre_name(item);
            if (name) return name;
        }
        return NULL;
    }
    if (strcmp(type, "Split") == 0) {
        const char *re =
            json_string_value(json_object_get(json_object_get(pre, "pattern"), "Regex"));
        return re ? rk_tok_pre_name_for_regex(re) : NULL;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        const json_t *use = json_object_get(pre, "use_regex");
        if (!use || json_is_true(use)) return "gpt2";
    }
    return NULL;
}

/* Store token text at id, refusing ids outside [0, n) and ids given twice. */
static rk_status hf_assign(rk_vocab *v, const char *path, int64_t id, const char *text,
                           size_t len) {
    if (id < 0 || id >= v->n_tokens)
        return rk_errorf(RK_ERR_FORMAT, "%s: token id %lld out of range", path, (long long)id);
    if (v->tokens[id])
        return rk_errorf(RK_ERR_FORMAT, "%s: token id %lld is assigned twice (\"%s\" and \"%s\")",
                         path, (long long)id, v->tokens[id], text);
    if (strlen(text) != len)
        return rk_errorf(RK_ERR_FORMAT, "%s: token %lld contains a NUL byte", path, (long long)id);
    v->tokens[id] = dup_n(text, len);
    if (!v->tokens[id]) return rk_errorf(RK_ERR_NOMEM, "%s: out of memory", path);
    return RK_OK;
}

/* Copy one merge, given as "a b" or as the pair ["a", "b"], into *out. */
static rk_status hf_merge(const json_t *m, const char *path, size_t i, char **out) {
    if (json_is_string(m)) {
        const char *s = json_string_value(m);
        size_t len = json_string_length(m);
        if (strlen(s) != len || !strchr(s + (len > 0), ' '))
            return rk_errorf(RK_ERR_FORMAT, "%s: merge %zu is not \"left right\"", path, i);
        *out = dup_n(s, len);
    } else if (json_is_array(m) && json_array_size(m) == 2 &&
               json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
        const json_t *a = json_array_get(m, 0), *b = json_array_get(m, 1);
        size_t la = json_string_length(a), lb = json_string_length(b);
        const char *sa = json_string_value(a), *sb = json_string_value(b);
        /* GGUF stores merges as "left right": the halves must not hold spaces. */
        if (la == 0 || lb == 0 || strlen(sa) != la || strlen(sb) != lb || strchr(sa, ' ') ||
            strchr(sb, ' '))
            return rk_errorf(RK_ERR_FORMAT, "%s: merge %zu cannot be stored as \"left right\"",
                             path, i);
        *out = malloc(la + lb + 2);
        if (*out) {
            memcpy(*out, sa, la);
            (*out)[la] = ' ';
            memcpy(*out + la + 1, sb, lb + 1);
        }
    } else {
        return rk_errorf(RK_ERR_FORMAT, "%s: merge %zu is neither a string nor a pair", path, i);
    }
    if (!*out) return rk_errorf(RK_ERR_NOMEM, "%s: out of memory", path);
    return RK_OK;
}

/* One past the largest id of the vocab and the added tokens (checking that
 * every entry has an integer id), into *out_n. */
static rk_status hf_size(const char *path, const json_t *vmap, const json_t *added,
                         int32_t *out_n) {
    int64_t max_id = -1;
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)vmap, key, val) {
        if (!json_is_integer(val))
            return rk_errorf(RK_ERR_FORMAT, "%s: vocab entry \"%s\" has no integer id", path, key);
        if (json_integer_value(val) > max_id) max_id = json_integer_value(val);
    }
    size_t i;
    json_array_foreach(added, i, val) {
        const json_t *id = json_object_get(val, "id");
        if (!json_is_integer(id) || !json_is_string(json_object_get(val, "content")))
            return rk_errorf(RK_ERR_FORMAT, "%s: added_tokens[%zu] lacks id or content", path, i);
        if (json_integer_value(id) > max_id) max_id = json_integer_value(id);
    }
    if (max_id < 0 || max_id >= VOCAB_MAX_TOKENS)
        return rk_errorf(RK_ERR_FORMAT, "%s: vocabulary size %lld out of range", path,
                         (long long)max_id + 1);
    *out_n = (int32_t)max_id + 1;
    return RK_OK;
}

/* The vocab's and the added tokens' texts and types into ids 0..n_base-1
 * (every id assigned), then padding tokens up to v->n_tokens. */
static rk_status hf_tokens(rk_vocab *v, const char *path, const json_t *vmap, const json_t *added,
                           int32_t n_base) {
    int32_t n = v->n_tokens;
    v->n_tokens = n_base; /* ids >= n_base are padding, filled below */
    rk_status st;
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)vmap, key, val) {
        if ((st = hf_assign(v, path, json_integer_value(val), key, strlen(key))) != RK_OK)
            return st;
    }
    size_t i;
    json_array_foreach(added, i, val) {
        int64_t id = json_integer_value(json_object_get(val, "id"));
        const json_t *content = json_object_get(val, "content");
        const char *text = json_string_value(content);
        int special = json_is_true(json_object_get(val, "special"));
        /* Listed in the vocab too, with the same text: only the type changes. */
        int known = id >= 0 && id < n_base && v->tokens[id] &&
                    v->token_types[id] == RK_TOKEN_NORMAL && strcmp(v->tokens[id], text) == 0;
        if (!known && (st = hf_assign(v, path, id, text, json_string_length(content))) != RK_OK)
            return st;
        v->token_types[id] = special ? RK_TOKEN_CONTROL : RK_TOKEN_USER_DEFINED;
    }
    /* Ids no entry names (o200k leaves 199998 and 200000..200017 free) and
     * the ids up to n are unused "[PAD<id>]" tokens, as GGUF converters
     * write them. */
    v->n_tokens = n;
    for (int32_t id = 0; id < n; id++) {
        if (v->tokens[id]) continue;
        char buf[32];
        int len = snprintf(buf, sizeof buf, "[PAD%d]", (int)id);
        if (!(v->tokens[id] = dup_n(buf, (size_t)len)))
            return rk_errorf(RK_ERR_NOMEM, "%s: out of memory", path);
        v->token_types[id] = RK_TOKEN_UNUSED;
    }
    return RK_OK;
}

/* model.merges, by rank. */
static rk_status hf_merges(rk_vocab *v, const char *path, const json_t *merges) {
    size_t n = json_array_size(merges), i;
    if (n > VOCAB_MAX_TOKENS) return rk_errorf(RK_ERR_FORMAT, "%s: %zu merges", path, n);
    if (!(v->merges = calloc(n ? n : 1, sizeof *v->merges)))
        return rk_errorf(RK_ERR_NOMEM, "%s: out of memory", path);
    const json_t *val;
    json_array_foreach(merges, i, val) {
        rk_status st = hf_merge(val, path, i, &v->merges[i]);
        if (st != RK_OK) return st;
        v->n_merges = (int32_t)i + 1;
    }
    return RK_OK;
}

/* The tokenizer.json at path, parsed; its own error when it is not JSON. */
static rk_status hf_load(const char *path, json_t **out) {
    json_error_t jerr;
    if ((*out = json_load_file(path, JSON_ALLOW_NUL, &jerr))) return RK_OK;
    FILE *f = fopen(path, "rb");
    if (!f) return rk_errorf(RK_ERR_IO, "%s: %s", path, strerror(errno));
    fclose(f);
    return rk_errorf(RK_ERR_FORMAT, "%s:%d: %s", path, jerr.line, jerr.text);
}

/* ---------------------------------------------------------------- SentencePiece-style BPE */

/* A SentencePiece BPE model exported to tokenizer.json: a BPE model with
 * byte_fallback (spaces turned into U+2581 by the normalizer or a Metaspace
 * pre-tokenizer; Gemma's Split on " " then finds none). */
static int hf_is_spm(const json_t *root) {
    const json_t *model = json_object_get(root, "model");
    const char *type = json_string_value(json_object_get(model, "type"));
    return type && !strcmp(type, "BPE") && json_is_true(json_object_get(model, "byte_fallback"));
}

/* Whether the text gets a U+2581 in front: a Prepend normalizer, or a
 * Metaspace pre-tokenizer whose prepend_scheme is not "never". */
static int hf_spm_space_prefix(const json_t *root) {
    const json_t *norm = json_object_get(root, "normalizer");
    const json_t *list = json_object_get(norm, "normalizers");
    size_t i;
    const json_t *item;
    if (json_is_object(norm) && !list) {
        const char *type = json_string_value(json_object_get(norm, "type"));
        if (type && strcmp(type, "Prepend") == 0) return 1;
    }
    json_array_foreach(list, i, item) {
        const char *type = json_string_value(json_object_get(item, "type"));
        if (type && strcmp(type, "Prepend") == 0) return 1;
    }
    const json_t *pre = json_object_get(root, "pre_tokenizer");
    const char *type = json_string_value(json_object_get(pre, "type"));
    const char *scheme = json_string_value(json_object_get(pre, "prepend_scheme"));
    return type && !strcmp(type, "Metaspace") && (!scheme || strcmp(scheme, "never") != 0);
}

/* Scores for a llama (SentencePiece) vocabulary from the merge list: ragkv
 * and the reference engine merge the adjacent pair whose joined piece scores
 * highest, Hugging Face the pair of lowest merge rank; a piece scoring
 * -(rank of the first merge that makes it) gives both the same order.
 * Pieces no merge makes score -1e9 (reached only when nothing else is),
 * single characters 0. */
static rk_status hf_spm_scores(rk_vocab *v, const char *path, const json_t *vmap,
                               const json_t *merges) {
    if (!(v->scores = malloc((size_t)v->n_tokens * sizeof *v->scores)))
        return rk_errorf(RK_ERR_NOMEM, "%s: out of memory", path);
    for (int32_t id = 0; id < v->n_tokens; id++) {
        const char *t = v->tokens[id];
        uint32_t cp;
        size_t len = strlen(t);
        int first = len ? rk_utf8_decode((const unsigned char *)t, len, &cp) : 0;
        v->scores[id] = first > 0 && (size_t)first == len ? 0.0f : -1e9f;
    }
    size_t i;
    const json_t *m;
    json_array_foreach(merges, i, m) {
        char *pair;
        rk_status st = hf_merge(m, path, i, &pair);
        if (st) return st;
        char *sp = strchr(pair, ' ');
        memmove(sp, sp + 1, strlen(sp + 1) + 1); /* "a b" -> "ab" */
        const json_t *id = json_object_get(vmap, pair);
        free(pair);
        if (!json_is_integer(id)) continue;
        int64_t k = json_integer_value(id);
        float score = -(float)(i + 1);
        if (k >= 0 && k < v->n_tokens && v->scores[k] < score) v->scores[k] = score;
    }
    return RK_OK;
}

/* The llama vocabulary of a SentencePiece-style tokenizer.json: byte tokens
 * typed BYTE, model.unk_token UNKNOWN, the first special <s>/<bos>,
 * </s>/<eos> and <pad> the special ids; BOS added when the post-processor
 * starts with a special token. */
static rk_status hf_spm_vocab(const json_t *root, const char *path, int32_t n_pad_to, rk_vocab *v) {
    const json_t *model = json_object_get(root, "model");
    const json_t *vmap = json_object_get(model, "vocab");
    const json_t *merges = json_object_get(model, "merges");
    const json_t *added = json_object_get(root, "added_tokens");
    if (!json_is_object(vmap) || !json_is_array(merges) || (added && !json_is_array(added)))
        return rk_errorf(RK_ERR_FORMAT, "%s: model.vocab, model.merges or added_tokens missing",
                         path);
    memset(v, 0, sizeof *v);
    int32_t n_base;
    rk_status st = hf_size(path, vmap, added, &n_base);
    if (!st) st = vocab_init(v, "llama", n_pad_to > n_base ? n_pad_to : n_base);
    if (!st) st = hf_tokens(v, path, vmap, added, n_base);
    if (!st) st = hf_spm_scores(v, path, vmap, merges);
    if (!st) st = hf_merges(v, path, merges); /* kept for the gemma4 model; llama ignores them */
    if (st) return st;
    const char *unk = json_string_value(json_object_get(model, "unk_token"));
    for (int32_t id = 0; id < n_base; id++) {
        const char *t = v->tokens[id];
        if (is_byte_token(t)) v->token_types[id] = RK_TOKEN_BYTE;
        if (unk && strcmp(t, unk) == 0) {
            v->token_types[id] = RK_TOKEN_UNKNOWN;
            v->unk_id = id;
        }
        /* Special (control) tokens only, the first of each kind: Gemma also
         * has <s> and </s> as ordinary added tokens. */
        if (v->token_types[id] != RK_TOKEN_CONTROL) continue;
        if ((!strcmp(t, "<s>") || !strcmp(t, "<bos>")) && v->bos_id < 0) v->bos_id = id;
        if ((!strcmp(t, "</s>") || !strcmp(t, "<eos>")) && v->eos_id < 0) v->eos_id = id;
        if (!strcmp(t, "<pad>") && v->pad_id < 0) v->pad_id = id;
    }
    const json_t *single = json_object_get(json_object_get(root, "post_processor"), "single");
    v->add_bos = v->bos_id >= 0 && json_object_get(json_array_get(single, 0), "SpecialToken");
    v->add_space_prefix = hf_spm_space_prefix(root);
    return RK_OK;
}

rk_status rk_vocab_from_hf_json(const char *path, int32_t n_pad_to, rk_vocab *out) {
    memset(out, 0, sizeof *out);
    json_t *root;
    rk_status st = hf_load(path, &root);
    if (st) return st;
    if (hf_is_spm(root)) {
        rk_vocab v;
        st = hf_spm_vocab(root, path, n_pad_to, &v);
        json_decref(root);
        if (st)
            rk_vocab_free(&v);
        else
            *out = v;
        return st;
    }
    rk_vocab v;
    memset(&v, 0, sizeof v);
    const json_t *model = json_object_get(root, "model");
    const json_t *vmap = json_object_get(model, "vocab");
    const json_t *merges = json_object_get(model, "merges");
    const json_t *added = json_object_get(root, "added_tokens");
    const char *mtype = json_string_value(json_object_get(model, "type"));
    const char *pre = hf_pre_name(json_object_get(root, "pre_tokenizer"));
    int32_t n_base = 0;
    if (!mtype || strcmp(mtype, "BPE") != 0 || !json_is_object(vmap) || !json_is_array(merges))
        st = rk_errorf(RK_ERR_UNSUPPORTED,
                       "%s: not a BPE tokenizer with model.vocab and model.merges", path);
    else if (added && !json_is_array(added))
        st = rk_errorf(RK_ERR_FORMAT, "%s: added_tokens is not an array", path);
    else if (!pre)
        st = rk_errorf(RK_ERR_UNSUPPORTED,
                       "%s: pre-tokenizer not recognised (supported regexes: %s)", path,
                       rk_tok_pre_names());
    if (!st) st = hf_size(path, vmap, added, &n_base);
    if (!st) st = vocab_init(&v, "gpt2", n_pad_to > n_base ? n_pad_to : n_base);
    if (!st) {
        snprintf(v.pre, sizeof v.pre, "%s", pre);
        st = hf_tokens(&v, path, vmap, added, n_base);
    }
    if (!st) st = hf_merges(&v, path, merges);
    json_decref(root);
    if (st != RK_OK) {
        rk_vocab_free(&v);
        return st;
    }
    /* As llama.cpp sets it for Qwen: <|endoftext|> is bos, eos and padding;
     * chat end markers (<|im_end|>) are end-of-generation tokens. */
    for (int32_t id = 0; id < v.n_tokens; id++)
        if (v.token_types[id] != RK_TOKEN_NORMAL && strcmp(v.tokens[id], "<|endoftext|>") == 0) {
            v.bos_id = v.eos_id = v.pad_id = id;
            break;
        }
    v.add_bos = 0;
    *out = v;
    return RK_OK;
}

/* ================================================================ tiny */

/* Pieces of the tiny vocabulary, best (highest score) first: merges learned by
 * a small BPE run over common English words (with capitalised, -s, -ing and
 * -ed forms), then "▁x" for every letter, then single characters. Every
 * multi-character piece splits into two pieces of the table, so BPE by score
 * can reach it. */
static const char *const k_tiny_pieces[] = {
    "▁t",      "in",     "he",      "▁a",     "▁w",     "ing",    "ed",    "▁o",    "▁s",
    "ou",      "re",     "▁the",    "ha",     "▁f",     "nd",     "▁b",    "▁m",    "er",
    "is",      "or",     "it",      "▁c",     "▁l",     "▁p",     "▁n",    "ll",    "ea",
    "ow",      "▁T",     "▁of",     "me",     "ve",     "▁to",    "▁h",    "▁d",    "▁wa",
    "hat",     "▁he",    "▁y",      "▁on",    "▁ha",    "▁I",     "▁and",  "se",    "en",
    "▁you",    "an",     "▁A",      "▁th",    "ld",     "st",     "▁W",    "▁in",   "▁g",
    "ut",      "ch",     "▁be",     "▁is",    "ro",     "ar",     "le",    "▁u",    "▁it",
    "ot",      "▁O",     "ver",     "▁for",   "▁we",    "gh",     "▁S",    "ce",    "ay",
    "oo",      "▁that",  "id",      "▁H",     "▁as",    "ome",    "▁was",  "ke",    "▁st",
    "ir",      "▁are",   "ith",     "▁wh",    "her",    "▁The",   "et",    "at",    "▁wor",
    "on",      "▁with",  "▁F",      "▁an",    "▁his",   "ould",   "ear",   "▁they", "rom",
    "ound",    "▁B",     "ter",     "▁M",     "▁not",   "▁e",     "▁at",   "▁r",    "ad",
    "ain",     "▁one",   "▁li",     "ght",    "▁or",    "al",     "▁have", "▁whe",  "▁this",
    "▁mo",     "▁do",    "▁from",   "▁sa",    "▁ca",    "▁C",     "ct",    "▁se",   "▁had",
    "▁pl",     "ss",     "▁ea",     "▁by",    "ill",    "▁L",     "ind",   "ake",   "ther",
    "▁word",   "if",     "▁but",    "▁what",  "im",     "ple",    "▁some", "nt",    "▁man",
    "ur",      "▁re",    "▁ne",     "▁can",   "ly",     "es",     "ck",    "▁out",  "ong",
    "▁P",      "▁other", "out",     "▁k",     "▁N",     "ood",    "ry",    "▁were", "▁whi",
    "▁all",    "▁ab",    "▁there",  "ace",    "▁when",  "ite",    "ge",    "▁up",   "ook",
    "▁use",    "ime",    "▁Of",     "▁your",  "▁sh",    "ight",   "and",   "▁how",  "han",
    "▁mu",     "▁D",     "▁said",   "▁she",   "um",     "ive",    "very",  "▁Y",    "art",
    "▁To",     "ure",    "ber",     "▁On",    "▁their", "▁each",  "ten",   "▁time", "▁go",
    "▁And",    "▁Is",    "▁if",     "rou",    "▁which", "rite",   "▁will", "ell",   "▁see",
    "▁way",    "▁co",    "▁about",  "ort",    "▁many",  "▁You",   "now",   "▁then", "wo",
    "▁them",   "▁Th",    "own",     "▁num",   "▁bo",    "▁would", "ame",   "ree",   "▁like",
    "▁so",     "▁G",     "ack",     "▁these", "▁her",   "▁E",     "▁In",   "▁long", "▁make",
    "▁write",  "ine",    "▁thing",  "ide",    "ose",    "▁who",   "ople",  "eople", "▁him",
    "▁two",    "▁R",     "▁look",   "▁He",    "all",    "▁more",  "irst",  "▁day",  "▁Be",
    "as",      "ave",    "▁could",  "ate",    "nder",   "▁U",     "▁come", "▁pa",   "▁did",
    "▁It",     "our",    "▁number", "▁has",   "ep",     "▁sound", "▁no",   "▁sp",   "▁most",
    "▁people", "▁fe",    "ean",     "▁my",    "hed",    "▁For",   "▁over", "ild",   "▁know",
    "ie",      "el",     "▁water",  "ore",    "▁than",  "un",     "▁That", "▁call", "fter",
    "▁too",    "▁first", "tle",     "ittle",  "ig",     "▁al",    "ust",   "dy",    "▁may",
    "▁ag",     "▁down",  "ount",    "▁i",     "▁j",     "▁q",     "▁v",    "▁x",    "▁z",
    "▁J",      "▁K",     "▁Q",      "▁V",     "▁X",     "▁Z",     "▁",     "a",     "b",
    "c",       "d",      "e",       "f",      "g",      "h",      "i",     "j",     "k",
    "l",       "m",      "n",       "o",      "p",      "q",      "r",     "s",     "t",
    "u",       "v",      "w",       "x",      "y",      "z",      "A",     "B",     "C",
    "D",       "E",      "F",       "G",      "H",      "I",      "J",     "K",     "L",
    "M",       "N",      "O",       "P",      "Q",      "R",      "S",     "T",     "U",
    "V",       "W",      "X",       "Y",      "Z",      "0",      "1",     "2",     "3",
    "4",       "5",      "6",       "7",      "8",      "9",      ".",     ",",     "'",
    "\"",      "!",      "?",       ":",      ";",      "-",      "(",     ")",     "/",
    "&",       "%",      "$",       "#",      "@",      "*",      "+",     "=",     "<",
    ">",       "[",      "]",       "{",      "}",      "_",      "`",     "~",     "^",
    "|",       "\\",
};

#define TINY_N_PIECES ((int32_t)(sizeof k_tiny_pieces / sizeof k_tiny_pieces[0]))

rk_status rk_vocab_tiny(rk_vocab *out) {
    memset(out, 0, sizeof *out);
    rk_vocab v;
    int32_t n = 3 + 256 + TINY_N_PIECES;
    rk_status st = vocab_init(&v, "llama", n);
    if (st != RK_OK) return st;
    v.scores = malloc((size_t)n * sizeof *v.scores);
    if (!v.scores) goto nomem;
    static const char *const specials[3] = {"<unk>", "<s>", "</s>"};
    static const int32_t special_types[3] = {RK_TOKEN_UNKNOWN, RK_TOKEN_CONTROL, RK_TOKEN_CONTROL};
    for (int32_t i = 0; i < 3; i++) {
        if (!(v.tokens[i] = dup_n(specials[i], strlen(specials[i])))) goto nomem;
        v.token_types[i] = special_types[i];
        v.scores[i] = 0.0f;
    }
    for (int32_t b = 0; b < 256; b++) {
        char buf[8];
        snprintf(buf, sizeof buf, "<0x%02X>", (unsigned)b);
        if (!(v.tokens[3 + b] = dup_n(buf, 6))) goto nomem;
        v.token_types[3 + b] = RK_TOKEN_BYTE;
        v.scores[3 + b] = 0.0f;
    }
    for (int32_t k = 0; k < TINY_N_PIECES; k++) {
        int32_t id = 3 + 256 + k;
        if (!(v.tokens[id] = dup_n(k_tiny_pieces[k], strlen(k_tiny_pieces[k])))) goto nomem;
        v.scores[id] = (float)-k;
    }
    v.unk_id = 0;
    v.bos_id = 1;
    v.eos_id = 2;
    v.add_bos = 1;
    v.add_space_prefix = 1;
    *out = v;
    return RK_OK;

nomem:
    rk_vocab_free(&v);
    return rk_errorf(RK_ERR_NOMEM, "tiny vocabulary: out of memory");
}
