/* cpu_kernels: the asynchronous file I/O engine and CRC32C (see aio.h for the contract).
 *
 * A fixed pool of pthreads runs blocking pread/pwrite calls; this is the portable
 * baseline the issue asks for (no io_uring: it needs liburing or raw syscalls and has not
 * measured faster on a virtual disk that already saturates at a few threads).
 *
 * Requests live in a table of queue_depth slots until waited for; a FIFO of slot indices
 * hands out each request's chunks in order, so one large request is spread over every
 * thread (a single 1 GiB read keeps all threads busy) while requests still start in
 * submission order. One mutex guards everything: it is held only to pick or record a
 * chunk, never across a system call.
 */
#define _GNU_SOURCE
#include "aio.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <nmmintrin.h>
#define HAVE_X86 1
#endif

/* Linux is the target; these keep other POSIX systems building (no O_DIRECT there). */
#ifndef O_DIRECT
#define O_DIRECT 0
#endif
#ifdef __linux__
#define WAIT_CLOCK CLOCK_MONOTONIC  /* timeouts immune to wall-clock changes */
#else
#define WAIT_CLOCK CLOCK_REALTIME
#define fdatasync fsync
#endif

/* ------------------------------------------------------------------------------------ */
/* CRC32C                                                                                */

#define CRC32C_POLY 0x82f63b78u  /* Castagnoli, reflected */

static uint32_t crc_table[8][256];
static uint32_t x2n_table[32];  /* x^(2^k) mod P */
static uint32_t k_lane, k_2lane;  /* shift constants of the three-stream loop */
/* The path: 0 the tables, 1 crc32 (SSE4.2), 2 crc32 after a carry-less fold (AVX-512 VPCLMULQDQ);
 * crc_hw_max what the CPU has (hybrid_crc32c_set_hw lowers crc_hw for the tests) */
static int crc_hw, crc_hw_max;
/* The fold's constants (crc_fold_avx512): [d] moves 128 bits forward by FOLD_BITS[d] bits, as
 * (x^(D + 63) mod P, x^(D - 1) mod P) in the 64-bit reflected form (bit j is x^(63 - j)). */
static const int64_t FOLD_BITS[5] = {2048, 512, 384, 256, 128};
static uint64_t k_fold[5][2];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* Three interleaved streams of this many bytes each: crc32 has 3 cycles of latency and
 * one per cycle of throughput, so three independent chains fill the pipeline. */
#define CRC_LANE 8192

/* a * b mod P, in the reflected representation (bit 31 is x^0); as zlib's multmodp. */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) mod P */
static uint32_t x2nmodp(uint64_t n, unsigned k)
{
    uint32_t p = (uint32_t)1 << 31;
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int b = 0; b < 8; b++) c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
    uint32_t p = (uint32_t)1 << 30;  /* x^1 */
    x2n_table[0] = p;
    for (int k = 1; k < 32; k++) x2n_table[k] = p = multmodp(p, p);
    k_lane = x2nmodp(CRC_LANE, 3);
    k_2lane = x2nmodp(2 * CRC_LANE, 3);
#ifdef HAVE_X86
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    if (crc_hw && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq")) crc_hw = 2;
#endif
    crc_hw_max = crc_hw;
    /* x2nmodp's form has x^0 at bit 31: shifted up 32, x^d lands at bit 63 - d */
    for (int d = 0; d < 5; d++) {
        k_fold[d][0] = (uint64_t)x2nmodp((uint64_t)FOLD_BITS[d] + 63, 0) << 32;
        k_fold[d][1] = (uint64_t)x2nmodp((uint64_t)FOLD_BITS[d] - 1, 0) << 32;
    }
}

/* Raw register update (no pre/post inversion), slicing by 8. */
static uint32_t crc_raw_portable(uint32_t c, const unsigned char *p, int64_t n)
{
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= c;
        c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^
            crc_table[5][(w >> 16) & 0xff] ^ crc_table[4][(w >> 24) & 0xff] ^
            crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
            crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n-- > 0) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return c;
}

#ifdef HAVE_X86
#include <immintrin.h>

