/* cpu_kernels, AVX-512 level (F, BW, VL, DQ). */
#include "kernels.h"
#define LEVEL avx512
#define LEVEL_HAS_FMA 1

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

static inline __m512 load16(const void *src, int dt, int64_t i)
{
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)src + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
    if (dt == DT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void load_block(float *dst, const void *src, int dt, int64_t off, int len, float scale)
{
    const __m512 s = _mm512_set1_ps(scale);
    int i = 0;
    for (; i + 16 <= len; i += 16) _mm512_store_ps(dst + i, _mm512_mul_ps(load16(src, dt, off + i), s));
    for (; i < len; i++) dst[i] = load_scalar(src, dt, off + i) * scale;
}

/* 16 floats -> 16 bf16, torch's rounding: nearest even, NaN -> 0x7FC0 */
static inline __m256i to_bf16_16(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

static inline void store_block(void *dst, int dt, int64_t off, const float *src, int len, int nt)
{
    int i = 0;
    if (dt == DT_F32) {
        float *d = (float *)dst + off;
        if (nt) {
            for (; i < len && ((uintptr_t)(d + i) & 63); i++) d[i] = src[i];
            for (; i + 16 <= len; i += 16) _mm512_stream_ps(d + i, _mm512_loadu_ps(src + i));
        } else {
            for (; i + 16 <= len; i += 16) _mm512_storeu_ps(d + i, _mm512_loadu_ps(src + i));
        }
        for (; i < len; i++) d[i] = src[i];
        return;
    }
    uint16_t *d = (uint16_t *)dst + off;
    for (; i < len && nt && ((uintptr_t)(d + i) & 31); i++) store_scalar(dst, dt, off + i, src[i]);
    const int aligned = nt && !((uintptr_t)(d + i) & 31);
    for (; i + 16 <= len; i += 16) {
        __m512 x = _mm512_loadu_ps(src + i);
        __m256i h = dt == DT_BF16 ? to_bf16_16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (aligned) _mm256_stream_si256((__m256i *)(d + i), h);
        else _mm256_storeu_si256((__m256i *)(d + i), h);
    }
    for (; i < len; i++) store_scalar(dst, dt, off + i, src[i]);
}

static inline void finish_stores(void) { _mm_sfence(); }

/* remainders, 16 at a time: decode = ((p - carry) << 16) | r, the shift dropping what the
 * 16-bit wrap-around drops; encode narrows with vpmovdw, which truncates to the low half */
static inline __m512 decode16(const uint16_t *p, const int16_t *r, int64_t i)
{
    const __m512i pp = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + i)));
    const __m512i rr = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + i)));
    const __m512i hi = _mm512_sub_epi32(pp, _mm512_srli_epi32(rr, 15));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(hi, 16), rr));
}

static inline void decode_block(float *dst, const uint16_t *p, const int16_t *r, int64_t off, int len)
{
    int i = 0;
    for (; i + 16 <= len; i += 16) _mm512_storeu_ps(dst + i, decode16(p, r, off + i));
    for (; i < len; i++) dst[i] = remainder_decode(p[off + i], (uint16_t)r[off + i]);
}

