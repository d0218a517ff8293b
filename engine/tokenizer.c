/* engine/tokenizer.c — building a tokenizer from a vocabulary, the parts of
 * encoding common to both families (UTF-8 validation, special tokens), and
 * decoding. The two encoding algorithms live in tokenizer_spm.c (llama) and
 * tokenizer_bpe.c (gpt2). */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "engine/tokenizer.h"
#include "engine/tokenizer_internal.h"

/* ================================================================ small helpers */

rk_status rk_tok_ids_push(rk_tok_ids *v, int32_t id) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->ids, cap * sizeof *p);
        if (!p) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory for %zu ids", cap);
        v->ids = p;
        v->cap = cap;
    }
    v->ids[v->n++] = id;
    return RK_OK;
}

int rk_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int len;
    uint32_t min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2, min = 0x80, c &= 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, min = 0x800, c &= 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, min = 0x10000, c &= 0x07;
    } else {
        return 0;
    }
    uint32_t v = c;
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n) return -1; /* so far so good, but cut short */
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = v << 6 | (s[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
    *cp = v;
    return len;
}

int rk_tok_utf8_encode(uint32_t cp, char *buf) {
    unsigned char *b = (unsigned char *)buf;
    if (cp < 0x80) {
        b[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        b[0] = (unsigned char)(0xC0 | cp >> 6);
        b[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        b[0] = (unsigned char)(0xE0 | cp >> 12);
        b[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        b[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    b[0] = (unsigned char)(0xF0 | cp >> 18);
    b[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    b[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    b[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Check that s[0..n) is well-formed UTF-8. On failure record a message with
 * the byte offset and the reason and return RK_ERR_INVALID. */
static rk_status utf8_validate(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int len = rk_utf8_decode(s + i, n - i, &cp);
        if (len > 0) {
            i += (size_t)len;
            continue;
        }
        const char *why;
        if ((c & 0xC0) == 0x80) {
            why = "unexpected continuation byte";
        } else if (c == 0xC0 || c == 0xC1) {
            why = "overlong encoding";
        } else if (c >= 0xF5) {
            why = c >= 0xF8 ? "invalid byte" : "code point above U+10FFFF";
        } else {
            /* A valid lead byte: find what is wrong with the continuation. */
            int need = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
            int have = 1;
            while (have < need && i + (size_t)have < n && (s[i + (size_t)have] & 0xC0) == 0x80)
                have++;
            if (have < need) {
                why = i + (size_t)have >= n ? "truncated sequence at end of text"
                                            : "truncated sequence";
            } else {
                uint32_t v = c & (need == 3 ? 0x0F : 0x07);
                for (int k = 1; k < need; k++) v = v << 6 | (s[i + (size_t)k] & 0x3F);
                if (v >= 0xD800 && v <= 0xDFFF)
                    why = "UTF-16 surrogate";
                else if (v > 0x10FFFF)
                    why = "code point above U+10FFFF";
                else
                    why = "overlong encoding";
            }
        }
        return rk_errorf(RK_ERR_INVALID, "invalid UTF-8 at byte offset %zu (0x%02X): %s", i, c,
                         why);
    }
    return RK_OK;
}

/* ================================================================ text -> id map */

static uint64_t hash_bytes(const char *s, size_t n) { return XXH3_64bits(s, n); }

int32_t rk_tok_lookup(const rk_tokenizer *t, const char *s, size_t n) {
    uint32_t mask = t->map.mask;
    for (uint32_t h = (uint32_t)hash_bytes(s, n) & mask;; h = (h + 1) & mask) {
        int32_t id = t->map.slots[h];
        if (id < 0) return -1;
        if (rk_tok_text_len(t, id) == n && memcmp(t->text + t->text_off[id], s, n) == 0) return id;
    }
}

/* Build the text -> id map; when two tokens share a text, the lower id wins. */
static rk_status strmap_build(rk_tokenizer *t) {
    uint32_t cap = 16;
    while (cap < 2u * (uint32_t)t->n_tokens) cap *= 2;
    t->map.slots = malloc((size_t)cap * sizeof *t->map.slots);
    if (!t->map.slots) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory for the token map");
    memset(t->map.slots, 0xff, (size_t)cap * sizeof *t->map.slots);
    t->map.mask = cap - 1;
    for (int32_t id = 0; id < t->n_tokens; id++) {
        const char *s = t->text + t->text_off[id];
        size_t n = rk_tok_text_len(t, id);
        uint32_t h = (uint32_t)hash_bytes(s, n) & t->map.mask;
        for (;; h = (h + 1) & t->map.mask) {
            int32_t other = t->map.slots[h];
            if (other < 0) {
                t->map.slots[h] = id;
                break;
            }
            if (rk_tok_text_len(t, other) == n && memcmp(t->text + t->text_off[other], s, n) == 0)
                break; /* duplicate text: keep the first */
        }
    }
    return RK_OK;
}

/* ================================================================ building */

/* Parse "<0xHH>" into its byte value, or return -1. */
static int parse_byte_token(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Fill the decode table: the exact bytes each token stands for. */
static rk_status build_decode(rk_tokenizer *t) {
    size_t total = t->text_off[t->n_tokens];
    t->dec = malloc(total ? total : 1);
    t->dec_off = malloc(((size_t)t->n_tokens + 1) * sizeof *t->dec_off);
    t->dec_special = malloc((size_t)t->n_tokens);
    if (!t->dec || !t->dec_off || !t->dec_special)
        return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory for the decode table");
    uint32_t pos = 0;
    for (int32_t id = 0; id < t->n_tokens; id++) {
        const char *s = t->text + t->text_off[id];
        uint32_t n = rk_tok_text_len(t, id);
        int type = t->types[id];
        t->dec_off[id] = pos;
        t->dec_special[id] =
            type == RK_TOKEN_CONTROL || type == RK_TOKEN_UNKNOWN || type == RK_TOKEN_UNUSED;
        int byte = type == RK_TOKEN_BYTE ? parse_byte_token(s, n) : -1;
        if (byte >= 0) {
            t->dec[pos++] = (char)byte;
        } else if (t->dec_special[id] || (t->is_gpt2 && type == RK_TOKEN_USER_DEFINED)) {
            memcpy(t->dec + pos, s, n);
            pos += n;
        } else if (!t->is_gpt2) {
            /* SentencePiece: U+2581 (E2 96 81) spells a space. */
            for (uint32_t i = 0; i < n; i++) {
                if (i + 2 < n && (unsigned char)s[i] == 0xE2 && (unsigned char)s[i + 1] == 0x96 &&
                    (unsigned char)s[i + 2] == 0x81) {
                    t->dec[pos++] = ' ';
                    i += 2;
                } else {
                    t->dec[pos++] = s[i];
                }
            }
        } else {
            /* Byte-level BPE: every character stands for one byte. */
            for (uint32_t i = 0; i < n;) {
                uint32_t cp;
                int len = rk_utf8_decode((const unsigned char *)s + i, n - i, &cp);
                int b = len > 0 ? rk_tok_gpt2_unicode_to_byte(cp) : -1;
                if (b >= 0) {
                    t->dec[pos++] = (char)b;
                    i += (uint32_t)len;
                } else { /* not a byte-level character: keep it as it is */
                    int k = len > 0 ? len : 1;
                    memcpy(t->dec + pos, s + i, (size_t)k);
                    pos += (uint32_t)k;
                    i += (uint32_t)k;
                }
            }
        }
    }
    t->dec_off[t->n_tokens] = pos;
    return RK_OK;
}

/* Sort key of a special token: first byte, then longest first, then lowest id. */
typedef struct special_key {
    uint32_t first;
    uint32_t len;
    int32_t id;
} special_key;

static int special_cmp(const void *pa, const void *pb) {
    const special_key *a = pa, *b = pb;
    if (a->first != b->first) return a->first < b->first ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* Collect the control and user-defined tokens that parse_special matches. */
/* Tokens matched by their text when special tokens are parsed: control,
 * user-defined and the unknown token, as the reference engine matches them. */
static int is_matched_special(const rk_tokenizer *t, int32_t id) {
    int32_t ty = t->types[id];
    return (ty == RK_TOKEN_CONTROL || ty == RK_TOKEN_USER_DEFINED || ty == RK_TOKEN_UNKNOWN) &&
           rk_tok_text_len(t, id) > 0;
}

static rk_status build_specials(rk_tokenizer *t) {
    int32_t n = 0;
    for (int32_t id = 0; id < t->n_tokens; id++)
        if (is_matched_special(t, id)) n++;
    special_key *keys = malloc((size_t)(n ? n : 1) * sizeof *keys);
    t->special = malloc((size_t)(n ? n : 1) * sizeof *t->special);
    if (!keys || !t->special) {
        free(keys);
        return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory");
    }
    n = 0;
    for (int32_t id = 0; id < t->n_tokens; id++)
        if (is_matched_special(t, id))
            keys[n++] =
                (special_key){(unsigned char)t->text[t->text_off[id]], rk_tok_text_len(t, id), id};
    qsort(keys, (size_t)n, sizeof *keys, special_cmp);
    for (int32_t i = 0; i < n; i++) t->special[i] = keys[i].id;
    free(keys);
    t->n_special = n;
    int32_t k = 0;
    for (int b = 0; b < 256; b++) {
        t->special_first[b] = (uint32_t)k;
        while (k < n && (unsigned char)t->text[t->text_off[t->special[k]]] == b) k++;
    }
    t->special_first[256] = (uint32_t)n;
    return RK_OK;
}

/* End-of-generation tokens: eos, plus the usual end markers when present as
 * non-normal tokens (Gemma 4's <|tool_response> opens the results of the
 * calls just written: the answer is over, as the reference engine has it). */
static void build_eog(rk_tokenizer *t) {
    static const char *const names[] = {"<|im_end|>",      "<|endoftext|>", "<|eot_id|>",
                                        "<|end_of_text|>", "</s>",          "<|end|>",
                                        "<end_of_turn>",   "<turn|>",       "<|tool_response>"};
    static const char *const harmony[] = {"<|return|>", "<|call|>"};
    t->n_eog = 0;
    if (t->eos_id >= 0) t->eog[t->n_eog++] = t->eos_id;
    /* o200k_harmony (gpt-oss): <|end|> closes one message of an answer
     * (its analysis, before the final one); <|return|> and <|call|> end it. */
    int is_harmony = 1;
    for (size_t i = 0; i < 2; i++) {
        int32_t id = rk_tok_lookup(t, harmony[i], strlen(harmony[i]));
        is_harmony &= id >= 0 && t->types[id] != RK_TOKEN_NORMAL;
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        int32_t id = rk_tok_lookup(t, names[i], strlen(names[i]));
        if (id < 0 || t->types[id] == RK_TOKEN_NORMAL || id == t->eos_id) continue;
        if (is_harmony && !strcmp(names[i], "<|end|>")) continue;
        t->eog[t->n_eog++] = id;
    }
    for (size_t i = 0; is_harmony && i < 2; i++) {
        int32_t id = rk_tok_lookup(t, harmony[i], strlen(harmony[i]));
        if (id != t->eos_id) t->eog[t->n_eog++] = id;
    }
}

/* True when no token holds U+2581 right after a character other than U+2581,
 * so that SentencePiece merges never cross the start of a word. */
static int spm_can_split(const rk_tokenizer *t) {
    for (int32_t id = 0; id < t->n_tokens; id++) {
        const unsigned char *s = (const unsigned char *)t->text + t->text_off[id];
        uint32_t n = rk_tok_text_len(t, id);
        for (uint32_t i = 1; i + 3 <= n; i++) {
            if (s[i] != 0xE2 || s[i + 1] != 0x96 || s[i + 2] != 0x81) continue;
            if (i < 3 || s[i - 3] != 0xE2 || s[i - 2] != 0x96 || s[i - 1] != 0x81) return 0;
        }
    }
    return 1;
}

rk_status rk_tokenizer_create(const rk_vocab *v, rk_tokenizer **out) {
    *out = NULL;
    if (!v || v->n_tokens <= 0 || !v->tokens)
        return rk_errorf(RK_ERR_INVALID, "tokenizer: empty vocabulary");
    int gpt2 = strcmp(v->model, "gpt2") == 0, gemma4 = strcmp(v->model, "gemma4") == 0;
    if (!gpt2 && !gemma4 && strcmp(v->model, "llama") != 0)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "tokenizer: model \"%.16s\" is not supported (supported: llama, gpt2, "
                         "gemma4)",
                         v->model);
    int32_t n = v->n_tokens;
    const int32_t *special_ids[4] = {&v->bos_id, &v->eos_id, &v->unk_id, &v->pad_id};
    static const char *const special_names[4] = {"bos", "eos", "unk", "pad"};
    for (int i = 0; i < 4; i++)
        if (*special_ids[i] < -1 || *special_ids[i] >= n)
            return rk_errorf(RK_ERR_INVALID, "tokenizer: %s id %d outside the vocabulary (%d)",
                             special_names[i], (int)*special_ids[i], (int)n);
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!v->tokens[i]) return rk_errorf(RK_ERR_INVALID, "tokenizer: token %d is NULL", (int)i);
        if (v->token_types && (v->token_types[i] < 0 || v->token_types[i] > RK_TOKEN_BYTE))
            return rk_errorf(RK_ERR_INVALID, "tokenizer: token %d has invalid type %d", (int)i,
                             (int)v->token_types[i]);
        total += strlen(v->tokens[i]) + 1;
    }
    if (total >= UINT32_MAX) return rk_errorf(RK_ERR_LIMIT, "tokenizer: token texts too large");

    rk_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory");
    rk_status st = RK_ERR_NOMEM;
    t->is_gpt2 = gpt2;
    t->spm_merges = gemma4;
    snprintf(t->model, sizeof t->model, "%s", v->model);
    snprintf(t->pre, sizeof t->pre, "%.31s", v->pre);
    t->n_tokens = n;
    t->bos_id = v->bos_id;
    t->eos_id = v->eos_id;
    t->unk_id = v->unk_id;
    t->pad_id = v->pad_id;
    t->add_bos = v->add_bos != 0;
    t->add_space_prefix = !gpt2 && !gemma4 && v->add_space_prefix;
    t->special_rstrip = v->special_rstrip;

    t->text = malloc(total);
    t->text_off = malloc(((size_t)n + 1) * sizeof *t->text_off);
    t->scores = malloc((size_t)n * sizeof *t->scores);
    t->types = malloc((size_t)n * sizeof *t->types);
    if (!t->text || !t->text_off || !t->scores || !t->types) {
        st = rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory for %d tokens", (int)n);
        goto fail;
    }
    uint32_t pos = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t len = strlen(v->tokens[i]);
        t->text_off[i] = pos;
        memcpy(t->text + pos, v->tokens[i], len + 1);
        pos += (uint32_t)len + 1;
        t->scores[i] = v->scores ? v->scores[i] : 0.0f;
        int type = v->token_types ? v->token_types[i] : RK_TOKEN_NORMAL;
        t->types[i] = type == 0 ? RK_TOKEN_NORMAL : type;
    }
    t->text_off[n] = pos;

    if ((st = strmap_build(t)) != RK_OK) goto fail;
    if (gpt2) {
        if ((st = rk_tok_bpe_init(t, v)) != RK_OK) goto fail;
    } else {
        for (int b = 0; b < 256; b++) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", (unsigned)b);
            t->byte_tok[b] = rk_tok_lookup(t, name, 6);
        }
        if (gemma4 && (st = rk_tok_bpe_merges_init(t, v)) != RK_OK) goto fail;
        t->spm_split = spm_can_split(t);
    }
    if ((st = build_decode(t)) != RK_OK) goto fail;
    if ((st = build_specials(t)) != RK_OK) goto fail;
    build_eog(t);
    *out = t;
    return RK_OK;

fail:
    rk_tokenizer_free(t);
    return st;
}

rk_status rk_tokenizer_from_gguf(const rk_gguf *g, rk_tokenizer **out) {
    *out = NULL;
    rk_vocab v;
    rk_status st = rk_vocab_from_gguf(g, &v);
    if (st != RK_OK) return st;
    st = rk_tokenizer_create(&v, out);
    rk_vocab_free(&v);
    return st;
}

void rk_tokenizer_free(rk_tokenizer *t) {
    if (!t) return;
    rk_tok_bpe_free(t);
    free(t->text);
    free(t->text_off);
    free(t->scores);
    free(t->types);
    free(t->dec);
    free(t->dec_off);
    free(t->dec_special);
    free(t->map.slots);
    free(t->special);
    free(t);
}

/* ================================================================ queries */

int32_t rk_tokenizer_n_vocab(const rk_tokenizer *t) { return t->n_tokens; }
int32_t rk_tokenizer_bos(const rk_tokenizer *t) { return t->bos_id; }
int32_t rk_tokenizer_eos(const rk_tokenizer *t) { return t->eos_id; }
int rk_tokenizer_add_bos(const rk_tokenizer *t) { return t->add_bos; }

int rk_tokenizer_is_eog(const rk_tokenizer *t, int32_t id) {
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return 1;
    return 0;
}

const char *rk_tokenizer_token_text(const rk_tokenizer *t, int32_t id) {
    if (id < 0 || id >= t->n_tokens) return NULL;
    return t->text + t->text_off[id];
}

int32_t rk_tokenizer_find(const rk_tokenizer *t, const char *s) {
    return rk_tok_lookup(t, s, strlen(s));
}

/* ================================================================ encode */

/* Encode one fragment that holds no special token. */
static rk_status encode_fragment(const rk_tokenizer *t, const char *s, size_t n, int after_special,
                                 rk_tok_ids *out) {
    if (n == 0) return RK_OK;
    if (t->is_gpt2) return rk_tok_bpe_encode(t, s, n, out);
    if (t->spm_merges) return rk_tok_bpe_spm_encode(t, s, n, out);
    return rk_tok_spm_encode(t, s, n, after_special && t->add_space_prefix, out);
}

/* Id of the longest special token that starts at s (n bytes left), or -1. */
static int32_t match_special(const rk_tokenizer *t, const char *s, size_t n) {
    unsigned char b = (unsigned char)s[0];
    for (uint32_t k = t->special_first[b]; k < t->special_first[b + 1]; k++) {
        int32_t id = t->special[k];
        uint32_t len = rk_tok_text_len(t, id);
        if (len <= n && memcmp(s, t->text + t->text_off[id], len) == 0) return id;
    }
    return -1;
}

rk_status rk_tokenizer_encode(const rk_tokenizer *t, const char *text, size_t len,
                              int parse_special, int32_t **out_ids, size_t *out_n) {
    *out_ids = NULL;
    *out_n = 0;
    if (len == 0) return RK_OK;
    if (!text) return rk_errorf(RK_ERR_INVALID, "tokenizer: NULL text of %zu bytes", len);
    if (len > RK_TOK_MAX_TEXT)
        return rk_errorf(RK_ERR_LIMIT, "tokenizer: text of %zu bytes exceeds the %zu byte limit",
                         len, RK_TOK_MAX_TEXT);
    rk_status st = utf8_validate((const unsigned char *)text, len);
    if (st != RK_OK) return st;

    rk_tok_ids ids = {0};
    size_t frag = 0;       /* start of the fragment not yet encoded */
    int after_special = 1; /* the text start counts as following a special token */
    if (parse_special && t->n_special > 0) {
        for (size_t i = 0; i < len;) {
            int32_t id = match_special(t, text + i, len - i);
            if (id < 0) {
                i++;
                while (i < len && ((unsigned char)text[i] & 0xC0) == 0x80) i++;
                continue;
            }
            if ((st = encode_fragment(t, text + frag, i - frag, after_special, &ids)) != RK_OK ||
                (st = rk_tok_ids_push(&ids, id)) != RK_OK)
                goto fail;
            after_special = 1;
            i += rk_tok_text_len(t, id);
            if (t->special_rstrip && id != t->bos_id && id != t->eos_id && id != t->unk_id)
                while (i < len &&
                       (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r'))
                    i++;
            frag = i;
        }
    }
    if ((st = encode_fragment(t, text + frag, len - frag, after_special, &ids)) != RK_OK) goto fail;
    *out_ids = ids.ids;
    *out_n = ids.n;
    return RK_OK;

fail:
    free(ids.ids);
    return st;
}

/* ================================================================ decode */

int rk_tokenizer_token_bytes(const rk_tokenizer *t, int32_t id, int render_special, char *buf,
                             int cap) {
    if (id < 0 || id >= t->n_tokens) return -1;
    if (t->dec_special[id] && !render_special) return 0;
    int n = (int)(t->dec_off[id + 1] - t->dec_off[id]);
    if (buf && cap > 0) memcpy(buf, t->dec + t->dec_off[id], (size_t)(n < cap ? n : cap));
    return n;
}

rk_status rk_tokenizer_decode(const rk_tokenizer *t, const int32_t *ids, size_t n,
                              int render_special, int skip_leading_space, char **out,
                              size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_tokens)
            return rk_errorf(RK_ERR_INVALID,
                             "decode: id %d at position %zu is outside the "
                             "vocabulary (%d tokens)",
                             (int)id, i, (int)t->n_tokens);
        if (!t->dec_special[id] || render_special) total += t->dec_off[id + 1] - t->dec_off[id];
    }
    char *buf = malloc(total + 1);
    if (!buf) return rk_errorf(RK_ERR_NOMEM, "decode: out of memory for %zu bytes", total);
    size_t pos = 0;
    int skip = skip_leading_space && !t->is_gpt2 && t->add_space_prefix;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (t->dec_special[id] && !render_special) continue;
        const char *s = t->dec + t->dec_off[id];
        size_t len = t->dec_off[id + 1] - t->dec_off[id];
        if (skip && len > 0) {
            /* llama2.c drops the space that starts the first piece after BOS. */
            if (s[0] == ' ') s++, len--;
            skip = 0;
        }
        memcpy(buf + pos, s, len);
        pos += len;
    }
    buf[pos] = '\0';
    *out = buf;
    *out_len = pos;
    return RK_OK;
}