/* 128-bit lanes moved forward by k's distance and added to d: per lane lo·k.lo ^ hi·k.hi ^ d */
__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i crc_fold_lanes(__m512i x, __m512i k, __m512i d)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), d,
                                     0x96);
}

__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i crc_k(int d)
{
    return _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k_fold[d][1], (long long)k_fold[d][0]));
}

/* Raw register update over n bytes (a multiple of 256, at least 256) by carry-less multiplication:
 * four 512-bit accumulators fold the message forward 256 bytes at a time, then into one another and
 * their lanes into one 128-bit block, congruent mod P to the whole message with c added to its
 * first bytes (the register is linear in its input). Its CRC from a register of 0 is the message's:
 * two crc32 instructions. About 64 bytes a cycle in L1 against crc32's 8 (tests/test_aio.py holds it
 * to the tables at every length). */
__attribute__((target("avx512f,vpclmulqdq,sse4.2"))) static uint32_t crc_fold_avx512(uint32_t c,
                                                                                      const unsigned char *p,
                                                                                      int64_t n)
{
    __m512i x0 = _mm512_loadu_si512((const void *)p), x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128)), x3 = _mm512_loadu_si512((const void *)(p + 192));
    x0 = _mm512_xor_si512(x0, _mm512_castsi128_si512(_mm_cvtsi32_si128((int)c)));
    const __m512i k2048 = crc_k(0);
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        x0 = crc_fold_lanes(x0, k2048, _mm512_loadu_si512((const void *)p));
        x1 = crc_fold_lanes(x1, k2048, _mm512_loadu_si512((const void *)(p + 64)));
        x2 = crc_fold_lanes(x2, k2048, _mm512_loadu_si512((const void *)(p + 128)));
        x3 = crc_fold_lanes(x3, k2048, _mm512_loadu_si512((const void *)(p + 192)));
    }
    const __m512i k512 = crc_k(1);
    x3 = crc_fold_lanes(crc_fold_lanes(crc_fold_lanes(x0, k512, x1), k512, x2), k512, x3);
    /* lanes 0, 1, 2 forward by 384, 256, 128 bits onto lane 3 (whose constants are 0) */
    const __m512i kl = _mm512_set_epi64(0, 0, (long long)k_fold[4][1], (long long)k_fold[4][0],
                                        (long long)k_fold[3][1], (long long)k_fold[3][0], (long long)k_fold[2][1],
                                        (long long)k_fold[2][0]);
    const __m512i t = crc_fold_lanes(x3, kl, _mm512_setzero_si512());
    const __m128i r = _mm_xor_si128(_mm_xor_si128(_mm512_castsi512_si128(t), _mm512_extracti32x4_epi32(t, 1)),
                                    _mm_xor_si128(_mm512_extracti32x4_epi32(t, 2), _mm512_extracti32x4_epi32(x3, 3)));
    return (uint32_t)_mm_crc32_u64(_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r)),
                                   (uint64_t)_mm_extract_epi64(r, 1));
}

__attribute__((target("sse4.2")))
static uint32_t crc_raw_hw(uint32_t c, const unsigned char *p, int64_t n)
{
    if (crc_hw >= 2 && n >= 256) {
        const int64_t whole = n & ~(int64_t)255;
        c = crc_fold_avx512(c, p, whole);
        p += whole;
        n -= whole;
    }
    while (n >= 3 * CRC_LANE) {
        uint64_t a = c, b = 0, d = 0;
        for (int64_t i = 0; i < CRC_LANE; i += 8) {
            uint64_t wa, wb, wd;
            memcpy(&wa, p + i, 8);
            memcpy(&wb, p + CRC_LANE + i, 8);
            memcpy(&wd, p + 2 * CRC_LANE + i, 8);
            a = _mm_crc32_u64(a, wa);
            b = _mm_crc32_u64(b, wb);
            d = _mm_crc32_u64(d, wd);
        }
        /* the register is linear in its input: shift each lane past the bytes after it */
        c = multmodp(k_2lane, (uint32_t)a) ^ multmodp(k_lane, (uint32_t)b) ^ (uint32_t)d;
        p += 3 * CRC_LANE;
        n -= 3 * CRC_LANE;
    }
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n-- > 0) c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

