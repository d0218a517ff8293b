/* engine/tokenizer_bpe.c — the gpt2 (byte-level BPE) encoder, and gemma4's
 * BPE over SentencePiece-spelled text (rk_tok_bpe_spm_encode, at the end).
 *
 * 1. A regex chosen by tokenizer.ggml.pre splits the text into pieces (PCRE2,
 *    UTF + UCP, JIT when available). Text between matches, if any, is a piece
 *    too.
 * 2. Each byte of a piece is one initial symbol: the token of the character
 *    GPT-2's byte-to-unicode table spells that byte with.
 * 3. The adjacent pair with the lowest merge rank is merged, repeatedly (ties
 *    go to the leftmost pair), with a priority queue over a linked list of
 *    symbols: O(n log n) per piece. A merge is keyed by the pair of token ids
 *    and gives the merged token's id directly, so no text is looked up while
 *    encoding. */
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer_internal.h"

/* ================================================================ pre-tokenizers */

static const char k_re_gpt2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char k_re_qwen2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char k_re_llama3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* o200k (GPT-4o, Phi-4-mini): cased words with their contractions, numbers
 * of up to three digits. */
static const char k_re_gpt4o[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}"
    "\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}"
    "\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static const struct {
    const char *name;
    const char *re;
} k_pre[] = {
    {"default", k_re_gpt2},  {"gpt2", k_re_gpt2},        {"qwen2", k_re_qwen2},
    {"llama3", k_re_llama3}, {"llama-bpe", k_re_llama3}, {"gpt-4o", k_re_gpt4o},
};
#define N_PRE (sizeof k_pre / sizeof k_pre[0])

const char *rk_tok_pre_name_for_regex(const char *re) {
    for (size_t i = 0; i < N_PRE; i++)
        if (strcmp(re, k_pre[i].re) == 0) return k_pre[i].name;
    return NULL;
}

const char *rk_tok_pre_names(void) { return "default, gpt2, qwen2, llama3, llama-bpe, gpt-4o"; }

/* ================================================================ byte <-> unicode */

/* GPT-2 spells the printable bytes (! .. ~, ¡ .. ¬, ® .. ÿ) as themselves and
 * the other 68 bytes, in increasing order, as U+0100 .. U+0143. */
static int is_printable_byte(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
}

uint32_t rk_tok_gpt2_byte_to_unicode(uint8_t b) {
    if (is_printable_byte(b)) return b;
    if (b <= 0x20) return 256u + b;
    if (b <= 0xA0) return 256u + 33u + (b - 0x7Fu);
    return 256u + 67u; /* 0xAD */
}

int rk_tok_gpt2_unicode_to_byte(uint32_t cp) {
    if (cp < 256) return is_printable_byte(cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1;
    uint32_t k = cp - 256;
    if (k < 33) return (int)k;
    if (k < 67) return (int)(0x7F + (k - 33));
    return 0xAD;
}

/* ================================================================ merge table */

static uint32_t merge_slot(uint64_t key, uint32_t mask) {
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & mask;
}

/* The merge of (left, right), or NULL. */
static const rk_tok_merge *merge_find(const rk_tokenizer *t, int32_t left, int32_t right) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (uint32_t h = merge_slot(key, t->merge_mask);; h = (h + 1) & t->merge_mask) {
        const rk_tok_merge *m = &t->merges[h];
        if (m->key == key) return m;
        if (m->key == UINT64_MAX) return NULL;
    }
}

rk_status rk_tok_bpe_merges_init(rk_tokenizer *t, const rk_vocab *v) {
    if (v->n_merges < 0 || (v->n_merges > 0 && !v->merges))
        return rk_errorf(RK_ERR_INVALID, "tokenizer: bad merge list");
    uint32_t cap = 16;
    while (cap < 2u * (uint32_t)v->n_merges) cap *= 2;
    t->merges = malloc((size_t)cap * sizeof *t->merges);
    if (!t->merges) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory for the merge table");
    for (uint32_t i = 0; i < cap; i++) t->merges[i].key = UINT64_MAX;
    t->merge_mask = cap - 1;

    char small[256];
    int32_t n_skipped = 0;
    for (int32_t rank = 0; rank < v->n_merges; rank++) {
        const char *m = v->merges[rank];
        const char *sp = m && m[0] ? strchr(m + 1, ' ') : NULL; /* the left part may be " " */
        if (!sp)
            return rk_errorf(RK_ERR_FORMAT, "tokenizer: merge %d (\"%s\") is not \"left right\"",
                             (int)rank, m ? m : "(null)");
        size_t nl = (size_t)(sp - m), nr = strlen(sp + 1);
        char *cat = nl + nr <= sizeof small ? small : malloc(nl + nr);
        if (!cat) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory");
        memcpy(cat, m, nl);
        memcpy(cat + nl, sp + 1, nr);
        int32_t left = rk_tok_lookup(t, m, nl);
        int32_t right = rk_tok_lookup(t, sp + 1, nr);
        int32_t id = rk_tok_lookup(t, cat, nl + nr);
        if (cat != small) free(cat);
        if (left < 0 || right < 0 || id < 0) { /* refers to tokens the vocabulary lacks */
            n_skipped++;
            continue;
        }
        uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
        for (uint32_t h = merge_slot(key, t->merge_mask);; h = (h + 1) & t->merge_mask) {
            rk_tok_merge *e = &t->merges[h];
            if (e->key == key) break; /* listed twice: the lower rank stays */
            if (e->key == UINT64_MAX) {
                *e = (rk_tok_merge){key, rank, id};
                break;
            }
        }
    }
    if (n_skipped > 0)
        RK_LOG_WARN("%d of %d merges refer to tokens not in the vocabulary; ignored",
                    (int)n_skipped, (int)v->n_merges);
    return RK_OK;
}

