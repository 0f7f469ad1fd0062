/* cpu_kernels, q8 Adam step, AVX2 level: 8 lanes; the map and the quantizer's tables read by scalar
 * loads. The common format (q8 + q8, no amsgrad, no param copy) runs its own fused block: the
 * moments dequantized inside the Adam loop, both quantized together through q8x2_fast. */
#include "q8.h"
#include <stdlib.h>
#define Q8_LEVEL avx2

#if defined(__x86_64__)
/* Above the target pragma: plain x86-64 code, as it runs at load on every CPU (an AVX2 build of
 * a constructor would kill a CPU without AVX2 with SIGILL; tests/test_x86_cpu_models.py). */
/* The quantizer's bucket table (q8_buckets) with the rank's + 1 folded in: (rank + 1) << 17 | step,
 * so a lane's rank is entry >> 17, less one while |x|'s low 16 bits lie below the step. */
static uint32_t q8x2_entries[2][2 * Q8_KEYS] __attribute__((aligned(64)));

/* The bounded quantizer's table (x·(1/absmax), finite |x| <= 1 + 2^-23: q8x2_codes_pair), indexed
 * by u >> 16 of x's bits u, sign included, from Q8X2_K0 (smaller magnitudes clamp to it: rank 0) to
 * 1.0's negative key: step << 8 | code, step signed. A lane's code is code - 1 (x >= 0; + 1 for x
 * < 0) while u's low 16 bits lie below the step, and it is near when they lie within Q8_SLACK of
 * it. A bucket without a step of its own stores a step it never meets (-65536: code as it is), or
 * the step of a neighbour that lies within Q8_SLACK of their shared edge (moved by 65536 across
 * it), so the near test covers the patterns whose Q8_SLACK span crosses into that neighbour's
 * step; where q8_buckets' rank steps at an edge (the next bucket's rank one higher, no step), the
 * step is that bucket's at 0. No bucket holds two steps (q8_avx2_init checks it; else the fused
 * block quantizes the generic way). The keys between +1.0's and -0's (> 1.0, NaN) are never
 * read; those of negative magnitudes below 2^-23 copy its entry. Against q8x2_entries: a key is
 * 2 ops (shift, clamp) not 8, a code 10 not 16, no edge test, and the near lanes drop from 1 in
 * 4096 of all patterns to about 1 in 250,000 of the bounded ones (the test hook counts them). */
#define Q8X2_K0 0x3400
#define Q8X2_NKEYS (0xbf80 + 1 - Q8X2_K0)
#define Q8X2_NO_STEP (-65536)
/* indexed by the key itself: the rows' first Q8X2_K0 entries are never read (nor their pages touched) */
static int32_t q8x2_fast[2][Q8X2_K0 + Q8X2_NKEYS] __attribute__((aligned(64)));
static int q8x2_fast_ok;  /* the table was built (no bucket needed two steps) */

