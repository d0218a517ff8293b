/* store/payload.c — the KV payload file: format, durable write, checked read.
 *
 * A payload file is a fixed header, the token ids, then the body. It describes
 * itself completely, so the store's rows can be rebuilt from the files alone.
 * All integers are little-endian. Version 2 (written now) has a 512-byte
 * header:
 *
 *   offset size  field
 *        0    4  magic "RKKV"
 *        4    4  u32 format version (2)
 *        8    4  u32 header size (512)
 *       12    4  u32 flags (0)
 *       16   32  model fingerprint, 32 lowercase hex characters, no NUL
 *       48   32  key, 32 lowercase hex characters, no NUL
 *       80    4  u32 n_tokens (>= 1)
 *       84   24  i32 n_layers, n_kv_heads, head_dim, dtype, block_size, base_pos
 *      108    4  reserved (0)
 *      112    8  u64 body size in bytes
 *      120   16  XXH3-128 of the bytes after the header (token ids then body),
 *                canonical form (big-endian high64 then low64)
 *      136   24  reserved (0)
 *      160   32  policy, 1..31 printable ASCII characters, NUL-padded
 *      192    8  f64 creation time, unix seconds (IEEE 754 bits as a u64)
 *      200    4  u32 document id length (0..255)
 *      204  256  document id bytes, zero-padded
 *      460   44  reserved (0)
 *      504    8  u64 XXH3-64 of header bytes [0, 504)
 *      512       i32 token ids (n_tokens of them)
 *  512+4*n       body (body size bytes)
 *
 * Version 1 (read, never written) is the first 160 bytes of that layout with
 * the header checksum at offset 152 over [0, 152) and no policy, creation time
 * or document id.
 *
 * The file size is therefore exactly header size + 4 * n_tokens + body size,
 * which the row records as n_bytes. A reader checks, in order: the size
 * against the row, the magic, version, header size and flags, the header
 * checksum, the fingerprint, key, token count, body size and checksum against
 * the row, and finally the checksum over the rest of the file. Nothing read
 * from the file is used to size an allocation before the file size has
 * confirmed it.
 *
 * Every open, read, write, fsync, rename and stat of a payload goes through
 * rk_payload_io_fault(), the countdown armed by rk_store_fault_io() in tests. */
#include "store/payload.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "store/payload.c writes token ids in host order and assumes a little-endian host"
#endif

_Static_assert(RK_STORE_HEADER_BYTES == 512, "payload header is 512 bytes");

enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 4,
    OFF_HSIZE = 8,
    OFF_FLAGS = 12,
    OFF_FP = 16,
    OFF_KEY = 48,
    OFF_NTOK = 80,
    OFF_LAYOUT = 84,
    OFF_BODY_SIZE = 112,
    OFF_SUM = 120,
    OFF_POLICY = 160,
    OFF_CREATED = 192,
    OFF_DOC_LEN = 200,
    OFF_DOC = 204,
    V1_HEADER_BYTES = 160,
    FORMAT_VERSION = 2,
    READ_CHUNK = 1 << 20,
};

static const char k_magic[4] = {'R', 'K', 'K', 'V'};

/* ---------------------------------------------------------------- fault injection */

static int g_fault_countdown; /* the I/O call that fails, counted from arming; 0 = none */
static int g_io_calls;        /* I/O calls since the last rk_store_fault_io() */

int rk_store_fault_io(int nth) {
    int n = g_io_calls;
    g_io_calls = 0;
    g_fault_countdown = nth > 0 ? nth : 0;
    return n;
}

int rk_payload_io_fault(void) {
    g_io_calls++;
    if (g_fault_countdown > 0 && --g_fault_countdown == 0) {
        errno = EIO;
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- helpers */

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

uint64_t rk_payload_file_bytes(uint64_t n_tokens, uint64_t body_size) {
    return RK_STORE_HEADER_BYTES + 4 * n_tokens + body_size;
}

void rk_payload_checksum(const int32_t *tokens, size_t n_tokens, const void *body, size_t body_size,
                         uint8_t out[16]) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, tokens, n_tokens * sizeof(int32_t));
    if (body_size) XXH3_128bits_update(&st, body, body_size);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&st));
    memcpy(out, c.digest, 16);
}

void rk_payload_checksum_hex(const uint8_t sum[16], char out[RK_STORE_KEY_LEN + 1]) {
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = hex[sum[i] >> 4];
        out[2 * i + 1] = hex[sum[i] & 15];
    }
    out[RK_STORE_KEY_LEN] = '\0';
}

