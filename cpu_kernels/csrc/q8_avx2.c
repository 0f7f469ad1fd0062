/* cpu_kernels, q8 Adam step, AVX2 level: 8 lanes; the map and the bucket table read by scalar loads. */
#include "q8.h"
#define Q8_LEVEL avx2

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

/* Table reads by scalar loads, not vpgatherdd: on Zen 5 (measured per element of a block in L1)
 * 8 scalar loads inserted into a vector cost 0.17 ns, a gather of 8 0.49 ns. */
static inline __m256i q8_lookup8(const uint32_t *table, const uint32_t k[8])
{
    __m128i lo = _mm_cvtsi32_si128((int)table[k[0]]), hi = _mm_cvtsi32_si128((int)table[k[4]]);
    lo = _mm_insert_epi32(lo, (int)table[k[1]], 1);
    hi = _mm_insert_epi32(hi, (int)table[k[5]], 1);
    lo = _mm_insert_epi32(lo, (int)table[k[2]], 2);
    hi = _mm_insert_epi32(hi, (int)table[k[6]], 2);
    lo = _mm_insert_epi32(lo, (int)table[k[3]], 3);
    hi = _mm_insert_epi32(hi, (int)table[k[7]], 3);
    return _mm256_set_m128i(hi, lo);
}

static inline void q8_dequant_block(float *restrict dst, const uint8_t *codes, float absmax,
                                    const uint32_t *map, int len)
{
    const __m256 s = _mm256_set1_ps(absmax);
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t c;
        memcpy(&c, codes + i, 8);
        uint32_t k[8];
        for (int j = 0; j < 8; j++) k[j] = (uint32_t)(c >> (8 * j)) & 0xffu;
        _mm256_store_ps(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(q8_lookup8(map, k)), s));
    }
    for (; i < len; i++) dst[i] = bits_f32(map[codes[i]]) * absmax;
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    const __m256 s = _mm256_set1_ps(absmax);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), low16 = _mm256_set1_epi32(0xffff);
    const __m256i low17 = _mm256_set1_epi32(0x1ffff), first = _mm256_set1_epi32(Q8_KEY_FIRST);
    const __m256i last = _mm256_set1_epi32(Q8_KEYS - 1), keys = _mm256_set1_epi32(Q8_KEYS);
    const __m256i zero_code = _mm256_set1_epi32(zero), one = _mm256_set1_epi32(1);
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_div_ps(_mm256_load_ps(x + i), s));
        const __m256i mag = _mm256_and_si256(u, abs_mask);
        const __m256i neg = _mm256_srai_epi32(u, 31);  /* all ones where x <= -0 */
        __m256i key = _mm256_sub_epi32(_mm256_srli_epi32(mag, 16), first);
        key = _mm256_min_epi32(_mm256_max_epi32(key, _mm256_setzero_si256()), last);
        key = _mm256_add_epi32(key, _mm256_and_si256(neg, keys));
        uint32_t k[8] __attribute__((aligned(32)));
        _mm256_store_si256((__m256i *)k, key);
        const __m256i entry = q8_lookup8(table, k);
        /* rank = entry >> 17, + 1 unless the step lies above |x| (both below 2^17: signed compare) */
        const __m256i above = _mm256_cmpgt_epi32(_mm256_and_si256(entry, low17), _mm256_and_si256(mag, low16));
        const __m256i rank = _mm256_add_epi32(_mm256_add_epi32(_mm256_srli_epi32(entry, 17), one), above);
        const __m256i code = _mm256_blendv_epi8(_mm256_add_epi32(zero_code, rank),
                                                _mm256_sub_epi32(zero_code, rank), neg);
        const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
        _mm_storel_epi64((__m128i *)(codes + i), _mm_packus_epi16(words, words));
    }
    for (; i < len; i++) codes[i] = q8_code(x[i] / absmax, table, zero);
}

/* The generic loop (q8_body.h) serves every format; the common one below fuses its passes. */
#undef Q8_LEVEL
#define Q8_LEVEL avx2_generic
#include "q8_body.h"

/* q8 exp_avg and exp_avg_sq, no amsgrad, no param copy, fp32 / bf16 grads, whole blocks: as
 * q8_avx512.c's fused loop, 8 lanes. Same operations in the same order as q8_math. */
static inline int q8_fusable(const q8_args_t *a, const q8_consts_t *c)
{
    return a->exp_avg_dtype == DT_Q8 && a->exp_avg_sq_dtype == DT_Q8 && !c->amsgrad && !a->param_copy &&
           (a->grad_dtype == DT_F32 || a->grad_dtype == DT_BF16);
}

static inline void q8_quant_out(uint8_t *codes, float *absmax_out, const float *restrict x, __m256i mx,
                                int map)
{
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, mx);
    uint32_t m = 0;
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    *absmax_out = bits_f32(m);
    const int zero = map == 0 ? 127 : 0;
    if (m == 0) memset(codes, zero, Q8_BLOCK);  /* x = 0 when the absmax is 0 */
    else q8_quant_block(codes, x, bits_f32(m), q8_buckets[map], zero, Q8_BLOCK);
}