static int q8x2_fast_build(int m, int32_t *steps, int32_t *base)
{
    const int zero = m == 0 ? 127 : 0;
    for (int k = 0; k < Q8X2_NKEYS; k++) {
        const int k16 = k + Q8X2_K0, neg = k16 >> 15;
        int mk = (k16 & 0x7fff) - Q8_KEY_FIRST;
        mk = mk < 0 ? 0 : mk > Q8_KEYS - 1 ? Q8_KEYS - 1 : mk;
        const uint32_t e = q8_buckets[m][neg * Q8_KEYS + mk];
        base[k] = (int32_t)(e >> 17);
        /* a clamped key (|x| < 2^-23) must not step: its low bits are another bucket's */
        const int clamped = mk != (k16 & 0x7fff) - Q8_KEY_FIRST, gap = !neg && k16 > 0x3f80;
        steps[k] = (e & 0x1ffffu) < 65536 && !gap ? (int32_t)(e & 0xffffu) : -1;
        if (clamped && steps[k] >= 0) return 0;
    }
    /* q8_buckets steps at an edge by the next bucket's rank (no step): that is a step at 0 here */
    for (int k = 1; k < Q8X2_NKEYS; k++) {
        if (((k - 1 + Q8X2_K0) >> 15) != ((k + Q8X2_K0) >> 15) || (!((k + Q8X2_K0) >> 15) && k + Q8X2_K0 > 0x3f80))
            continue;
        const int32_t before = base[k - 1] + (steps[k - 1] >= 0);
        if (base[k] == before) continue;
        if (base[k] != before + 1 || steps[k] >= 0) return 0;
        steps[k] = 0;
        base[k] = before;
    }
    for (int k = 0; k < Q8X2_NKEYS; k++) {
        const int neg = (k + Q8X2_K0) >> 15, dir = neg ? -1 : 1;
        int32_t step = Q8X2_NO_STEP, code = zero + dir * base[k];
        int held = 0;
        if (steps[k] >= 0) {
            step = steps[k];
            code = zero + dir * (base[k] + 1);
            held++;
        }
        /* the neighbours' steps within Q8_SLACK of an edge, on this side of 0 */
        if (k > 0 && ((k - 1 + Q8X2_K0) >> 15) == neg && steps[k - 1] > 65535 - Q8_SLACK) {
            step = steps[k - 1] - 65536;  /* always met: the code as it is */
            code = zero + dir * base[k];
            held++;
        }
        if (k + 1 < Q8X2_NKEYS && ((k + 1 + Q8X2_K0) >> 15) == neg && steps[k + 1] >= 0 && steps[k + 1] < Q8_SLACK) {
            step = steps[k + 1] + 65536;  /* never met */
            code = zero + dir * (base[k] + 1);
            held++;
        }
        if (held > 1 || code < 0 || code > 255) return 0;
        q8x2_fast[m][Q8X2_K0 + k] = (int32_t)((uint32_t)step << 8 | (uint32_t)code);
    }
    return 1;
}

static int q8x2_fast_init(int m)
{
    int32_t *scratch = malloc(2 * Q8X2_NKEYS * sizeof(int32_t));  /* steps, ranks: off the stack */
    const int ok = scratch && q8x2_fast_build(m, scratch, scratch + Q8X2_NKEYS);
    free(scratch);
    return ok;
}

__attribute__((constructor)) static void q8_avx2_init(void)
{
    for (int m = 0; m < 2; m++)
        for (int k = 0; k < 2 * Q8_KEYS; k++) {
            const uint32_t e = q8_buckets[m][k];
            q8x2_entries[m][k] = ((e >> 17) + 1) << 17 | (e & 0x1ffffu);
        }
    q8x2_fast_ok = q8x2_fast_init(0) && q8x2_fast_init(1);
}

#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

/* Table reads by scalar loads, not vpgatherdd: on Zen 5 (measured per element of a block in L1)
 * 8 scalar loads inserted into a vector cost 0.17 ns, a gather of 8 0.49 ns. The entries at
 * k0 .. k7, whatever the width of the caller's indexes (inlined, each index is its own load). */
static inline __attribute__((always_inline)) __m256i q8_entries8(const uint32_t *table, uint32_t k0, uint32_t k1,
                                                                 uint32_t k2, uint32_t k3, uint32_t k4, uint32_t k5,
                                                                 uint32_t k6, uint32_t k7)
{
    __m128i lo = _mm_cvtsi32_si128((int)table[k0]), hi = _mm_cvtsi32_si128((int)table[k4]);
    lo = _mm_insert_epi32(lo, (int)table[k1], 1);
    hi = _mm_insert_epi32(hi, (int)table[k5], 1);
    lo = _mm_insert_epi32(lo, (int)table[k2], 2);
    hi = _mm_insert_epi32(hi, (int)table[k6], 2);
    lo = _mm_insert_epi32(lo, (int)table[k3], 3);
    hi = _mm_insert_epi32(hi, (int)table[k7], 3);
    return _mm256_set_m128i(hi, lo);
}