void rk_payload_header_encode(const rk_payload_header *h, uint8_t b[RK_STORE_HEADER_BYTES]) {
    memset(b, 0, RK_STORE_HEADER_BYTES);
    memcpy(b + OFF_MAGIC, k_magic, 4);
    put_u32(b + OFF_VERSION, FORMAT_VERSION);
    put_u32(b + OFF_HSIZE, RK_STORE_HEADER_BYTES);
    memcpy(b + OFF_FP, h->fingerprint, RK_STORE_KEY_LEN);
    memcpy(b + OFF_KEY, h->key, RK_STORE_KEY_LEN);
    put_u32(b + OFF_NTOK, h->n_tokens);
    const int32_t lay[6] = {h->layout.n_layers, h->layout.n_kv_heads, h->layout.head_dim,
                            h->layout.dtype,    h->layout.block_size, h->layout.base_pos};
    for (int i = 0; i < 6; i++) put_u32(b + OFF_LAYOUT + 4 * i, (uint32_t)lay[i]);
    put_u64(b + OFF_BODY_SIZE, h->body_size);
    memcpy(b + OFF_SUM, h->checksum, 16);
    memcpy(b + OFF_POLICY, h->policy, strlen(h->policy));
    uint64_t created;
    memcpy(&created, &h->created, sizeof created);
    put_u64(b + OFF_CREATED, created);
    size_t nd = strlen(h->doc_id);
    put_u32(b + OFF_DOC_LEN, (uint32_t)nd);
    memcpy(b + OFF_DOC, h->doc_id, nd);
    put_u64(b + RK_STORE_HEADER_BYTES - 8, XXH3_64bits(b, RK_STORE_HEADER_BYTES - 8));
}

int rk_payload_printable(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] < 0x21 || p[i] > 0x7e) return 0;
    return 1;
}

/* Decode the header bytes of path (hsize of them, as checked by
 * header_size) into h, trusting nothing: every field is checked on its own
 * before the caller compares it with a row. */
static rk_status parse_header(const char *path, const uint8_t *b, uint32_t hsize,
                              rk_payload_header *h) {
    if (get_u32(b + OFF_FLAGS) != 0) return rk_errorf(RK_ERR_FORMAT, "%s: bad header flags", path);
    if (get_u64(b + hsize - 8) != XXH3_64bits(b, hsize - 8))
        return rk_errorf(RK_ERR_FORMAT, "%s: header checksum mismatch", path);
    memset(h, 0, sizeof *h);
    h->header_bytes = hsize;
    memcpy(h->fingerprint, b + OFF_FP, RK_STORE_KEY_LEN);
    memcpy(h->key, b + OFF_KEY, RK_STORE_KEY_LEN);
    h->n_tokens = get_u32(b + OFF_NTOK);
    int32_t lay[6];
    for (int i = 0; i < 6; i++) lay[i] = (int32_t)get_u32(b + OFF_LAYOUT + 4 * i);
    h->layout = (rk_store_layout){lay[0], lay[1], lay[2], lay[3], lay[4], lay[5]};
    h->body_size = get_u64(b + OFF_BODY_SIZE);
    memcpy(h->checksum, b + OFF_SUM, 16);
    if (hsize == V1_HEADER_BYTES) return RK_OK; /* no policy, time or document id */
    size_t np = strnlen((const char *)b + OFF_POLICY, RK_STORE_POLICY_MAX + 1);
    uint32_t nd = get_u32(b + OFF_DOC_LEN);
    if (np == 0 || np > RK_STORE_POLICY_MAX || !rk_payload_printable(b + OFF_POLICY, np) ||
        nd > RK_STORE_DOC_ID_MAX || memchr(b + OFF_DOC, 0, nd))
        return rk_errorf(RK_ERR_FORMAT, "%s: bad policy or document id in the header", path);
    memcpy(h->policy, b + OFF_POLICY, np);
    memcpy(h->doc_id, b + OFF_DOC, nd);
    uint64_t created = get_u64(b + OFF_CREATED);
    memcpy(&h->created, &created, sizeof h->created);
    return RK_OK;
}

