/* tests/faultinject.c — the --wrap targets behind tests/faultinject.h. The
 * state is atomic: compute threads may allocate while the test thread runs. */
#include "tests/faultinject.h"

#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>

void *__real_malloc(size_t size);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t size);
char *__real_strdup(const char *s);
void *__real_aligned_alloc(size_t alignment, size_t size);

void *__wrap_malloc(size_t size);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t size);
char *__wrap_strdup(const char *s);
void *__wrap_aligned_alloc(size_t alignment, size_t size);

static atomic_int g_active;
static atomic_long g_count;
static atomic_long g_fail_at;
static atomic_int g_persistent;
static atomic_int g_fired;

/* Distinct call sites of the allocations counted since the last arming. A
 * spin lock guards the table: it is written from inside the allocator, where
 * nothing that allocates may be called. */
#define MAX_SITES 1024
static struct {
    const void *site;
    long first, last;
} g_sites[MAX_SITES];
static int g_n_sites;
static atomic_flag g_sites_lock = ATOMIC_FLAG_INIT;

static void note_site(const void *site, long k) {
    while (atomic_flag_test_and_set(&g_sites_lock)) {
    }
    int i = 0;
    while (i < g_n_sites && g_sites[i].site != site) i++;
    if (i < g_n_sites) {
        g_sites[i].last = k;
    } else if (g_n_sites < MAX_SITES) {
        g_sites[g_n_sites].site = site;
        g_sites[g_n_sites].first = g_sites[g_n_sites].last = k;
        g_n_sites++;
    }
    atomic_flag_clear(&g_sites_lock);
}

static void arm(long n, int persistent) {
    atomic_store(&g_active, 0);
    atomic_store(&g_count, 0);
    atomic_store(&g_fail_at, n);
    atomic_store(&g_persistent, persistent);
    atomic_store(&g_fired, 0);
    while (atomic_flag_test_and_set(&g_sites_lock)) {
    }
    g_n_sites = 0;
    atomic_flag_clear(&g_sites_lock);
    atomic_store(&g_active, 1);
}

void rk_fault_alloc_fail_at(long n) { arm(n, 0); }
void rk_fault_alloc_fail_from(long n) { arm(n, 1); }

void rk_fault_alloc_stop(void) { atomic_store(&g_active, 0); }
long rk_fault_alloc_count(void) { return atomic_load(&g_count); }
int rk_fault_alloc_fired(void) { return atomic_load(&g_fired); }

int rk_fault_alloc_sites(long *out_first, long *out_last, int cap) {
    int n = g_n_sites < cap ? g_n_sites : cap;
    for (int i = 0; i < n; i++) {
        out_first[i] = g_sites[i].first;
        out_last[i] = g_sites[i].last;
    }
    return g_n_sites;
}

/* Count one allocation while armed; 1 when it must fail. */
static int should_fail(const void *site) {
    if (!atomic_load(&g_active)) return 0;
    long k = atomic_fetch_add(&g_count, 1) + 1, at = atomic_load(&g_fail_at);
    note_site(site, k);
    if (at == 0 || k < at || (k > at && !atomic_load(&g_persistent))) return 0;
    atomic_store(&g_fired, 1);
    errno = ENOMEM;
    return 1;
}

void *__wrap_malloc(size_t size) {
    return should_fail(__builtin_return_address(0)) ? NULL : __real_malloc(size);
}

void *__wrap_calloc(size_t n, size_t size) {
    return should_fail(__builtin_return_address(0)) ? NULL : __real_calloc(n, size);
}

/* A failed realloc leaves the block as it was, as the real one does. */
void *__wrap_realloc(void *p, size_t size) {
    return should_fail(__builtin_return_address(0)) ? NULL : __real_realloc(p, size);
}

char *__wrap_strdup(const char *s) {
    return should_fail(__builtin_return_address(0)) ? NULL : __real_strdup(s);
}

void *__wrap_aligned_alloc(size_t alignment, size_t size) {
    return should_fail(__builtin_return_address(0)) ? NULL : __real_aligned_alloc(alignment, size);
}
