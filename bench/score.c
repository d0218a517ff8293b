/* bench/score.c — see score.h. */
#include "bench/score.h"

#include <stdlib.h>
#include <string.h>

static int is_punct(unsigned char c) {
    return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
           (c >= 123 && c <= 126);
}

static int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* A word character for the article rule: ASCII letters, digits and '_', and
 * every byte of a non-ASCII character. */
static int is_word(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c >= 0x80;
}

static int is_article(const char *w, size_t n) {
    return (n == 1 && w[0] == 'a') || (n == 2 && !memcmp(w, "an", 2)) ||
           (n == 3 && !memcmp(w, "the", 3));
}

/* Lowercase and drop punctuation, then blank out articles that are whole
 * words (bounded by non-word bytes), then split on whitespace and join the
 * words with single spaces. */
char *rk_score_normalize(const char *s, size_t len) {
    char *t = malloc(len + 1), *out = malloc(len + 1);
    if (!t || !out) {
        free(t);
        free(out);
        return NULL;
    }
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (is_punct(c)) continue;
        t[n++] = (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    }
    for (size_t i = 0; i < n;) {
        if (!is_word((unsigned char)t[i])) {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && is_word((unsigned char)t[j])) j++;
        if (is_article(t + i, j - i)) memset(t + i, ' ', j - i);
        i = j;
    }
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        while (i < n && is_space((unsigned char)t[i])) i++;
        if (i == n) break;
        if (m) out[m++] = ' ';
        while (i < n && !is_space((unsigned char)t[i])) out[m++] = t[i++];
    }
    out[m] = '\0';
    free(t);
    return out;
}

int rk_score_exact(const char *pred, const char *answer) {
    char *a = rk_score_normalize(pred, strlen(pred)),
         *b = rk_score_normalize(answer, strlen(answer));
    int r = a && b ? strcmp(a, b) == 0 : -1;
    free(a);
    free(b);
    return r;
}

/* The words of a normalised string, cut in place (it has single spaces). */
static int split_words(char *s, char ***out) {
    int n = *s != '\0';
    for (char *p = s; *p; p++) n += *p == ' ';
    char **w = malloc((size_t)(n ? n : 1) * sizeof *w);
    if (!w) return -1;
    int k = 0;
    for (char *p = s; *s && p;) {
        w[k++] = p;
        p = strchr(p, ' ');
        if (p) *p++ = '\0';
    }
    *out = w;
    return k;
}

double rk_score_f1(const char *pred, const char *answer) {
    char *a = rk_score_normalize(pred, strlen(pred)),
         *b = rk_score_normalize(answer, strlen(answer));
    char **wa = NULL, **wb = NULL;
    unsigned char *used = NULL;
    double f1 = -1;
    int na, nb;
    if (!a || !b || (na = split_words(a, &wa)) < 0 || (nb = split_words(b, &wb)) < 0 ||
        !(used = calloc((size_t)(nb ? nb : 1), 1)))
        goto done;
    int same = 0; /* multiset intersection: each answer word matches once */
    for (int i = 0; i < na; i++)
        for (int j = 0; j < nb; j++)
            if (!used[j] && !strcmp(wa[i], wb[j])) {
                used[j] = 1;
                same++;
                break;
            }
    f1 = 0;
    if (same > 0) {
        double p = (double)same / na, r = (double)same / nb;
        f1 = 2 * p * r / (p + r);
    }
done:
    free(a);
    free(b);
    free(wa);
    free(wb);
    free(used);
    return f1;
}
