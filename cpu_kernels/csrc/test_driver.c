/* A native test driver for cpu_kernels' C library: runs kernel calls read from a case file
 * and writes every buffer back out, so another build of the library (another architecture,
 * another SIMD level) can be compared with it bit for bit. Not part of the installed
 * library; tests/test_aarch64_emulation.py cross-compiles it with the library's own sources
 * and flags (cpu_kernels/_build.py) and runs it under qemu-aarch64.
 *
 *   test_driver --info                 prints the levels, the detected one, the q8 step's and SVE's length
 *   test_driver CASES OUT [--level NAME] [--threads N] [--streaming-stores] [--flush-to-zero]
 *
 * --flush-to-zero turns on what a -ffast-math library sets when it is loaded (x86 FTZ and DAZ,
 * AArch64 FZ) before the first call: the kernels must give the same bits (kernels.h, ieee_enter).
 *
 * Case file (little-endian): "HOKCASE1", u32 ncases, u32 0; per case u32 kind, u32 nbuf,
 * nbuf x {u64 nbytes, u32 misalign, u32 0} then the buffers' bytes one after another, then
 * a case_params_t. Each buffer is placed `misalign` bytes past a 64-byte boundary. Outputs:
 * "HOKOUT01", u32 ncases, u32 0; per case every buffer's bytes after the call, then a double
 * (grad_stats' sum; the CRC32C of the aio case) and an i32 status (0 ok), i32 0.
 * Kinds: Adam, grad_stats, the fp64 inverse, remainder encode / decode, the aio engine, the q8 step.
 * Exit status: 0, 2 bad usage or file, 3 level refused, 4 a case failed its own checks.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aio.h"
#include "kernels.h"
#include "q8.h"

int hybrid_max_level(void);
int hybrid_get_level(void);
int hybrid_set_level(int level);
int hybrid_level_count(void);
const char *hybrid_level_name(int rank);
int hybrid_set_arm_streaming_stores(int on);
void hybrid_set_num_threads(int n);
void hybrid_adam_step(const adam_args_t *a);
void hybrid_adam_inverse(const adam_inverse_args_t *a);
int hybrid_grad_stats(const void *g, int dt, int64_t n, double *out);
void hybrid_remainder_encode(const float *m, uint16_t *p, int16_t *r, int64_t n);
void hybrid_remainder_decode(const uint16_t *p, const int16_t *r, float *m, int64_t n);
int hybrid_q8_adam_step(const q8_args_t *a);
const char *hybrid_q8_level(void);

enum { K_ADAM = 0, K_GRAD_STATS = 1, K_INVERSE = 2, K_ENCODE = 3, K_DECODE = 4, K_AIO = 5, K_Q8 = 6 };
/* buffer slots of case_params_t.buf (-1: none); the absmax ones are the q8 step's */
enum { B_PARAM, B_GRAD, B_EXP_AVG, B_EXP_AVG_SQ, B_MAX, B_PARAM_OUT, B_EXP_AVG_OUT, B_EXP_AVG_SQ_OUT,
       B_MAX_OUT, B_COPY, B_REM, B_REM_OUT, B_EXP_AVG_ABSMAX, B_EXP_AVG_SQ_ABSMAX, B_MAX_ABSMAX,
       B_EXP_AVG_ABSMAX_OUT, B_EXP_AVG_SQ_ABSMAX_OUT, B_MAX_ABSMAX_OUT, B_SLOTS };

typedef struct {
    int32_t buf[B_SLOTS];
    int32_t grad_dtype, moment_dtype, exp_avg_sq_dtype, copy_dtype, decoupled, pad;
    int64_t n, step;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
} case_params_t;

static void die(const char *what)
{
    fprintf(stderr, "test_driver: %s\n", what);
    exit(2);
}

static void read_exact(FILE *f, void *p, size_t n)
{
    if (n && fread(p, 1, n, f) != n) die("case file truncated");
}

static void write_exact(FILE *f, const void *p, size_t n)
{
    if (n && fwrite(p, 1, n, f) != n) die("cannot write the output file");
}

static int level_rank(const char *name)
{
    for (int k = 0; k < hybrid_level_count(); k++)
        if (!strcmp(hybrid_level_name(k), name)) return k;
    return -1;
}

static void print_info(void)
{
    printf("levels=");
    for (int k = 0; k < hybrid_level_count(); k++) printf("%s%s", k ? "," : "", hybrid_level_name(k));
    printf(" max=%s level=%s", hybrid_level_name(hybrid_max_level()), hybrid_level_name(hybrid_get_level()));
    printf(" q8=%s", hybrid_q8_level());
#ifdef HYBRID_HAVE_SVE
    if (!strcmp(hybrid_level_name(hybrid_max_level()), "sve")) printf(" sve_bits=%d", hybrid_sve_vector_bits());
#endif
    printf("\n");
    fflush(stdout);
}

/* The aio engine on this architecture: write buf to a temporary file and read it back into
 * back, both with CRC32C; status 0 when the bytes and the three checksums agree. */