uint32_t hybrid_crc32c_portable(uint32_t crc, const void *buf, int64_t n)
{
    pthread_once(&crc_once, crc_init);
    if (n <= 0) return crc;
    return ~crc_raw_portable(~crc, (const unsigned char *)buf, n);
}

uint32_t hybrid_crc32c(uint32_t crc, const void *buf, int64_t n)
{
    pthread_once(&crc_once, crc_init);
    if (n <= 0) return crc;
#ifdef HAVE_X86
    if (crc_hw) return ~crc_raw_hw(~crc, (const unsigned char *)buf, n);
#endif
    return ~crc_raw_portable(~crc, (const unsigned char *)buf, n);
}

uint32_t hybrid_crc32c_combine(uint32_t crc_a, uint32_t crc_b, int64_t len_b)
{
    pthread_once(&crc_once, crc_init);
    if (len_b <= 0) return crc_a;
    return multmodp(x2nmodp((uint64_t)len_b, 3), crc_a) ^ crc_b;
}

int hybrid_crc32c_hw(void)
{
    pthread_once(&crc_once, crc_init);
    return crc_hw;
}

/* Tests and benchmarks: the path at most `level` (0 tables, 1 crc32, 2 the fold), as far as the CPU
 * has it; returns the path now. Not while a checksum runs. */
int hybrid_crc32c_set_hw(int level)
{
    pthread_once(&crc_once, crc_init);
    crc_hw = level < 0 ? 0 : level < crc_hw_max ? level : crc_hw_max;
    return crc_hw;
}

/* ------------------------------------------------------------------------------------ */
/* The engine                                                                            */

enum { SLOT_FREE = 0, SLOT_RUNNING = 1, SLOT_DONE = 2 };

typedef struct {
    int64_t id;
    int state, op, fd, flags, mark;
    uint32_t gen;
    char *buf;
    int64_t nbytes, offset;
    int64_t nchunks, next_chunk, chunks_left;
    int64_t bytes_done, error_offset;
    int error, eof;
    uint32_t *crcs;  /* one per chunk, FLAG_CRC only */
    uint32_t crc;
} request_t;

struct hybrid_aio {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;  /* done_cv: a request finished or a thread exited */
    int nthreads, live, stop, waiters;
    pthread_t *threads;
    int *busy, *exited, *started;
    int qd, outstanding, next_slot;
    request_t *reqs;
    int *fifo, fifo_head, fifo_count;  /* slots with chunks not yet handed out */
    int64_t chunk_bytes, alignment;
    int notify_fd;  /* told of each finished request (hybrid_aio_set_notify), or -1 */
};

typedef struct {
    hybrid_aio_t *e;
    int index;
} worker_arg_t;

static int64_t chunk_len(const request_t *r, int64_t chunk_bytes, int64_t k)
{
    if (r->offset < 0) return r->nbytes;  /* a stream: one piece */
    const int64_t left = r->nbytes - k * chunk_bytes;
    return left < chunk_bytes ? left : chunk_bytes;
}

/* Called with the mutex held when a request's last chunk is recorded. */
static void finish_request(hybrid_aio_t *e, request_t *r)
{
    if (r->crcs) {
        if (r->error == 0 && r->nchunks > 0) {
            uint32_t c = r->crcs[0];
            for (int64_t k = 1; k < r->nchunks; k++)
                c = hybrid_crc32c_combine(c, r->crcs[k], chunk_len(r, e->chunk_bytes, k));
            r->crc = c;
        }
        free(r->crcs);
        r->crcs = NULL;
    }
    r->state = SLOT_DONE;
    pthread_cond_broadcast(&e->done_cv);
    if (e->notify_fd >= 0) {
        /* an eventfd's counter: never blocks short of 2^64 - 1 finished requests unread,
         * and a failed write only costs the waiter its wake-up (it still bounds its wait) */
        const uint64_t one = 1;
        ssize_t rc;
        do rc = write(e->notify_fd, &one, sizeof(one));
        while (rc < 0 && errno == EINTR);
    }
}

/* Called with the mutex held. The lowest failing offset wins: it says how much of the
 * file range is known good. */
