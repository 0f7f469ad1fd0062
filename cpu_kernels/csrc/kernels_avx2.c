/* cpu_kernels, AVX2 level (with FMA and F16C). */
#include "kernels.h"
#define LEVEL avx2
#define LEVEL_HAS_FMA 1

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

static inline __m256 load8(const void *src, int dt, int64_t i)
{
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)src + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + i));
    if (dt == DT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline void load_block(float *dst, const void *src, int dt, int64_t off, int len, float scale)
{
    const __m256 s = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 8 <= len; i += 8) _mm256_store_ps(dst + i, _mm256_mul_ps(load8(src, dt, off + i), s));
    for (; i < len; i++) dst[i] = load_scalar(src, dt, off + i) * scale;
}

/* 8 floats -> 8 bf16, torch's rounding: nearest even, NaN -> 0x7FC0 */
static inline __m128i to_bf16_8(__m256 x)
{
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m256i packed = _mm256_packus_epi32(r, r);  /* in-lane: words 0-3 | 4-7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

static inline void store_block(void *dst, int dt, int64_t off, const float *src, int len, int nt)
{
    int i = 0;
    if (dt == DT_F32) {
        float *d = (float *)dst + off;
        if (nt) {
            for (; i < len && ((uintptr_t)(d + i) & 31); i++) d[i] = src[i];
            for (; i + 8 <= len; i += 8) _mm256_stream_ps(d + i, _mm256_loadu_ps(src + i));
        } else {
            for (; i + 8 <= len; i += 8) _mm256_storeu_ps(d + i, _mm256_loadu_ps(src + i));
        }
        for (; i < len; i++) d[i] = src[i];
        return;
    }
    uint16_t *d = (uint16_t *)dst + off;
    for (; i < len && nt && ((uintptr_t)(d + i) & 15); i++) store_scalar(dst, dt, off + i, src[i]);
    const int aligned = nt && !((uintptr_t)(d + i) & 15);
    for (; i + 8 <= len; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        __m128i h = dt == DT_BF16 ? to_bf16_8(x) : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
        if (aligned) _mm_stream_si128((__m128i *)(d + i), h);
        else _mm_storeu_si128((__m128i *)(d + i), h);
    }
    for (; i < len; i++) store_scalar(dst, dt, off + i, src[i]);
}

static inline void finish_stores(void) { _mm_sfence(); }

/* remainders, 8 at a time (see kernels_avx512.c) */
static inline __m256 decode8(const uint16_t *p, const int16_t *r, int64_t i)
{
    const __m256i pp = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + i)));
    const __m256i rr = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + i)));
    const __m256i hi = _mm256_sub_epi32(pp, _mm256_srli_epi32(rr, 15));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(hi, 16), rr));
}

static inline void decode_block(float *dst, const uint16_t *p, const int16_t *r, int64_t off, int len)
{
    int i = 0;
    for (; i + 8 <= len; i += 8) _mm256_storeu_ps(dst + i, decode8(p, r, off + i));
    for (; i < len; i++) dst[i] = remainder_decode(p[off + i], (uint16_t)r[off + i]);
}

/* the low 16 bits of 8 int32 lanes, in order (packus cannot saturate once masked) */
static inline __m128i low_halves_8(__m256i x)
{
    const __m256i lo = _mm256_and_si256(x, _mm256_set1_epi32(0xffff));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0x08));
}

static inline void encode_block(uint16_t *p, int16_t *r, int64_t off, const float *src, int len, int nt)
{
    int i = 0;
    uint16_t *dp = p + off;
    int16_t *dr = r + off;
    for (; i < len && nt && ((uintptr_t)(dp + i) & 15); i++) {
        const uint32_t u = f32_bits(src[i]);
        dp[i] = remainder_param_bits(u);
        dr[i] = (int16_t)(uint16_t)u;
    }
    const int ntp = nt && !((uintptr_t)(dp + i) & 15), ntr = nt && !((uintptr_t)(dr + i) & 15);
    const __m256i one = _mm256_set1_epi32(1);
    for (; i + 8 <= len; i += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        const __m256i hi = _mm256_add_epi32(_mm256_srli_epi32(u, 16),
                                            _mm256_and_si256(_mm256_srli_epi32(u, 15), one));
        const __m128i ph = low_halves_8(hi), rh = low_halves_8(u);
        if (ntp) _mm_stream_si128((__m128i *)(dp + i), ph); else _mm_storeu_si128((__m128i *)(dp + i), ph);
        if (ntr) _mm_stream_si128((__m128i *)(dr + i), rh); else _mm_storeu_si128((__m128i *)(dr + i), rh);
    }
    for (; i < len; i++) {
        const uint32_t u = f32_bits(src[i]);
        dp[i] = remainder_param_bits(u);
        dr[i] = (int16_t)(uint16_t)u;
    }
}