static inline __m256i q8_lookup8(const uint32_t *table, const uint32_t k[8])
{
    return q8_entries8(table, k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7]);
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

/* The keys of 8 quotients u (fp32 bits) into the bucket table: Q8_KEYS per sign. */
static inline __m256i q8_key8(__m256i u)
{
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i neg = _mm256_srai_epi32(u, 31);
    __m256i key = _mm256_sub_epi32(_mm256_srli_epi32(mag, 16), _mm256_set1_epi32(Q8_KEY_FIRST));
    key = _mm256_min_epi32(_mm256_max_epi32(key, _mm256_setzero_si256()), _mm256_set1_epi32(Q8_KEYS - 1));
    return _mm256_add_epi32(key, _mm256_and_si256(neg, _mm256_set1_epi32(Q8_KEYS)));
}

/* The rank of 8 quotients u (fp32 bits), negated where u < 0, from their entries in
 * q8x2_entries; *near marks the lanes whose |u| lies within Q8_SLACK patterns of the bucket's step
 * or of an edge of the bucket (where a rank may change with no step). Every pattern within Q8_SLACK
 * of a lane not near lies in the same bucket on the same side of its step, so has the same code
 * (the test hook holds every pattern to this): x·(1/absmax), within 3 ulps of x / absmax, gets its
 * code there. */
static inline __m256i q8_rank8(__m256i u, __m256i entry, __m256i *near)
{
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i step = _mm256_and_si256(entry, _mm256_set1_epi32(0x1ffff));
    const __m256i low = _mm256_and_si256(mag, _mm256_set1_epi32(0xffff));
    /* near the step, or an edge of the bucket (a rank may change there without a step) */
    const __m256i edge = _mm256_and_si256(_mm256_add_epi32(mag, _mm256_set1_epi32(Q8_SLACK)), _mm256_set1_epi32(0xffff));
    *near = _mm256_or_si256(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(Q8_SLACK + 1), _mm256_abs_epi32(_mm256_sub_epi32(low, step))),
        _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * Q8_SLACK), edge));
    const __m256i rank = _mm256_add_epi32(_mm256_srli_epi32(entry, 17), _mm256_cmpgt_epi32(step, low));
    return _mm256_sign_epi32(rank, u);
}

/* codes[i] = the code of x[i] / absmax: quotients x·(1/absmax) where both are normal (recip),
 * else x / absmax; lanes near a step or edge take q8_code. Two passes over the block (len <=
 * Q8_BLOCK): the keys into an L1 buffer, then the quotients again, their entries (the keys read
 * back by scalar loads), ranks and codes, 32 lanes a round packed to bytes at once. Measured on
 * Zen 5 in L1: 0.28 ns an element, against 0.49 for one pass that divided and moved its keys out
 * of the vector register by vpextrd (gcc's code for q8_lookup8 on a vector just stored). */
static inline __attribute__((always_inline)) void q8_quant_run(uint8_t *restrict codes, const float *restrict x,
                                                               float absmax, const uint32_t *table, int zero,
                                                               int len, const int recip)
{
    const uint32_t *entries = q8x2_entries[zero ? 0 : 1];
    const __m256 s = _mm256_set1_ps(recip ? 1.0f / absmax : absmax);
    const __m256i zv = _mm256_set1_epi32(zero), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    uint32_t kb[Q8_BLOCK] __attribute__((aligned(64)));
#define Q8_QUOT(v) _mm256_castps_si256(recip ? _mm256_mul_ps((v), s) : _mm256_div_ps((v), s))
    const int whole = len & ~31;
    for (int i = 0; i < whole; i += 8) _mm256_store_si256((__m256i *)(kb + i), q8_key8(Q8_QUOT(_mm256_load_ps(x + i))));
    for (int i = 0; i < whole; i += 32) {
        __m256i n0, n1, n2, n3;
#define Q8_CODE8(j, n) _mm256_add_epi32(zv, q8_rank8(Q8_QUOT(_mm256_load_ps(x + i + (j))), \
                                                        q8_lookup8(entries, kb + i + (j)), &(n)))
        const __m256i c0 = Q8_CODE8(0, n0), c1 = Q8_CODE8(8, n1), c2 = Q8_CODE8(16, n2), c3 = Q8_CODE8(24, n3);
