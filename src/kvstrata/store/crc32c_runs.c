/* The native helpers of a restore read straight into place: CRC32C over many runs of one buffer in
 * one call (the check of a record), and the reads of every range in one call (kvs_preadv_ranges,
 * at the end of this file).
 *
 * A record read into its slices of a restore buffer lands as one run per K/V, layer and head
 * (16 KiB each for SmolLM2's 64-token blocks). Checked run by run from Python, each call pays its
 * overhead and, to let the reader thread run, a release of the GIL: 5.2 GB/s here against 9.4 for
 * one call over a contiguous buffer. Here every run of a record is one call (ctypes releases the GIL
 * once), with three independent CRC streams interleaved to hide the instruction's latency, their
 * results combined by shifting through zeros.
 *
 * The three-stream method and its zero-shift tables follow Mark Adler's crc32c.c (zlib licence,
 * https://stackoverflow.com/a/17646775). Same value as the `crc32c` package's crc32c(data, crc):
 * `crc` is a previous result (0 to start), the result is final (inverted). */
#define _GNU_SOURCE /* O_DIRECT */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__x86_64__)
#include <nmmintrin.h>

#define POLY 0x82f63b78u
#define LONG 8192
#define SHORT 256

static uint32_t gf2_matrix_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_matrix_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_matrix_times(mat, mat[n]);
}

/* The operator that appends len (a power of two) zero bytes to a crc. */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_matrix_square(even, odd); /* two zero bits */
    gf2_matrix_square(odd, even); /* four zero bits */
    do {                          /* one zero byte in even first, then doubling */
        gf2_matrix_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_matrix_square(odd, even);
        len >>= 1;
    } while (len);
    for (int n = 0; n < 32; n++) even[n] = odd[n];
}

static void zeros_table(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_matrix_times(op, n);
        zeros[1][n] = gf2_matrix_times(op, n << 8);
        zeros[2][n] = gf2_matrix_times(op, n << 16);
        zeros[3][n] = gf2_matrix_times(op, n << 24);
    }
}

static uint32_t shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

static uint32_t long_zeros[4][256], short_zeros[4][256];
static int tables_ready = 0;

int kvs_crc32c_supported(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) return 0;
    if (!tables_ready) { /* called once, from the loader, before any kvs_crc32c_runs */
        zeros_table(long_zeros, LONG);
        zeros_table(short_zeros, SHORT);
        tables_ready = 1;
    }
    return 1;
}

/* Whole groups of 3 x `block` bytes from *next: three independent streams, combined by shifting
 * the first two through `block` zero bytes (zeros: that shift's table). */
__attribute__((target("sse4.2"))) static inline uint64_t crc_three_way(uint64_t crc0,
                                                                       const unsigned char **next,
                                                                       size_t *len, size_t block,
                                                                       uint32_t zeros[][256]) {
    const unsigned char *at = *next;
    while (*len >= 3 * block) {
        uint64_t crc1 = 0, crc2 = 0;
        const unsigned char *end = at + block;
        do {
            crc0 = _mm_crc32_u64(crc0, *(const uint64_t *)at);
            crc1 = _mm_crc32_u64(crc1, *(const uint64_t *)(at + block));
            crc2 = _mm_crc32_u64(crc2, *(const uint64_t *)(at + 2 * block));
            at += 8;
        } while (at < end);
        crc0 = shift(zeros, (uint32_t)crc0) ^ crc1;
        crc0 = shift(zeros, (uint32_t)crc0) ^ crc2;
        at += 2 * block;
        *len -= 3 * block;
    }
    *next = at;
    return crc0;
}

/* crc is the raw (not inverted) running value. */
__attribute__((target("sse4.2"))) static uint64_t crc_raw(uint64_t crc0, const unsigned char *next,
                                                           size_t len) {
    while (len && ((uintptr_t)next & 7) != 0) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    crc0 = crc_three_way(crc0, &next, &len, LONG, long_zeros);
    crc0 = crc_three_way(crc0, &next, &len, SHORT, short_zeros);
    while (len >= 8) {
        crc0 = _mm_crc32_u64(crc0, *(const uint64_t *)next);
        next += 8;
        len -= 8;
    }
    while (len) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    return crc0;
}