/* Compressed state (bf16 moments and/or remainders), AVX2: a register loop, 32 elements a
 * step so each 16-bit output leaves as one whole 64-byte line (two consecutive 32-byte
 * stores; non-temporal in bank mode where aligned); adam_range runs it over the multiple of
 * 32 and leaves the tail to the block path, which rounds identically.
 * It is compute-bound at one thread. Measured on a 2-core Zen 5 VM, AVX2 forced, one thread,
 * ns an element (L2-resident 32Ki elements / 16Mi from DRAM), bf16 grads and moments with
 * remainders: the correctly rounded vsqrtps + vdivps pair alone costs 0.22-0.26 (1.8-2.1 ns
 * per 8 lanes; the bits need both); the step with both replaced by multiplies 0.34, so the
 * rest (~110 vector instructions per 32 elements: widening, the remainder decode / encode,
 * the bf16 rounding, the arithmetic) is what bounds it, and the divider overlaps it. The
 * whole step 0.35 / 0.37, where the fp32 step is 0.26 / 0.47 and 18 B at this machine's
 * one-thread DRAM speed would be 0.30. Earlier versions took 0.42 / 0.44 (constants
 * reloaded after every store, since a store through a vector pointer may alias them; options
 * tested inside the loop; four live copies of every stream, spilled), then 0.37 / 0.41 (a
 * software pipeline across iterations that spilled, 262 instructions per 32 elements where
 * this loop has 177, callgrind). So the constants are broadcast once into locals, the stream
 * pointers copied out of adam_args_t, the moment dtypes, remainders and amsgrad are constants
 * of each instance (and the grad dtype, L2 mode and outputs of the common ones), and each 32
 * elements run as two halves whose divisions are in flight together. */
#define HAVE_ADAM_C16_REGS 1
/* fp32 state updated in place with 16-bit grads goes through the register loop too (split
 * halves: no shuffle for fp32 streams), where the block path's L1 round trips cost more than
 * the loop's conversions: one thread, ns an element, L2-resident (64Ki elements, median of
 * 3000) / from DRAM (16Mi, median of 15), a Zen 5 at AVX2: bf16 grads + bf16 copy 0.437 -> 0.395 /
 * 0.524 -> 0.456; on a Zen 3 (EPYC, AVX2 its best level; 16Mi, in-process A/B, interleaved
 * rounds) 18.3 -> 14.4 ms at one thread, 7.7 -> 7.2 at two. fp32 grads in place stay in the
 * blocks (0.285 there, 0.363 here in L2 on the Zen 5: its fp32 grads cost two inserts a vector
 * more), and so does bank mode (outputs elsewhere, non-temporal): on the Zen 5 the loop was
 * faster there too (0.623 -> 0.581 from DRAM), but on the Zen 3, a host whose best level this
 * is, the blocks are 15-25 % faster: fp32 grads 23.2 -> 18.8 ms at one thread and 16.4 -> 13.1
 * at two; bf16 grads with a bf16 copy 24.4 -> 19.2 and 15.3 -> 12.4. Where the loop's bank stores
 * are non-temporal (an Intel CPU: hybrid_get_avx2_bank_nt), bank mode takes the loop again: on an
 * Intel Xeon at AVX2, fp32 grads, 25.1 -> 21.6 ms at one thread and 13.2 -> 11.4 at two. */
#define C16_TAKES_FP32_STATE(a, c) \
    ((!(c)->out_of_place && (a)->grad_dtype != DT_F32) || ((c)->out_of_place && hybrid_get_avx2_bank_nt()))

typedef struct {
    __m256 gs, wd, w1, w2, b2, ib, eps, decay, nss;
} consts8_t;

static inline consts8_t consts8(const adam_consts_t *c)
{
    const consts8_t k = {_mm256_set1_ps(c->grad_scale), _mm256_set1_ps(c->l2),
                         _mm256_set1_ps(c->one_minus_beta1), _mm256_set1_ps(c->one_minus_beta2),
                         _mm256_set1_ps(c->beta2), _mm256_set1_ps(c->inv_bias_correction2_sqrt),
                         _mm256_set1_ps(c->eps), _mm256_set1_ps(c->decay), _mm256_set1_ps(c->neg_step_size)};
    return k;
}

/* adam_math's arithmetic on 8 lanes, FMA for FMA, in two parts: up to the quotient
 * q = m / (sqrt(v) * ib + eps), then the param. scaled: 0 where the grad scale is 1.0f, whose
 * multiply is left out: g·1 is g, bit for bit (a signalling NaN is quieted by the next operation
 * as by this one, and keeps its place among the operands). The two FMA pipes carry 8 multiplies and
 * FMAs per 8 lanes, the loop's busiest: without this one, bf16 moments + remainders took 0.510-0.520
 * -> 0.497 ns an element on a Zen 4 at AVX2 (one thread, 32Ki elements in L2; adam_c16_modes). */
static inline __attribute__((always_inline)) void adam8_moments(
    const consts8_t *k, const int l2, const int ams, const int scaled, __m256 p, __m256 g, __m256 m0, __m256 v0,
    __m256 x0, __m256 *mi, __m256 *vi, __m256 *vv, __m256 *q)
{
    __m256 gi = scaled ? _mm256_mul_ps(g, k->gs) : g;
    if (l2) gi = _mm256_fmadd_ps(k->wd, p, gi);
    *mi = _mm256_fmadd_ps(k->w1, _mm256_sub_ps(gi, m0), m0);
    *vi = _mm256_fmadd_ps(k->w2, _mm256_mul_ps(gi, gi), _mm256_mul_ps(v0, k->b2));
    *vv = ams ? _mm256_max_ps(x0, *vi) : *vi;  /* (vmax > v) ? vmax : v */
    *q = _mm256_div_ps(*mi, _mm256_fmadd_ps(_mm256_sqrt_ps(*vv), k->ib, k->eps));
}

static inline __m256 adam8_param(const consts8_t *k, __m256 p, __m256 q)
{
    return _mm256_fmadd_ps(p, k->decay, _mm256_mul_ps(k->nss, q));
}

