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

/* Compressed state (bf16 moments and/or remainders), AVX2: the register loop of
 * kernels_avx512.c with 8 lanes, 32 elements a step so each 16-bit output leaves as one
 * whole 64-byte line (two consecutive 32-byte stores; non-temporal in bank mode where
 * aligned). Through L1 blocks this level ran compressed state at 0.91x the fp32 fused step
 * (one thread, 16Mi): compute-bound; adam_range runs this over the multiple of 32 and
 * leaves the tail to the block path, which rounds identically. */
#define HAVE_ADAM_C16_REGS 1

static inline __attribute__((always_inline)) void adam8(
    const adam_consts_t *c, __m256 p, __m256 g, __m256 m0, __m256 v0, __m256 x0, int ams,
    __m256 *pn, __m256 *mi, __m256 *vi, __m256 *vv)
{
    __m256 gi = _mm256_mul_ps(g, _mm256_set1_ps(c->grad_scale));
    if (c->l2_mode) gi = _mm256_fmadd_ps(_mm256_set1_ps(c->l2), p, gi);
    *mi = _mm256_fmadd_ps(_mm256_set1_ps(c->one_minus_beta1), _mm256_sub_ps(gi, m0), m0);
    *vi = _mm256_fmadd_ps(_mm256_set1_ps(c->one_minus_beta2), _mm256_mul_ps(gi, gi),
                          _mm256_mul_ps(v0, _mm256_set1_ps(c->beta2)));
    *vv = ams ? _mm256_max_ps(x0, *vi) : *vi;  /* (vmax > v) ? vmax : v */
    const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(*vv), _mm256_set1_ps(c->inv_bias_correction2_sqrt),
                                         _mm256_set1_ps(c->eps));
    *pn = _mm256_fmadd_ps(p, _mm256_set1_ps(c->decay),
                          _mm256_mul_ps(_mm256_set1_ps(c->neg_step_size), _mm256_div_ps(*mi, denom)));
}

/* The register loop holds each 16 elements as two vectors in even/odd order: E = elements
 * 0,2,..,14 and O = 1,3,..,15. A 16-bit stream then needs no shuffle at all: its 32-bit lane
 * k holds elements 2k (low half) and 2k+1 (high half), so widening is a shift / a mask, and
 * narrowing a shift / a mask and an OR (port 5, AVX2's only shuffle port on Intel, was this
 * loop's bottleneck: 32 shuffles per 32 elements in pack16 / permutes / vpmovzxwd). An fp32
 * stream is gathered by two 128-bit loads per vector (rows 0-3|8-11 and 4-7|12-15) and two
 * shufps, scattered by two unpacks and four 128-bit stores (or two vperm2f128 for streaming
 * stores). The arithmetic is per element: same bits as any order. */
#define HI16 _mm256_set1_epi32((int)0xffff0000u)

static inline __m256 loadu2x128(const float *lo, const float *hi)
{
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
}

/* [e0-3|e8-11], [e4-7|e12-15] -> E, O */
static inline void split_eo(__m256 a, __m256 b, __m256 *e, __m256 *o)
{
    *e = _mm256_shuffle_ps(a, b, 0x88);
    *o = _mm256_shuffle_ps(a, b, 0xDD);
}

static inline void load16_eo(const void *src, int dt, int64_t j, __m256 *e, __m256 *o)
{
    if (dt == DT_F32) {
        const float *s = (const float *)src + j;
        split_eo(loadu2x128(s, s + 8), loadu2x128(s + 4, s + 12), e, o);
    } else if (dt == DT_BF16) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + j));
        *e = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *o = _mm256_castsi256_ps(_mm256_and_si256(x, HI16));
    } else {
        const __m128i *s = (const __m128i *)((const uint16_t *)src + j);
        const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(s)), b = _mm256_cvtph_ps(_mm_loadu_si128(s + 1));
        split_eo(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31), e, o);
    }
}