static inline void encode_block(uint16_t *p, int16_t *r, int64_t off, const float *src, int len, int nt)
{
    int i = 0;
    uint16_t *dp = p + off;
    int16_t *dr = r + off;
    for (; i < len && nt && ((uintptr_t)(dp + i) & 31); i++) {
        const uint32_t u = f32_bits(src[i]);
        dp[i] = remainder_param_bits(u);
        dr[i] = (int16_t)(uint16_t)u;
    }
    const int ntp = nt && !((uintptr_t)(dp + i) & 31), ntr = nt && !((uintptr_t)(dr + i) & 31);
    const __m512i one = _mm512_set1_epi32(1);
    for (; i + 16 <= len; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
        const __m512i hi = _mm512_add_epi32(_mm512_srli_epi32(u, 16),
                                            _mm512_and_si512(_mm512_srli_epi32(u, 15), one));
        const __m256i ph = _mm512_cvtepi32_epi16(hi), rh = _mm512_cvtepi32_epi16(u);
        if (ntp) _mm256_stream_si256((__m256i *)(dp + i), ph); else _mm256_storeu_si256((__m256i *)(dp + i), ph);
        if (ntr) _mm256_stream_si256((__m256i *)(dr + i), rh); else _mm256_storeu_si256((__m256i *)(dr + i), rh);
    }
    for (; i < len; i++) {
        const uint32_t u = f32_bits(src[i]);
        dp[i] = remainder_param_bits(u);
        dr[i] = (int16_t)(uint16_t)u;
    }
}

/* fp32 state, AVX-512: the Adam math in registers, every output stored from them —
 * non-temporal in bank mode where aligned, so a spare bank is written without being read
 * first and without an L1 round trip. Full vectors unmasked; the tail runs the same
 * arithmetic under a mask. */
#define HAVE_ADAM_F32_REGS 1
typedef struct {
    __m512 w1, b2, w2, eps, nss, ib, decay, wd, gs;
    int l2, ams;
} regs_consts_t;

static inline __attribute__((always_inline)) void adam16(
    const regs_consts_t *k, __m512 p, __m512 g, __m512 m0, __m512 v0, __m512 x0,
    __m512 *pn, __m512 *mi, __m512 *vi, __m512 *vv)
{
    __m512 gi = _mm512_mul_ps(g, k->gs);
    if (k->l2) gi = _mm512_fmadd_ps(k->wd, p, gi);
    *mi = _mm512_fmadd_ps(k->w1, _mm512_sub_ps(gi, m0), m0);
    *vi = _mm512_fmadd_ps(k->w2, _mm512_mul_ps(gi, gi), _mm512_mul_ps(v0, k->b2));
    *vv = k->ams ? _mm512_max_ps(x0, *vi) : *vi;  /* (vmax > v) ? vmax : v */
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(*vv), k->ib, k->eps);
    *pn = _mm512_fmadd_ps(p, k->decay, _mm512_mul_ps(k->nss, _mm512_div_ps(*mi, denom)));
}

static inline __attribute__((always_inline)) void store_state16(
    float *po, float *mo, float *vo, float *xo, __m512 p, __m512 m, __m512 v, __m512 x, int ntp, int ntm)
{
    if (ntp) _mm512_stream_ps(po, p); else _mm512_storeu_ps(po, p);
    if (ntm) {
        _mm512_stream_ps(mo, m);
        _mm512_stream_ps(vo, v);
        if (xo) _mm512_stream_ps(xo, x);
    } else {
        _mm512_storeu_ps(mo, m);
        _mm512_storeu_ps(vo, v);
        if (xo) _mm512_storeu_ps(xo, x);
    }
}