/* The register loop holds each 16 elements as a pair of vectors in one of two layouts, fixed
 * per instance (the arithmetic is per element: same bits in any order):
 * - even/odd (EO), where every stream is 16-bit: vector 0 = elements 0,2,..,14, vector 1 =
 *   1,3,..,15. A 16-bit stream's 32-bit lane k holds elements 2k (low half) and 2k+1 (high
 *   half), so widening is a shift / a mask and narrowing a shift and a word blend: no shuffle
 *   (port 5, AVX2's only shuffle port on Intel, was this loop's bottleneck: 32 shuffles per 32
 *   elements in pack16 / permutes / vpmovzxwd). An fp32 stream costs two shufps a vector more.
 * - split halves (AB), where an fp32 stream is (fp32 master or moments): vector 0 = elements
 *   0-3|8-11, vector 1 = 4-7|12-15, so an fp32 stream is two 128-bit loads / stores per vector
 *   and a 16-bit one an unpack against zero to widen, a vpshufb and a 64-bit unpack pair to
 *   narrow. Measured at one thread in L2 (64Ki elements, min of 3000 calls), EO -> AB: fp32
 *   master + bf16 moments + bf16 copy 0.418 -> 0.385 ns an element, remainders with fp32
 *   moments 0.334 -> 0.291 (callgrind: 188.5 -> 178.5 and 166.4 -> 143.4 instructions per 32
 *   elements); bf16 moments + remainders would go 0.349 -> 0.353 (AB's vpshufb / unpacks cost
 *   more than EO's shifts and blends), so the all-16-bit instances keep EO. */
#define HI16 _mm256_set1_epi32((int)0xffff0000u)
/* per 128-bit lane: the low words of its four 32-bit lanes to bytes 0-7, the high words to 8-15 */
#define SPLIT_WORDS                                                                                  \
    _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, \
                     3, 6, 7, 10, 11, 14, 15)

static inline __m256 loadu2x128(const float *lo, const float *hi)
{
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
}

/* AB [e0-3|e8-11], [e4-7|e12-15] -> EO */
static inline void split_eo(__m256 a, __m256 b, __m256 *e, __m256 *o)
{
    *e = _mm256_shuffle_ps(a, b, 0x88);
    *o = _mm256_shuffle_ps(a, b, 0xDD);
}

/* 16 words in element order -> the pair with each word the high half of its element's lane */
static inline void widen16(__m256i x, const int ab, __m256 *v0, __m256 *v1)
{
    if (ab) {
        *v0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
        *v1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
    } else {
        *v0 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *v1 = _mm256_castsi256_ps(_mm256_and_si256(x, HI16));
    }
}

/* the pair's high and low 16-bit halves, each as 16 words in element order */
static inline void halves16(__m256 v0, __m256 v1, const int ab, __m256i *hi, __m256i *lo)
{
    const __m256i a = _mm256_castps_si256(v0), b = _mm256_castps_si256(v1);
    if (ab) {
        const __m256i sa = _mm256_shuffle_epi8(a, SPLIT_WORDS), sb = _mm256_shuffle_epi8(b, SPLIT_WORDS);
        *hi = _mm256_unpackhi_epi64(sa, sb);
        *lo = _mm256_unpacklo_epi64(sa, sb);
    } else {
        *hi = _mm256_blend_epi16(b, _mm256_srli_epi32(a, 16), 0x55);
        *lo = _mm256_blend_epi16(_mm256_slli_epi32(b, 16), a, 0x55);
    }
}

static inline __attribute__((always_inline)) void load16(const void *src, const int dt, int64_t j, const int ab,
                                                         __m256 *v0, __m256 *v1)
{
    if (dt == DT_F32) {
        const float *s = (const float *)src + j;
        const __m256 a = loadu2x128(s, s + 8), b = loadu2x128(s + 4, s + 12);
        if (ab) *v0 = a, *v1 = b;
        else split_eo(a, b, v0, v1);
    } else if (dt == DT_BF16) {
        widen16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + j)), ab, v0, v1);
    } else {
        const __m128i *s = (const __m128i *)((const uint16_t *)src + j);
        const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(s)), y = _mm256_cvtph_ps(_mm_loadu_si128(s + 1));
        const __m256 a = _mm256_permute2f128_ps(x, y, 0x20), b = _mm256_permute2f128_ps(x, y, 0x31);
        if (ab) *v0 = a, *v1 = b;
        else split_eo(a, b, v0, v1);
    }
}

/* 16 fp32 elements: one 64-byte line, four 16-byte stores in address order (non-temporal: nt, d
 * line-aligned) */
static inline void store_f32x16(float *d, __m256 v0, __m256 v1, const int ab, const int nt)
{
    /* EO -> AB: 0-3|8-11, 4-7|12-15 */
    const __m256 a = ab ? v0 : _mm256_unpacklo_ps(v0, v1), b = ab ? v1 : _mm256_unpackhi_ps(v0, v1);
    const __m128 q[4] = {_mm256_castps256_ps128(a), _mm256_castps256_ps128(b), _mm256_extractf128_ps(a, 1),
                         _mm256_extractf128_ps(b, 1)};
    for (int k = 0; k < 4; k++) {
        if (nt) _mm_stream_ps(d + 4 * k, q[k]);
        else _mm_storeu_ps(d + 4 * k, q[k]);
    }
}

/* to_bf16_8's rounding (nearest even) of the pair: 16 bf16 in order. No NaN handling: the
 * loop tests each 16 elements for NaN once and takes bf16x16_nan where one is.
 * In 16-bit lanes: h = the high halves (truncated bf16), l = the low halves; the carry is
 * l + lsb(h) + 0x7fff >= 0x10000, bit 15 of vpavgw(l, 0x7ffe | lsb(h)) = (l + lsb + 0x7fff) >> 1
 * (17-bit sum, no overflow). 9 instructions a pair (EO), where rounding each fp32 lane
 * (u + 0x7fff + bit 16) and joining the halves took 10. The same bits as to_bf16_8 for every
 * one of the 2^32 inputs but NaNs (checked exhaustively when written). */