static inline void store_f32_eo(float *d, __m256 e, __m256 o, int nt)
{
    const __m256 l = _mm256_unpacklo_ps(e, o), h = _mm256_unpackhi_ps(e, o);  /* 0-3|8-11, 4-7|12-15 */
    if (nt) {
        _mm256_stream_ps(d, _mm256_permute2f128_ps(l, h, 0x20));
        _mm256_stream_ps(d + 8, _mm256_permute2f128_ps(l, h, 0x31));
    } else {
        _mm_storeu_ps(d, _mm256_castps256_ps128(l));
        _mm_storeu_ps(d + 4, _mm256_castps256_ps128(h));
        _mm_storeu_ps(d + 8, _mm256_extractf128_ps(l, 1));
        _mm_storeu_ps(d + 12, _mm256_extractf128_ps(h, 1));
    }
}

/* to_bf16_8's rounding (nearest even, NaN -> 0x7FC0) of E and O, joined: 16 bf16 in order.
 * nan = 0 when the caller knows neither holds a NaN (one compare per step, see the loop) */
static inline __m256i bf16_eo(__m256 e, __m256 o, const int nan)
{
    const __m256i ue = _mm256_castps_si256(e), uo = _mm256_castps_si256(o);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    const __m256i re = _mm256_add_epi32(ue, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(ue, 16), one), half));
    const __m256i ro = _mm256_add_epi32(uo, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(uo, 16), one), half));
    __m256i le = _mm256_srli_epi32(re, 16), ho = _mm256_and_si256(ro, HI16);
    if (nan) {
        le = _mm256_blendv_epi8(le, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(e, e, _CMP_UNORD_Q)));
        ho = _mm256_blendv_epi8(ho, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(_mm256_cmp_ps(o, o, _CMP_UNORD_Q)));
    }
    return _mm256_or_si256(le, ho);
}

static inline void store_u16x32(void *dst, __m256i a, __m256i b, int nt)
{
    if (nt) { _mm256_stream_si256((__m256i *)dst, a); _mm256_stream_si256((__m256i *)dst + 1, b); }
    else { _mm256_storeu_si256((__m256i *)dst, a); _mm256_storeu_si256((__m256i *)dst + 1, b); }
}

/* x[0..3] = E, O of elements 0-15 then of 16-31 */
static inline void store_moment32(void *dst, int dt, int64_t j, const __m256 x[4], int nt, const int nan)
{
    if (dt == DT_F32) {
        store_f32_eo((float *)dst + j, x[0], x[1], nt);
        store_f32_eo((float *)dst + j + 16, x[2], x[3], nt);
        return;
    }
    store_u16x32((uint16_t *)dst + j, bf16_eo(x[0], x[1], nan), bf16_eo(x[2], x[3], nan), nt);
}

/* 16 masters from 16 (param, remainder) pairs: the carry subtracted in 16-bit lanes, each
 * 32-bit lane's halves moved to the top (param) or bottom (remainder) of its own lane */
static inline void decode16_eo(const uint16_t *p, const int16_t *r, int64_t j, __m256 *e, __m256 *o)
{
    const __m256i pp = _mm256_loadu_si256((const __m256i *)(p + j));
    const __m256i rr = _mm256_loadu_si256((const __m256i *)(r + j));
    const __m256i h = _mm256_sub_epi16(pp, _mm256_srli_epi16(rr, 15));
    const __m256i lo = _mm256_set1_epi32(0xffff);
    *e = _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(h, 16), _mm256_and_si256(rr, lo)));
    *o = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(h, HI16), _mm256_srli_epi32(rr, 16)));
}

/* the inverse: remainder words = low halves in order; param words = high halves plus the
 * remainder's top bit, added in 16-bit lanes (wraps as remainder_param_bits' & 0xffff) */
static inline void encode16_eo(__m256 e, __m256 o, __m256i *ph, __m256i *rh)
{
    const __m256i ue = _mm256_castps_si256(e), uo = _mm256_castps_si256(o);
    *rh = _mm256_or_si256(_mm256_and_si256(ue, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(uo, 16));
    const __m256i t = _mm256_or_si256(_mm256_srli_epi32(ue, 16), _mm256_and_si256(uo, HI16));
    *ph = _mm256_add_epi16(t, _mm256_srli_epi16(*rh, 15));
}

static inline __m256i f16_eo(__m256 e, __m256 o)
{
    const __m128i he = _mm256_cvtps_ph(e, _MM_FROUND_TO_NEAREST_INT), ho = _mm256_cvtps_ph(o, _MM_FROUND_TO_NEAREST_INT);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(he, ho)), _mm_unpackhi_epi16(he, ho), 1);
}


