/* cpu_kernels: asynchronous file I/O engine (a pthread pool of pread/pwrite workers) and
 * the CRC32C checksum used for swap slots.
 *
 * Model: the caller submits requests (read, write or data-sync of one file range into or
 * out of one caller-owned buffer) and gets an id back at once; worker threads split each
 * request into chunks of `chunk_bytes` and run them concurrently; the caller later waits
 * on ids with a bounded timeout and gets one result per request. The engine never copies
 * data and never touches a buffer outside a request's range; the caller keeps the buffer
 * alive and untouched until the request has been waited for.
 *
 * Errors are values, never asserts: submit returns a negative code, a failed request
 * reports its errno, the file offset where it failed and the bytes transferred.
 *
 * O_DIRECT: a descriptor opened with O_DIRECT (checked with fcntl at submit) must be given
 * a buffer address, a length and a file offset that are multiples of the engine's
 * alignment (4096 by default: a page, and a multiple of every logical block size we run
 * on); a violation is reported by submit with the codes below, before any I/O.
 *
 * Thread safety: every function but destroy may be called from any thread.
 */
#ifndef HYBRID_OPT_AIO_H
#define HYBRID_OPT_AIO_H

#include <stdint.h>

enum { HYBRID_AIO_READ = 0, HYBRID_AIO_WRITE = 1, HYBRID_AIO_SYNC = 2 };

/* submit flags */
enum { HYBRID_AIO_FLAG_CRC = 1 };  /* compute the CRC32C of the request's bytes (result.crc) */

/* submit's negative returns beyond -errno (-EINVAL bad argument, -EAGAIN queue full,
 * -ESHUTDOWN engine closing, -EBADF bad descriptor): */
#define HYBRID_AIO_EMISALIGNED_BUF (-1001)    /* O_DIRECT: buffer address not aligned */
#define HYBRID_AIO_EMISALIGNED_LEN (-1002)    /* O_DIRECT: nbytes not a multiple */
#define HYBRID_AIO_EMISALIGNED_OFF (-1003)    /* O_DIRECT: file offset not a multiple */

typedef struct hybrid_aio hybrid_aio_t;

/* One finished request (ctypes mirrors this layout). */
typedef struct {
    int64_t id;
    int64_t bytes_done;    /* bytes transferred, summed over every chunk */
    int64_t error_offset;  /* file offset of the lowest failure; -1 when error == 0 */
    int32_t error;         /* 0 or an errno; a read that met end of file: ENODATA, eof = 1 */
    int32_t eof;
    uint32_t crc;          /* CRC32C of the request's bytes (FLAG_CRC and error == 0), else 0 */
    int32_t reserved;
} hybrid_aio_result_t;

/* threads >= 1; queue_depth >= 1 (requests submitted and not yet waited for);
 * chunk_bytes a positive multiple of alignment; alignment a power of two.
 * Returns NULL with *err = an errno on failure. */
hybrid_aio_t *hybrid_aio_create(int threads, int queue_depth, int64_t chunk_bytes,
                                int64_t alignment, int *err);

/* op: HYBRID_AIO_READ/WRITE (nbytes >= 0 at `offset`; offset < 0 means the descriptor's
 * own position with read()/write() in one piece: pipes and FIFOs) or HYBRID_AIO_SYNC
 * (fdatasync; buf, nbytes and offset ignored). Returns an id > 0, or a negative code. */
int64_t hybrid_aio_submit(hybrid_aio_t *e, int op, int fd, void *buf, int64_t nbytes,
                          int64_t offset, int flags);

/* Waits until every id in ids[0..n) has finished, or timeout_ns (< 0: no limit) passed.
 * 0: all finished; out[i] holds ids[i]'s result and the ids are released (an id is waited
 * for once). -ETIMEDOUT: nothing released, wait again later. -EINVAL: an unknown,
 * repeated or already-waited id (nothing released). */
int hybrid_aio_wait(hybrid_aio_t *e, const int64_t *ids, int n, int64_t timeout_ns,
                    hybrid_aio_result_t *out);

/* A descriptor told of every request that finishes: 8 bytes holding 1 are written to it
 * (an eventfd adds them up) once the request's result can be waited for without blocking.
 * -1 (the default) tells nothing. A caller that waits on it and on other descriptors at
 * once (the worker's request pipe) sleeps until there is something to do, instead of
 * polling done() on a timer. Returns 0, or -EINVAL for fd < -1. */
int hybrid_aio_set_notify(hybrid_aio_t *e, int fd);

/* 1 finished, 0 still running, -EINVAL unknown id. Releases nothing. */
int hybrid_aio_done(hybrid_aio_t *e, int64_t id);

/* Requests submitted and not yet waited for. */
int hybrid_aio_outstanding(hybrid_aio_t *e);

/* Refuses new requests (-ESHUTDOWN), cancels chunks not yet started (their requests end
 * with ECANCELED) and wakes every waiter (-ESHUTDOWN). Safe to call from any thread while
 * others are inside submit/wait; destroy must still follow once they have returned. */
void hybrid_aio_shutdown(hybrid_aio_t *e);

/* Shuts down, gives chunks inside a system call grace_ns to finish, then cancels their
 * threads (pthread_cancel acts inside pread/pwrite/read/write/fdatasync), joins every
 * thread and frees the engine. Returns the number of threads that had to be cancelled, or
 * -1 when one could not be joined at all (a call stuck in the kernel): the engine's memory
 * is then leaked rather than freed under that thread, and the caller must likewise keep
 * the buffers of unfinished requests alive. No other call may be in progress or follow. */
int hybrid_aio_destroy(hybrid_aio_t *e, int64_t grace_ns);

/* CRC32C (Castagnoli, reflected, init and final xor ~0): crc32c(0, "123456789", 9) ==
 * 0xE3069283. Chain calls by passing the previous result. SSE4.2 when the CPU has it,
 * with three interleaved streams (~3 x a single stream's speed); the same value from the
 * portable table path. */
uint32_t hybrid_crc32c(uint32_t crc, const void *buf, int64_t n);
uint32_t hybrid_crc32c_portable(uint32_t crc, const void *buf, int64_t n);
/* CRC of A||B from crc(A), crc(B) and len(B). */
uint32_t hybrid_crc32c_combine(uint32_t crc_a, uint32_t crc_b, int64_t len_b);
/* 1 when the SSE4.2 path is used. */
int hybrid_crc32c_hw(void);

#endif