static inline __m256i to_copy16(__m512 x, int dt)
{
    return dt == DT_BF16 ? to_bf16_16(x) : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

#define HYBRID_PF 256  /* floats ahead */

static inline void adam_f32_regs(const float *pin, const float *g, const float *m, const float *v,
                                 const float *vmax, float *po, float *mo, float *vo, float *xo,
                                 void *copy, int copy_dt, int64_t off, int len,
                                 const adam_consts_t *c, int nt_p, int nt_m)
{
    regs_consts_t k = {_mm512_set1_ps(c->one_minus_beta1), _mm512_set1_ps(c->beta2),
                       _mm512_set1_ps(c->one_minus_beta2), _mm512_set1_ps(c->eps),
                       _mm512_set1_ps(c->neg_step_size), _mm512_set1_ps(c->inv_bias_correction2_sqrt),
                       _mm512_set1_ps(c->decay), _mm512_set1_ps(c->l2), _mm512_set1_ps(c->grad_scale),
                       c->l2_mode, vmax != NULL};
    const int ams = vmax != NULL;
    const int ntp = nt_p && !((uintptr_t)po & 63);
    const int ntm = nt_m && !((uintptr_t)mo & 63) && !((uintptr_t)vo & 63) && (!ams || !((uintptr_t)xo & 63));
    uint16_t *cp = copy ? (uint16_t *)copy + off : NULL;
    const int ntc = cp && !((uintptr_t)cp & 63);
    const __m512 zero = _mm512_setzero_ps();
    int i = 0;
    /* 32 at a time: two copies' halves make one full 64-byte line, so its non-temporal
     * store fills a whole write-combining buffer (half lines stall the other streams) */
    for (; i + 32 <= len; i += 32) {
        __m512 pn[2], mi, vi, vv;
        /* software prefetch 1 KiB ahead on the four read streams: with three non-temporal
         * write streams beside them the hardware prefetcher alone leaves bank mode ~10 %
         * below the pattern's own bandwidth here (A/B on the same run: 0.82-0.89 -> 0.91-0.98
         * of the bank-pattern probe); prefetches past the end never fault */
        _mm_prefetch((const char *)(pin + i + HYBRID_PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(pin + i + HYBRID_PF + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(g + i + HYBRID_PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(g + i + HYBRID_PF + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(m + i + HYBRID_PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(m + i + HYBRID_PF + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + i + HYBRID_PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + i + HYBRID_PF + 16), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            const int j = i + 16 * h;
            adam16(&k, _mm512_loadu_ps(pin + j), _mm512_loadu_ps(g + j), _mm512_loadu_ps(m + j),
                   _mm512_loadu_ps(v + j), ams ? _mm512_loadu_ps(vmax + j) : zero, &pn[h], &mi, &vi, &vv);
            store_state16(po + j, mo + j, vo + j, ams ? xo + j : NULL, pn[h], mi, vi, vv, ntp, ntm);
        }
        if (cp) {
            const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(to_copy16(pn[0], copy_dt)),
                                                    to_copy16(pn[1], copy_dt), 1);
            if (ntc) _mm512_stream_si512((__m512i *)(cp + i), line);
            else _mm512_storeu_si512(cp + i, line);
        }
    }
    for (; i + 16 <= len; i += 16) {
        __m512 pn, mi, vi, vv;
        adam16(&k, _mm512_loadu_ps(pin + i), _mm512_loadu_ps(g + i), _mm512_loadu_ps(m + i),
               _mm512_loadu_ps(v + i), ams ? _mm512_loadu_ps(vmax + i) : zero, &pn, &mi, &vi, &vv);
        store_state16(po + i, mo + i, vo + i, ams ? xo + i : NULL, pn, mi, vi, vv, ntp, ntm);
        if (cp) _mm256_storeu_si256((__m256i *)(cp + i), to_copy16(pn, copy_dt));
    }
    if (i < len) {
        const __mmask16 km = (__mmask16)((1u << (len - i)) - 1);
        __m512 pn, mi, vi, vv;
        adam16(&k, _mm512_maskz_loadu_ps(km, pin + i), _mm512_maskz_loadu_ps(km, g + i),
               _mm512_maskz_loadu_ps(km, m + i), _mm512_maskz_loadu_ps(km, v + i),
               ams ? _mm512_maskz_loadu_ps(km, vmax + i) : zero, &pn, &mi, &vi, &vv);
        _mm512_mask_storeu_ps(po + i, km, pn);
        _mm512_mask_storeu_ps(mo + i, km, mi);
        _mm512_mask_storeu_ps(vo + i, km, vi);
        if (ams) _mm512_mask_storeu_ps(xo + i, km, vv);
        if (cp) _mm256_mask_storeu_epi16(cp + i, km, to_copy16(pn, copy_dt));
    }
}

/* Compressed state (bf16 moments and/or remainders), AVX-512: every stream loaded, widened,
 * stepped (adam16: the same arithmetic, FMA for FMA), rounded and stored from registers, 32
 * elements at a time so each 16-bit output leaves as whole 64-byte lines (non-temporal in
 * bank mode where aligned). Through L1 blocks this path was ~0.65x the fp32 path's compute
 * rate in L2 (below what 18 B/element at memory speed needs); adam_range runs it over the
 * multiple of 32 and leaves the tail to the block path, which rounds identically.
 * 512-bit code issues on two vector ports only, and this loop is bound by them, not by
 * memory, at 18 B/element (in L2, one thread, 64Ki elements: 0.70x the elements/s of the
 * fp32-state loop with vpmovdw packing and integer rounding, 1.05x as it is now), so its
 * 16-bit packing uses the fewest shuffles: a 32-lane 16-bit vector is split or joined by
 * one vpermw per 16 dwords plus a 128-bit shuffle (vpmovdw costs two uops for half the
 * work), and on CPUs with AVX-512 BF16 two moment halves are rounded and packed by one
 * vcvtne2ps2bf16 — whose results differ from round-to-nearest-even only for NaN and
 * subnormal inputs (payload kept, flushed to zero): a 32-element step holding any of those
 * (vfpclassps, one test) takes the integer rounding instead, so the bits never depend on it. */
#define HAVE_ADAM_C16_REGS 1

static inline __m512i join_lines(__m256i lo, __m256i hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline void store_line(void *dst, __m512i x, int nt)
{
    if (nt) _mm512_stream_si512((__m512i *)dst, x); else _mm512_storeu_si512(dst, x);
}

static inline void store_f32x2(float *dst, __m512 x0, __m512 x1, int nt)
{
    if (nt) { _mm512_stream_ps(dst, x0); _mm512_stream_ps(dst + 16, x1); }
    else { _mm512_storeu_ps(dst, x0); _mm512_storeu_ps(dst + 16, x1); }
}

/* vpermw index: a vector's 16 high words to its lower 256 bits, its 16 low words above */
static const uint16_t SPLIT_WORDS[32] __attribute__((aligned(64))) = {
    1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
    0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};

/* 32 dwords (a: elements 0-15, b: 16-31) -> their high and low 16-bit halves, in order */
static inline __attribute__((always_inline)) void split_words32(__m512i a, __m512i b, __m512i *hi, __m512i *lo)
{
    const __m512i idx = _mm512_load_si512((const void *)SPLIT_WORDS);
    const __m512i x = _mm512_permutexvar_epi16(idx, a), y = _mm512_permutexvar_epi16(idx, b);
    *hi = _mm512_shuffle_i64x2(x, y, _MM_SHUFFLE(1, 0, 1, 0));
    if (lo) *lo = _mm512_shuffle_i64x2(x, y, _MM_SHUFFLE(3, 2, 3, 2));
}

/* to_bf16_16's rounding with the result left in each dword's high half */
static inline __attribute__((always_inline)) __m512i bf16_high_bits(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}

/* 32 floats (x0: elements 0-15, x1: 16-31) -> 32 bf16 in order, torch's rounding */
static inline __attribute__((always_inline)) __m512i to_bf16_32(__m512 x0, __m512 x1)
{
    __m512i hi;
    split_words32(bf16_high_bits(x0), bf16_high_bits(x1), &hi, NULL);
    return hi;
}

#if defined(__GNUC__) && (__GNUC__ >= 10 || defined(__clang__))
#define HAVE_BF16_INSN 1
/* the same bits through vcvtne2ps2bf16 where no input is a NaN or subnormal (see above) */
static inline __attribute__((target("avx512bf16"))) __m512i to_bf16_32_insn(__m512 x0, __m512 x1)
{
    /* NaN or subnormal anywhere: kortest, no mask moved to a general register */
    if (__builtin_expect(!_kortestz_mask16_u8(_mm512_fpclass_ps_mask(x0, 0xA1), _mm512_fpclass_ps_mask(x1, 0xA1)), 0))
        return to_bf16_32(x0, x1);
    return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
}
#endif

/* a moment pair (two 16-lane halves) out in the moment dtype; insn: vcvtne2ps2bf16 allowed */
static inline __attribute__((always_inline)) void store_moment32(void *dst, int dt, int64_t j, __m512 x0,
                                                                 __m512 x1, int nt, const int insn)
{
    if (dt == DT_F32) { store_f32x2((float *)dst + j, x0, x1, nt); return; }
#ifdef HAVE_BF16_INSN
    if (insn) { store_line((uint16_t *)dst + j, to_bf16_32_insn(x0, x1), nt); return; }
#endif
    store_line((uint16_t *)dst + j, to_bf16_32(x0, x1), nt);
}

/* 32 masters from 32 (param, remainder) pairs: the carry subtracted in 16-bit lanes, then
 * the halves interleaved by unpack, the inputs quad-permuted first so that 128-bit lane k
 * holds elements 4k..4k+3 and 16+4k..16+4k+3 and the unpacks come out in order */
static inline __attribute__((always_inline)) void decode32(const uint16_t *p, const int16_t *r, int64_t j,
                                                           __m512 *m0, __m512 *m1)
{
    const __m512i q = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
    const __m512i pp = _mm512_permutexvar_epi64(q, _mm512_loadu_si512((const void *)(p + j)));
    const __m512i rr = _mm512_permutexvar_epi64(q, _mm512_loadu_si512((const void *)(r + j)));
    const __m512i h = _mm512_sub_epi16(pp, _mm512_srli_epi16(rr, 15));
    *m0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(rr, h));
    *m1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(rr, h));
}

/* 32 bf16 -> 32 floats in order (lo: elements 0-15, hi: 16-31): decode32's quad permute,
 * then unpacks against zero put each value in a dword's high half (3 shuffles per 32, where
 * vpmovzxwd + vpslld take 4 uops) */
static inline __attribute__((always_inline)) void load_bf16x32(const void *src, int64_t j, __m512 *lo, __m512 *hi)
{
    const __m512i q = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
    const __m512i x = _mm512_permutexvar_epi64(q, _mm512_loadu_si512((const void *)((const uint16_t *)src + j)));
    *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), x));
    *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), x));
}