static inline __m256i bf16x16(__m256 v0, __m256 v1, const int ab)
{
    __m256i h, l;
    halves16(v0, v1, ab, &h, &l);
    const __m256i x = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(1)), _mm256_set1_epi16(0x7ffe));
    return _mm256_add_epi16(h, _mm256_srli_epi16(_mm256_avg_epu16(l, x), 15));
}

/* bf16x16 with torch's NaN -> 0x7FC0 */
static inline __m256i bf16x16_nan(__m256 v0, __m256 v1, const int ab)
{
    const __m256i r = bf16x16(v0, v1, ab);
    const __m256i n0 = _mm256_castps_si256(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q));
    const __m256i n1 = _mm256_castps_si256(_mm256_cmp_ps(v1, v1, _CMP_UNORD_Q));
    /* per element, as 16-bit masks in order (packs keeps -1 and 0) */
    const __m256i nan = ab ? _mm256_packs_epi32(n0, n1) : _mm256_blend_epi16(n1, n0, 0x55);
    return _mm256_blendv_epi8(r, _mm256_set1_epi16(0x7fc0), nan);
}

static inline void store_u16x16(void *dst, __m256i x, int nt)
{
    if (nt) _mm256_stream_si256((__m256i *)dst, x); else _mm256_storeu_si256((__m256i *)dst, x);
}

/* 16 masters from 16 (param, remainder) pairs: the carry subtracted in 16-bit lanes, then
 * each element's param word as the high half of its lane, its remainder word as the low */
static inline void decode16(const uint16_t *p, const int16_t *r, int64_t j, const int ab, __m256 *v0, __m256 *v1)
{
    const __m256i pp = _mm256_loadu_si256((const __m256i *)(p + j));
    const __m256i rr = _mm256_loadu_si256((const __m256i *)(r + j));
    /* the carry as a mask (-1 where the remainder's top bit is set): a compare, not a shift */
    const __m256i h = _mm256_add_epi16(pp, _mm256_cmpgt_epi16(_mm256_setzero_si256(), rr));
    if (ab) {
        *v0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(rr, h));
        *v1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(rr, h));
    } else {
        *v0 = _mm256_castsi256_ps(_mm256_blend_epi16(_mm256_slli_epi32(h, 16), rr, 0x55));
        *v1 = _mm256_castsi256_ps(_mm256_blend_epi16(h, _mm256_srli_epi32(rr, 16), 0x55));
    }
}

/* the inverse: remainder words = low halves in order; param words = high halves plus the
 * remainder's top bit, added in 16-bit lanes (wraps as remainder_param_bits' & 0xffff) */
static inline void encode16(__m256 v0, __m256 v1, const int ab, __m256i *ph, __m256i *rh)
{
    __m256i t;
    halves16(v0, v1, ab, &t, rh);
    *ph = _mm256_sub_epi16(t, _mm256_cmpgt_epi16(_mm256_setzero_si256(), *rh));
}

static inline __m256i f16x16(__m256 v0, __m256 v1, const int ab)
{
    const __m128i h0 = _mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT);
    const __m128i h1 = _mm256_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT);
    /* AB: h0 = elements 0-3, 8-11, h1 = 4-7, 12-15; EO: h0 = evens, h1 = odds */
    const __m128i lo = ab ? _mm_unpacklo_epi64(h0, h1) : _mm_unpacklo_epi16(h0, h1);
    const __m128i hi = ab ? _mm_unpackhi_epi64(h0, h1) : _mm_unpackhi_epi16(h0, h1);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* One call's streams, copied out of adam_args_t into locals: a vector store may alias
 * anything, so pointers read through `a` would be reloaded after every store. */
typedef struct {
    const uint16_t *p16;
    const float *param;
    const int16_t *rin;
    const void *grad, *m, *v, *x;
    uint16_t *po16;
    float *pout;
    int16_t *rout;
    void *mo, *vo, *xo;
    uint16_t *cp;
    int cp_bf16;
} c16_streams_t;

static inline c16_streams_t c16_streams(const adam_args_t *a)
{
    const c16_streams_t s = {(const uint16_t *)(const void *)a->param, a->param, a->remainder, a->grad,
                             a->exp_avg, a->exp_avg_sq, a->max_exp_avg_sq,
                             (uint16_t *)(void *)a->param_out, a->param_out, a->remainder_out,
                             a->exp_avg_out, a->exp_avg_sq_out, a->max_exp_avg_sq_out,
                             (uint16_t *)a->param_copy, a->param_copy && a->copy_dtype == DT_BF16};
    return s;
}

/* Each 32 elements in two halves: both fronts (loads, the moments up to the quotient
 * q = m / (sqrt(v) * ib + eps)) before both backs (the params, the conversions, the stores),
 * so the two halves' square roots and divisions are in flight together. Measured at one
 * thread, L2-resident (min of 4000 calls, 32Ki elements, bf16 moments + remainders): 0.359 ns
 * an element where the loop ran the front of the next 16 before the back of these (a
 * software pipeline across iterations, whose state spilled: 16 vector registers), 0.393 with
 * each 16 front-to-back, 0.344 this way; four halves (64 elements) spilled more, 0.399. */
typedef struct {
    __m256 p[2], mi[2], vi[2], vv[2], q[2];
} c16_inflight_t;

