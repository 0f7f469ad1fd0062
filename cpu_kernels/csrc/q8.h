/* cpu_kernels: the q8 Adam step (issue 38) — Adam / AdamW over moments that are each q8 (8-bit
 * blockwise codes into bitsandbytes' dynamic maps, one fp32 absmax per block of 256), fp32 or bf16.
 *
 * Bitwise cpu_kernels/q8_reference.py's q8_adam_step_reference at every level and thread count:
 * every multiply and add rounded on its own (these files build with -ffp-contract=off and fuse
 * nothing), IEEE division and sqrt, no flush-to-zero (an absmax may be subnormal). Per element:
 *
 *     m, v, v̂  = map[code]·absmax (q8), or the fp32 / bf16 value
 *     g  = s·g;  g = p·wd + g (Adam's L2, wd != 0)
 *     m  = (g − m)·(1 − β1) + m;   v = (g·g)·(1 − β2) + v·β2;   v̂ = v̂ > v ? v̂ : v
 *     p  = p·decay + (m / (√v̂·ib + ε))·nss
 *     each q8 moment stored again: absmax = the block's largest |bits|, code = table(x / absmax)
 *
 * The param update uses the fp32 moments before they are quantized. Threads split the work on
 * block boundaries (a block's absmax needs all of it); the kernels hold no state between calls.
 * Levels: portable (plain C), avx2, avx512 on x86-64, neon, sve on AArch64; q8_dispatch.c follows
 * the level the Adam dispatcher uses (hybrid_get_level).
 */
#ifndef HYBRID_OPT_Q8_H
#define HYBRID_OPT_Q8_H

#include "kernels.h"

enum { DT_Q8 = 3 };  /* a moment's dtype code beside kernels.h's DT_F32 / DT_BF16 */

#define Q8_BLOCK 256
#define Q8_KEY_FIRST 0x3400  /* (bits of 2^-23) >> 16: smaller magnitudes quantize to 0.0 */
#define Q8_KEYS 2945         /* buckets up to 1.0's, per sign */

/* One q8 Adam call (ctypes mirrors this layout in cpu_kernels/_q8_lib.py). A q8 moment is its
 * codes (uint8 [n]) and absmax (fp32 [ceil(n / 256)]); the *_absmax pointers are NULL otherwise.
 * max_exp_avg_sq has exp_avg_sq's dtype. Outputs equal the inputs in place; elsewhere in bank
 * mode, where the inputs are left untouched. */
typedef struct {
    int64_t n;
    void *param;                      /* fp32 master; with remainders the bf16 param (high half) */
    const void *grad;                 /* grad_dtype: fp32 / bf16 / fp16 */
    const void *exp_avg;
    const float *exp_avg_absmax;
    const void *exp_avg_sq;
    const float *exp_avg_sq_absmax;
    const void *max_exp_avg_sq;       /* NULL unless amsgrad */
    const float *max_exp_avg_sq_absmax;
    void *param_out;
    void *exp_avg_out;
    float *exp_avg_absmax_out;
    void *exp_avg_sq_out;
    float *exp_avg_sq_absmax_out;
    void *max_exp_avg_sq_out;
    float *max_exp_avg_sq_absmax_out;
    void *param_copy;                 /* copy_dtype (bf16 / fp16), NULL when absent */
    const int16_t *remainder;         /* the fp32 master's low halves, NULL when off */
    int16_t *remainder_out;
    int32_t grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, copy_dtype;
    int32_t decoupled, reserved;
    int64_t step;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
} q8_args_t;

/* The call's constants in fp32: the Adam dispatcher's (adam_consts_init), the same computation. */
typedef adam_consts_t q8_consts_t;

/* The codebook (q8_tables.c, generated): the maps' fp32 bits, [0] signed, [1] unsigned; each
 * map's bucket table, a row for x >= +0 then one for x <= -0. */