/* 32 values of a stream in dtype dt as two 16-lane halves */
static inline __attribute__((always_inline)) void load32(const void *src, int dt, int64_t j, __m512 x[2])
{
    if (dt == DT_BF16) { load_bf16x32(src, j, &x[0], &x[1]); return; }
    x[0] = load16(src, dt, j);
    x[1] = load16(src, dt, j + 16);
}


/* The register loop prefetches each stream C16_AHEAD elements ahead (1 KiB of a 16-bit stream, 2 of
 * an fp32 one), both lines of an fp32 stream's 32 elements: with one, the rows with an fp32 stream
 * beside 16-bit ones ran at 82-89 % of their roof on an Intel Xeon, with both at 99-105 % (0.82-0.84x
 * the time; 1024 ahead the same). */
#ifndef C16_AHEAD
#define C16_AHEAD 512
#endif
/* the lines of 32 elements of a stream of sz bytes an element (one, or two for fp32) at element i;
 * always_inline, as adam_body.h's prefetch_block */
static inline __attribute__((always_inline)) void prefetch32(const void *stream, const int sz, int64_t i)
{
    const char *q = (const char *)stream + i * sz;
    _mm_prefetch(q, _MM_HINT_T0);
    if (sz == 4) _mm_prefetch(q + 64, _MM_HINT_T0);
}