/* The param copy: streaming stores or not (ntc), its dtype (cpk: 0 when there is none). The
 * param (and remainder) and the moments: streaming stores or not (ntp, ntm), plain in place, in
 * bank mode as the CPU's vendor chose (adam_c16_modes says why). */
typedef struct {
    int ntc, cpk, ntp, ntm;
} c16_out_t;

/* The layout of an instance (the two described above the helpers): split halves (AB) where a
 * stream is fp32 (the master without remainders, or a moment), even/odd (EO) where all are
 * 16-bit. */
static inline int c16_ab(const int mdt, const int vdt, const int rem)
{
    return !rem || mdt == DT_F32 || vdt == DT_F32;
}

/* Compile-time constants of both halves: the moment dtypes (mdt exp_avg's, vdt exp_avg_sq's),
 * the grad dtype where it is bf16 (else read per step), remainders, amsgrad, whether the grads
 * are scaled (adam8_moments); l2, the param copy and the streaming stores (bank mode) are tested
 * per step (loop-invariant). */
static inline __attribute__((always_inline)) c16_inflight_t c16_front(
    const c16_streams_t *s, const consts8_t *k, int64_t j, const int mdt, const int vdt, const int gdt,
    const int rem, const int ams, const int l2, const int scaled)
{
    const int ab = c16_ab(mdt, vdt, rem);
    c16_inflight_t f;
    __m256 g[2], m[2], v[2], x[2];
    if (rem) decode16(s->p16, s->rin, j, ab, &f.p[0], &f.p[1]);
    else load16(s->param, DT_F32, j, ab, &f.p[0], &f.p[1]);
    load16(s->grad, gdt, j, ab, &g[0], &g[1]);
    load16(s->m, mdt, j, ab, &m[0], &m[1]);
    load16(s->v, vdt, j, ab, &v[0], &v[1]);
    if (ams) load16(s->x, vdt, j, ab, &x[0], &x[1]);
    else x[0] = x[1] = _mm256_setzero_ps();
    for (int h = 0; h < 2; h++)
        adam8_moments(k, l2, ams, scaled, f.p[h], g[h], m[h], v[h], x[h], &f.mi[h], &f.vi[h], &f.vv[h], &f.q[h]);
    return f;
}

/* the new params of one half */
static inline __attribute__((always_inline)) void c16_params(const consts8_t *k, c16_inflight_t *f)
{
    f->p[0] = adam8_param(k, f->p[0], f->q[0]);
    f->p[1] = adam8_param(k, f->p[1], f->q[1]);
}

/* A NaN in exp_avg or exp_avg_sq (or amsgrad's max, which is a NaN only where exp_avg_sq is)
 * makes the new param a NaN: mi / denom, sqrt and max all pass it on. So unordered compares
 * of the new params tell whether anything rounded to bf16 needs torch's NaN: the loop tests
 * its 32 elements at once, one test and branch for both halves. Measured at one thread in L2
 * (32Ki elements, min of 5 x 3000 calls, both builds alternately; callgrind instructions an
 * element), a Zen 5 at AVX2: fp32 master + bf16 moments + bf16 copy 0.365 -> 0.348 ns (5.66 ->
 * 5.44), fp32 bank mode 0.289 -> 0.284 (5.69 -> 5.34). The remainder instances kept one test
 * per half there (one for both was 1-2 % slower) until the stores went stream by stream
 * (c16_back), which needs both halves' params before the first store. */
static inline __attribute__((always_inline)) int c16_any_nan(const c16_inflight_t *f0, const c16_inflight_t *f1)
{
    const __m256 un = _mm256_or_ps(_mm256_cmp_ps(f0->p[0], f0->p[1], _CMP_UNORD_Q),
                                   _mm256_cmp_ps(f1->p[0], f1->p[1], _CMP_UNORD_Q));
    return !_mm256_testz_ps(un, un);
}

static inline __attribute__((always_inline)) void store_u16x16_pair(void *dst, int64_t j, __m256i x0, __m256i x1,
                                                                    int nt)
{
    store_u16x16((uint16_t *)dst + j, x0, nt);
    store_u16x16((uint16_t *)dst + j + 16, x1, nt);
}

/* one moment (or the bf16 param copy) of both halves: a then b, 16 elements each */
static inline __attribute__((always_inline)) void store_moment16_pair(void *dst, const int dt, int64_t j,
                                                                      const __m256 *a, const __m256 *b, int nt,
                                                                      const int nan, const int ab)
{
    if (dt == DT_F32) {
        store_f32x16((float *)dst + j, a[0], a[1], ab, nt);
        store_f32x16((float *)dst + j + 16, b[0], b[1], ab, nt);
    } else {
        const __m256i x0 = nan ? bf16x16_nan(a[0], a[1], ab) : bf16x16(a[0], a[1], ab);
        const __m256i x1 = nan ? bf16x16_nan(b[0], b[1], ab) : bf16x16(b[0], b[1], ab);
        store_u16x16_pair(dst, j, x0, x1, nt);
    }
}

/* The stores of a step's 32 elements, the params of both halves new (c16_params); nan:
 * c16_any_nan's answer where a 16-bit stream is rounded. Stream by stream, each stream's two
 * halves back to back: a 16-bit stream's 64-byte line is its two halves, and leaves as two
 * consecutive stores. Measured on a 2-core Zen 3 (EPYC, AVX2, 16Mi elements, in-process A/B of
 * both libraries, interleaved rounds, one thread / two): where each half stored all its streams
 * in turn, a line's two halves three other stores apart, remainders with bf16 moments took
 * 14.9 / 7.4 ms in place against 12.1 / 6.5 now (the Zen 5 showed nothing of it). */
