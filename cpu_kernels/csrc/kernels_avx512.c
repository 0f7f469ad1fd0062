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
 * multiple of 32 and leaves the tail to the block path, which rounds identically. */
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

/* a moment pair (two 16-lane halves) out in the moment dtype */
static inline void store_moment32(void *dst, int dt, int64_t j, __m512 x0, __m512 x1, int nt)
{
    if (dt == DT_F32) store_f32x2((float *)dst + j, x0, x1, nt);
    else store_line((uint16_t *)dst + j, join_lines(to_bf16_16(x0), to_bf16_16(x1)), nt);
}

#define LINE_ALIGNED(p) (!((uintptr_t)(p) & 63))

/* one instance per (exp_avg dtype, exp_avg_sq dtype) pair: mdt and vdt are constants in
 * each, so the loop holds no dtype branches (the pair is fixed for a call) */
static inline __attribute__((always_inline)) void adam_c16_body(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end, const int mdt, const int vdt)
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
    /* streams start line-aligned at begin (a multiple of 16384 elements past the base) and
     * advance by whole lines: one check each decides for the whole range */
    const int ntp = oop && (rem ? LINE_ALIGNED(po16 + begin) && LINE_ALIGNED(a->remainder_out + begin)
                                : LINE_ALIGNED(a->param_out + begin));
    const int ntm = oop && LINE_ALIGNED((char *)a->exp_avg_out + begin * msz) &&
                    LINE_ALIGNED((char *)a->exp_avg_sq_out + begin * vsz) &&
                    (!ams || LINE_ALIGNED((char *)a->max_exp_avg_sq_out + begin * vsz));
    const int ntc = cp && LINE_ALIGNED(cp + begin);
    const __m512 zero = _mm512_setzero_ps();
    const __m512i one = _mm512_set1_epi32(1);
    for (int64_t i = begin; i + 32 <= end; i += 32) {
        __m512 pn[2], mi[2], vi[2], vv[2];
        const int64_t ahead = i + 512;  /* 1 KiB of a 16-bit stream */
        _mm_prefetch((const char *)((const char *)a->exp_avg + ahead * msz), _MM_HINT_T0);
        _mm_prefetch((const char *)((const char *)a->exp_avg_sq + ahead * vsz), _MM_HINT_T0);
        _mm_prefetch((const char *)((const char *)a->grad + ahead * (gdt == DT_F32 ? 4 : 2)), _MM_HINT_T0);
        if (rem) {
            _mm_prefetch((const char *)(p16 + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(rin + ahead), _MM_HINT_T0);
        } else {
            _mm_prefetch((const char *)(a->param + ahead), _MM_HINT_T0);
        }
        for (int h = 0; h < 2; h++) {
            const int64_t j = i + 16 * h;
            const __m512 p = rem ? decode16(p16, rin, j) : _mm512_loadu_ps(a->param + j);
            adam16(&k, p, load16(a->grad, gdt, j), load16(a->exp_avg, mdt, j),
                   load16(a->exp_avg_sq, vdt, j), ams ? load16(a->max_exp_avg_sq, vdt, j) : zero,
                   &pn[h], &mi[h], &vi[h], &vv[h]);
        }
        if (rem) {
            __m256i ph[2], rh[2];
            for (int h = 0; h < 2; h++) {
                const __m512i u = _mm512_castps_si512(pn[h]);
                ph[h] = _mm512_cvtepi32_epi16(_mm512_add_epi32(_mm512_srli_epi32(u, 16),
                                                               _mm512_and_si512(_mm512_srli_epi32(u, 15), one)));
                rh[h] = _mm512_cvtepi32_epi16(u);
            }
            store_line(po16 + i, join_lines(ph[0], ph[1]), ntp);
            store_line(a->remainder_out + i, join_lines(rh[0], rh[1]), ntp);
        } else {
            store_f32x2(a->param_out + i, pn[0], pn[1], ntp);
        }
        store_moment32(a->exp_avg_out, mdt, i, mi[0], mi[1], ntm);
        store_moment32(a->exp_avg_sq_out, vdt, i, vi[0], vi[1], ntm);
        if (ams) store_moment32(a->max_exp_avg_sq_out, vdt, i, vv[0], vv[1], ntm);
        if (cp) store_line(cp + i, join_lines(to_copy16(pn[0], a->copy_dtype), to_copy16(pn[1], a->copy_dtype)), ntc);
    }
}