/* one instance per (exp_avg dtype, exp_avg_sq dtype) pair, as in kernels_avx512.c */
static inline __attribute__((always_inline)) void adam_c16_body(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end, const int mdt, const int vdt)
{
    const int ams = c->amsgrad, oop = c->out_of_place, gdt = a->grad_dtype;
    const int msz = mdt == DT_F32 ? 4 : 2, vsz = vdt == DT_F32 ? 4 : 2;
    const uint16_t *p16 = (const uint16_t *)(const void *)a->param;
    const int16_t *rin = a->remainder;
    const int rem = rin != NULL;
    uint16_t *po16 = (uint16_t *)(void *)a->param_out;
    uint16_t *cp = (uint16_t *)a->param_copy;
    const nt_streams_t nt = nt_streams(a, oop, ams, begin, msz, vsz);
    const int ntp = nt.param, ntm = nt.moments, ntc = nt.copy;
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t i = begin; i + 32 <= end; i += 32) {
        /* [4]: E, O of elements i..i+15, then of i+16..i+31 */
        __m256 p[4], g[4], m[4], v[4], x[4], pn[4], mi[4], vi[4], vv[4];
        const int64_t ahead = i + 512;
        _mm_prefetch((const char *)((const char *)a->exp_avg + ahead * msz), _MM_HINT_T0);
        _mm_prefetch((const char *)((const char *)a->exp_avg_sq + ahead * vsz), _MM_HINT_T0);
        _mm_prefetch((const char *)((const char *)a->grad + ahead * (gdt == DT_F32 ? 4 : 2)), _MM_HINT_T0);
        if (rem) {
            _mm_prefetch((const char *)(p16 + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(rin + ahead), _MM_HINT_T0);
            decode16_eo(p16, rin, i, &p[0], &p[1]);
            decode16_eo(p16, rin, i + 16, &p[2], &p[3]);
        } else {
            _mm_prefetch((const char *)(a->param + ahead), _MM_HINT_T0);
            load16_eo(a->param, DT_F32, i, &p[0], &p[1]);
            load16_eo(a->param, DT_F32, i + 16, &p[2], &p[3]);
        }
        for (int h = 0; h < 2; h++) {
            const int64_t j = i + 16 * h;
            load16_eo(a->grad, gdt, j, &g[2 * h], &g[2 * h + 1]);
            load16_eo(a->exp_avg, mdt, j, &m[2 * h], &m[2 * h + 1]);
            load16_eo(a->exp_avg_sq, vdt, j, &v[2 * h], &v[2 * h + 1]);
            if (ams) load16_eo(a->max_exp_avg_sq, vdt, j, &x[2 * h], &x[2 * h + 1]);
            else x[2 * h] = x[2 * h + 1] = zero;
        }
        for (int q = 0; q < 4; q++) adam8(c, p[q], g[q], m[q], v[q], x[q], ams, &pn[q], &mi[q], &vi[q], &vv[q]);
        if (rem) {
            __m256i ph[2], rh[2];
            encode16_eo(pn[0], pn[1], &ph[0], &rh[0]);
            encode16_eo(pn[2], pn[3], &ph[1], &rh[1]);
            store_u16x32(po16 + i, ph[0], ph[1], ntp);
            store_u16x32(a->remainder_out + i, rh[0], rh[1], ntp);
        } else {
            store_f32_eo(a->param_out + i, pn[0], pn[1], ntp);
            store_f32_eo(a->param_out + i + 16, pn[2], pn[3], ntp);
        }
        /* NaN anywhere in what is rounded to bf16 here: one unordered compare per pair */
        __m256 un = zero;
        for (int q = 0; q < 4; q++) {
            un = _mm256_or_ps(un, _mm256_cmp_ps(mi[q], vi[q], _CMP_UNORD_Q));
            if (ams) un = _mm256_or_ps(un, _mm256_cmp_ps(vv[q], vv[q], _CMP_UNORD_Q));
            if (cp) un = _mm256_or_ps(un, _mm256_cmp_ps(pn[q], pn[q], _CMP_UNORD_Q));
        }
        if (_mm256_testz_ps(un, un)) {
            store_moment32(a->exp_avg_out, mdt, i, mi, ntm, 0);
            store_moment32(a->exp_avg_sq_out, vdt, i, vi, ntm, 0);
            if (ams) store_moment32(a->max_exp_avg_sq_out, vdt, i, vv, ntm, 0);
        } else {
            store_moment32(a->exp_avg_out, mdt, i, mi, ntm, 1);
            store_moment32(a->exp_avg_sq_out, vdt, i, vi, ntm, 1);
            if (ams) store_moment32(a->max_exp_avg_sq_out, vdt, i, vv, ntm, 1);
        }
        if (cp) {
            if (a->copy_dtype == DT_BF16) {
                const int nan = !_mm256_testz_ps(un, un);
                store_u16x32(cp + i, bf16_eo(pn[0], pn[1], nan), bf16_eo(pn[2], pn[3], nan), ntc);
            }
            else store_u16x32(cp + i, f16_eo(pn[0], pn[1]), f16_eo(pn[2], pn[3]), ntc);
        }
    }
}