static inline __attribute__((always_inline)) void c16_back(
    const c16_streams_t *s, int64_t j, const c16_inflight_t *f0, const c16_inflight_t *f1, const int mdt,
    const int vdt, const int rem, const int ams, const c16_out_t o, const int nan)
{
    uint16_t *cp = o.cpk ? s->cp : NULL;  /* a param copy never comes with remainders */
    const int ab = c16_ab(mdt, vdt, rem);
    if (rem) {
        __m256i ph0, rh0, ph1, rh1;
        encode16(f0->p[0], f0->p[1], ab, &ph0, &rh0);
        encode16(f1->p[0], f1->p[1], ab, &ph1, &rh1);
        store_u16x16_pair(s->po16, j, ph0, ph1, o.ntp);
        store_u16x16_pair(s->rout, j, rh0, rh1, o.ntp);
    } else {
        store_f32x16(s->pout + j, f0->p[0], f0->p[1], ab, o.ntp);
        store_f32x16(s->pout + j + 16, f1->p[0], f1->p[1], ab, o.ntp);
    }
    store_moment16_pair(s->mo, mdt, j, f0->mi, f1->mi, o.ntm, nan, ab);
    store_moment16_pair(s->vo, vdt, j, f0->vi, f1->vi, o.ntm, nan, ab);
    if (ams) store_moment16_pair(s->xo, vdt, j, f0->vv, f1->vv, o.ntm, nan, ab);
    if (o.cpk == DT_BF16) store_moment16_pair(cp, DT_BF16, j, f0->p, f1->p, o.ntc, nan, ab);
    else if (cp) store_u16x16_pair(cp, j, f16x16(f0->p[0], f0->p[1], ab), f16x16(f1->p[0], f1->p[1], ab), o.ntc);
}

static inline __attribute__((always_inline)) void adam_c16_body(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end, const int mdt, const int vdt,
    const int gdt, const int rem, const int ams, const int l2, const int scaled, const c16_out_t out)
{
    const consts8_t k = consts8(c);
    const c16_streams_t s = c16_streams(a);
    const int msz = mdt == DT_F32 ? 4 : 2, vsz = vdt == DT_F32 ? 4 : 2, gsz = gdt == DT_F32 ? 4 : 2;
    const char *pm = (const char *)s.m, *pv = (const char *)s.v, *pg = (const char *)s.grad;
    const char *pp = (const char *)s.param, *pr = (const char *)s.rin, *px = (const char *)s.x;
    for (int64_t i = begin; i + 32 <= end; i += 32) {
        /* software prefetch 1024 elements ahead (2 KiB of a 16-bit stream): one line per
         * 16-bit stream per step, two per fp32 stream. 512 ahead was 2-8 % slower from DRAM
         * at one thread (16Mi elements, min of 11 calls, three rounds; 768 and 1536 between) */
        const int64_t ahead = i + 1024;
        _mm_prefetch(pm + ahead * msz, _MM_HINT_T0);
        if (msz == 4) _mm_prefetch(pm + ahead * msz + 64, _MM_HINT_T0);
        _mm_prefetch(pv + ahead * vsz, _MM_HINT_T0);
        if (vsz == 4) _mm_prefetch(pv + ahead * vsz + 64, _MM_HINT_T0);
        _mm_prefetch(pg + ahead * gsz, _MM_HINT_T0);
        if (gsz == 4) _mm_prefetch(pg + ahead * gsz + 64, _MM_HINT_T0);
        if (rem) {
            _mm_prefetch(pp + ahead * 2, _MM_HINT_T0);
            _mm_prefetch(pr + ahead * 2, _MM_HINT_T0);
        } else {
            _mm_prefetch(pp + ahead * 4, _MM_HINT_T0);
            _mm_prefetch(pp + ahead * 4 + 64, _MM_HINT_T0);
        }
        if (ams) {
            _mm_prefetch(px + ahead * vsz, _MM_HINT_T0);
            if (vsz == 4) _mm_prefetch(px + ahead * vsz + 64, _MM_HINT_T0);
        }
        c16_inflight_t f0 = c16_front(&s, &k, i, mdt, vdt, gdt, rem, ams, l2, scaled);
        c16_inflight_t f1 = c16_front(&s, &k, i + 16, mdt, vdt, gdt, rem, ams, l2, scaled);
        c16_params(&k, &f0);
        c16_params(&k, &f1);
        const int rounds16 = mdt == DT_BF16 || vdt == DT_BF16 || out.cpk == DT_BF16;
        if (rounds16 && __builtin_expect(c16_any_nan(&f0, &f1), 0)) c16_back(&s, i, &f0, &f1, mdt, vdt, rem, ams, out, 1);
        else c16_back(&s, i, &f0, &f1, mdt, vdt, rem, ams, out, 0);
    }
}

/* One instance per (exp_avg dtype, exp_avg_sq dtype, remainders, amsgrad) with the grad dtype,
 * L2 mode and the outputs read per call (loop-invariant branches the compiler leaves in the
 * loop), and for the common calls (bf16 grads, AdamW, no amsgrad) instances where those are
 * constants too, so the loop has no branch but its own. */
