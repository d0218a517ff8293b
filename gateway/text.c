/* gateway/text.c — text helpers for the user-facing output. */
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway.h"

/* Length of the valid UTF-8 sequence at s (n bytes left), or 0 if invalid. */
static size_t utf8_seq_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len;
    unsigned min, cp;
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0)
        len = 2, min = 0x80, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0)
        len = 3, min = 0x800, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0)
        len = 4, min = 0x10000, cp = c & 0x07;
    else
        return 0;
    if (len > n) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

char *rk_utf8_sanitize(const char *text, size_t n, size_t *out_len) {
    char *out = malloc(n * 3 + 1); /* each invalid byte may become 3 bytes */
    if (!out) return NULL;
    const unsigned char *s = (const unsigned char *)text;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t len = utf8_seq_len(s + i, n - i);
        if (len && !(len == 1 && s[i] == 0)) {
            memcpy(out + o, s + i, len);
            o += len;
            i += len;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3); /* U+FFFD */
            o += 3;
            i++;
        }
    }
    out[o] = '\0';
    if (out_len) *out_len = o;
    return out;
}