/* 16 int32 lanes (values < 2^16) of x then y -> 16 u16 in order: packus interleaves the
 * 128-bit lanes (x0-3 y0-3 | x4-7 y4-7), the quad permute puts them back */
static inline __m256i pack16(__m256i x, __m256i y)
{
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(x, y), 0xD8);
}

/* to_bf16_8's rounding, left in int32 lanes for pack16 */
static inline __m256i bf16_bits_8(__m256 x)
{
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

/* 16 masters from 16 (param, remainder) pairs: the carry subtracted in 16-bit lanes, the
 * halves joined by unpack (inputs quad-permuted first so the unpacks come out in order) */
static inline void decode16_avx2(const uint16_t *p, const int16_t *r, int64_t j, __m256 *lo, __m256 *hi)
{
    const __m256i pp = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(p + j)), 0xD8);
    const __m256i rr = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(r + j)), 0xD8);
    const __m256i h = _mm256_sub_epi16(pp, _mm256_srli_epi16(rr, 15));
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(rr, h));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(rr, h));
}

static inline void store_f32x32(float *dst, const __m256 x[4], int nt)
{
    for (int q = 0; q < 4; q++) {
        if (nt) _mm256_stream_ps(dst + 8 * q, x[q]); else _mm256_storeu_ps(dst + 8 * q, x[q]);
    }
}

static inline void store_moment32_lin(void *dst, int dt, int64_t j, const __m256 x[4], int nt)
{
    if (dt == DT_F32) { store_f32x32((float *)dst + j, x, nt); return; }
    store_u16x32((uint16_t *)dst + j, pack16(bf16_bits_8(x[0]), bf16_bits_8(x[1])),
                 pack16(bf16_bits_8(x[2]), bf16_bits_8(x[3])), nt);
}

/* the loop in element order, for fp32 moments or an fp32 master, whose gathers / scatters
 * cost the even/odd loop more than its 16-bit streams save (in L2: 0.9x) */