/* one instance per (exp_avg dtype, exp_avg_sq dtype, bf16 instruction) triple: all three
 * are constants in each, so the loop holds no dtype branches (the pair is fixed for a call) */
static inline __attribute__((always_inline)) void adam_c16_body(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end, const int mdt, const int vdt,
    const int insn)
{
    const regs_consts_t k = {_mm512_set1_ps(c->one_minus_beta1), _mm512_set1_ps(c->beta2),
                             _mm512_set1_ps(c->one_minus_beta2), _mm512_set1_ps(c->eps),
                             _mm512_set1_ps(c->neg_step_size), _mm512_set1_ps(c->inv_bias_correction2_sqrt),
                             _mm512_set1_ps(c->decay), _mm512_set1_ps(c->l2), _mm512_set1_ps(c->grad_scale),
                             c->l2_mode, c->amsgrad};
    const int ams = c->amsgrad, oop = c->out_of_place, gdt = a->grad_dtype;
    const int msz = mdt == DT_F32 ? 4 : 2, vsz = vdt == DT_F32 ? 4 : 2;
    const uint16_t *p16 = (const uint16_t *)(const void *)a->param;
    const int16_t *rin = a->remainder;
    const int rem = rin != NULL;
    uint16_t *po16 = (uint16_t *)(void *)a->param_out;
    uint16_t *cp = (uint16_t *)a->param_copy;
    /* non-temporal stores where a stream starts line-aligned (kernels.h nt_streams) */
    const nt_streams_t nt = nt_streams(a, oop, ams, begin, msz, vsz);
    const int ntp = nt.param, ntm = nt.moments, ntc = nt.copy;
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t i = begin; i + 32 <= end; i += 32) {
        __m512 p[2], pn[2], mi[2], vi[2], vv[2];
        const int64_t ahead = i + C16_AHEAD;
        prefetch32(a->exp_avg, msz, ahead);
        prefetch32(a->exp_avg_sq, vsz, ahead);
        prefetch32(a->grad, gdt == DT_F32 ? 4 : 2, ahead);
        if (ams) prefetch32(a->max_exp_avg_sq, vsz, ahead);
        if (rem) {
            prefetch32(p16, 2, ahead);
            prefetch32(rin, 2, ahead);
            decode32(p16, rin, i, &p[0], &p[1]);
        } else {
            prefetch32(a->param, 4, ahead);
            p[0] = _mm512_loadu_ps(a->param + i);
            p[1] = _mm512_loadu_ps(a->param + i + 16);
        }
        __m512 g[2], m[2], v[2], x[2] = {zero, zero};
        load32(a->grad, gdt, i, g);
        load32(a->exp_avg, mdt, i, m);
        load32(a->exp_avg_sq, vdt, i, v);
        if (ams) load32(a->max_exp_avg_sq, vdt, i, x);
        for (int h = 0; h < 2; h++)
            adam16(&k, p[h], g[h], m[h], v[h], x[h], &pn[h], &mi[h], &vi[h], &vv[h]);
        if (rem) {  /* remainder = the low halves; param = the high halves + their carry */
            __m512i hi, lo;
            split_words32(_mm512_castps_si512(pn[0]), _mm512_castps_si512(pn[1]), &hi, &lo);
            store_line(po16 + i, _mm512_add_epi16(hi, _mm512_srli_epi16(lo, 15)), ntp);
            store_line(a->remainder_out + i, lo, ntp);
        } else {
            store_f32x2(a->param_out + i, pn[0], pn[1], ntp);
        }
        store_moment32(a->exp_avg_out, mdt, i, mi[0], mi[1], ntm, insn);
        store_moment32(a->exp_avg_sq_out, vdt, i, vi[0], vi[1], ntm, insn);
        if (ams) store_moment32(a->max_exp_avg_sq_out, vdt, i, vv[0], vv[1], ntm, insn);
        if (cp) {
            if (a->copy_dtype == DT_BF16) store_moment32(cp, DT_BF16, i, pn[0], pn[1], ntc, insn);
            else store_line(cp + i, join_lines(to_copy16(pn[0], DT_F16), to_copy16(pn[1], DT_F16)), ntc);
        }
    }
}

