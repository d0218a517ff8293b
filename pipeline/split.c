/* pipeline/split.c — see split.h. One pass finds the piece boundaries
 * (unescaped separators); each piece is then copied with its escaped
 * separators turned into literal ones. */
#include "pipeline/split.h"

#include <stdlib.h>
#include <string.h>

rk_status rk_separator_check(const char *sep) {
    size_t n = strlen(sep);
    if (n == 0 || n > RK_SEPARATOR_MAX)
        return rk_errorf(RK_ERR_INVALID, "separator must be 1 to %d bytes, got %zu",
                         RK_SEPARATOR_MAX, n);
    if (strchr(sep, '\\'))
        return rk_errorf(RK_ERR_INVALID, "separator must not contain a backslash");
    return RK_OK;
}

/* Does the escaped form of sep (a backslash before each byte) start at p? */
static size_t escaped_at(const char *p, size_t left, const char *sep, size_t n_sep) {
    if (left < 2 * n_sep) return 0;
    for (size_t i = 0; i < n_sep; i++)
        if (p[2 * i] != '\\' || p[2 * i + 1] != sep[i]) return 0;
    return 2 * n_sep;
}

/* Copy a piece, turning escaped separators into literal ones. */
static rk_status copy_piece(const char *p, size_t len, const char *sep, size_t n_sep,
                            rk_text *out) {
    out->s = malloc(len + 1);
    if (!out->s) return rk_errorf(RK_ERR_NOMEM, "split: out of memory");
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t e = escaped_at(p + i, len - i, sep, n_sep);
        if (e) {
            memcpy(out->s + o, sep, n_sep);
            o += n_sep;
            i += e;
        } else {
            out->s[o++] = p[i++];
        }
    }
    out->s[o] = '\0';
    out->len = o;
    return RK_OK;
}

void rk_split_free(rk_split *s) {
    if (!s) return;
    free(s->system.s);
    for (int i = 0; i < s->n_chunks; i++) free(s->chunks[i].s);
    free(s->chunks);
    free(s->question.s);
    for (int g = 0; s->texts && g + 1 < s->n_groups; g++) free(s->texts[g].s);
    free(s->texts);
    free(s->group_end);
    memset(s, 0, sizeof *s);
}

rk_status rk_split_prompt(const char *prompt, size_t len, const char *sep, int max_chunks,
                          rk_split *out) {
    memset(out, 0, sizeof *out);
    if (!sep) sep = "##";
    rk_status st = rk_separator_check(sep);
    if (st) return st;
    size_t n_sep = strlen(sep);
    /* Boundaries: piece k spans [start[k], end[k]). */
    size_t cap = 16, n = 0, from = 0;
    size_t *start = malloc(cap * sizeof *start), *end = malloc(cap * sizeof *end);
    if (!start || !end) {
        st = rk_errorf(RK_ERR_NOMEM, "split: out of memory");
        goto fail;
    }
    for (size_t i = 0;;) {
        size_t e = i < len ? escaped_at(prompt + i, len - i, sep, n_sep) : 0;
        int at_sep = !e && i + n_sep <= len && memcmp(prompt + i, sep, n_sep) == 0;
        if (i >= len || at_sep) {
            if (n == cap) {
                cap *= 2;
                size_t *ns = realloc(start, cap * sizeof *ns);
                if (ns) start = ns;
                size_t *ne = ns ? realloc(end, cap * sizeof *ne) : NULL;
                if (!ns || !ne) {
                    st = rk_errorf(RK_ERR_NOMEM, "split: out of memory");
                    goto fail;
                }
                end = ne;
            }
            start[n] = from;
            end[n++] = i < len ? i : len;
            if (i >= len) break;
            i += n_sep;
            from = i;
        } else {
            i += e ? e : 1;
        }
    }
    /* n >= 1. One piece: the question; two: system + question; more: chunks between. */
    size_t q = n - 1;
    if (n > 1 && end[q] == start[q]) {
        st = rk_errorf(RK_ERR_INVALID, "the question (the text after the last separator) is empty");
        goto fail;
    }
    int n_chunks = 0;
    for (size_t k = 1; k + 1 < n; k++) n_chunks += end[k] > start[k];
    if (n_chunks > max_chunks) {
        st = rk_errorf(RK_ERR_LIMIT, "the prompt has %d chunks; at most %d are allowed", n_chunks,
                       max_chunks);
        goto fail;
    }
    out->n_empty_chunks = n > 2 ? (int)(n - 2) - n_chunks : 0;
    out->chunks = calloc((size_t)(n_chunks ? n_chunks : 1), sizeof *out->chunks);
    if (!out->chunks) {
        st = rk_errorf(RK_ERR_NOMEM, "split: out of memory");
        goto fail;
    }
    if (n > 1 && (st = copy_piece(prompt + start[0], end[0] - start[0], sep, n_sep, &out->system)))
        goto fail;
    for (size_t k = 1; k + 1 < n; k++) {
        if (end[k] == start[k]) continue;
        st = copy_piece(prompt + start[k], end[k] - start[k], sep, n_sep,
                        &out->chunks[out->n_chunks]);
        if (st) goto fail;
        out->n_chunks++;
    }
    if ((st = copy_piece(prompt + start[q], end[q] - start[q], sep, n_sep, &out->question)))
        goto fail;
    if (!out->system.s && (st = copy_piece("", 0, sep, n_sep, &out->system))) goto fail;
    free(start);
    free(end);
    return RK_OK;
fail:
    free(start);
    free(end);
    rk_split_free(out);
    return st;
}