/* Check the header of path (decoded by parse_header) against e. */
static rk_status header_matches(const char *path, const rk_payload_header *h,
                                const rk_payload_expect *e) {
    if (strcmp(h->fingerprint, e->fingerprint) != 0)
        return rk_errorf(RK_ERR_FORMAT, "%s: written for another model than the row's %s", path,
                         e->fingerprint);
    if (strcmp(h->key, e->key) != 0)
        return rk_errorf(RK_ERR_FORMAT, "%s: header key does not match the row", path);
    if ((int64_t)h->n_tokens != e->n_tokens)
        return rk_errorf(RK_ERR_FORMAT, "%s: header has %u tokens, row says %lld", path,
                         h->n_tokens, (long long)e->n_tokens);
    /* body_size comes from the file: compare without overflowing */
    uint64_t fixed = h->header_bytes + 4 * (uint64_t)h->n_tokens;
    if (e->n_bytes < fixed || h->body_size != e->n_bytes - fixed)
        return rk_errorf(RK_ERR_FORMAT, "%s: header body size %llu does not fit the file size %llu",
                         path, (unsigned long long)h->body_size, (unsigned long long)e->n_bytes);
    char hex[RK_STORE_KEY_LEN + 1];
    rk_payload_checksum_hex(h->checksum, hex);
    if (strcmp(hex, e->checksum_hex) != 0)
        return rk_errorf(RK_ERR_FORMAT, "%s: header checksum %s does not match the row's %s", path,
                         hex, e->checksum_hex);
    return RK_OK;
}

static rk_status write_all(int fd, const void *buf, size_t n, const char *path) {
    const uint8_t *p = buf;
    while (n > 0) {
        size_t step = n > (1u << 30) ? (1u << 30) : n;
        ssize_t w = rk_payload_io_fault() ? -1 : write(fd, p, step);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return rk_errorf(RK_ERR_IO, "%s: write: %s", path, strerror(errno));
        if (w == 0) return rk_errorf(RK_ERR_IO, "%s: write: no progress", path);
        p += w;
        n -= (size_t)w;
    }
    return RK_OK;
}

/* Read exactly n bytes; a short file is a bad payload (RK_ERR_FORMAT). */
static rk_status read_all(int fd, void *buf, size_t n, const char *path) {
    uint8_t *p = buf;
    while (n > 0) {
        size_t step = n > (1u << 30) ? (1u << 30) : n;
        ssize_t r = rk_payload_io_fault() ? -1 : read(fd, p, step);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return rk_errorf(RK_ERR_IO, "%s: read: %s", path, strerror(errno));
        if (r == 0) return rk_errorf(RK_ERR_FORMAT, "%s: truncated while reading", path);
        p += r;
        n -= (size_t)r;
    }
    return RK_OK;
}