#define C16_INSTANCES(insn)                                                                   \
    do {                                                                                      \
        const int mb = a->moment_dtype == DT_BF16, vb = a->exp_avg_sq_dtype == DT_BF16;      \
        if (mb && vb) adam_c16_body(a, c, begin, end, DT_BF16, DT_BF16, insn);                \
        else if (mb) adam_c16_body(a, c, begin, end, DT_BF16, DT_F32, insn);                  \
        else if (vb) adam_c16_body(a, c, begin, end, DT_F32, DT_BF16, insn);                  \
        else adam_c16_body(a, c, begin, end, DT_F32, DT_F32, insn);                           \
    } while (0)

/* whether the register loop may use vcvtne2ps2bf16: -1 until first asked (the CPU decides),
 * then 0 / 1; hybrid_set_avx512_bf16 turns it off (tests of the integer rounding) or on */
static int g_bf16_insn = -1;

static int bf16_insn_supported(void)
{
#ifdef HAVE_BF16_INSN
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
#else
    return 0;
#endif
}

int hybrid_set_avx512_bf16(int on)
{
    if (on && !bf16_insn_supported()) return -1;
    g_bf16_insn = on ? 1 : 0;
    return 0;
}

int hybrid_get_avx512_bf16(void)
{
    if (g_bf16_insn < 0) g_bf16_insn = bf16_insn_supported();
    return g_bf16_insn;
}

