/* engine/tokenizer_spm.c — the llama (SentencePiece-style BPE) encoder.
 *
 * The text gets a leading space, spaces are spelled U+2581, and the text is
 * split into UTF-8 characters. Then, repeatedly, the adjacent pair of symbols
 * whose concatenation is a token with the highest score is merged (ties go to
 * the leftmost pair), until no adjacent pair forms a token. A priority queue
 * keeps this O(n log n): every candidate pair is pushed once when it becomes
 * adjacent, and stale entries (a side already merged into something longer)
 * are dropped when popped. Symbols that are not tokens (characters missing
 * from the vocabulary) fall back to <0xXX> byte tokens, or <unk>. */
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

typedef struct spm_heap {
    spm_pair *a;
    size_t n, cap;
} spm_heap;

/* True when pair a should be merged before pair b. */
static int pair_before(const spm_pair *a, const spm_pair *b) {
    if (a->score != b->score) return a->score > b->score;
    return a->left < b->left;
}

static rk_status heap_push(spm_heap *h, spm_pair p) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        spm_pair *a = realloc(h->a, cap * sizeof *a);
        if (!a) return rk_errorf(RK_ERR_NOMEM, "tokenizer: out of memory");
        h->a = a;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!pair_before(&p, &h->a[parent])) break;
        h->a[i] = h->a[parent];
        i = parent;
    }
    h->a[i] = p;
    return RK_OK;
}

static spm_pair heap_pop(spm_heap *h) {
    spm_pair top = h->a[0];
    spm_pair last = h->a[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && pair_before(&h->a[c + 1], &h->a[c])) c++;
        if (!pair_before(&h->a[c], &last)) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (h->n > 0) h->a[i] = last;
    return top;
}

/* Push the pair (l, r) when their concatenation is a token. */
static rk_status try_pair(const rk_tokenizer *t, const char *buf, const spm_sym *sym, int32_t l,
                          int32_t r, spm_heap *h) {
    if (l < 0 || r < 0) return RK_OK;
    int32_t size = sym[l].len + sym[r].len;
    int32_t id = rk_tok_lookup(t, buf + sym[l].start, (size_t)size);
    if (id < 0) return RK_OK;
    return heap_push(h, (spm_pair){t->scores[id], l, r, size});
}

/* Length of the UTF-8 character with lead byte c (the text is valid). */
static int32_t utf8_len(unsigned char c) { return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

rk_status rk_tok_spm_encode(const rk_tokenizer *t, const char *s, size_t n, int add_space,
                            rk_tok_ids *out) {
    static const char k_space[3] = {'\xE2', '\x96', '\x81'}; /* U+2581 */
    size_t cap = 3 * (n + 1);
    char *buf = malloc(cap);                      /* the text, spaces spelled U+2581 */
    spm_sym *sym = malloc((n + 1) * sizeof *sym); /* (n_sym) */
    spm_heap h = {0};
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

    int32_t n_sym = 0;
    for (size_t i = 0; i < len;) {
        int32_t cl = utf8_len((unsigned char)buf[i]);
        sym[n_sym] = (spm_sym){(int32_t)i, cl, n_sym - 1, n_sym + 1};
        n_sym++;
        i += (size_t)cl;
    }
    if (n_sym == 0) goto done;
    sym[n_sym - 1].next = -1;

    for (int32_t i = 0; i + 1 < n_sym; i++)
        if ((st = try_pair(t, buf, sym, i, i + 1, &h)) != RK_OK) goto done;
    while (h.n > 0) {
        spm_pair p = heap_pop(&h);
        spm_sym *l = &sym[p.left], *r = &sym[p.right];
        if (l->len == 0 || r->len == 0 || l->len + r->len != p.size) continue; /* stale */
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) sym[r->next].prev = p.left;
        if ((st = try_pair(t, buf, sym, l->prev, p.left, &h)) != RK_OK ||
            (st = try_pair(t, buf, sym, p.left, l->next, &h)) != RK_OK)
            goto done;
    }

    for (int32_t i = 0; i >= 0; i = sym[i].next) {
        int32_t id = rk_tok_lookup(t, buf + sym[i].start, (size_t)sym[i].len);
        if (id >= 0) {
            if ((st = rk_tok_ids_push(out, id)) != RK_OK) goto done;
            continue;
        }
        /* A character with no token: its bytes as <0xXX> tokens, or one <unk>
         * when the vocabulary lacks one of them. */
        int all_bytes = 1;
        for (int32_t k = 0; k < sym[i].len; k++)
            if (t->byte_tok[(unsigned char)buf[sym[i].start + k]] < 0) all_bytes = 0;
        if (!all_bytes) {
            if (t->unk_id < 0) {
                st = rk_errorf(RK_ERR_UNSUPPORTED,
                               "tokenizer: character at byte %d has no token, no byte token "
                               "and the vocabulary has no <unk>",
                               (int)sym[i].start);
                goto done;
            }
            if ((st = rk_tok_ids_push(out, t->unk_id)) != RK_OK) goto done;
            continue;
        }
        for (int32_t k = 0; k < sym[i].len; k++)
            if ((st = rk_tok_ids_push(out, t->byte_tok[(unsigned char)buf[sym[i].start + k]])) !=
                RK_OK)
                goto done;
    }

done:
    free(buf);
    free(sym);
    free(h.a);
    return st;
}