static inline __attribute__((always_inline)) void adam_c16_modes(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end, const int mdt, const int vdt,
    const int rem)
{
    const int msz = mdt == DT_F32 ? 4 : 2, vsz = vdt == DT_F32 ? 4 : 2;
    /* Bank mode's outputs (the param or its two halves, the moments): non-temporal stores where
     * the CPU is an Intel one, plain ones elsewhere (hybrid_get_avx2_bank_nt, dispatch.c). On a Zen 3
     * (AVX2 its best level; 16Mi elements, in-process A/B, interleaved rounds, one thread / two)
     * remainders with bf16 moments took 19.2 / 10.3 ms non-temporal and 14.0 / 7.8 plainly, an fp32
     * master with bf16 moments 16.3 / 9.0 against 12.7 / 8.0. On an Intel Xeon at AVX2 the same
     * remainders row took 23.9 / 12.2 ms plainly and 14.4 / 7.6 non-temporal. The param copy
     * beside an in-place step is non-temporal where line-aligned, on both: plain, that step was
     * 3-6 % slower on the Zen 3. */
    const nt_streams_t nts = nt_streams(a, c->out_of_place, c->amsgrad, begin, msz, vsz);
    const int ntc = nts.copy, bank_nt = hybrid_get_avx2_bank_nt();
    const int cpk = rem || !a->param_copy ? 0 : a->copy_dtype;
    const int ntp = bank_nt && nts.param, ntm = bank_nt && nts.moments;
    const c16_out_t o = {ntc, cpk, ntp, ntm};
    const int gdt = a->grad_dtype, l2 = c->l2_mode;
    if (!c->amsgrad && gdt == DT_BF16 && !l2 && (!cpk || ntc)) {
        /* the store kinds constants too: streaming bank mode (both kinds of stream aligned, an Intel
         * CPU) an instance of its own, so an in-place step tests no store kind per store (a
         * runtime flag there cost 3-4 % at AVX2 with an fp32 param stream: 16 Mi, in-process A/B) */
        const int bank_streams = ntp && ntm;
        /* unscaled grads (adam8_moments) an instance of their own where remainders are: a clip or a
         * loss scale takes the multiply. Elsewhere the multiply stays: an fp32 master with bf16
         * moments and a bf16 copy took 0.525 -> 0.59 ns an element in L2 with instances of both
         * kinds (one thread, Zen 4 at AVX2), though the multiply left out of every instance gained
         * a little there too. */
        const int unscaled = rem && c->grad_scale == 1.0f;
#define C16_FAST(cpv, nt, sc) \
    adam_c16_body(a, c, begin, end, mdt, vdt, DT_BF16, rem, 0, 0, sc, (c16_out_t){1, cpv, nt, nt})
#define C16_FAST_KINDS(cpv, sc)            \
    do {                                   \
        if (bank_streams) C16_FAST(cpv, 1, sc); \
        else C16_FAST(cpv, 0, sc);         \
    } while (0)
        if (cpk == DT_BF16) C16_FAST_KINDS(DT_BF16, 1);
        else if (cpk == DT_F16) C16_FAST_KINDS(DT_F16, 1);
        else if (unscaled) C16_FAST_KINDS(0, 0);
        else C16_FAST_KINDS(0, 1);
#undef C16_FAST_KINDS
#undef C16_FAST
    } else if (c->amsgrad) {
        adam_c16_body(a, c, begin, end, mdt, vdt, gdt, rem, 1, l2, 1, o);
    } else {
        adam_c16_body(a, c, begin, end, mdt, vdt, gdt, rem, 0, l2, 1, o);
    }
}

static void adam_c16_regs(const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end)
{
    const int mb = a->moment_dtype == DT_BF16, vb = a->exp_avg_sq_dtype == DT_BF16;
    if (a->remainder) {
        if (mb && vb) adam_c16_modes(a, c, begin, end, DT_BF16, DT_BF16, 1);
        else if (mb) adam_c16_modes(a, c, begin, end, DT_BF16, DT_F32, 1);
        else if (vb) adam_c16_modes(a, c, begin, end, DT_F32, DT_BF16, 1);
        else adam_c16_modes(a, c, begin, end, DT_F32, DT_F32, 1);
    } else {
        if (mb && vb) adam_c16_modes(a, c, begin, end, DT_BF16, DT_BF16, 0);
        else if (mb) adam_c16_modes(a, c, begin, end, DT_BF16, DT_F32, 0);
        else if (vb) adam_c16_modes(a, c, begin, end, DT_F32, DT_BF16, 0);
        else adam_c16_modes(a, c, begin, end, DT_F32, DT_F32, 0);
    }
}

static inline void chunk_sumsq(const void *g, int dt, int64_t off, int64_t len, double *lanes)
{
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m256 a = load8(g, dt, off + i), b = load8(g, dt, off + i + 8);
        const __m256d x0 = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
        const __m256d x1 = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
        const __m256d x2 = _mm256_cvtps_pd(_mm256_castps256_ps128(b));
        const __m256d x3 = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
        acc[0] = _mm256_fmadd_pd(x0, x0, acc[0]);
        acc[1] = _mm256_fmadd_pd(x1, x1, acc[1]);
        acc[2] = _mm256_fmadd_pd(x2, x2, acc[2]);
        acc[3] = _mm256_fmadd_pd(x3, x3, acc[3]);
    }
    for (int k = 0; k < 4; k++) _mm256_storeu_pd(lanes + 4 * k, acc[k]);
    for (int l = 0; i < len; i++, l++) {  /* x*x is exact in fp64: fma and mul+add agree */
        const double x = (double)load_scalar(g, dt, off + i);
        lanes[l] += x * x;
    }
}

/* The roofline probes (adam_body.h), as kernels_avx512.c's: 32 elements a step (two lines of
 * each stream), software prefetch 1 KiB ahead on the four read streams, bank mode's three
 * outputs non-temporal where aligned, as this level's bank mode writes them. */