static rk_status fsync_dir(const char *dir_path) {
    int fd = rk_payload_io_fault() ? -1 : open(dir_path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return rk_errorf(RK_ERR_IO, "%s: open directory: %s", dir_path, strerror(errno));
    int rc = rk_payload_io_fault() ? -1 : fsync(fd);
    int err = errno;
    close(fd);
    if (rc != 0) return rk_errorf(RK_ERR_IO, "%s: fsync directory: %s", dir_path, strerror(err));
    return RK_OK;
}

/* ---------------------------------------------------------------- write */

rk_status rk_payload_write(const char *tmp_path, const char *final_path, const char *dir_path,
                           const rk_payload_header *h, const int32_t *tokens, const void *body) {
    uint8_t hdr[RK_STORE_HEADER_BYTES];
    rk_payload_header_encode(h, hdr);
    int fd =
        rk_payload_io_fault() ? -1 : open(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return rk_errorf(RK_ERR_IO, "%s: create: %s", tmp_path, strerror(errno));
    rk_status st = write_all(fd, hdr, sizeof hdr, tmp_path);
    if (st == RK_OK) st = write_all(fd, tokens, (size_t)h->n_tokens * sizeof(int32_t), tmp_path);
    if (st == RK_OK && h->body_size) st = write_all(fd, body, (size_t)h->body_size, tmp_path);
    if (st == RK_OK && (rk_payload_io_fault() || fsync(fd) != 0))
        st = rk_errorf(RK_ERR_IO, "%s: fsync: %s", tmp_path, strerror(errno));
    if (close(fd) != 0 && st == RK_OK)
        st = rk_errorf(RK_ERR_IO, "%s: close: %s", tmp_path, strerror(errno));
    if (st != RK_OK) {
        unlink(tmp_path);
        return st;
    }
    if (rk_payload_io_fault() || rename(tmp_path, final_path) != 0) {
        st = rk_errorf(RK_ERR_IO, "%s: rename: %s", final_path, strerror(errno));
        unlink(tmp_path);
        return st;
    }
    st = fsync_dir(dir_path);
    if (st != RK_OK) unlink(final_path);
    return st;
}

/* Check the magic, version and header size at the start of a header (its
 * first 160 bytes) and return the header's size: 160 for version 1, 512 for
 * version 2. what names the source in the message. */
static rk_status header_size(const char *what, const uint8_t *b, uint32_t *out_hsize) {
    if (memcmp(b + OFF_MAGIC, k_magic, 4) != 0)
        return rk_errorf(RK_ERR_FORMAT, "%s: bad magic (not a ragkv payload)", what);
    uint32_t version = get_u32(b + OFF_VERSION), hsize = get_u32(b + OFF_HSIZE);
    if (version != 1 && version != FORMAT_VERSION)
        return rk_errorf(RK_ERR_FORMAT, "%s: payload format version %u, this ragkv reads 1 and %d",
                         what, version, FORMAT_VERSION);
    if (hsize != (version == 1 ? V1_HEADER_BYTES : RK_STORE_HEADER_BYTES))
        return rk_errorf(RK_ERR_FORMAT, "%s: bad header size %u for version %u", what, hsize,
                         version);
    *out_hsize = hsize;
    return RK_OK;
}

rk_status rk_payload_header_decode(const char *what, const uint8_t *b, size_t len,
                                   rk_payload_header *h) {
    uint32_t hsize;
    if (len < V1_HEADER_BYTES) return rk_errorf(RK_ERR_FORMAT, "%s: shorter than a header", what);
    rk_status st = header_size(what, b, &hsize);
    if (st != RK_OK) return st;
    if (len < hsize) return rk_errorf(RK_ERR_FORMAT, "%s: shorter than a header", what);
    return parse_header(what, b, hsize, h);
}

/* ---------------------------------------------------------------- read */

/* Read the header of the open file path (file_bytes long) into b and return
 * its size in *out_hsize: 160 bytes for version 1, 512 for version 2. */
static rk_status read_header(int fd, const char *path, uint64_t file_bytes,
                             uint8_t b[RK_STORE_HEADER_BYTES], uint32_t *out_hsize) {
    if (file_bytes < V1_HEADER_BYTES)
        return rk_errorf(RK_ERR_FORMAT, "%s: shorter than a header", path);
    rk_status st = read_all(fd, b, V1_HEADER_BYTES, path);
    if (st != RK_OK) return st;
    uint32_t hsize;
    if ((st = header_size(path, b, &hsize)) != RK_OK) return st;
    if (file_bytes < hsize) return rk_errorf(RK_ERR_FORMAT, "%s: shorter than a header", path);
    if (hsize > V1_HEADER_BYTES)
        st = read_all(fd, b + V1_HEADER_BYTES, hsize - V1_HEADER_BYTES, path);
    *out_hsize = hsize;
    return st;
}

/* Open path, stat it and read and parse its header. With e, the size and
 * header must match e's row. On RK_OK *out_fd is positioned right after the
 * header and *out_bytes holds the file size. */
static rk_status open_checked(const char *path, const rk_payload_expect *e, rk_payload_header *h,
                              int *out_fd, uint64_t *out_bytes) {
    int fd = rk_payload_io_fault() ? -1 : open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return rk_errorf(RK_ERR_FORMAT, "%s: payload file missing", path);
        return rk_errorf(RK_ERR_IO, "%s: open: %s", path, strerror(errno));
    }
    struct stat sb;
    rk_status st = RK_OK;
    if (rk_payload_io_fault() || fstat(fd, &sb) != 0)
        st = rk_errorf(RK_ERR_IO, "%s: stat: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = rk_errorf(RK_ERR_FORMAT, "%s: not a regular file", path);
    else if (e && (uint64_t)sb.st_size != e->n_bytes)
        st = rk_errorf(RK_ERR_FORMAT, "%s: %s (%lld bytes, row says %llu)", path,
                       (uint64_t)sb.st_size < e->n_bytes ? "truncated" : "too long",
                       (long long)sb.st_size, (unsigned long long)e->n_bytes);
    uint8_t hdr[RK_STORE_HEADER_BYTES];
    uint32_t hsize = 0;
    if (st == RK_OK) st = read_header(fd, path, (uint64_t)sb.st_size, hdr, &hsize);
    if (st == RK_OK) st = parse_header(path, hdr, hsize, h);
    if (st == RK_OK && e) st = header_matches(path, h, e);
    if (st != RK_OK) {
        close(fd);
        return st;
    }
    *out_fd = fd;
    *out_bytes = (uint64_t)sb.st_size;
    return RK_OK;
}

static rk_status checksum_matches(const char *path, const rk_payload_header *h,
                                  const uint8_t sum[16]) {
    if (memcmp(sum, h->checksum, 16) == 0) return RK_OK;
    return rk_errorf(RK_ERR_FORMAT, "%s: checksum mismatch (token ids or body corrupt)", path);
}

/* Hash the rest of the open file (left bytes) and compare with h's checksum. */
static rk_status check_rest(int fd, const char *path, const rk_payload_header *h, uint64_t left) {
    uint8_t *buf = malloc(READ_CHUNK);
    if (!buf) return rk_errorf(RK_ERR_NOMEM, "%s: no memory for a read buffer", path);
    XXH3_state_t xs;
    XXH3_128bits_reset(&xs);
    rk_status st = RK_OK;
    while (st == RK_OK && left > 0) {
        size_t n = left > READ_CHUNK ? READ_CHUNK : (size_t)left;
        st = read_all(fd, buf, n, path);
        if (st == RK_OK) XXH3_128bits_update(&xs, buf, n);
        left -= n;
    }
    free(buf);
    if (st != RK_OK) return st;
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&xs));
    return checksum_matches(path, h, c.digest);
}

