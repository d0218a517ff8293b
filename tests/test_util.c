/* tests/test_util.c — the shared helpers of config/util.c: the heap gives
 * its items in the order a sort does, the string buffer grows and keeps
 * every byte, and the string copy copies. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"

typedef struct item {
    int key, seq; /* seq: the push order, to tell equal keys apart */
} item;

static int item_before(const void *pa, const void *pb, void *ctx) {
    (void)ctx;
    const item *a = pa, *b = pb;
    return a->key != b->key ? a->key < b->key : a->seq < b->seq;
}

static int item_cmp(const void *pa, const void *pb) {
    return item_before(pa, pb, NULL) ? -1 : item_before(pb, pa, NULL) ? 1 : 0;
}

Test(util, heap_gives_items_in_sorted_order_ties_included) {
    enum { N = 5000 };
    static item in[N], want[N];
    srand(7);
    rk_heap h = {.item_size = sizeof(item), .before = item_before};
    for (int i = 0; i < N; i++) {
        in[i] = (item){rand() % 97, i}; /* many equal keys */
        cr_assert_eq(rk_heap_push(&h, &in[i]), RK_OK);
    }
    memcpy(want, in, sizeof in);
    qsort(want, N, sizeof *want, item_cmp);
    item got;
    for (int i = 0; i < N; i++) {
        cr_assert_eq(rk_heap_pop(&h, &got), 1);
        cr_assert_eq(got.key, want[i].key, "item %d", i);
        cr_assert_eq(got.seq, want[i].seq, "item %d", i);
    }
    cr_assert_eq(rk_heap_pop(&h, &got), 0, "empty");
    rk_heap_free(&h);
}

Test(util, heap_takes_pushes_between_pops) {
    rk_heap empty = {.item_size = sizeof(item), .before = item_before};
    rk_heap_free(&empty); /* an empty heap frees */
    rk_heap g = {.item_size = sizeof(item), .before = item_before};
    int keys[] = {5, 3, 9, 1}, seq = 0;
    for (int i = 0; i < 4; i++) cr_assert_eq(rk_heap_push(&g, &(item){keys[i], seq++}), RK_OK);
    item x;
    cr_assert(rk_heap_pop(&g, &x) && x.key == 1);
    cr_assert_eq(rk_heap_push(&g, &(item){2, seq++}), RK_OK);
    cr_assert_eq(rk_heap_push(&g, &(item){0, seq++}), RK_OK);
    int want[] = {0, 2, 3, 5, 9};
    for (int i = 0; i < 5; i++) {
        cr_assert(rk_heap_pop(&g, &x));
        cr_assert_eq(x.key, want[i]);
    }
    rk_heap_free(&g);
}

Test(util, strbuf_grows_and_keeps_every_byte) {
    rk_strbuf b = {0};
    for (int i = 0; i < 1000; i++) rk_strbuf_printf(&b, "%d,", i);
    rk_strbuf_putn(&b, "ab\0c", 4); /* bytes, a NUL among them */
    rk_strbuf_puts(&b, "end");
    cr_assert_eq(b.oom, 0);
    size_t len = b.len;
    char *s = rk_strbuf_take(&b);
    cr_assert_not_null(s);
    cr_assert_eq(strncmp(s, "0,1,2,", 6), 0);
    cr_assert_eq(memcmp(s + len - 7, "ab\0cend", 7), 0);
    cr_assert_eq(s[len], 0, "zero-terminated");
    cr_assert_eq(b.s, NULL, "take leaves the buffer empty");
    free(s);
}

Test(util, strbuf_take_of_nothing_is_an_empty_string) {
    rk_strbuf b = {0};
    char *s = rk_strbuf_take(&b);
    cr_assert_str_eq(s, "");
    free(s);
    rk_strbuf_puts(&b, "x");
    rk_strbuf_free(&b);
    cr_assert_eq(b.s, NULL);
}

Test(util, strdup_copies_and_accepts_null) {
    char *s = rk_strdup("chunk");
    cr_assert_str_eq(s, "chunk");
    free(s);
    cr_assert_eq(rk_strdup(NULL), NULL);
}