#undef Q8_CODE8
        /* bytes c0[0..3] c1[0..3] c2[0..3] c3[0..3] | c0[4..7] ..: vpermd puts the dwords in order */
        const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
        _mm256_storeu_si256((__m256i *)(codes + i), _mm256_permutevar8x32_epi32(b, order));
        const __m256i any = _mm256_or_si256(_mm256_or_si256(n0, n1), _mm256_or_si256(n2, n3));
        if (__builtin_expect(_mm256_movemask_ps(_mm256_castsi256_ps(any)) != 0, 0)) {
            const uint32_t m = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(n0)) |
                               (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(n1)) << 8 |
                               (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(n2)) << 16 |
                               (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(n3)) << 24;
            for (uint32_t r = m; r; r &= r - 1) {
                const int j = i + __builtin_ctz(r);
                codes[j] = q8_code(x[j] / absmax, table, zero);
            }
        }
    }
#undef Q8_QUOT
    for (int i = whole; i < len; i++) codes[i] = q8_code(x[i] / absmax, table, zero);
}

static inline void q8_quant_block(uint8_t *restrict codes, const float *restrict x, float absmax,
                                  const uint32_t *table, int zero, int len)
{
    if (q8_recip_ok(absmax)) q8_quant_run(codes, x, absmax, table, zero, len, 1);
    else q8_quant_run(codes, x, absmax, table, zero, len, 0);
}

/* The codes of 8 bounded quotients u (fp32 bits; keys their q8x2_fast keys) from their entries:
 * code + the sign of u times (low < step ? -1 : 0); *dist is |low - step|, and a lane is near
 * (q8x2_near8) when that is Q8_SLACK or less (q8x2_fast). A lane not near lies in the same bucket
 * on the same side of the step as every pattern within Q8_SLACK of it, or its bucket stores the
 * neighbour's step that the span meets: the test hook holds every bounded pattern to q8_code's
 * code over its whole span. */
static inline __m256i q8x2_fast_code8(__m256i u, __m256i entry, __m256i *dist)
{
    const __m256i step = _mm256_srai_epi32(entry, 8), code = _mm256_and_si256(entry, _mm256_set1_epi32(0xff));
    const __m256i c = _mm256_sub_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0xffff)), step);
    *dist = _mm256_abs_epi32(c);
    return _mm256_add_epi32(code, _mm256_sign_epi32(_mm256_srai_epi32(c, 31), u));
}

static inline __m256i q8x2_near8(__m256i dist)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(Q8_SLACK + 1), dist);
}

static inline __m256i q8x2_fast_key8(__m256i u)
{
    return _mm256_max_epi32(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(Q8X2_K0));
}

/* the lanes of near (a bit per lane from x) by the scalar quantizer */
static inline void q8x2_fix_near(uint8_t *codes, const float *x, uint32_t near, float absmax, int map)
{
    for (; near; near &= near - 1) {
        const int j = __builtin_ctz(near);
        codes[j] = q8_code(x[j] / absmax, q8_buckets[map], map == 0 ? 127 : 0);
    }
}