extern const uint32_t q8_maps[2][256];
extern const uint32_t q8_buckets[2][2 * Q8_KEYS];
/* The vector quantizer's lines (q8_codegen.line_tables), fp32 bits: [map][line][slope, offset][bucket
 * of |x|: an octave 2^-31 .. 2^0, from 1.75 · 2^e in the signed map], in each bucket the fewest
 * whose minimum crosses every one of its code boundaries. Their minimum, raised to the top line
 * (q8_top_line[map]: slope, offset) from bucket Q8_TOP_BUCKET on, is t = 256 + |x|'s rank away from
 * the zero code + Q8_NEAR (+ 127 in the signed map) wherever that lies Q8_NEAR or more from an
 * integer: floor(t) - 256 is then the rank (the signed map's positive code; 511 - t floors to the
 * negative one), and t's fraction below 2·Q8_NEAR (its low 15 bits below 8) marks a lane near a
 * boundary, which takes q8_code. */
#define Q8_LINES 3           /* table rows: the most lines a bucket of either map needs */
#define Q8_LINES_SIGNED 2    /* the rows the signed map's buckets use */
#define Q8_LINES_UNSIGNED 3
#define Q8_LINE_SHIFT_SIGNED 0x200000  /* added to |x|'s bits before its bucket (octave) is taken */
#define Q8_LINE_SHIFT_UNSIGNED 0
#define Q8_TOP_BUCKET 30  /* the top line's first bucket */
#define Q8_NEAR 0x1p-13f  /* q8_codegen.NEAR */

extern const uint32_t q8_lines[2][Q8_LINES][2][32];
extern const uint32_t q8_top_line[2][2];

/* x -> its code in the signed (zero code 127) or unsigned (0) map: the fast quantizer of
 * q8_reference. NaN and |x| > 1 saturate at the sign's end; the unsigned map gives 0 for x <= 0. */
static inline uint8_t q8_code(float x, const uint32_t *table, int zero_code)
{
    const uint32_t u = f32_bits(x), mag = u & 0x7fffffffu, neg = u >> 31;
    int32_t key = (int32_t)(mag >> 16) - Q8_KEY_FIRST;
    key = key < 0 ? 0 : key > Q8_KEYS - 1 ? Q8_KEYS - 1 : key;
    const uint32_t entry = table[neg * Q8_KEYS + (uint32_t)key];
    const int rank = (int)(entry >> 17) + ((mag & 0xffffu) >= (entry & 0x1ffffu));
    return (uint8_t)(neg ? zero_code - rank : zero_code + rank);
}

/* The vector quantizers take x·(1/absmax) for x / absmax where both absmax and 1/absmax are normal
 * (q8_recip_ok): two roundings put it within 3 ulps of the rounded quotient, so within Q8_SLACK bit
 * patterns of it on the same side of 0 (8 covers a binade's edge, where ulps halve). A lane the
 * quantizer does not send to q8_code (x / absmax) must be right for every pattern that near:
 * q8_code is monotone in |x|, so agreeing at both ends of the span suffices. The test hooks hold
 * every fp32 pattern to this. */
#define Q8_SLACK 8

static inline int q8_recip_ok(float absmax)
{
    const uint32_t e = (f32_bits(absmax) >> 23) & 0xffu;  /* absmax in [2^-126, 2^126) */
    return e >= 1 && e <= 252;
}

/* code (the vector quantizer's for the pattern u) is q8_code's for every pattern within Q8_SLACK
 * of u, on u's side of 0 */
static inline int q8_slack_agrees(uint32_t code, uint32_t u, const uint32_t *table, int zero_code)
{
    const uint32_t sign = u & 0x80000000u, mag = u & 0x7fffffffu;
    const uint32_t lo = mag < Q8_SLACK ? 0 : mag - Q8_SLACK;
    const uint32_t hi = mag > 0x7fffffffu - Q8_SLACK ? 0x7fffffffu : mag + Q8_SLACK;
    return code == q8_code(bits_f32(sign | lo), table, zero_code) &&
           code == q8_code(bits_f32(sign | hi), table, zero_code);
}

/* Per-level ranges: [begin, end) with begin a multiple of Q8_BLOCK, end too or n. */
void q8_range_portable(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end);
#if defined(__x86_64__)
void q8_range_avx2(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end);
void q8_range_avx512(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end);
#elif defined(__aarch64__)
void q8_range_neon(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end);
#ifdef HYBRID_HAVE_SVE
void q8_range_sve(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end);
#endif
#endif

#endif
