/* config/util.c — the helpers every module shares: a string copy, a
 * growable string and a binary heap (config.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"

char *rk_strdup(const char *z) {
    if (!z) return NULL;
    size_t n = strlen(z) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, z, n);
    return p;
}

/* ---------------------------------------------------------------- rk_strbuf */

/* Room for n more bytes and the terminator; 0 on success. */
static int strbuf_reserve(rk_strbuf *b, size_t n) {
    if (b->oom) return -1;
    if (b->len + n < b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap <= b->len + n) {
        if (cap > SIZE_MAX / 2) goto fail;
        cap *= 2;
    }
    char *p = realloc(b->s, cap);
    if (!p) goto fail;
    b->s = p;
    b->cap = cap;
    return 0;
fail:
    b->oom = 1;
    return -1;
}

void rk_strbuf_putn(rk_strbuf *b, const char *z, size_t n) {
    if (strbuf_reserve(b, n)) return;
    if (n) memcpy(b->s + b->len, z, n);
    b->len += n;
    b->s[b->len] = 0;
}

void rk_strbuf_puts(rk_strbuf *b, const char *z) { rk_strbuf_putn(b, z, strlen(z)); }

void rk_strbuf_printf(rk_strbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = 1;
        return;
    }
    if (strbuf_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

char *rk_strbuf_take(rk_strbuf *b) {
    char *s = b->oom ? NULL : b->s ? b->s : rk_strdup("");
    if (b->oom) free(b->s);
    *b = (rk_strbuf){0};
    return s;
}

void rk_strbuf_free(rk_strbuf *b) {
    free(b->s);
    *b = (rk_strbuf){0};
}

/* ---------------------------------------------------------------- rk_heap */

static void *item_at(const rk_heap *h, size_t i) { return h->items + i * h->item_size; }

rk_status rk_heap_push(rk_heap *h, const void *item) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        unsigned char *p = realloc(h->items, cap * h->item_size);
        if (!p) return rk_errorf(RK_ERR_NOMEM, "heap: out of memory");
        h->items = p;
        h->cap = cap;
    }
    /* Sift up: parents that come after item move down a level. */
    size_t i = h->n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!h->before(item, item_at(h, parent), h->ctx)) break;
        memcpy(item_at(h, i), item_at(h, parent), h->item_size);
        i = parent;
    }
    memcpy(item_at(h, i), item, h->item_size);
    return RK_OK;
}

int rk_heap_pop(rk_heap *h, void *out) {
    if (h->n == 0) return 0;
    memcpy(out, item_at(h, 0), h->item_size);
    if (--h->n == 0) return 1;
    /* Sift the last item down from the root. */
    const void *last = item_at(h, h->n);
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->before(item_at(h, c + 1), item_at(h, c), h->ctx)) c++;
        if (!h->before(item_at(h, c), last, h->ctx)) break;
        memcpy(item_at(h, i), item_at(h, c), h->item_size);
        i = c;
    }
    memmove(item_at(h, i), last, h->item_size);
    return 1;
}

void rk_heap_free(rk_heap *h) {
    free(h->items);
    h->items = NULL;
    h->n = h->cap = 0;
}