/* the entries of 8 keys read as 4 8-byte words (half the loads of one per key) */
static inline __m256i q8x2_lookup_pairs(const int32_t *table, const uint32_t *keys)
{
    uint64_t w0, w1, w2, w3;
    memcpy(&w0, keys, 8);
    memcpy(&w1, keys + 2, 8);
    memcpy(&w2, keys + 4, 8);
    memcpy(&w3, keys + 6, 8);
    __m128i lo = _mm_cvtsi32_si128(table[(uint32_t)w0]), hi = _mm_cvtsi32_si128(table[(uint32_t)w2]);
    lo = _mm_insert_epi32(lo, table[w0 >> 32], 1);
    hi = _mm_insert_epi32(hi, table[w2 >> 32], 1);
    lo = _mm_insert_epi32(lo, table[(uint32_t)w1], 2);
    hi = _mm_insert_epi32(hi, table[(uint32_t)w3], 2);
    lo = _mm_insert_epi32(lo, table[w1 >> 32], 3);
    hi = _mm_insert_epi32(hi, table[w3 >> 32], 3);
    return _mm256_set_m128i(hi, lo);
}

/* 32 lanes' codes from their quotients q (recomputed from x) and keys; *near: whether any is near */
static inline __attribute__((always_inline)) __m256i q8x2_fast_code32(const float *x, __m256 s, const int32_t *table,
                                                                     const uint32_t *keys, int *near)
{
    __m256i c[4], d[4];
    for (int j = 0; j < 4; j++) {
        const __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_load_ps(x + 8 * j), s));
        c[j] = q8x2_fast_code8(u, q8x2_lookup_pairs(table, keys + 8 * j), &d[j]);
    }
    /* the nearest of the 32 lanes tested once: 3 minimums and a compare, not a compare per 8 lanes
     * (gcc makes each a minimum and an equality) and 3 ors */
    const __m256i dmin = _mm256_min_epi32(_mm256_min_epi32(d[0], d[1]), _mm256_min_epi32(d[2], d[3]));
    *near = _mm256_movemask_ps(_mm256_castsi256_ps(q8x2_near8(dmin))) != 0;
    /* bytes c0[0..3] c1[0..3] c2[0..3] c3[0..3] | c0[4..7] ..: vpermd puts the dwords in order */
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Test hook (tests/test_q8_cpu.py): the vector quantizer on the fp32 bit patterns [first, first +
 * count) of map (0 signed, 1 unsigned) against q8_code at every pattern within Q8_SLACK of each
 * (q8_slack_agrees); returns the mismatches, *near_lanes the lanes that took q8_code. */
int64_t q8_check_quant_avx2(int map, uint32_t first, uint64_t count, int64_t *near_lanes)
{
    const int bounded = map >= 2;
    map &= 1;
    const int zero = map == 0 ? 127 : 0;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), zv = _mm256_set1_epi32(zero);
    const int32_t *fast = q8x2_fast[map];
    int64_t bad = 0, nears = 0;
    if (bounded && !q8x2_fast_ok) return -1;
    for (uint64_t k = 0; k < count; k += 8) {
        const uint32_t base = first + (uint32_t)k;
        const __m256i u = _mm256_add_epi32(_mm256_set1_epi32((int)base), lane);
        uint32_t kb[8] __attribute__((aligned(32)));
        __m256i near, code;
        if (bounded) {
            _mm256_store_si256((__m256i *)kb, q8x2_fast_key8(u));
            __m256i dist;
            code = q8x2_fast_code8(u, q8_lookup8((const uint32_t *)fast, kb), &dist);
            near = q8x2_near8(dist);
        } else {
            _mm256_store_si256((__m256i *)kb, q8_key8(u));
            code = _mm256_add_epi32(zv, q8_rank8(u, q8_lookup8(q8x2_entries[map], kb), &near));
        }
        uint32_t c[8];
        _mm256_storeu_si256((__m256i *)c, code);
        const int nm = _mm256_movemask_ps(_mm256_castsi256_ps(near));
        nears += __builtin_popcount((unsigned)nm);
        for (int j = 0; j < 8 && k + (uint64_t)j < count; j++) {
            if (nm >> j & 1) continue;
            bad += !q8_slack_agrees(c[j], base + (uint32_t)j, q8_buckets[map], zero);
        }
    }
    *near_lanes = nears;
    return bad;
}