static void record_error(request_t *r, int err, int eof, int64_t at)
{
    if (r->error == 0 || at < r->error_offset) {
        r->error = err;
        r->eof = eof;
        r->error_offset = at;
    }
}

typedef struct {
    int64_t bytes, at;
    int error, eof;
    uint32_t crc;
} chunk_result_t;

/* Runs without the mutex. Cancellation is enabled only inside the system calls, so a
 * thread cancelled by destroy never holds the mutex or half-records a result. */
static void run_chunk(const request_t *r, int64_t chunk_bytes, int64_t k, chunk_result_t *o)
{
    int unused;
    memset(o, 0, sizeof(*o));
    if (r->op == HYBRID_AIO_SYNC) {
        int rc;
        do {
            pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &unused);
            rc = fdatasync(r->fd);
            pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &unused);
        } while (rc != 0 && errno == EINTR);
        if (rc != 0) o->error = errno;
        return;
    }
    const int stream = r->offset < 0;
    const int64_t start = stream ? 0 : k * chunk_bytes;
    const int64_t len = chunk_len(r, chunk_bytes, k);
    char *p = r->buf + start;
    int64_t done = 0;
    while (done < len) {
        const size_t want = (size_t)(len - done);
        ssize_t got;
        pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &unused);
        if (r->op == HYBRID_AIO_READ)
            got = stream ? read(r->fd, p + done, want)
                         : pread(r->fd, p + done, want, (off_t)(r->offset + start + done));
        else
            got = stream ? write(r->fd, p + done, want)
                         : pwrite(r->fd, p + done, want, (off_t)(r->offset + start + done));
        pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &unused);
        if (got < 0) {
            if (errno == EINTR) continue;
            o->error = errno;
            break;
        }
        if (got == 0) {
            /* a read at end of file; a write of nothing means the device gave up */
            o->error = r->op == HYBRID_AIO_READ ? ENODATA : EIO;
            o->eof = r->op == HYBRID_AIO_READ;
            break;
        }
        done += got;
    }
    o->bytes = done;
    o->at = (stream ? 0 : r->offset) + start + done;
    if (o->error == 0 && (r->flags & HYBRID_AIO_FLAG_CRC)) o->crc = hybrid_crc32c(0, p, len);
}

static void *worker_main(void *arg)
{
    hybrid_aio_t *e = ((worker_arg_t *)arg)->e;
    const int t = ((worker_arg_t *)arg)->index;
    free(arg);
    int unused;
    pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &unused);
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->stop && e->fifo_count == 0) pthread_cond_wait(&e->work_cv, &e->mu);
        if (e->fifo_count == 0) break;  /* stopping; destroy has emptied the fifo */
        const int slot = e->fifo[e->fifo_head];
        request_t *r = &e->reqs[slot];
        const int64_t k = r->next_chunk++;
        if (r->next_chunk == r->nchunks) {
            e->fifo_head = (e->fifo_head + 1) % e->qd;
            e->fifo_count--;
        }
        e->busy[t] = 1;
        pthread_mutex_unlock(&e->mu);

        chunk_result_t o;
        run_chunk(r, e->chunk_bytes, k, &o);

        pthread_mutex_lock(&e->mu);
        e->busy[t] = 0;
        r->bytes_done += o.bytes;
        if (o.error) record_error(r, o.error, o.eof, o.at);
        if (r->crcs) r->crcs[k] = o.crc;
        if (--r->chunks_left == 0) finish_request(e, r);
    }
    e->exited[t] = 1;
    e->live--;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

static void deadline_after(struct timespec *ts, clockid_t clock, int64_t ns)
{
    clock_gettime(clock, ts);
    const int64_t total = (int64_t)ts->tv_nsec + ns % 1000000000;
    ts->tv_sec += (time_t)(ns / 1000000000 + total / 1000000000);
    ts->tv_nsec = (long)(total % 1000000000);
}