rk_status rk_tok_bpe_init(rk_tokenizer *t, const rk_vocab *v) {
    for (int b = 0; b < 256; b++) {
        char buf[4];
        int n = rk_tok_utf8_encode(rk_tok_gpt2_byte_to_unicode((uint8_t)b), buf);
        t->byte_tok[b] = rk_tok_lookup(t, buf, (size_t)n);
        if (t->byte_tok[b] < 0)
            return rk_errorf(RK_ERR_FORMAT,
                             "gpt2 vocabulary has no token for byte 0x%02X (\"%.*s\")", (unsigned)b,
                             n, buf);
    }
    rk_status st = rk_tok_bpe_merges_init(t, v);
    if (st != RK_OK) return st;

    const char *re = NULL;
    for (size_t i = 0; i < N_PRE; i++)
        if (strcmp(v->pre, k_pre[i].name) == 0) re = k_pre[i].re;
    if (!re)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "tokenizer.ggml.pre \"%s\" is not supported (supported: %s)", v->pre,
                         rk_tok_pre_names());
    int err;
    PCRE2_SIZE err_off;
    t->re = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                          &err_off, NULL);
    if (!t->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return rk_errorf(RK_ERR_INTERNAL, "tokenizer: regex for \"%s\" at %zu: %s", v->pre,
                         (size_t)err_off, (const char *)msg);
    }
    t->re_jit = pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE) == 0;
    return RK_OK;
}

void rk_tok_bpe_free(rk_tokenizer *t) {
    free(t->merges);
    t->merges = NULL;
    pcre2_code_free(t->re);
    t->re = NULL;
}

/* ================================================================ encoding */

typedef struct bpe_sym {
    int32_t id;
    int32_t len; /* bytes; 0 once merged into its left neighbour */
    int32_t prev, next;
} bpe_sym;

typedef struct bpe_pair {
    int32_t rank;
    int32_t left, right;
    int32_t size; /* len(left) + len(right) when pushed: detects stale entries */
    int32_t id;   /* the merged token */
} bpe_pair;

/* Per-call scratch memory, grown as pieces need it. */
typedef struct bpe_scratch {
    bpe_sym *sym;
    size_t sym_cap;
    rk_heap heap; /* bpe_pair, lowest rank first */
} bpe_scratch;

/* The merge order: lowest rank first, leftmost among equals. */
static int pair_before(const void *pa, const void *pb, void *ctx) {
    (void)ctx;
    const bpe_pair *a = pa, *b = pb;
    if (a->rank != b->rank) return a->rank < b->rank;
    return a->left < b->left;
}

/* Push the pair (l, r) when the merge list has it. */
static rk_status try_pair(const rk_tokenizer *t, bpe_scratch *s, int32_t l, int32_t r) {
    if (l < 0 || r < 0 || s->sym[l].id < 0 || s->sym[r].id < 0) return RK_OK;
    const rk_tok_merge *m = merge_find(t, s->sym[l].id, s->sym[r].id);
    if (!m) return RK_OK;
    bpe_pair pr = {m->rank, l, r, s->sym[l].len + s->sym[r].len, m->id};
    return rk_heap_push(&s->heap, &pr);
}

/* BPE over one piece of n bytes, appending the ids to out. by_char 0
 * (gpt2): each byte starts as the token of its byte-level character. by_char
 * 1 (gemma4): each UTF-8 character starts as the token spelling it, or as
 * none (id -1: merged with nothing, and written as its <0xXX> byte tokens,
 * those the vocabulary has). */