/* The generic loop (q8_body.h) serves every format; the common one below fuses its passes. */
#undef Q8_LEVEL
#define Q8_LEVEL avx2_generic
#include "q8_body.h"

/* The fused pass (q8_fused.h) over 8 lanes, as q8_range_avx2_fused; q8_range_avx2 below runs it
 * a few blocks at a time with the next blocks' inputs prefetched. */
#undef Q8_LEVEL
#define Q8_LEVEL avx2_fused
#define Q8_GENERIC q8_range_avx2_generic
#define Q8_W 8
typedef __m256 q8_vf;
typedef __m256i q8_vi;
#define q8f_set1 _mm256_set1_ps
#define q8f_load _mm256_load_ps
#define q8f_loadu _mm256_loadu_ps
#define q8f_store _mm256_store_ps
#define q8f_storeu _mm256_storeu_ps
#define q8f_add _mm256_add_ps
#define q8f_sub _mm256_sub_ps
#define q8f_mul _mm256_mul_ps
#define q8f_div _mm256_div_ps
#define q8f_sqrt _mm256_sqrt_ps
#define q8i_zero _mm256_setzero_si256
#define q8i_max_u32 _mm256_max_epu32

static inline q8_vf q8f_bf16(const uint16_t *s)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)s)), 16));
}

static inline q8_vi q8i_abs_bits(q8_vf x)
{
    return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
}

static inline uint32_t q8i_hmax_u32(q8_vi x)
{
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, x);
    uint32_t m = 0;
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    return m;
}

/* Both moments' codes of a whole block (q8_fused.h's Q8_CODES_OUT_PAIR) where both absmaxes take
 * the reciprocal (q8_recip_ok): every quotient is then finite with |x| <= 1 + 2^-23, which
 * q8x2_fast covers; else the one-moment way. Two passes: both moments' keys into L1, then their
 * entries read back by scalar loads, 32 lanes of each a round. */
static inline void q8x2_codes_pair(uint8_t *mc, float *ma_out, const float *restrict mb, uint32_t mx_m, uint8_t *vc,
                                   float *va_out, const float *restrict vb, uint32_t mx_v, int len)
{
    const float ma = bits_f32(mx_m), va = bits_f32(mx_v);
    if (len != Q8_BLOCK || !q8x2_fast_ok || !q8_recip_ok(ma) || !q8_recip_ok(va)) {
        q8_codes_out(mc, ma_out, mb, mx_m, 0, len);
        q8_codes_out(vc, va_out, vb, mx_v, 1, len);
        return;
    }
    *ma_out = ma;
    *va_out = va;
    const __m256 sm = _mm256_set1_ps(1.0f / ma), sv = _mm256_set1_ps(1.0f / va);
    uint32_t km[Q8_BLOCK] __attribute__((aligned(64))), kv[Q8_BLOCK] __attribute__((aligned(64)));
    for (int i = 0; i < Q8_BLOCK; i += 8) {
        _mm256_store_si256((__m256i *)(km + i),
                           q8x2_fast_key8(_mm256_castps_si256(_mm256_mul_ps(_mm256_load_ps(mb + i), sm))));
        _mm256_store_si256((__m256i *)(kv + i),
                           q8x2_fast_key8(_mm256_castps_si256(_mm256_mul_ps(_mm256_load_ps(vb + i), sv))));
    }
    const int32_t *tm = q8x2_fast[0], *tv = q8x2_fast[1];
    for (int i = 0; i < Q8_BLOCK; i += 32) {
        int nm, nv;
        _mm256_storeu_si256((__m256i *)(mc + i), q8x2_fast_code32(mb + i, sm, tm, km + i, &nm));
        _mm256_storeu_si256((__m256i *)(vc + i), q8x2_fast_code32(vb + i, sv, tv, kv + i, &nv));
        /* a round with a near lane (about 1 in 8000 over all patterns) takes q8_code for all 32 */
        if (__builtin_expect(nm, 0)) q8x2_fix_near(mc + i, mb + i, 0xffffffffu, ma, 0);
        if (__builtin_expect(nv, 0)) q8x2_fix_near(vc + i, vb + i, 0xffffffffu, va, 1);
    }
}