static void adam_c16_regs(const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end)
{
    const int mb = a->moment_dtype == DT_BF16, vb = a->exp_avg_sq_dtype == DT_BF16;
    if (mb && vb) adam_c16_body(a, c, begin, end, DT_BF16, DT_BF16);
    else if (mb) adam_c16_body(a, c, begin, end, DT_BF16, DT_F32);
    else if (vb) adam_c16_body(a, c, begin, end, DT_F32, DT_BF16);
    else adam_c16_body(a, c, begin, end, DT_F32, DT_F32);
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

#include "adam_body.h"

/* The bank-mode roofline probe: Adam's bank-mode access pattern (read p, g, m, v; write
 * three other arrays with non-temporal stores) with none of its arithmetic. */
void bw_bank_avx512(const float *p, const float *g, const float *m, const float *v,
                    float *po, float *mo, float *vo, int64_t b, int64_t e)
{
    const __m512 s = _mm512_set1_ps(0.999f);
    const int nt = !((uintptr_t)(po + b) & 63) && !((uintptr_t)(mo + b) & 63) && !((uintptr_t)(vo + b) & 63);
    int64_t i = b;
    for (; i + 16 <= e; i += 16) {
        const __m512 gi = _mm512_loadu_ps(g + i);
        const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(p + i), s, gi);
        const __m512 y = _mm512_fmadd_ps(_mm512_loadu_ps(m + i), s, gi);
        const __m512 z = _mm512_fmadd_ps(_mm512_loadu_ps(v + i), s, gi);
        if (nt) {
            _mm512_stream_ps(po + i, x);
            _mm512_stream_ps(mo + i, y);
            _mm512_stream_ps(vo + i, z);
        } else {
            _mm512_storeu_ps(po + i, x);
            _mm512_storeu_ps(mo + i, y);
            _mm512_storeu_ps(vo + i, z);
        }
    }
    for (; i < e; i++) {
        po[i] = p[i] * 0.999f + g[i];
        mo[i] = m[i] * 0.999f + g[i];
        vo[i] = v[i] * 0.999f + g[i];
    }
    _mm_sfence();
}

#else  /* not x86-64: never dispatched to */
void bw_bank_avx512(const float *p, const float *g, const float *m, const float *v,
                    float *po, float *mo, float *vo, int64_t b, int64_t e)
{ (void)p; (void)g; (void)m; (void)v; (void)po; (void)mo; (void)vo; (void)b; (void)e; }
void adam_range_avx512(const adam_args_t *a, const adam_consts_t *c, int64_t b, int64_t e) { (void)a; (void)c; (void)b; (void)e; }
void grad_chunk_sums_avx512(const void *g, int dt, int64_t n, int64_t c0, int64_t c1, double *p) { (void)g; (void)dt; (void)n; (void)c0; (void)c1; (void)p; }
void bw_inplace_avx512(float *p, const float *g, float *m, float *v, int64_t b, int64_t e) { (void)p; (void)g; (void)m; (void)v; (void)b; (void)e; }
void remainder_encode_avx512(const float *m, uint16_t *p, int16_t *r, int64_t b, int64_t e) { (void)m; (void)p; (void)r; (void)b; (void)e; }
void remainder_decode_avx512(const uint16_t *p, const int16_t *r, float *m, int64_t b, int64_t e) { (void)p; (void)r; (void)m; (void)b; (void)e; }
#endif
