/* cpu_kernels: shared declarations of the C kernels and their scalar helpers.
 *
 * Every kernel exists once per SIMD level (x86-64: avx512, avx2; AArch64: sve, neon; and
 * portable everywhere); dispatch.c picks one at run time. Scalar helpers here are the reference for the tails of the SIMD loops, so
 * a value rounds the same way whichever level stepped it.
 */
#ifndef HYBRID_OPT_KERNELS_H
#define HYBRID_OPT_KERNELS_H

#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* IEEE arithmetic whatever the thread's floating-point environment. A shared library built with
 * -ffast-math (gcc links crtfastmath.o into it) sets flush-to-zero and denormals-are-zero (x86 MXCSR)
 * or flush-to-zero (AArch64 FPCR) in the thread that loads it, for good: torch 2.4's inductor does so
 * with the CPU kernels it compiles. Our bits would then depend on what else the trainer process had
 * loaded, while the worker process, which loads nothing, keeps IEEE. Each exported kernel, and each
 * thread of its parallel region, clears those bits for its work (ieee_enter) and puts them back after
 * (ieee_leave): two register accesses a call and thread where they are clear. */
#if defined(__aarch64__)
#define HYBRID_FPCR_FLUSH ((uint64_t)1 << 24 | (uint64_t)1 << 19) /* FZ, FZ16 */
#endif
static inline uint64_t ieee_enter(void)
{
#if defined(__x86_64__) || defined(__i386__)
    const unsigned csr = __builtin_ia32_stmxcsr();
    if (csr & 0x8040u) __builtin_ia32_ldmxcsr(csr & ~0x8040u); /* FTZ (bit 15), DAZ (bit 6) */
    return csr;
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    if (fpcr & HYBRID_FPCR_FLUSH) __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr & ~HYBRID_FPCR_FLUSH));
    return fpcr;
#else
    return 0;
#endif
}

static inline void ieee_leave(uint64_t saved)
{
#if defined(__x86_64__) || defined(__i386__)
    if (saved & 0x8040u) __builtin_ia32_ldmxcsr((unsigned)saved);
#elif defined(__aarch64__)
    if (saved & HYBRID_FPCR_FLUSH) __asm__ __volatile__("msr fpcr, %0" : : "r"(saved));
#else
    (void)saved;
#endif
}

/* This thread's share [k0, k1) of `units` in one contiguous run (all of them outside a parallel
 * region): the dispatchers' one split (a contiguous run keeps the hardware prefetchers on their
 * streams; an interleaved one restarted them at every jump). */
static inline void chunk_range(int64_t units, int64_t *k0, int64_t *k1)
{
#ifdef _OPENMP
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int64_t nt = 1, t = 0;
#endif
    *k0 = units * t / nt;
    *k1 = units * (t + 1) / nt;
}

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* One Adam call, as filled in by the Python binding (ctypes mirrors this layout). */
typedef struct {
    int64_t n;
    float *param;                  /* fp32 master; with remainders the bf16 param (high half) */
    const void *grad;              /* grad_dtype */
    const void *exp_avg;           /* moment_dtype */
    const void *exp_avg_sq;        /* exp_avg_sq_dtype */
    const void *max_exp_avg_sq;    /* exp_avg_sq_dtype, NULL unless amsgrad */
    float *param_out;              /* == param in place; another buffer in bank mode (bf16
                                    * with remainders) */
    void *exp_avg_out;
    void *exp_avg_sq_out;
    void *max_exp_avg_sq_out;
    void *param_copy;              /* copy_dtype (bf16/fp16), NULL when absent */
    int32_t grad_dtype, moment_dtype, copy_dtype, decoupled;  /* moment_dtype: exp_avg's */
    int64_t step;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    /* Remainders (NULL when off): the fp32 master is param (bf16 bits) joined with these
     * int16 low halves, see remainder_decode; remainder_out == remainder in place. */
    const int16_t *remainder;
    int16_t *remainder_out;
    /* exp_avg_sq's and max_exp_avg_sq's dtype (DT_F32 / DT_BF16), independent of exp_avg's
     * moment_dtype (Megatron/TE's exp_avg_sq_dtype); last so older layouts keep their offsets */
    int32_t exp_avg_sq_dtype;
} adam_args_t;

/* Per-call constants in the precision the kernel uses, computed once in dispatch.c. */
typedef struct {
    float grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
    float neg_step_size, inv_bias_correction2_sqrt, decay, l2;
    int amsgrad, l2_mode, out_of_place;
} adam_consts_t;