/* 8 codes' map values, each code by its own byte load: the step in L1 took 0.91 ns an element so,
 * 0.95 with one 8-byte load split by shifts (Zen 5; docs/kernels.md) */
static inline __m256 q8x2_map8(const uint32_t *map, const uint8_t *k)
{
    return _mm256_castsi256_ps(q8_entries8(map, k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7]));
}

#define Q8_CODES_OUT_PAIR q8x2_codes_pair
/* the moments dequantized inside the arithmetic loop: no L1 round trip for the block's inputs */
#define Q8_MOMENT_IN(k, codes, absmax) _mm256_mul_ps(q8x2_map8(q8_maps[k], (codes)), _mm256_set1_ps(absmax))
/* Declared always_inline before q8_fused.h defines it, so that q8_range_avx2 compiles the block once
 * with c->grad_scale a constant 1.0f (its unscaled copy): gcc left the block's test of it (scaled) in
 * its loop, both floats reloaded from the stack each 8 lanes (16 vector registers do not hold the
 * loop's constants). */
static inline __attribute__((always_inline)) void Q8_FN(q8_block)(const q8_args_t *a, const q8_consts_t *c,
                                                                  int64_t off);
#include "q8_fused.h"

/* Blocks ahead whose inputs are prefetched: at 16Mi elements, one thread, Zen 5, the fused pass
 * took 2.05 ns an element without, 1.6-1.7 with 2 to 4 (1.25 with everything in L1): the hardware
 * prefetchers alone leave each block's misses in series with its arithmetic. q8_prefetch_span is
 * always_inline, as adam_body.h's prefetch_block (gcc deletes calls of a prefetch-only function). */
#define Q8_PF_AHEAD 4

static inline __attribute__((always_inline)) void q8_prefetch_span(const void *p, size_t bytes)
{
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

void q8_range_avx2(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end)
{
    /* the streams a block reads (in place, the ones it writes): the moments' codes, the param
     * (fp32, or bf16 and its remainders) and the grad; a block's absmax shares its line with 15 */
    const size_t gsz = a->grad_dtype == DT_F32 ? 4 : 2, psz = a->remainder ? 2 : 4;
    const int fused = q8_fusable(a, c);
    for (int64_t off = begin; off < end; off += Q8_BLOCK) {
        const int64_t e = off + Q8_BLOCK < end ? off + Q8_BLOCK : end;
        const int64_t pf = off + Q8_PF_AHEAD * Q8_BLOCK;
        if (pf + Q8_BLOCK <= end) {
            q8_prefetch_span((const char *)a->param + pf * psz, Q8_BLOCK * psz);
            q8_prefetch_span((const char *)a->grad + pf * gsz, Q8_BLOCK * gsz);
            if (a->remainder) q8_prefetch_span(a->remainder + pf, Q8_BLOCK * 2);
            if (a->exp_avg_dtype == DT_Q8) q8_prefetch_span((const uint8_t *)a->exp_avg + pf, Q8_BLOCK);
            if (a->exp_avg_sq_dtype == DT_Q8) q8_prefetch_span((const uint8_t *)a->exp_avg_sq + pf, Q8_BLOCK);
        }
        if (fused && e - off == Q8_BLOCK) {
            if (c->grad_scale == 1.0f) {
                /* c with grad_scale 1.0f stored where the inlined block reads it: a constant there,
                 * so this block (the common case) has no per-iteration test of it. The same bits:
                 * the block skips the multiply by 1.0f either way. */
                q8_consts_t unscaled = *c;
                unscaled.grad_scale = 1.0f;
                q8_block_avx2_fused(a, &unscaled, off);
            } else {
                q8_block_avx2_fused(a, c, off);
            }
        } else {
            q8_range_avx2_fused(a, c, off, e);
        }
    }
}
#endif