/* The CRC32C of `count` runs of `run` bytes at base + offsets[i], in order, continuing `crc`. */
uint32_t kvs_crc32c_runs(uint32_t crc, const unsigned char *base, const int64_t *offsets, int64_t count,
                         int64_t run) {
    uint64_t raw = crc ^ 0xffffffffu;
    for (int64_t i = 0; i < count; i++) raw = crc_raw(raw, base + offsets[i], (size_t)run);
    return (uint32_t)raw ^ 0xffffffffu;
}

#else

int kvs_crc32c_supported(void) { return 0; }

uint32_t kvs_crc32c_runs(uint32_t crc, const unsigned char *base, const int64_t *offsets, int64_t count,
                         int64_t run) {
    (void)base, (void)offsets, (void)count, (void)run;
    return crc;
}

#endif

/* The reads of a restore straight into place, all in one call: `count` ranges, range r of file
 * fds[r] (or -errno: it could not be opened) from file offset offsets[r] into the buffers
 * iovs[first[r] .. first[r + 1]) (headers and trailers to scratch, payload runs to their slices of
 * the destination), one preadv after another, short reads continued. After each range, done[r]
 * is published (release store): the bytes read, fewer only at the end of the file, or -errno.
 * The caller's thread polls done[r] (INT64_MIN until then) and checks range r while the next ones
 * are read: from Python, the reader had to get the GIL back from the checking thread after every
 * read and made the next range's scatter list between two reads, and the disk waited.
 * (Checksumming each record in this loop, while it is still in the CPU's caches, made the restores
 * slower: 512 SmolLM2 tokens 0.87x of a plain read against 0.89-0.94x, the tiny model 0.87x against
 * 0.94x: the next read waited for the checksum.)
 * kvs_preadv_ranges_start runs it on a thread of its own (no Python thread to wake, no GIL to
 * take back before the first read); kvs_preadv_ranges_join waits for it and frees it.
 *
 * Ranges read into buffers that the caller reuses (records to decode: a ring of a few buffers,
 * not one the size of the restore) are gated: with `after` given, range r is read only once
 * released[after[r]] is set (the caller has decoded the range that used its buffer before;
 * after[r] < 0: no wait). A negative released[] value cancels the reads left: each gets
 * -ECANCELED (the caller stops early, on an error). Polled every KVS_GATE_POLL_NS: a wait means
 * the decoders are behind, and the disk keeps reading ahead meanwhile.
 *
 * `start` and `step` pick the ranges one call reads (start, start + step, ...): several calls on
 * threads of their own keep several reads in flight, which direct reads (no readahead) want.
 *
 * A file opened with O_DIRECT (the caller aligned offsets, buffers and lengths) reads past the
 * page cache, straight from the disk into the buffers: a short read there is the end of the file,
 * and the loop does not ask again from the unaligned offset it leaves. */
#define KVS_IOV_MAX 1024
#define KVS_DIRECT_ALIGN 4096 /* in_place.DIRECT_ALIGN */
#define KVS_GATE_POLL_NS 20000

/* 1: range r may be read; 0: cancelled. */
static int kvs_gate_open(const int64_t *after, const int64_t *released, int64_t r) {
    if (after == NULL || after[r] < 0) return 1;
    const struct timespec pause = {0, KVS_GATE_POLL_NS};
    for (;;) {
        int64_t state = __atomic_load_n(&released[after[r]], __ATOMIC_ACQUIRE);
        if (state > 0) return 1;
        if (state < 0) return 0;
        nanosleep(&pause, NULL);
    }
}