/* An Adam call's constants from its hyperparameters (dispatch.c), out_of_place left 0: the one
 * computation hybrid_adam_step and the q8 step (q8_dispatch.c) share. */
void adam_consts_init(adam_consts_t *c, int64_t step, double lr, double beta1, double beta2, double eps,
                      double weight_decay, double grad_scale, int decoupled, int amsgrad);

typedef struct {
    int64_t n;
    float *param;                  /* post-step fp32 master, restored in place */
    const void *grad;
    float *exp_avg, *exp_avg_sq;   /* post-step fp32 moments, restored in place */
    int32_t grad_dtype, decoupled;
    int64_t step;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
} adam_inverse_args_t;

/* grad_stats reduces fixed chunks of this many elements, 16 fp64 lanes each (element i of
 * a chunk goes to lane i % 16), lanes combined by a fixed tree, chunk partials summed in
 * chunk order: the same bits for every thread count and SIMD level. Squares of fp32 values
 * are exact in fp64, so only the additions round, and always in this one order. */
#define GRAD_STATS_CHUNK 16384
#define GRAD_STATS_LANES 16

/* ---- scalar conversions (bit-exact with torch's casts) ---- */
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* torch's float -> bfloat16: round to nearest even, NaN -> 0x7FC0 */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---- remainders: an fp32 master as a bf16 param plus its low 16 bits (Transformer
 * Engine's store_param_remainders encoding) ----
 * encode: param = high half + 1 when the low half's top bit is set (nearest, ties away from
 * zero), remainder = low half; decode subtracts that carry again. Both in 16-bit wrap-around
 * arithmetic, so every one of the 2^32 patterns round-trips: a carry out of 0x7F7F (finite,
 * >= 0x7F7F8000) gives the param +inf, out of 0x7FFF (a NaN) -0.0, out of 0xFFFF (a NaN) +0.0,
 * and decode undoes each. */
static inline uint16_t remainder_param_bits(uint32_t m) { return (uint16_t)((m >> 16) + ((m >> 15) & 1u)); }

static inline float remainder_decode(uint16_t p, uint16_t r)
{
    return bits_f32(((uint32_t)(uint16_t)(p - (r >> 15)) << 16) | r);
}

/* IEEE half -> float, exact for every input (normal, subnormal, inf, NaN). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t r = sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
    return bits_f32(r);
}

/* float -> IEEE half, round to nearest even (the hardware's and torch's rounding). */
static inline uint16_t f32_to_f16(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float load_scalar(const void *p, int dt, int64_t i) {
    switch (dt) {
    case DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void store_scalar(void *p, int dt, int64_t i, float v) {
    switch (dt) {
    case DT_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    case DT_F16: ((uint16_t *)p)[i] = f32_to_f16(v); break;
    default: ((float *)p)[i] = v;
    }
}

/* The per-pattern roofline probe (adam_body.h, bw_pattern): up to BW_MAX_STREAMS streams of
 * 2- or 4-byte elements, each of one kind. A kernel's access pattern is a list of them: bank
 * mode reads p, g, m, v (BW_READ) and writes three other arrays (BW_WRITE_NT); in place the state
 * is BW_UPDATE; a param copy is BW_WRITE_NT (the kernels stream it wherever it is line-aligned). */
enum { BW_READ = 0, BW_UPDATE = 1, BW_WRITE = 2, BW_WRITE_NT = 3 };
#define BW_MAX_STREAMS 12

/* ---- per-level entry points (kernels_<level>.c) ---- */
#define DECLARE_LEVEL(L)                                                                  \
    void adam_range_##L(const adam_args_t *a, const adam_consts_t *c, int64_t b, int64_t e); \
    void grad_chunk_sums_##L(const void *g, int dt, int64_t n, int64_t chunk0, int64_t chunk1, \
                             double *partials);                                           \
    void bw_inplace_##L(float *p, const float *g, float *m, float *v, int64_t b, int64_t e); \
    void bw_bank_##L(const float *p, const float *g, const float *m, const float *v, float *po, \
                     float *mo, float *vo, int64_t b, int64_t e);                         \
    void remainder_encode_##L(const float *m, uint16_t *p, int16_t *r, int64_t b, int64_t e); \
    void remainder_decode_##L(const uint16_t *p, const int16_t *r, float *m, int64_t b, int64_t e); \
    uint32_t bw_pattern_##L(void *const *ptrs, const int *bytes, const int *kinds, int ns, int64_t ahead, int64_t b, \
                            int64_t e);