#ifdef HAVE_BF16_INSN
static __attribute__((target("avx512bf16"), noinline)) void adam_c16_insn(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end)
{
    C16_INSTANCES(1);
}
#endif

static void adam_c16_regs(const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end)
{
#ifdef HAVE_BF16_INSN
    if (hybrid_get_avx512_bf16()) { adam_c16_insn(a, c, begin, end); return; }
#endif
    C16_INSTANCES(0);
}

static inline void chunk_sumsq(const void *g, int dt, int64_t off, int64_t len, double *lanes)
{
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512 x = load16(g, dt, off + i);
        const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
        const __m512d x1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
        lo = _mm512_fmadd_pd(x0, x0, lo);
        hi = _mm512_fmadd_pd(x1, x1, hi);
    }
    _mm512_storeu_pd(lanes, lo);
    _mm512_storeu_pd(lanes + 8, hi);
    for (int l = 0; i < len; i++, l++) {
        const double x = (double)load_scalar(g, dt, off + i);
        lanes[l] += x * x;
    }
}

/* The roofline probes (adam_body.h): Adam's streams moved as the fp32 register loop moves
 * them, 32 elements a step (two lines of each stream), software prefetch 1 KiB ahead on the
 * four read streams, bank mode's three outputs written non-temporal where aligned. A plain
 * loop left torch's fused AdamW at up to 1.5x "the roof" at one thread on an AVX2 host: the
 * probe has to be the best this core does with Adam's pattern, or % of roof means nothing. */
#define HAVE_BW_REGS 1

static inline void bw_prefetch(const float *p, const float *g, const float *m, const float *v, int64_t i)
{
    for (int h = 0; h < 32; h += 16) {
        _mm_prefetch((const char *)(p + i + HYBRID_PF + h), _MM_HINT_T0);
        _mm_prefetch((const char *)(g + i + HYBRID_PF + h), _MM_HINT_T0);
        _mm_prefetch((const char *)(m + i + HYBRID_PF + h), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + i + HYBRID_PF + h), _MM_HINT_T0);
    }
}

