/* cpu_kernels, AVX-512 level (F, BW, VL, DQ). */
#include "kernels.h"
#define LEVEL avx512

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

#else  /* not x86-64: never dispatched to */
void adam_range_avx512(const adam_args_t *a, const adam_consts_t *c, int64_t b, int64_t e) { (void)a; (void)c; (void)b; (void)e; }
void grad_chunk_sums_avx512(const void *g, int dt, int64_t n, int64_t c0, int64_t c1, double *p) { (void)g; (void)dt; (void)n; (void)c0; (void)c1; (void)p; }
void bw_inplace_avx512(float *p, const float *g, float *m, float *v, int64_t b, int64_t e) { (void)p; (void)g; (void)m; (void)v; (void)b; (void)e; }
#endif