static int run_aio(void *buf, void *back, int64_t n, double *crc_out)
{
    char path[] = "/tmp/hybrid_opt_driver_XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) return 10;
    unlink(path);
    int err = 0, status = 0;
    hybrid_aio_t *e = hybrid_aio_create(2, 4, 4096, 4096, &err);
    if (!e) { close(fd); return 11; }
    hybrid_aio_result_t res[2];
    int64_t id = hybrid_aio_submit(e, HYBRID_AIO_WRITE, fd, buf, n, 0, HYBRID_AIO_FLAG_CRC);
    if (id <= 0 || hybrid_aio_wait(e, &id, 1, 10000000000LL, &res[0]) != 0 || res[0].error) status = 12;
    if (!status) {
        id = hybrid_aio_submit(e, HYBRID_AIO_READ, fd, back, n, 0, HYBRID_AIO_FLAG_CRC);
        if (id <= 0 || hybrid_aio_wait(e, &id, 1, 10000000000LL, &res[1]) != 0 || res[1].error) status = 13;
    }
    if (!status) {
        const uint32_t crc = hybrid_crc32c(0, buf, n);
        if (memcmp(buf, back, (size_t)n) || res[0].crc != crc || res[1].crc != crc) status = 14;
        *crc_out = (double)crc;
    }
    hybrid_aio_destroy(e, 1000000000LL);
    close(fd);
    return status;
}

static void *slot(unsigned char **bufs, const case_params_t *c, int k)
{
    return c->buf[k] < 0 ? NULL : bufs[c->buf[k]];
}

/* The fields adam_args_t, adam_inverse_args_t and q8_args_t share, from the case. */
#define SET_HYPERPARAMETERS(a, c)                                                                    \
    do {                                                                                             \
        (a).n = (c)->n;                                                                              \
        (a).grad_dtype = (c)->grad_dtype;                                                            \
        (a).decoupled = (c)->decoupled;                                                              \
        (a).step = (c)->step;                                                                        \
        (a).lr = (c)->lr; (a).beta1 = (c)->beta1; (a).beta2 = (c)->beta2; (a).eps = (c)->eps;       \
        (a).weight_decay = (c)->weight_decay; (a).grad_scale = (c)->grad_scale;                     \
    } while (0)

/* ... and those adam_args_t and q8_args_t share: the step's buffers but the absmaxes, the dtypes
 * but exp_avg's (moment_dtype / exp_avg_dtype). */
#define SET_STEP_FIELDS(a, bufs, c)                                                                  \
    do {                                                                                             \
        SET_HYPERPARAMETERS(a, c);                                                                   \
        (a).param = slot(bufs, c, B_PARAM);                                                          \
        (a).grad = slot(bufs, c, B_GRAD);                                                            \
        (a).exp_avg = slot(bufs, c, B_EXP_AVG);                                                      \
        (a).exp_avg_sq = slot(bufs, c, B_EXP_AVG_SQ);                                                \
        (a).max_exp_avg_sq = slot(bufs, c, B_MAX);                                                   \
        (a).param_out = slot(bufs, c, B_PARAM_OUT);                                                  \
        (a).exp_avg_out = slot(bufs, c, B_EXP_AVG_OUT);                                              \
        (a).exp_avg_sq_out = slot(bufs, c, B_EXP_AVG_SQ_OUT);                                        \
        (a).max_exp_avg_sq_out = slot(bufs, c, B_MAX_OUT);                                           \
        (a).param_copy = slot(bufs, c, B_COPY);                                                      \
        (a).remainder = slot(bufs, c, B_REM);                                                        \
        (a).remainder_out = slot(bufs, c, B_REM_OUT);                                                \
        (a).exp_avg_sq_dtype = (c)->exp_avg_sq_dtype;                                                \
        (a).copy_dtype = (c)->copy_dtype;                                                            \
    } while (0)