static inline __attribute__((always_inline)) void adam_c16_body_lin(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end, const int mdt, const int vdt)
{
    const int ams = c->amsgrad, oop = c->out_of_place, gdt = a->grad_dtype;
    const int msz = mdt == DT_F32 ? 4 : 2, vsz = vdt == DT_F32 ? 4 : 2;
    const uint16_t *p16 = (const uint16_t *)(const void *)a->param;
    const int16_t *rin = a->remainder;
    const int rem = rin != NULL;
    uint16_t *po16 = (uint16_t *)(void *)a->param_out;
    uint16_t *cp = (uint16_t *)a->param_copy;
    const nt_streams_t nt = nt_streams(a, oop, ams, begin, msz, vsz);
    const int ntp = nt.param, ntm = nt.moments, ntc = nt.copy;
    const __m256 zero = _mm256_setzero_ps();
    const __m256i one = _mm256_set1_epi32(1), low = _mm256_set1_epi32(0xffff);
    for (int64_t i = begin; i + 32 <= end; i += 32) {
        __m256 p[4], pn[4], mi[4], vi[4], vv[4];
        const int64_t ahead = i + 512;
        _mm_prefetch((const char *)((const char *)a->exp_avg + ahead * msz), _MM_HINT_T0);
        _mm_prefetch((const char *)((const char *)a->exp_avg_sq + ahead * vsz), _MM_HINT_T0);
        _mm_prefetch((const char *)((const char *)a->grad + ahead * (gdt == DT_F32 ? 4 : 2)), _MM_HINT_T0);
        if (rem) {
            _mm_prefetch((const char *)(p16 + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(rin + ahead), _MM_HINT_T0);
            decode16_avx2(p16, rin, i, &p[0], &p[1]);
            decode16_avx2(p16, rin, i + 16, &p[2], &p[3]);
        } else {
            _mm_prefetch((const char *)(a->param + ahead), _MM_HINT_T0);
            for (int q = 0; q < 4; q++) p[q] = _mm256_loadu_ps(a->param + i + 8 * q);
        }
        for (int q = 0; q < 4; q++) {
            const int64_t j = i + 8 * q;
            adam8(c, p[q], load8(a->grad, gdt, j), load8(a->exp_avg, mdt, j), load8(a->exp_avg_sq, vdt, j),
                  ams ? load8(a->max_exp_avg_sq, vdt, j) : zero, ams, &pn[q], &mi[q], &vi[q], &vv[q]);
        }
        if (rem) {
            __m256i ph[4], rh[4];
            for (int q = 0; q < 4; q++) {
                const __m256i u = _mm256_castps_si256(pn[q]);
                ph[q] = _mm256_and_si256(_mm256_add_epi32(_mm256_srli_epi32(u, 16),
                                                          _mm256_and_si256(_mm256_srli_epi32(u, 15), one)), low);
                rh[q] = _mm256_and_si256(u, low);
            }
            store_u16x32(po16 + i, pack16(ph[0], ph[1]), pack16(ph[2], ph[3]), ntp);
            store_u16x32(a->remainder_out + i, pack16(rh[0], rh[1]), pack16(rh[2], rh[3]), ntp);
        } else {
            store_f32x32(a->param_out + i, pn, ntp);
        }
        store_moment32_lin(a->exp_avg_out, mdt, i, mi, ntm);
        store_moment32_lin(a->exp_avg_sq_out, vdt, i, vi, ntm);
        if (ams) store_moment32_lin(a->max_exp_avg_sq_out, vdt, i, vv, ntm);
        if (cp) {
            __m256i h[2];
            for (int q = 0; q < 2; q++)
                h[q] = a->copy_dtype == DT_BF16
                    ? pack16(bf16_bits_8(pn[2 * q]), bf16_bits_8(pn[2 * q + 1]))
                    : _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtps_ph(pn[2 * q], _MM_FROUND_TO_NEAREST_INT)),
                                              _mm256_cvtps_ph(pn[2 * q + 1], _MM_FROUND_TO_NEAREST_INT), 1);
            store_u16x32(cp + i, h[0], h[1], ntc);
        }
    }
}

static void adam_c16_regs(const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end)
{
    const int mb = a->moment_dtype == DT_BF16, vb = a->exp_avg_sq_dtype == DT_BF16;
    if (mb && vb && a->remainder) adam_c16_body(a, c, begin, end, DT_BF16, DT_BF16);
    else if (mb && vb) adam_c16_body_lin(a, c, begin, end, DT_BF16, DT_BF16);
    else if (mb) adam_c16_body_lin(a, c, begin, end, DT_BF16, DT_F32);
    else if (vb) adam_c16_body_lin(a, c, begin, end, DT_F32, DT_BF16);
    else adam_c16_body_lin(a, c, begin, end, DT_F32, DT_F32);
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

#include "adam_body.h"

#else  /* not x86: never dispatched to */
void adam_range_avx2(const adam_args_t *a, const adam_consts_t *c, int64_t b, int64_t e) { (void)a; (void)c; (void)b; (void)e; }
void grad_chunk_sums_avx2(const void *g, int dt, int64_t n, int64_t c0, int64_t c1, double *p) { (void)g; (void)dt; (void)n; (void)c0; (void)c1; (void)p; }
void bw_inplace_avx2(float *p, const float *g, float *m, float *v, int64_t b, int64_t e) { (void)p; (void)g; (void)m; (void)v; (void)b; (void)e; }
void remainder_encode_avx2(const float *m, uint16_t *p, int16_t *r, int64_t b, int64_t e) { (void)m; (void)p; (void)r; (void)b; (void)e; }
void remainder_decode_avx2(const uint16_t *p, const int16_t *r, float *m, int64_t b, int64_t e) { (void)p; (void)r; (void)m; (void)b; (void)e; }
#endif