static rk_status encode_piece(const rk_tokenizer *t, const unsigned char *p, size_t n, int by_char,
                              bpe_scratch *s, rk_tok_ids *out) {
    if (n == 1 && !by_char) return rk_tok_ids_push(out, t->byte_tok[p[0]]);
    if (n > s->sym_cap) {
        size_t cap = s->sym_cap ? s->sym_cap : 64;
        while (cap < n) cap *= 2;
        bpe_sym *sym = realloc(s->sym, cap * sizeof *sym);
        if (!sym) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory");
        s->sym = sym;
        s->sym_cap = cap;
    }
    int32_t ns = 0;
    for (size_t i = 0; i < n; ns++) {
        int32_t len = 1;
        if (by_char)
            while (i + (size_t)len < n && (p[i + (size_t)len] & 0xC0) == 0x80) len++;
        int32_t id =
            by_char ? rk_tok_lookup(t, (const char *)p + i, (size_t)len) : t->byte_tok[p[i]];
        s->sym[ns] = (bpe_sym){id, len, ns - 1, ns + 1};
        i += (size_t)len;
    }
    s->sym[ns - 1].next = -1;
    s->heap.n = 0; /* emptied, its memory kept for the next piece */
    rk_status st = RK_OK;
    for (int32_t i = 0; i + 1 < ns; i++)
        if ((st = try_pair(t, s, i, i + 1)) != RK_OK) return st;
    for (bpe_pair pr; rk_heap_pop(&s->heap, &pr);) {
        bpe_sym *l = &s->sym[pr.left], *r = &s->sym[pr.right];
        if (l->len == 0 || r->len == 0 || l->len + r->len != pr.size) continue; /* stale */
        l->id = pr.id;
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) s->sym[r->next].prev = pr.left;
        if ((st = try_pair(t, s, l->prev, pr.left)) != RK_OK ||
            (st = try_pair(t, s, pr.left, l->next)) != RK_OK)
            return st;
    }
    size_t at = 0; /* byte offset of symbol i in the piece */
    for (int32_t i = 0; i >= 0; i = s->sym[i].next) {
        if (s->sym[i].id >= 0) {
            st = rk_tok_ids_push(out, s->sym[i].id);
        } else {
            for (int32_t b = 0; st == RK_OK && b < s->sym[i].len; b++)
                if (t->byte_tok[p[at + (size_t)b]] >= 0)
                    st = rk_tok_ids_push(out, t->byte_tok[p[at + (size_t)b]]);
        }
        if (st != RK_OK) return st;
        at += (size_t)s->sym[i].len;
    }
    return RK_OK;
}

/* Find the next pre-tokenizer match at or after off. Return 1 with the match
 * in [*ms, *me), 0 when there is none, or a negative PCRE2 error. */
static int next_match(const rk_tokenizer *t, const char *text, size_t n, size_t off,
                      pcre2_match_data *md, size_t *ms, size_t *me) {
    int rc = PCRE2_ERROR_NOMATCH;
    if (t->re_jit) rc = pcre2_jit_match(t->re, (PCRE2_SPTR)text, n, off, 0, md, NULL);
    if (!t->re_jit || (rc < 0 && rc != PCRE2_ERROR_NOMATCH)) /* e.g. JIT stack limit */
        rc = pcre2_match(t->re, (PCRE2_SPTR)text, n, off, PCRE2_NO_UTF_CHECK, md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) return rc;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

rk_status rk_tok_bpe_encode(const rk_tokenizer *t, const char *text, size_t n, rk_tok_ids *out) {
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->re, NULL);
    if (!md) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory for regex match data");
    bpe_scratch s = {.heap = {.item_size = sizeof(bpe_pair), .before = pair_before}};
    rk_status st = RK_OK;
    const unsigned char *u = (const unsigned char *)text;
    size_t off = 0;
    while (off < n) {
        size_t ms, me;
        int rc = next_match(t, text, n, off, md, &ms, &me);
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            st = rk_errorf(RK_ERR_INTERNAL, "tokenizer: regex match failed at byte %zu: %s", off,
                           (const char *)msg);
            break;
        }
        if (rc == 0) ms = me = n; /* the rest is one piece */
        if (ms > off && (st = encode_piece(t, u + off, ms - off, 0, &s, out)) != RK_OK) break;
        if (me == ms && ms < n) {
            /* An empty match: take one character as a piece and go on. */
            size_t cl = 1;
            while (ms + cl < n && (u[ms + cl] & 0xC0) == 0x80) cl++;
            me = ms + cl;
        }
        if (me > ms && (st = encode_piece(t, u + ms, me - ms, 0, &s, out)) != RK_OK) break;
        off = me;
    }
    pcre2_match_data_free(md);
    free(s.sym);
    rk_heap_free(&s.heap);
    return st;
}

rk_status rk_tok_bpe_spm_encode(const rk_tokenizer *t, const char *text, size_t n,
                                rk_tok_ids *out) {
    size_t spaces = 0;
    for (size_t i = 0; i < n; i++) spaces += text[i] == ' ';
    unsigned char *u = malloc(n + 2 * spaces + 1); /* U+2581 is 3 bytes */
    if (!u) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory");
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        if (text[i] == ' ') {
            memcpy(u + len, "\xE2\x96\x81", 3);
            len += 3;
        } else {
            u[len++] = (unsigned char)text[i];
        }
    }
    bpe_scratch s = {.heap = {.item_size = sizeof(bpe_pair), .before = pair_before}};
    rk_status st = RK_OK;
    for (size_t a = 0, b; st == RK_OK && a < len; a = b) {
        int newlines = u[a] == '\n';
        for (b = a + 1; b < len && (u[b] == '\n') == newlines;) b++;
        int32_t whole = newlines ? rk_tok_lookup(t, (const char *)u + a, b - a) : -1;
        st = whole >= 0 ? rk_tok_ids_push(out, whole) : encode_piece(t, u + a, b - a, 1, &s, out);
    }
    free(u);
    free(s.sym);
    rk_heap_free(&s.heap);
    return st;
}