static int run_case(uint32_t kind, unsigned char **bufs, const case_params_t *c, double *scalar)
{
    switch (kind) {
    case K_ADAM: {
        adam_args_t a;
        memset(&a, 0, sizeof(a));
        SET_STEP_FIELDS(a, bufs, c);
        a.moment_dtype = c->moment_dtype;
        hybrid_adam_step(&a);
        return 0;
    }
    case K_GRAD_STATS:
        return hybrid_grad_stats(slot(bufs, c, B_GRAD), c->grad_dtype, c->n, scalar) ? 20 : 0;
    case K_INVERSE: {
        adam_inverse_args_t a;
        memset(&a, 0, sizeof(a));
        SET_HYPERPARAMETERS(a, c);
        a.param = slot(bufs, c, B_PARAM);
        a.grad = slot(bufs, c, B_GRAD);
        a.exp_avg = slot(bufs, c, B_EXP_AVG);
        a.exp_avg_sq = slot(bufs, c, B_EXP_AVG_SQ);
        hybrid_adam_inverse(&a);
        return 0;
    }
    case K_ENCODE:
        hybrid_remainder_encode(slot(bufs, c, B_PARAM), slot(bufs, c, B_PARAM_OUT), slot(bufs, c, B_REM_OUT), c->n);
        return 0;
    case K_DECODE:
        hybrid_remainder_decode(slot(bufs, c, B_PARAM), slot(bufs, c, B_REM), slot(bufs, c, B_PARAM_OUT), c->n);
        return 0;
    case K_AIO:
        return run_aio(slot(bufs, c, B_PARAM), slot(bufs, c, B_PARAM_OUT), c->n, scalar);
    case K_Q8: {
        q8_args_t a;
        memset(&a, 0, sizeof(a));
        SET_STEP_FIELDS(a, bufs, c);
        a.exp_avg_dtype = c->moment_dtype;
        a.exp_avg_absmax = slot(bufs, c, B_EXP_AVG_ABSMAX);
        a.exp_avg_sq_absmax = slot(bufs, c, B_EXP_AVG_SQ_ABSMAX);
        a.max_exp_avg_sq_absmax = slot(bufs, c, B_MAX_ABSMAX);
        a.exp_avg_absmax_out = slot(bufs, c, B_EXP_AVG_ABSMAX_OUT);
        a.exp_avg_sq_absmax_out = slot(bufs, c, B_EXP_AVG_SQ_ABSMAX_OUT);
        a.max_exp_avg_sq_absmax_out = slot(bufs, c, B_MAX_ABSMAX_OUT);
        return hybrid_q8_adam_step(&a) ? 40 : 0;
    }
    }
    return 30;
}

static void set_flush_to_zero(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_ldmxcsr(__builtin_ia32_stmxcsr() | 0x8040u);
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr | HYBRID_FPCR_FLUSH));
#endif
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--info")) { print_info(); return 0; }
    if (argc < 3)
        die("usage: test_driver --info | test_driver CASES OUT [--level NAME] [--threads N] [--streaming-stores] "
            "[--flush-to-zero]");
    for (int k = 3; k < argc; k++) {
        if (!strcmp(argv[k], "--level") && k + 1 < argc) {
            const int rank = level_rank(argv[++k]);
            if (rank < 0 || hybrid_set_level(rank) != 0) {
                printf("refused level %s (max %s)\n", argv[k], hybrid_level_name(hybrid_max_level()));
                return 3;
            }
        } else if (!strcmp(argv[k], "--threads") && k + 1 < argc) {
            hybrid_set_num_threads(atoi(argv[++k]));
        } else if (!strcmp(argv[k], "--streaming-stores")) {
            if (hybrid_set_arm_streaming_stores(1) != 0) die("--streaming-stores: not an Arm build");
        } else if (!strcmp(argv[k], "--flush-to-zero")) {
            set_flush_to_zero();
        } else {
            die("unknown option");
        }
    }
    print_info();
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) die("cannot open the case or output file");
    char magic[8];
    uint32_t head[2];
    read_exact(in, magic, 8);
    read_exact(in, head, 8);
    if (memcmp(magic, "HOKCASE1", 8)) die("not a case file");
    write_exact(out, "HOKOUT01", 8);
    write_exact(out, head, 8);
    int failed = 0;
    for (uint32_t ci = 0; ci < head[0]; ci++) {
        uint32_t kn[2];
        read_exact(in, kn, 8);
        const uint32_t nbuf = kn[1];
        uint64_t *sizes = calloc(nbuf + 1, sizeof(uint64_t));
        uint32_t *mis = calloc(nbuf + 1, sizeof(uint32_t));
        unsigned char **raw = calloc(nbuf + 1, sizeof(void *)), **bufs = calloc(nbuf + 1, sizeof(void *));
        if (!sizes || !mis || !raw || !bufs) die("out of memory");
        for (uint32_t b = 0; b < nbuf; b++) {
            uint32_t m2[2];
            read_exact(in, &sizes[b], 8);
            read_exact(in, m2, 8);
            mis[b] = m2[0] & 63;
        }
        for (uint32_t b = 0; b < nbuf; b++) {
            raw[b] = aligned_alloc(64, ((sizes[b] + 64 + 63) / 64) * 64);
            if (!raw[b]) die("out of memory");
            bufs[b] = raw[b] + mis[b];
            read_exact(in, bufs[b], sizes[b]);
        }
        case_params_t c;
        read_exact(in, &c, sizeof(c));
        double scalar = 0.0;
        const int32_t status[2] = {run_case(kn[0], bufs, &c, &scalar), 0};
        if (status[0]) {
            fprintf(stderr, "test_driver: case %u (kind %u) failed with status %d\n", ci, kn[0], status[0]);
            failed = 1;
        }
        write_exact(out, &nbuf, 4);
        for (uint32_t b = 0; b < nbuf; b++) write_exact(out, bufs[b], sizes[b]);
        write_exact(out, &scalar, 8);
        write_exact(out, status, 8);
        for (uint32_t b = 0; b < nbuf; b++) free(raw[b]);
        free(sizes); free(mis); free(raw); free(bufs);
    }
    if (fclose(out) != 0) die("cannot write the output file");
    fclose(in);
    return failed ? 4 : 0;
}