static rk_status copy_plain(const char *s, rk_text *out) {
    size_t n = s ? strlen(s) : 0;
    out->s = malloc(n + 1);
    if (!out->s) return rk_errorf(RK_ERR_NOMEM, "split: out of memory");
    if (n) memcpy(out->s, s, n);
    out->s[n] = '\0';
    out->len = n;
    return RK_OK;
}

rk_status rk_split_structured(const char *system, const char *const *chunks, int n_chunks,
                              const char *question, int max_chunks, rk_split *out) {
    memset(out, 0, sizeof *out);
    rk_status st;
    if (!question || !*question) return rk_errorf(RK_ERR_INVALID, "the question is empty");
    int n_nonempty = 0;
    for (int i = 0; i < n_chunks; i++) n_nonempty += chunks[i] && *chunks[i];
    if (n_nonempty > max_chunks)
        return rk_errorf(RK_ERR_LIMIT, "the request has %d chunks; at most %d are allowed",
                         n_nonempty, max_chunks);
    out->chunks = calloc((size_t)(n_nonempty ? n_nonempty : 1), sizeof *out->chunks);
    if (!out->chunks) return rk_errorf(RK_ERR_NOMEM, "split: out of memory");
    out->n_empty_chunks = n_chunks - n_nonempty;
    if ((st = copy_plain(system, &out->system)) || (st = copy_plain(question, &out->question)))
        goto fail;
    for (int i = 0; i < n_chunks; i++) {
        if (!chunks[i] || !*chunks[i]) continue;
        if ((st = copy_plain(chunks[i], &out->chunks[out->n_chunks]))) goto fail;
        out->n_chunks++;
    }
    return RK_OK;
fail:
    rk_split_free(out);
    return st;
}

/* Append n bytes of s to t (t->s NULL: empty). */
static rk_status text_append(rk_text *t, const char *s, size_t n) {
    char *p = realloc(t->s, t->len + n + 1);
    if (!p) return rk_errorf(RK_ERR_NOMEM, "split: out of memory");
    memcpy(p + t->len, s, n);
    t->len += n;
    p[t->len] = '\0';
    t->s = p;
    return RK_OK;
}

rk_status rk_split_segments(const rk_segment *segs, int n_segs, int max_chunks, rk_split *out) {
    memset(out, 0, sizeof *out);
    int n_groups = 0, n_chunks = 0, n_nonempty = 0;
    for (int i = 0; i < n_segs; i++) {
        if (segs[i].text) continue;
        n_groups++;
        n_chunks += segs[i].n_chunks;
        for (int k = 0; k < segs[i].n_chunks; k++)
            n_nonempty += segs[i].chunks[k] && *segs[i].chunks[k];
    }
    if (n_nonempty > max_chunks)
        return rk_errorf(RK_ERR_LIMIT, "the request has %d chunks; at most %d are allowed",
                         n_nonempty, max_chunks);
    out->chunks = calloc((size_t)(n_nonempty ? n_nonempty : 1), sizeof *out->chunks);
    out->group_end = calloc((size_t)(n_groups ? n_groups : 1), sizeof *out->group_end);
    out->texts = calloc((size_t)(n_groups ? n_groups : 1), sizeof *out->texts);
    out->n_groups = n_groups;
    out->n_empty_chunks = n_chunks - n_nonempty;
    rk_status st = RK_OK;
    if (!out->chunks || !out->group_end || !out->texts)
        st = rk_errorf(RK_ERR_NOMEM, "split: out of memory");
    /* The text being gathered: the system prompt, then texts[g] after group
     * g, the question after the last. */
    int g = 0;
    for (int i = 0; i < n_segs && !st; i++) {
        rk_text *t = g == 0 ? &out->system : g < n_groups ? &out->texts[g - 1] : &out->question;
        if (n_groups == 0) t = &out->question;
        if (segs[i].text) {
            st = text_append(t, segs[i].text, strlen(segs[i].text));
            continue;
        }
        for (int k = 0; k < segs[i].n_chunks && !st; k++) {
            const char *c = segs[i].chunks[k];
            if (!c || !*c) continue;
            st = copy_plain(c, &out->chunks[out->n_chunks]);
            if (!st) out->n_chunks++;
        }
        out->group_end[g++] = out->n_chunks;
    }
    /* Every text exists, empty or not. */
    if (!st && !out->system.s) st = text_append(&out->system, "", 0);
    if (!st && !out->question.s) st = text_append(&out->question, "", 0);
    for (int i = 0; i + 1 < n_groups && !st; i++)
        if (!out->texts[i].s) st = text_append(&out->texts[i], "", 0);
    if (!st && n_groups > 0 && out->question.len == 0)
        st = rk_errorf(RK_ERR_INVALID,
                       "the question (the text after the last chunk group) is empty");
    if (st) {
        rk_split_free(out);
        return st;
    }
    if (n_groups <= 1) { /* one group: the classic layout */
        free(out->texts);
        free(out->group_end);
        out->texts = NULL;
        out->group_end = NULL;
        out->n_groups = 0;
    }
    return RK_OK;
}