#define HAVE_BW_REGS 1
#define BW_PF 256  /* floats ahead */

static inline void bw_prefetch(const float *p, const float *g, const float *m, const float *v, int64_t i)
{
    for (int h = 0; h < 32; h += 16) {
        _mm_prefetch((const char *)(p + i + BW_PF + h), _MM_HINT_T0);
        _mm_prefetch((const char *)(g + i + BW_PF + h), _MM_HINT_T0);
        _mm_prefetch((const char *)(m + i + BW_PF + h), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + i + BW_PF + h), _MM_HINT_T0);
    }
}

void bw_inplace_avx2(float *p, const float *g, float *m, float *v, int64_t b, int64_t e)
{
    const __m256 s = _mm256_set1_ps(0.999f);
    int64_t i = b;
    for (; i + 32 <= e; i += 32) {
        bw_prefetch(p, g, m, v, i);
        for (int64_t j = i; j < i + 32; j += 8) {
            const __m256 gj = _mm256_loadu_ps(g + j);
            _mm256_storeu_ps(p + j, _mm256_fmadd_ps(_mm256_loadu_ps(p + j), s, gj));
            _mm256_storeu_ps(m + j, _mm256_fmadd_ps(_mm256_loadu_ps(m + j), s, gj));
            _mm256_storeu_ps(v + j, _mm256_fmadd_ps(_mm256_loadu_ps(v + j), s, gj));
        }
    }
    for (; i < e; i++) {
        p[i] = __builtin_fmaf(p[i], 0.999f, g[i]);
        m[i] = __builtin_fmaf(m[i], 0.999f, g[i]);
        v[i] = __builtin_fmaf(v[i], 0.999f, g[i]);
    }
}

void bw_bank_avx2(const float *p, const float *g, const float *m, const float *v,
                  float *po, float *mo, float *vo, int64_t b, int64_t e)
{
    const __m256 s = _mm256_set1_ps(0.999f);
    const int nt = LINE_ALIGNED(po + b) && LINE_ALIGNED(mo + b) && LINE_ALIGNED(vo + b);
    int64_t i = b;
    for (; i + 32 <= e; i += 32) {
        bw_prefetch(p, g, m, v, i);
        for (int64_t j = i; j < i + 32; j += 8) {
            const __m256 gj = _mm256_loadu_ps(g + j);
            const __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(p + j), s, gj);
            const __m256 y = _mm256_fmadd_ps(_mm256_loadu_ps(m + j), s, gj);
            const __m256 z = _mm256_fmadd_ps(_mm256_loadu_ps(v + j), s, gj);
            if (nt) {
                _mm256_stream_ps(po + j, x);
                _mm256_stream_ps(mo + j, y);
                _mm256_stream_ps(vo + j, z);
            } else {
                _mm256_storeu_ps(po + j, x);
                _mm256_storeu_ps(mo + j, y);
                _mm256_storeu_ps(vo + j, z);
            }
        }
    }
    for (; i < e; i++) {
        po[i] = __builtin_fmaf(p[i], 0.999f, g[i]);
        mo[i] = __builtin_fmaf(m[i], 0.999f, g[i]);
        vo[i] = __builtin_fmaf(v[i], 0.999f, g[i]);
    }
    _mm_sfence();
}

#define BW_PATTERN_M256 1  /* the per-pattern probe in 32-byte vectors */
/* adam_body.h prefetches in-place blocks this many elements ahead (2 KiB of an fp32 stream) on
 * Intel CPUs (kernels.h, hybrid_get_block_prefetch): on an Intel Xeon at AVX2 (16 Mi elements,
 * in-process A/B) fp32 state with fp32 grads stepped in 0.90-0.91x the time, 256 and 512 alike
 * (docs/kernels.md, "Software prefetch of the fp32 streams") */
#ifndef BLOCK_AHEAD
#define BLOCK_AHEAD 512
#endif
#include "adam_body.h"

#else  /* not x86: never dispatched to */
void adam_range_avx2(const adam_args_t *a, const adam_consts_t *c, int64_t b, int64_t e) { (void)a; (void)c; (void)b; (void)e; }
void grad_chunk_sums_avx2(const void *g, int dt, int64_t n, int64_t c0, int64_t c1, double *p) { (void)g; (void)dt; (void)n; (void)c0; (void)c1; (void)p; }
void bw_inplace_avx2(float *p, const float *g, float *m, float *v, int64_t b, int64_t e) { (void)p; (void)g; (void)m; (void)v; (void)b; (void)e; }
void bw_bank_avx2(const float *p, const float *g, const float *m, const float *v, float *po, float *mo, float *vo, int64_t b, int64_t e)
{ (void)p; (void)g; (void)m; (void)v; (void)po; (void)mo; (void)vo; (void)b; (void)e; }
void remainder_encode_avx2(const float *m, uint16_t *p, int16_t *r, int64_t b, int64_t e) { (void)m; (void)p; (void)r; (void)b; (void)e; }
void remainder_decode_avx2(const uint16_t *p, const int16_t *r, float *m, int64_t b, int64_t e) { (void)p; (void)r; (void)m; (void)b; (void)e; }
uint32_t bw_pattern_avx2(void *const *ptrs, const int *bytes, const int *kinds, int ns, int64_t ahead, int64_t b, int64_t e)
{ (void)ptrs; (void)bytes; (void)kinds; (void)ns; (void)ahead; (void)b; (void)e; return 0; }
#endif