void bw_inplace_avx512(float *p, const float *g, float *m, float *v, int64_t b, int64_t e)
{
    const __m512 s = _mm512_set1_ps(0.999f);
    int64_t i = b;
    for (; i + 32 <= e; i += 32) {
        bw_prefetch(p, g, m, v, i);
        for (int64_t j = i; j < i + 32; j += 16) {
            const __m512 gj = _mm512_loadu_ps(g + j);
            _mm512_storeu_ps(p + j, _mm512_fmadd_ps(_mm512_loadu_ps(p + j), s, gj));
            _mm512_storeu_ps(m + j, _mm512_fmadd_ps(_mm512_loadu_ps(m + j), s, gj));
            _mm512_storeu_ps(v + j, _mm512_fmadd_ps(_mm512_loadu_ps(v + j), s, gj));
        }
    }
    for (; i < e; i++) {
        p[i] = __builtin_fmaf(p[i], 0.999f, g[i]);
        m[i] = __builtin_fmaf(m[i], 0.999f, g[i]);
        v[i] = __builtin_fmaf(v[i], 0.999f, g[i]);
    }
}

void bw_bank_avx512(const float *p, const float *g, const float *m, const float *v,
                    float *po, float *mo, float *vo, int64_t b, int64_t e)
{
    const __m512 s = _mm512_set1_ps(0.999f);
    const int nt = LINE_ALIGNED(po + b) && LINE_ALIGNED(mo + b) && LINE_ALIGNED(vo + b);
    int64_t i = b;
    for (; i + 32 <= e; i += 32) {
        bw_prefetch(p, g, m, v, i);
        for (int64_t j = i; j < i + 32; j += 16) {
            const __m512 gj = _mm512_loadu_ps(g + j);
            const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(p + j), s, gj);
            const __m512 y = _mm512_fmadd_ps(_mm512_loadu_ps(m + j), s, gj);
            const __m512 z = _mm512_fmadd_ps(_mm512_loadu_ps(v + j), s, gj);
            store_state16(po + j, mo + j, vo + j, NULL, x, y, z, z, nt, nt);
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
 * Intel CPUs (kernels.h, hybrid_get_block_prefetch): on an Intel Xeon (16 Mi elements, in-process
 * A/B) fp32 state stepped in 0.85-0.92x the time with fp32 or bf16 grads, 256 and 512 alike
 * (docs/kernels.md, "Software prefetch of the fp32 streams") */
#ifndef BLOCK_AHEAD
#define BLOCK_AHEAD 512
#endif
#include "adam_body.h"

#else  /* not x86-64: never dispatched to */
void bw_bank_avx512(const float *p, const float *g, const float *m, const float *v,
                    float *po, float *mo, float *vo, int64_t b, int64_t e)
{ (void)p; (void)g; (void)m; (void)v; (void)po; (void)mo; (void)vo; (void)b; (void)e; }
void adam_range_avx512(const adam_args_t *a, const adam_consts_t *c, int64_t b, int64_t e) { (void)a; (void)c; (void)b; (void)e; }
void grad_chunk_sums_avx512(const void *g, int dt, int64_t n, int64_t c0, int64_t c1, double *p) { (void)g; (void)dt; (void)n; (void)c0; (void)c1; (void)p; }
void bw_inplace_avx512(float *p, const float *g, float *m, float *v, int64_t b, int64_t e) { (void)p; (void)g; (void)m; (void)v; (void)b; (void)e; }
void remainder_encode_avx512(const float *m, uint16_t *p, int16_t *r, int64_t b, int64_t e) { (void)m; (void)p; (void)r; (void)b; (void)e; }
void remainder_decode_avx512(const uint16_t *p, const int16_t *r, float *m, int64_t b, int64_t e) { (void)p; (void)r; (void)m; (void)b; (void)e; }
uint32_t bw_pattern_avx512(void *const *ptrs, const int *bytes, const int *kinds, int ns, int64_t ahead, int64_t b, int64_t e)
{ (void)ptrs; (void)bytes; (void)kinds; (void)ns; (void)ahead; (void)b; (void)e; return 0; }
int hybrid_set_avx512_bf16(int on) { return on ? -1 : 0; }
int hybrid_get_avx512_bf16(void) { return 0; }
#endif