static void free_engine(hybrid_aio_t *e)
{
    if (e->reqs)
        for (int i = 0; i < e->qd; i++) free(e->reqs[i].crcs);
    free(e->reqs);
    free(e->fifo);
    free(e->threads);
    free(e->busy);
    free(e->exited);
    free(e->started);
    pthread_cond_destroy(&e->work_cv);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

hybrid_aio_t *hybrid_aio_create(int threads, int queue_depth, int64_t chunk_bytes,
                                int64_t alignment, int *err)
{
    *err = 0;
    if (threads < 1 || threads > 1024 || queue_depth < 1 || queue_depth > (1 << 20) ||
        alignment < 1 || (alignment & (alignment - 1)) != 0 || chunk_bytes < alignment ||
        chunk_bytes % alignment != 0 || chunk_bytes > ((int64_t)1 << 30)) {
        *err = EINVAL;
        return NULL;
    }
    pthread_once(&crc_once, crc_init);
    hybrid_aio_t *e = calloc(1, sizeof(*e));
    if (!e) {
        *err = ENOMEM;
        return NULL;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
#ifdef __linux__
    pthread_condattr_setclock(&ca, WAIT_CLOCK);
#endif
    pthread_cond_init(&e->work_cv, NULL);
    pthread_cond_init(&e->done_cv, &ca);
    pthread_condattr_destroy(&ca);
    e->nthreads = threads;
    e->notify_fd = -1;
    e->qd = queue_depth;
    e->chunk_bytes = chunk_bytes;
    e->alignment = alignment;
    e->reqs = calloc((size_t)queue_depth, sizeof(request_t));
    e->fifo = calloc((size_t)queue_depth, sizeof(int));
    e->threads = calloc((size_t)threads, sizeof(pthread_t));
    e->busy = calloc((size_t)threads, sizeof(int));
    e->exited = calloc((size_t)threads, sizeof(int));
    e->started = calloc((size_t)threads, sizeof(int));
    if (!e->reqs || !e->fifo || !e->threads || !e->busy || !e->exited || !e->started) {
        free_engine(e);
        *err = ENOMEM;
        return NULL;
    }
    for (int t = 0; t < threads; t++) {
        worker_arg_t *a = malloc(sizeof(*a));
        int rc = a ? 0 : ENOMEM;
        if (a) {
            a->e = e;
            a->index = t;
            pthread_mutex_lock(&e->mu);
            rc = pthread_create(&e->threads[t], NULL, worker_main, a);
            if (rc == 0) {
                e->started[t] = 1;
                e->live++;
            }
            pthread_mutex_unlock(&e->mu);
            if (rc != 0) free(a);
        }
        if (rc != 0) {
            hybrid_aio_destroy(e, 0);  /* joins the threads already started */
            *err = rc;
            return NULL;
        }
    }
    return e;
}

int64_t hybrid_aio_submit(hybrid_aio_t *e, int op, int fd, void *buf, int64_t nbytes,
                          int64_t offset, int flags)
{
    if (op != HYBRID_AIO_READ && op != HYBRID_AIO_WRITE && op != HYBRID_AIO_SYNC) return -EINVAL;
    if (fd < 0) return -EBADF;
    const int fl = fcntl(fd, F_GETFL);
    if (fl < 0) return -errno;
    const int acc = fl & O_ACCMODE;
    if (op == HYBRID_AIO_SYNC) {
        buf = NULL;
        nbytes = 0;
        offset = 0;
        flags &= ~HYBRID_AIO_FLAG_CRC;
    } else {
        if (nbytes < 0 || (nbytes > 0 && buf == NULL)) return -EINVAL;
        if ((op == HYBRID_AIO_READ && acc == O_WRONLY) || (op == HYBRID_AIO_WRITE && acc == O_RDONLY))
            return -EBADF;
        if (fl & O_DIRECT) {
            if ((uintptr_t)buf % (uintptr_t)e->alignment) return HYBRID_AIO_EMISALIGNED_BUF;
            if (nbytes % e->alignment) return HYBRID_AIO_EMISALIGNED_LEN;
            if (offset >= 0 && offset % e->alignment) return HYBRID_AIO_EMISALIGNED_OFF;
        }
    }
    int64_t nchunks;
    if (op == HYBRID_AIO_SYNC) nchunks = 1;
    else if (offset < 0) nchunks = nbytes > 0;
    else nchunks = (nbytes + e->chunk_bytes - 1) / e->chunk_bytes;
    uint32_t *crcs = NULL;
    if ((flags & HYBRID_AIO_FLAG_CRC) && nchunks > 0) {
        crcs = calloc((size_t)nchunks, sizeof(uint32_t));
        if (!crcs) return -ENOMEM;
    }

    pthread_mutex_lock(&e->mu);
    if (e->stop) {
        pthread_mutex_unlock(&e->mu);
        free(crcs);
        return -ESHUTDOWN;
    }
    int slot = -1;
    for (int i = 0; i < e->qd; i++) {
        const int s = (e->next_slot + i) % e->qd;
        if (e->reqs[s].state == SLOT_FREE) {
            slot = s;
            break;
        }
    }
    if (slot < 0) {
        pthread_mutex_unlock(&e->mu);
        free(crcs);
        return -EAGAIN;
    }
    e->next_slot = (slot + 1) % e->qd;
    request_t *r = &e->reqs[slot];
    const uint32_t gen = r->gen + 1;
    memset(r, 0, sizeof(*r));
    r->gen = gen;
    r->id = (int64_t)gen * e->qd + slot;
    r->op = op;
    r->fd = fd;
    r->flags = flags;
    r->buf = (char *)buf;
    r->nbytes = nbytes;
    r->offset = offset;
    r->nchunks = r->chunks_left = nchunks;
    r->error_offset = -1;
    r->crcs = crcs;
    e->outstanding++;
    if (nchunks == 0) {
        if (flags & HYBRID_AIO_FLAG_CRC) r->crc = 0;  /* CRC32C of nothing */
        r->state = SLOT_DONE;
    } else {
        r->state = SLOT_RUNNING;
        e->fifo[(e->fifo_head + e->fifo_count) % e->qd] = slot;
        e->fifo_count++;
        if (nchunks > 1) pthread_cond_broadcast(&e->work_cv);
        else pthread_cond_signal(&e->work_cv);
    }
    const int64_t id = r->id;
    pthread_mutex_unlock(&e->mu);
    return id;
}

/* The slot of a live request, or NULL. Called with the mutex held. */
static request_t *lookup(hybrid_aio_t *e, int64_t id)
{
    if (id <= 0) return NULL;
    request_t *r = &e->reqs[id % e->qd];
    return (r->state != SLOT_FREE && r->id == id) ? r : NULL;
}

int hybrid_aio_wait(hybrid_aio_t *e, const int64_t *ids, int n, int64_t timeout_ns,
                    hybrid_aio_result_t *out)
{
    if (n < 0 || (n > 0 && (!ids || !out))) return -EINVAL;
    struct timespec deadline;
    if (timeout_ns >= 0) deadline_after(&deadline, WAIT_CLOCK, timeout_ns);
    pthread_mutex_lock(&e->mu);
    e->waiters++;
    int rc = 0;
    for (;;) {
        /* re-checked after every wake: a concurrent waiter may have taken an id */
        int all_done = 1, bad = 0;
        for (int i = 0; i < n; i++) {
            request_t *r = lookup(e, ids[i]);
            if (!r || r->mark) {
                bad = 1;
                break;
            }
            r->mark = 1;
            if (r->state != SLOT_DONE) all_done = 0;
        }
        for (int i = 0; i < n; i++) {
            request_t *r = lookup(e, ids[i]);
            if (r) r->mark = 0;
        }
        if (bad) {
            rc = -EINVAL;
            break;
        }
        if (all_done) break;
        if (e->stop) {
            rc = -ESHUTDOWN;
            break;
        }
        if (timeout_ns < 0) {
            pthread_cond_wait(&e->done_cv, &e->mu);
        } else if (pthread_cond_timedwait(&e->done_cv, &e->mu, &deadline) == ETIMEDOUT) {
            /* one last look: the request may have finished as the clock ran out */
            int done_now = 1;
            for (int i = 0; i < n && done_now; i++) {
                request_t *r = lookup(e, ids[i]);
                done_now = r && r->state == SLOT_DONE;
            }
            if (!done_now) {
                rc = -ETIMEDOUT;
                break;
            }
        }
    }
    if (rc == 0) {
        for (int i = 0; i < n; i++) {
            request_t *r = lookup(e, ids[i]);
            hybrid_aio_result_t *o = &out[i];
            o->id = r->id;
            o->bytes_done = r->bytes_done;
            o->error_offset = r->error ? r->error_offset : -1;
            o->error = r->error;
            o->eof = r->eof;
            o->crc = r->crc;
            o->reserved = 0;
            r->state = SLOT_FREE;
            e->outstanding--;
        }
    }
    e->waiters--;
    if (e->stop) pthread_cond_broadcast(&e->done_cv);  /* destroy waits for waiters to leave */
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int hybrid_aio_set_notify(hybrid_aio_t *e, int fd)
{
    if (fd < -1) return -EINVAL;
    pthread_mutex_lock(&e->mu);
    e->notify_fd = fd;
    pthread_mutex_unlock(&e->mu);
    return 0;
}

int hybrid_aio_done(hybrid_aio_t *e, int64_t id)
{
    pthread_mutex_lock(&e->mu);
    request_t *r = lookup(e, id);
    const int rc = r ? r->state == SLOT_DONE : -EINVAL;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int hybrid_aio_outstanding(hybrid_aio_t *e)
{
    pthread_mutex_lock(&e->mu);
    const int n = e->outstanding;
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* Called with the mutex held. */
static void stop_locked(hybrid_aio_t *e)
{
    e->stop = 1;
    /* cancel every chunk not yet handed to a thread */
    while (e->fifo_count > 0) {
        request_t *r = &e->reqs[e->fifo[e->fifo_head]];
        const int64_t left = r->nchunks - r->next_chunk;
        const int64_t at = r->offset < 0 ? 0 : r->offset + r->next_chunk * e->chunk_bytes;
        record_error(r, ECANCELED, 0, at);
        r->next_chunk = r->nchunks;
        r->chunks_left -= left;
        if (r->chunks_left == 0) finish_request(e, r);
        e->fifo_head = (e->fifo_head + 1) % e->qd;
        e->fifo_count--;
    }
    pthread_cond_broadcast(&e->work_cv);
    pthread_cond_broadcast(&e->done_cv);
}

void hybrid_aio_shutdown(hybrid_aio_t *e)
{
    pthread_mutex_lock(&e->mu);
    stop_locked(e);
    pthread_mutex_unlock(&e->mu);
}

int hybrid_aio_destroy(hybrid_aio_t *e, int64_t grace_ns)
{
    if (!e) return 0;
    if (grace_ns < 0) grace_ns = 0;
    pthread_mutex_lock(&e->mu);
    stop_locked(e);
    struct timespec deadline;
    deadline_after(&deadline, WAIT_CLOCK, grace_ns);
    while (e->live > 0 || e->waiters > 0)
        if (pthread_cond_timedwait(&e->done_cv, &e->mu, &deadline) == ETIMEDOUT) break;
    int cancelled = 0;
    for (int t = 0; t < e->nthreads; t++)
        if (e->started[t] && !e->exited[t] && e->busy[t]) {
            pthread_cancel(e->threads[t]);  /* acts inside its blocked system call */
            cancelled++;
        }
    pthread_mutex_unlock(&e->mu);

    int leaked = 0;
    for (int t = 0; t < e->nthreads; t++) {
        if (!e->started[t]) continue;
#ifdef __GLIBC__
        struct timespec abs;
        /* pthread_timedjoin_np takes CLOCK_REALTIME */
        deadline_after(&abs, CLOCK_REALTIME, grace_ns > 1000000000 ? grace_ns : 1000000000);
        if (pthread_timedjoin_np(e->threads[t], NULL, &abs) != 0) {
            pthread_detach(e->threads[t]);
            leaked = 1;
        }
#else
        pthread_join(e->threads[t], NULL);
#endif
    }
    pthread_mutex_lock(&e->mu);
    leaked |= e->waiters > 0;
    pthread_mutex_unlock(&e->mu);
    if (leaked) return -1;  /* a thread stuck in the kernel may still touch it: leak it */
    free_engine(e);
    return cancelled;
}
