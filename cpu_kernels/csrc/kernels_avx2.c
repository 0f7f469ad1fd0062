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
