/* bench/score.h — answer scoring for `ragkv eval --task`: LongBench's
 * normalised exact match and token F1.
 *
 * Normalisation (LongBench's normalize_answer): lowercase, remove ASCII
 * punctuation, remove the articles a, an and the as whole words, collapse
 * whitespace. Lowercasing is ASCII only, and for the article rule every byte
 * of a multi-byte UTF-8 character counts as a word character (Python's \b
 * treats most non-ASCII letters so). F1 is over the whitespace tokens of the
 * normalised strings (a multiset intersection); 0 when nothing is shared. */
#ifndef RK_SCORE_H
#define RK_SCORE_H

#include <stddef.h>

/* The normalised form of s (len bytes): malloc'ed, NUL-terminated, NULL when
 * out of memory. The caller frees it. */
char *rk_score_normalize(const char *s, size_t len);

/* 1 when the normalised prediction equals the normalised answer, else 0;
 * -1 when out of memory. */
int rk_score_exact(const char *pred, const char *answer);

/* Token F1 of the normalised prediction against the normalised answer, in
 * [0, 1]; -1 when out of memory. */
double rk_score_f1(const char *pred, const char *answer);

#endif