static inline __attribute__((always_inline)) void q8_fused_block(const q8_args_t *a, const q8_consts_t *c,
                                                                 int64_t off, const int l2, const int bf16_grad,
                                                                 const int remainders)
{
    float mb[Q8_BLOCK] __attribute__((aligned(64))), vb[Q8_BLOCK] __attribute__((aligned(64)));
    float pb[Q8_BLOCK] __attribute__((aligned(64)));
    const int64_t blk = off / Q8_BLOCK;
    q8_dequant_block(mb, (const uint8_t *)a->exp_avg + off, a->exp_avg_absmax[blk], q8_maps[0], Q8_BLOCK);
    q8_dequant_block(vb, (const uint8_t *)a->exp_avg_sq + off, a->exp_avg_sq_absmax[blk], q8_maps[1], Q8_BLOCK);
    const float *pin = (const float *)a->param + off;
    float *pout = (float *)a->param_out + off;
    if (remainders) {
        const uint16_t *p16 = (const uint16_t *)a->param + off, *r = (const uint16_t *)(const void *)a->remainder + off;
#pragma omp simd
        for (int i = 0; i < Q8_BLOCK; i++) pb[i] = remainder_decode(p16[i], r[i]);
        pin = pout = pb;
    }
    const __m256 w1 = _mm256_set1_ps(c->one_minus_beta1), b2 = _mm256_set1_ps(c->beta2);
    const __m256 w2 = _mm256_set1_ps(c->one_minus_beta2), eps = _mm256_set1_ps(c->eps);
    const __m256 nss = _mm256_set1_ps(c->neg_step_size), ib = _mm256_set1_ps(c->inv_bias_correction2_sqrt);
    const __m256 decay = _mm256_set1_ps(c->decay), wd = _mm256_set1_ps(c->l2);
    const __m256 gscale = _mm256_set1_ps(c->grad_scale);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    __m256i mx_m = _mm256_setzero_si256(), mx_v = _mm256_setzero_si256();
    for (int i = 0; i < Q8_BLOCK; i += 8) {
        const __m256 p = _mm256_loadu_ps(pin + i);
        __m256 g;
        if (bf16_grad) {
            const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)a->grad + off + i));
            g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
            g = _mm256_loadu_ps((const float *)a->grad + off + i);
        }
        g = _mm256_mul_ps(g, gscale);
        if (l2) g = _mm256_add_ps(_mm256_mul_ps(p, wd), g);
        const __m256 m0 = _mm256_load_ps(mb + i), v0 = _mm256_load_ps(vb + i);
        const __m256 m = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(g, m0), w1), m0);
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(g, g), w2), _mm256_mul_ps(v0, b2));
        const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), ib), eps);
        _mm256_storeu_ps(pout + i, _mm256_add_ps(_mm256_mul_ps(p, decay), _mm256_mul_ps(_mm256_div_ps(m, denom), nss)));
        _mm256_store_ps(mb + i, m);
        _mm256_store_ps(vb + i, v);
        mx_m = _mm256_max_epu32(mx_m, _mm256_and_si256(_mm256_castps_si256(m), abs_mask));
        mx_v = _mm256_max_epu32(mx_v, _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
    }
    if (remainders) {
        uint16_t *po = (uint16_t *)a->param_out + off;
        int16_t *ro = a->remainder_out + off;
#pragma omp simd
        for (int i = 0; i < Q8_BLOCK; i++) {
            const uint32_t u = f32_bits(pb[i]);
            po[i] = remainder_param_bits(u);
            ro[i] = (int16_t)(uint16_t)u;
        }
    }
    q8_quant_out((uint8_t *)a->exp_avg_out + off, a->exp_avg_absmax_out + blk, mb, mx_m, 0);
    q8_quant_out((uint8_t *)a->exp_avg_sq_out + off, a->exp_avg_sq_absmax_out + blk, vb, mx_v, 1);
}

void q8_range_avx2(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end)
{
    if (!q8_fusable(a, c)) {
        q8_range_avx2_generic(a, c, begin, end);
        return;
    }
    const int64_t whole = begin + (end - begin) / Q8_BLOCK * Q8_BLOCK;
    const int l2 = c->l2_mode, bf16 = a->grad_dtype == DT_BF16, rem = a->remainder != NULL;
    for (int64_t off = begin; off < whole; off += Q8_BLOCK) {
        /* the flags as constants: one loop per combination */
        if (rem) {
            if (bf16) q8_fused_block(a, c, off, l2, 1, 1);
            else q8_fused_block(a, c, off, l2, 0, 1);
        } else if (l2) {
            if (bf16) q8_fused_block(a, c, off, 1, 1, 0);
            else q8_fused_block(a, c, off, 1, 0, 0);
        } else {
            if (bf16) q8_fused_block(a, c, off, 0, 1, 0);
            else q8_fused_block(a, c, off, 0, 0, 0);
        }
    }
    if (whole < end) q8_range_avx2_generic(a, c, whole, end);
}
#endif