DECLARE_LEVEL(avx512)
DECLARE_LEVEL(avx2)
DECLARE_LEVEL(portable)
DECLARE_LEVEL(neon)
#if defined(__aarch64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
/* SVE level: built with gcc's target pragma (clang would need another spelling), chosen at
 * run time from HWCAP_SVE on Linux */
#define HYBRID_HAVE_SVE 1
DECLARE_LEVEL(sve)
int hybrid_sve_vector_bits(void);  /* svcntb() * 8; call only where the CPU has SVE */
#endif
/* Arm vector levels: whether bank-mode state outputs and the param copy leave with
 * streaming (non-temporal) stores — STNP on NEON, STNT1 on SVE. Off by default: whether they
 * help on a given Arm core has not been measured (no Arm hardware here); the same bits
 * either way. Set through hybrid_set_arm_streaming_stores (dispatch.c). */
extern int hybrid_arm_streaming_stores_on;
/* AVX2 level: whether its register loop writes bank mode's outputs (the param or its halves, the
 * moments) with non-temporal stores. The CPU's vendor decides: on for Intel, whose cores stream them
 * faster (an Intel Xeon: 0.60x the time), off for AMD and others (a Zen 3: 1.37x). The same bits
 * either way. set returns -1 when asked to turn it on off x86-64. */
int hybrid_get_avx2_bank_nt(void);
int hybrid_set_avx2_bank_nt(int on);
/* x86 levels: whether the blocks that step state in place prefetch their streams (adam_body.h,
 * prefetch_block). The CPU's vendor decides: on for Intel (an Intel Xeon: 0.85-0.92x the time at
 * AVX-512 and AVX2), off for AMD and others (a Zen 3 measured a prefetch in the blocks 4-7 %
 * slower). set returns -1 when asked to turn it on off x86-64. */
int hybrid_get_block_prefetch(void);
int hybrid_set_block_prefetch(int on);
/* q8 fused pass (q8_fused.h, levels with Q8_PAIR_CHUNK: AVX-512): whether a block's codes are
 * written inside the next block's arithmetic loop (a pipeline) or after its own loop. The CPU's
 * vendor decides: on for Intel, whose divider leaves the other ports idle for 22 cycles per 16
 * lanes (an Intel Xeon: the pipeline 1.2x faster), off for AMD and others (a Zen 5, whose divider
 * is 3x faster: the two loops apart 0.93x the pipeline's time). The same bits either way. set
 * returns -1 when asked to turn it on off x86-64. */
int hybrid_get_q8_pipeline(void);
int hybrid_set_q8_pipeline(int on);
/* AVX-512 level: whether its compressed-state loop rounds with vcvtne2ps2bf16 (AVX-512 BF16;
 * the same bits either way). set returns -1 when asked to turn it on without CPU support. */
int hybrid_set_avx512_bf16(int on);
int hybrid_get_avx512_bf16(void);


/* Which output streams of a 16-bit-state call (cpu_kernels' c16 register loops) may be
 * written with non-temporal stores: only in bank mode (out of place), and only where the
 * stream starts line-aligned at `begin` (a multiple of 16384 elements past the base) — it
 * then advances by whole lines, so one check each decides for the whole range. */
#define LINE_ALIGNED(p) (!((uintptr_t)(p) & 63))
typedef struct { int param, moments, copy; } nt_streams_t;

static inline nt_streams_t nt_streams(const adam_args_t *a, int out_of_place, int amsgrad,
                                      int64_t begin, int msz, int vsz)
{
    const uint16_t *po16 = (const uint16_t *)(const void *)a->param_out;
    const uint16_t *cp = (const uint16_t *)a->param_copy;
    nt_streams_t nt;
    nt.param = out_of_place && (a->remainder ? LINE_ALIGNED(po16 + begin) && LINE_ALIGNED(a->remainder_out + begin)
                                             : LINE_ALIGNED(a->param_out + begin));
    nt.moments = out_of_place && LINE_ALIGNED((const char *)a->exp_avg_out + begin * msz) &&
                 LINE_ALIGNED((const char *)a->exp_avg_sq_out + begin * vsz) &&
                 (!amsgrad || LINE_ALIGNED((const char *)a->max_exp_avg_sq_out + begin * vsz));
    nt.copy = cp && LINE_ALIGNED(cp + begin);
    return nt;
}

#endif