int64_t kvs_preadv_ranges(const int64_t *fds, int64_t count, const int64_t *offsets, const int64_t *first,
                          const struct iovec *iovs, int64_t *done, const int64_t *after,
                          const int64_t *released, int64_t start, int64_t step) {
    struct iovec local[KVS_IOV_MAX];
    if (start < 0 || step < 1) return -(int64_t)EINVAL;
    for (int64_t r = start; r < count; r += step) {
        int64_t i = first[r], end = first[r + 1], got = 0, result = 0;
        int fd = (int)fds[r];
        if (!kvs_gate_open(after, released, r)) {
            for (; r < count; r += step) __atomic_store_n(&done[r], -(int64_t)ECANCELED, __ATOMIC_RELEASE);
            break;
        }
        if (fds[r] < 0) { /* its file could not be opened: fds[r] is -errno */
            __atomic_store_n(&done[r], fds[r], __ATOMIC_RELEASE);
            continue;
        }
        size_t skip = 0; /* bytes of iovs[i] already filled */
        int direct = (fcntl(fd, F_GETFL) & O_DIRECT) != 0;
        while (i < end) {
            int n = 0;
            for (int64_t j = i; j < end && n < KVS_IOV_MAX; j++) local[n++] = iovs[j];
            local[0].iov_base = (char *)local[0].iov_base + skip;
            local[0].iov_len -= skip;
            ssize_t now = preadv(fd, local, n, (off_t)(offsets[r] + got));
            if (now < 0) {
                if (errno == EINTR) continue;
                result = -(int64_t)errno;
                break;
            }
            if (now == 0) break; /* the end of the file */
            got += now;
            if (direct && (got & (KVS_DIRECT_ALIGN - 1))) break; /* the end of the file */
            size_t left = (size_t)now + skip;
            while (i < end && left >= iovs[i].iov_len) left -= iovs[i++].iov_len;
            skip = left;
        }
        __atomic_store_n(&done[r], result < 0 ? result : got, __ATOMIC_RELEASE);
    }
    return count;
}

struct kvs_reads {
    pthread_t thread;
    const int64_t *fds, *offsets, *first;
    const struct iovec *iovs;
    int64_t *done, count, start, step;
    const int64_t *after, *released;
};

static void *kvs_reads_run(void *arg) {
    struct kvs_reads *job = arg;
    kvs_preadv_ranges(job->fds, job->count, job->offsets, job->first, job->iovs, job->done, job->after,
                      job->released, job->start, job->step);
    return NULL;
}

/* A handle for kvs_preadv_ranges_join, or NULL when no thread could be started (nothing read). */
void *kvs_preadv_ranges_start(const int64_t *fds, int64_t count, const int64_t *offsets,
                              const int64_t *first, const struct iovec *iovs, int64_t *done,
                              const int64_t *after, const int64_t *released, int64_t start,
                              int64_t step) {
    if (start < 0 || step < 1) return NULL;
    struct kvs_reads *job = malloc(sizeof *job);
    if (job == NULL) return NULL;
    job->fds = fds, job->count = count, job->offsets = offsets, job->first = first;
    job->iovs = iovs, job->done = done, job->after = after, job->released = released;
    job->start = start, job->step = step;
    if (pthread_create(&job->thread, NULL, kvs_reads_run, job) != 0) {
        free(job);
        return NULL;
    }
    return job;
}

void kvs_preadv_ranges_join(void *handle) {
    struct kvs_reads *job = handle;
    pthread_join(job->thread, NULL);
    free(job);
}

/* How many of the pages of [offset, offset + length) of fd the page cache holds (mincore over a
 * mapping of them), or -errno. */
int64_t kvs_resident_pages(int fd, int64_t offset, int64_t length) {
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0 || offset < 0 || length < 0) return -(int64_t)EINVAL;
    int64_t start = offset - offset % page, span = offset + length - start;
    if (span == 0) return 0;
    void *map = mmap(NULL, (size_t)span, PROT_READ, MAP_SHARED, fd, (off_t)start);
    if (map == MAP_FAILED) return -(int64_t)errno;
    size_t pages = (size_t)((span + page - 1) / page);
    unsigned char *vec = malloc(pages);
    int64_t resident = -(int64_t)ENOMEM;
    if (vec != NULL) {
        if (mincore(map, (size_t)span, vec) == 0) {
            resident = 0;
            for (size_t p = 0; p < pages; p++) resident += vec[p] & 1;
        } else {
            resident = -(int64_t)errno;
        }
        free(vec);
    }
    munmap(map, (size_t)span);
    return resident;
}

