/* engine/tokenizer_spm.c — the llama (SentencePiece-style BPE) encoder.
 *
 * The text gets a leading space, spaces are spelled U+2581, and the text is
 * split into UTF-8 characters. Then, repeatedly, the adjacent pair of symbols
 * whose concatenation is a token with the highest score is merged (ties go to
 * the leftmost pair), until no adjacent pair forms a token. A priority queue
 * keeps this O(n log n): every candidate pair is pushed once when it becomes
 * adjacent, and stale entries (a side already merged into something longer)
 * are dropped when popped. Symbols that are not tokens (characters missing
 * from the vocabulary) fall back to <0xXX> byte tokens, or <unk>.
 *
 * Equivalent to llama2.c's encode() (which rescans all pairs at every step)
 * and to llama.cpp's SPM tokenizer. */
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer_internal.h"

typedef struct spm_sym {
    int32_t start; /* byte offset in the spelled text */
    int32_t len;   /* bytes; 0 once merged into its left neighbour */
    int32_t prev, next;
} spm_sym;

typedef struct spm_pair {
    float score;
    int32_t left, right;
    int32_t size; /* len(left) + len(right) when pushed: detects stale entries */
} spm_pair;

/* True when pair a should be merged before pair b: the higher score,
 * leftmost among equals. */
static int pair_before(const void *pa, const void *pb, void *ctx) {
    (void)ctx;
    const spm_pair *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score;
    return a->left < b->left;
}

/* Push the pair (l, r) when their concatenation is a token. */
static rk_status try_pair(const rk_tokenizer *t, const char *buf, const spm_sym *sym, int32_t l,
                          int32_t r, rk_heap *h) {
    if (l < 0 || r < 0) return RK_OK;
    int32_t size = sym[l].len + sym[r].len;
    int32_t id = rk_tok_lookup(t, buf + sym[l].start, (size_t)size);
    if (id < 0) return RK_OK;
    spm_pair p = {t->scores[id], l, r, size};
    return rk_heap_push(h, &p);
}

/* Length of the UTF-8 character with lead byte c (the text is valid). */
static int32_t utf8_len(unsigned char c) { return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

/* True when the 3 bytes at p spell U+2581. */
static int is_marker(const char *p) {
    return (unsigned char)p[0] == 0xE2 && (unsigned char)p[1] == 0x96 &&
           (unsigned char)p[2] == 0x81;
}

/* Emit the ids of symbol i: its token, or byte fallback for a character that
 * has none (one <unk> when a byte token is missing too). */
static rk_status emit_symbol(const rk_tokenizer *t, const char *buf, const spm_sym *sym,
                             rk_tok_ids *out) {
    int32_t id = rk_tok_lookup(t, buf + sym->start, (size_t)sym->len);
    if (id >= 0) return rk_tok_ids_push(out, id);
    int all_bytes = 1;
    for (int32_t k = 0; k < sym->len; k++)
        if (t->byte_tok[(unsigned char)buf[sym->start + k]] < 0) all_bytes = 0;
    if (!all_bytes) {
        if (t->unk_id < 0)
            return rk_errorf(RK_ERR_UNSUPPORTED, "tokenizer: a character of the text has no "
                                                 "token, no byte tokens and there is no <unk>");
        return rk_tok_ids_push(out, t->unk_id);
    }
    rk_status st = RK_OK;
    for (int32_t k = 0; k < sym->len && st == RK_OK; k++)
        st = rk_tok_ids_push(out, t->byte_tok[(unsigned char)buf[sym->start + k]]);
    return st;
}

/* Run BPE by score over buf[start, end) (whole characters) and emit the ids.
 * sym has room for one symbol per byte of the segment. */
static rk_status encode_segment(const rk_tokenizer *t, const char *buf, size_t start, size_t end,
                                spm_sym *sym, rk_heap *h, rk_tok_ids *out) {
    int32_t n_sym = 0;
    for (size_t i = start; i < end;) {
        int32_t cl = utf8_len((unsigned char)buf[i]);
        sym[n_sym] = (spm_sym){(int32_t)i, cl, n_sym - 1, n_sym + 1};
        n_sym++;
        i += (size_t)cl;
    }
    if (n_sym == 0) return RK_OK;
    sym[n_sym - 1].next = -1;

    rk_status st;
    h->n = 0;
    for (int32_t i = 0; i + 1 < n_sym; i++)
        if ((st = try_pair(t, buf, sym, i, i + 1, h)) != RK_OK) return st;
    for (spm_pair p; rk_heap_pop(h, &p);) {
        spm_sym *l = &sym[p.left], *r = &sym[p.right];
        if (l->len == 0 || r->len == 0 || l->len + r->len != p.size) continue; /* stale */
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) sym[r->next].prev = p.left;
        if ((st = try_pair(t, buf, sym, l->prev, p.left, h)) != RK_OK ||
            (st = try_pair(t, buf, sym, p.left, l->next, h)) != RK_OK)
            return st;
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next)
        if ((st = emit_symbol(t, buf, &sym[i], out)) != RK_OK) return st;
    return RK_OK;
}

rk_status rk_tok_spm_encode(const rk_tokenizer *t, const char *s, size_t n, int add_space,
                            rk_tok_ids *out) {
    static const char k_space[3] = {'\xE2', '\x96', '\x81'}; /* U+2581 */
    size_t cap = 3 * (n + 1);
    char *buf = malloc(cap);                      /* the text, spaces spelled U+2581 */
    spm_sym *sym = malloc((n + 1) * sizeof *sym); /* (characters of a segment) */
    rk_heap h = {.item_size = sizeof(spm_pair), .before = pair_before};
    rk_status st = RK_OK;
    if (!buf || !sym) {
        st = rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory for %zu bytes of text", n);
        goto done;
    }
    size_t len = 0;
    if (add_space) {
        memcpy(buf, k_space, 3);
        len = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(buf + len, k_space, 3);
            len += 3;
        } else {
            buf[len++] = s[i];
        }
    }

    /* When no token has a U+2581 right after another character (t->spm_split),
     * no merge can cross the start of a word, so each word is merged on its
     * own: the same result, with small heaps. */
    size_t seg = 0;
    if (t->spm_split) {
        for (size_t i = 1; i + 3 <= len; i++) {
            if (!is_marker(buf + i) || (i >= 3 && is_marker(buf + i - 3))) continue;
            if ((st = encode_segment(t, buf, seg, i, sym, &h, out)) != RK_OK) goto done;
            seg = i;
            i += 2;
        }
    }
    st = encode_segment(t, buf, seg, len, sym, &h, out);

done:
    free(buf);
    free(sym);
    rk_heap_free(&h);
    return st;
}