rk_status rk_payload_check(const char *path, const rk_payload_expect *e, int full) {
    rk_payload_header h;
    int fd = -1;
    uint64_t n_bytes = 0;
    rk_status st = open_checked(path, e, &h, &fd, &n_bytes);
    if (st == RK_OK && full) st = check_rest(fd, path, &h, n_bytes - h.header_bytes);
    if (fd >= 0) close(fd);
    return st;
}

rk_status rk_payload_inspect(const char *path, int full, rk_payload_header *out_h,
                             uint64_t *out_bytes) {
    rk_payload_header h;
    int fd = -1;
    uint64_t n_bytes = 0;
    rk_status st = open_checked(path, NULL, &h, &fd, &n_bytes);
    if (st != RK_OK) return st;
    /* the sizes in the header must account for the whole file */
    uint64_t fixed = h.header_bytes + 4 * (uint64_t)h.n_tokens;
    if (h.n_tokens == 0 || n_bytes < fixed || h.body_size != n_bytes - fixed)
        st = rk_errorf(RK_ERR_FORMAT,
                       "%s: %llu bytes do not fit a header of %u tokens and %llu "
                       "body bytes",
                       path, (unsigned long long)n_bytes, h.n_tokens,
                       (unsigned long long)h.body_size);
    if (st == RK_OK && full) st = check_rest(fd, path, &h, n_bytes - h.header_bytes);
    close(fd);
    if (st != RK_OK) return st;
    *out_h = h;
    *out_bytes = n_bytes;
    return RK_OK;
}

rk_status rk_payload_read(const char *path, const rk_payload_expect *e, rk_payload_header *out_h,
                          int32_t **out_tokens, void **out_body) {
    rk_payload_header h;
    int fd = -1;
    uint64_t n_bytes = 0;
    rk_status st = open_checked(path, e, &h, &fd, &n_bytes);
    if (st != RK_OK) return st;
    /* Sizes are confirmed by the file size now. */
    size_t tok_bytes = (size_t)h.n_tokens * sizeof(int32_t);
    int32_t *tokens = malloc(tok_bytes);
    void *body = h.body_size ? malloc((size_t)h.body_size) : NULL;
    if (!tokens || (h.body_size && !body))
        st = rk_errorf(RK_ERR_NOMEM, "%s: no memory for a %llu-byte payload", path,
                       (unsigned long long)e->n_bytes);
    /* Hash each piece right after it lands, while it is still in cache. */
    XXH3_state_t xs;
    XXH3_128bits_reset(&xs);
    if (st == RK_OK) st = read_all(fd, tokens, tok_bytes, path);
    if (st == RK_OK) XXH3_128bits_update(&xs, tokens, tok_bytes);
    for (uint64_t off = 0; st == RK_OK && off < h.body_size; off += READ_CHUNK) {
        size_t n = h.body_size - off > READ_CHUNK ? READ_CHUNK : (size_t)(h.body_size - off);
        st = read_all(fd, (uint8_t *)body + off, n, path);
        if (st == RK_OK) XXH3_128bits_update(&xs, (uint8_t *)body + off, n);
    }
    close(fd);
    if (st == RK_OK) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&xs));
        st = checksum_matches(path, &h, c.digest);
    }
    if (st != RK_OK) {
        free(tokens);
        free(body);
        return st;
    }
    *out_h = h;
    *out_tokens = tokens;
    *out_body = body;
    return RK_OK;
}