/* Copies of runs: run k is lens[k] bytes from src[k] to dest[k] (the K/V, layer and head rows of
 * blocks held in memory, into their slices of a restore buffer; 16 KiB each for SmolLM2).
 *
 * `stream`: with non-temporal stores (SSE2; each run whose destination is 16-byte aligned), so
 * that a destination larger than the caches is written without first being read into them. numpy's
 * copy of the same runs writes through the caches: 134 MB of 16 KiB runs took 15.6 ms against
 * 7.5 ms streamed, and a contiguous memcpy of the same bytes 9.6-11.4 ms (AMD EPYC VM,
 * 2026-12-02). The caller streams only copies much larger than the caches (a small restore is
 * read by the forward pass while it is still cached). Returns the bytes copied. */
/* One run copied (streamed when asked and the destination can be 16-byte aligned: the bytes
 * before the first aligned address go by memcpy). */
static void copy_run(char *d, const char *s, int64_t len, int stream) {
    int64_t done = 0;
#if defined(__SSE2__)
    if (stream) {
        int64_t lead = (int64_t)((16 - ((uintptr_t)d & 15)) & 15);
        if (lead > len) lead = len;
        if (lead) memcpy(d, s, (size_t)lead);
        __m128i *dv = (__m128i *)(d + lead);
        const __m128i *sv = (const __m128i *)(s + lead);
        int64_t body = (len - lead) / 64;
        for (int64_t i = 0; i < body; i++) {
            __m128i a = _mm_loadu_si128(sv + 4 * i), b = _mm_loadu_si128(sv + 4 * i + 1);
            __m128i c = _mm_loadu_si128(sv + 4 * i + 2), e = _mm_loadu_si128(sv + 4 * i + 3);
            _mm_stream_si128(dv + 4 * i, a);
            _mm_stream_si128(dv + 4 * i + 1, b);
            _mm_stream_si128(dv + 4 * i + 2, c);
            _mm_stream_si128(dv + 4 * i + 3, e);
        }
        done = lead + 64 * body;
    }
#endif
    if (done < len) memcpy(d + done, s + done, (size_t)(len - done));
}

int64_t kvs_copy_runs(const int64_t *dest, const int64_t *src, const int64_t *lens, int64_t count,
                      int stream) {
    int64_t total = 0;
    for (int64_t k = 0; k < count; k++) {
        copy_run((char *)(intptr_t)dest[k], (const char *)(intptr_t)src[k], lens[k], stream);
        total += lens[k];
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence(); /* the streamed stores are visible before the caller reads them */
#endif
    return total;
}

/* Copies of runs that also checksum them: the parts of a record going into the staging buffers of
 * a direct write (header, params, payload; the payload may straddle two buffers). Returns the
 * CRC32C of all the runs' bytes in order, continuing `crc`. Each run goes CHUNK bytes at a time,
 * checksummed and then copied while the chunk is still in the L1 cache, so the source is read
 * from memory once, not once for the checksum and again for the copy. */
#define KVS_COPY_CRC_CHUNK (3 * 8192)
#if defined(__x86_64__)
uint32_t kvs_copy_crc32c_runs(const int64_t *dest, const int64_t *src, const int64_t *lens, int64_t count,
                              uint32_t crc, int stream) {
    uint64_t raw = crc ^ 0xffffffffu;
    for (int64_t k = 0; k < count; k++) {
        char *d = (char *)(intptr_t)dest[k];
        const char *s = (const char *)(intptr_t)src[k];
        for (int64_t done = 0; done < lens[k];) {
            int64_t n = lens[k] - done < KVS_COPY_CRC_CHUNK ? lens[k] - done : KVS_COPY_CRC_CHUNK;
            raw = crc_raw(raw, (const unsigned char *)s + done, (size_t)n);
            copy_run(d + done, s + done, n, stream);
            done += n;
        }
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#endif
    return (uint32_t)raw ^ 0xffffffffu;
}
#else
uint32_t kvs_copy_crc32c_runs(const int64_t *dest, const int64_t *src, const int64_t *lens, int64_t count,
                              uint32_t crc, int stream) {
    (void)dest, (void)src, (void)lens, (void)count, (void)stream;
    return crc; /* never called: the library is not loaded without SSE4.2 */
}
#endif
