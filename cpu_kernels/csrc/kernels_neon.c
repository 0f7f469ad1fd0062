/* cpu_kernels, NEON level (AArch64 Advanced SIMD: every AArch64 CPU has it).
 *
 * One register loop steps every call (HAVE_ADAM_RANGE_REGS): 8 elements a step, each
 * stream widened on load and narrowed on store by single instructions (bf16 <-> fp32 is a
 * shift or a zip with zero, fp16 <-> fp32 FCVTL/FCVTN, remainders zip/unzip of 16-bit
 * lanes), the arithmetic that of adam_body.h's adam_math with explicit fused multiply-adds,
 * so the bits are those of the x86 AVX2/AVX-512 levels (AArch64 Advanced SIMD is IEEE
 * with subnormals, as SSE/AVX without FTZ/DAZ). A tail of fewer than 8 elements runs the
 * same step on zero-padded copies, so there is no scalar twin of the arithmetic to keep in
 * step. bf16 rounding is integer (nearest even, NaN -> 0x7FC0), not BFCVT: BFCVT is absent
 * on many AArch64 cores (Neoverse N1, Cortex-A72) and its NaN and subnormal handling would
 * have to be checked on hardware we do not have.
 */
#include "kernels.h"
#define LEVEL neon
#define LEVEL_HAS_FMA 1

#if defined(__aarch64__)
#include <arm_neon.h>

typedef struct {
    float32x4_t w1, b2, w2, eps, nss, ib, decay, wd, gs;
} vconsts_t;

static inline vconsts_t vconsts(const adam_consts_t *c)
{
    vconsts_t k = {vdupq_n_f32(c->one_minus_beta1), vdupq_n_f32(c->beta2), vdupq_n_f32(c->one_minus_beta2),
                   vdupq_n_f32(c->eps), vdupq_n_f32(c->neg_step_size), vdupq_n_f32(c->inv_bias_correction2_sqrt),
                   vdupq_n_f32(c->decay), vdupq_n_f32(c->l2), vdupq_n_f32(c->grad_scale)};
    return k;
}

/* adam_math on 4 lanes: vfmaq_f32(a, b, c) = a + b * c rounded once */
static inline __attribute__((always_inline)) void adam4(
    const vconsts_t *k, const int l2, const int ams, float32x4_t p, float32x4_t g, float32x4_t m0,
    float32x4_t v0, float32x4_t x0, float32x4_t *pn, float32x4_t *mi, float32x4_t *vi, float32x4_t *vv)
{
    float32x4_t gi = vmulq_f32(g, k->gs);
    if (l2) gi = vfmaq_f32(gi, k->wd, p);
    *mi = vfmaq_f32(m0, k->w1, vsubq_f32(gi, m0));
    *vi = vfmaq_f32(vmulq_f32(v0, k->b2), k->w2, vmulq_f32(gi, gi));
    /* maxps' rule: (vmax > v) ? vmax : v — a NaN on either side gives v (FMAX would not) */
    *vv = ams ? vbslq_f32(vcgtq_f32(x0, *vi), x0, *vi) : *vi;
    const float32x4_t denom = vfmaq_f32(k->eps, vsqrtq_f32(*vv), k->ib);
    *pn = vfmaq_f32(vmulq_f32(k->nss, vdivq_f32(*mi, denom)), p, k->decay);
}

/* 8 values of a stream in dtype dt: x[0] elements 0-3, x[1] 4-7 */
static inline __attribute__((always_inline)) void load8(const void *src, int dt, int64_t i, float32x4_t x[2])
{
    if (dt == DT_F32) {
        const float *s = (const float *)src + i;
        x[0] = vld1q_f32(s);
        x[1] = vld1q_f32(s + 4);
        return;
    }
    const uint16x8_t h = vld1q_u16((const uint16_t *)src + i);
    if (dt == DT_BF16) {
        x[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        x[1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
    } else {
        const float16x8_t f = vreinterpretq_f16_u16(h);
        x[0] = vcvt_f32_f16(vget_low_f16(f));
        x[1] = vcvt_high_f32_f16(f);
    }
}

/* torch's bf16 rounding of 8 floats: (u + 0x7fff + lsb) >> 16 narrowed in one ADDHN, NaN ->
 * 0x7FC0 */
static inline uint16x8_t to_bf16x8(float32x4_t a, float32x4_t b)
{
    const uint32x4_t ua = vreinterpretq_u32_f32(a), ub = vreinterpretq_u32_f32(b);
    const uint32x4_t one = vdupq_n_u32(1), half = vdupq_n_u32(0x7fff);
    const uint32x4_t ba = vaddq_u32(half, vandq_u32(vshrq_n_u32(ua, 16), one));
    const uint32x4_t bb = vaddq_u32(half, vandq_u32(vshrq_n_u32(ub, 16), one));
    const uint16x8_t r = vaddhn_high_u32(vaddhn_u32(ua, ba), ub, bb);
    const uint16x8_t ordered = vcombine_u16(vmovn_u32(vceqq_f32(a, a)), vmovn_u32(vceqq_f32(b, b)));
    return vbslq_u16(ordered, r, vdupq_n_u16(0x7fc0));
}

/* round to nearest even, as F16C and torch's cast (FPCR's default rounding mode) */
static inline uint16x8_t to_f16x8(float32x4_t a, float32x4_t b)
{
    return vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(a), b));
}

/* streaming stores (kernels.h: off unless asked for): STNP of two registers */
static inline void store_u16x8(uint16_t *d, uint16x8_t x, int nt)
{
    if (nt) __asm__ volatile("stnp %d1, %d2, [%0]" ::"r"(d), "w"(vget_low_u16(x)), "w"(vget_high_u16(x)) : "memory");
    else vst1q_u16(d, x);
}

static inline void store_f32x8(float *d, const float32x4_t x[2], int nt)
{
    if (nt) __asm__ volatile("stnp %q1, %q2, [%0]" ::"r"(d), "w"(x[0]), "w"(x[1]) : "memory");
    else { vst1q_f32(d, x[0]); vst1q_f32(d + 4, x[1]); }
}

static inline __attribute__((always_inline)) void store8(void *dst, int dt, int64_t i, const float32x4_t x[2], int nt)
{
    if (dt == DT_F32) store_f32x8((float *)dst + i, x, nt);
    else store_u16x8((uint16_t *)dst + i, dt == DT_BF16 ? to_bf16x8(x[0], x[1]) : to_f16x8(x[0], x[1]), nt);
}

/* remainders (kernels.h): master = ((param - carry) << 16) | remainder, the carry (the
 * remainder's top bit) subtracted in 16-bit lanes; zip puts each remainder below its param */
static inline void decode8(const uint16_t *p, const int16_t *r, int64_t i, float32x4_t m[2])
{
    const uint16x8_t rr = vld1q_u16((const uint16_t *)r + i);
    const uint16x8_t h = vsubq_u16(vld1q_u16(p + i), vshrq_n_u16(rr, 15));
    m[0] = vreinterpretq_f32_u16(vzip1q_u16(rr, h));
    m[1] = vreinterpretq_f32_u16(vzip2q_u16(rr, h));
}

/* the inverse: unzip to low halves (the remainder) and high halves + the low half's top bit */
static inline void encode8(const float32x4_t m[2], uint16x8_t *ph, uint16x8_t *rh)
{
    const uint16x8_t u0 = vreinterpretq_u16_f32(m[0]), u1 = vreinterpretq_u16_f32(m[1]);
    *rh = vuzp1q_u16(u0, u1);
    *ph = vaddq_u16(vuzp2q_u16(u0, u1), vshrq_n_u16(*rh, 15));
}

/* One step of 8 elements at i. mdt / vdt are constants in each instance (adam_regs_body);
 * nts: streaming stores for the state outputs (bank mode), ntc for the param copy. */
static inline __attribute__((always_inline)) void step8(
    const adam_args_t *a, const vconsts_t *k, int64_t i, const int mdt, const int vdt, const int l2,
    const int ams, int nts, int ntc)
{
    const float32x4_t zero = vdupq_n_f32(0.0f);
    float32x4_t p[2], g[2], m[2], v[2], x[2] = {zero, zero}, pn[2], mi[2], vi[2], vv[2];
    if (a->remainder) decode8((const uint16_t *)(const void *)a->param, a->remainder, i, p);
    else load8(a->param, DT_F32, i, p);
    load8(a->grad, a->grad_dtype, i, g);
    load8(a->exp_avg, mdt, i, m);
    load8(a->exp_avg_sq, vdt, i, v);
    if (ams) load8(a->max_exp_avg_sq, vdt, i, x);
    for (int h = 0; h < 2; h++) adam4(k, l2, ams, p[h], g[h], m[h], v[h], x[h], &pn[h], &mi[h], &vi[h], &vv[h]);
    if (a->remainder) {
        uint16x8_t ph, rh;
        encode8(pn, &ph, &rh);
        store_u16x8((uint16_t *)(void *)a->param_out + i, ph, nts);
        store_u16x8((uint16_t *)a->remainder_out + i, rh, nts);
    } else {
        store_f32x8(a->param_out + i, pn, nts);
    }
    store8(a->exp_avg_out, mdt, i, mi, nts);
    store8(a->exp_avg_sq_out, vdt, i, vi, nts);
    if (ams) store8(a->max_exp_avg_sq_out, vdt, i, vv, nts);
    if (a->param_copy) store8(a->param_copy, a->copy_dtype, i, pn, ntc);
}

static inline int dt_size(int dt) { return dt == DT_F32 ? 4 : 2; }

/* A stream's last len elements from i into a zero-padded 8-element buffer, or back. */
static inline const void *pad_in(unsigned char *buf, const void *src, int size, int64_t i, int len)
{
    if (!src) return NULL;
    memcpy(buf, (const unsigned char *)src + i * size, (size_t)len * size);
    return buf;
}

static inline void pad_out(void *dst, const unsigned char *buf, int size, int64_t i, int len)
{
    if (dst) memcpy((unsigned char *)dst + i * size, buf, (size_t)len * size);
}

/* The last len < 8 elements: step8 on zero-padded copies (a shadow of the call's arguments
 * pointing at them), then only the len real results written back. */
static inline __attribute__((always_inline)) void tail8(
    const adam_args_t *a, const vconsts_t *k, int64_t i, int len, const int mdt, const int vdt,
    const int l2, const int ams)
{
    enum { P, G, M, V, X, R, PO, MO, VO, XO, RO, CP, NSTREAMS };
    unsigned char buf[NSTREAMS][32] __attribute__((aligned(16)));
    memset(buf, 0, sizeof(buf));
    const int psz = a->remainder ? 2 : 4, msz = dt_size(mdt), vsz = dt_size(vdt);
    adam_args_t s = *a;
    s.param = (float *)(void *)pad_in(buf[P], a->param, psz, i, len);
    s.grad = pad_in(buf[G], a->grad, dt_size(a->grad_dtype), i, len);
    s.exp_avg = pad_in(buf[M], a->exp_avg, msz, i, len);
    s.exp_avg_sq = pad_in(buf[V], a->exp_avg_sq, vsz, i, len);
    s.max_exp_avg_sq = pad_in(buf[X], a->max_exp_avg_sq, vsz, i, len);
    s.remainder = (const int16_t *)pad_in(buf[R], a->remainder, 2, i, len);
    s.param_out = (float *)(void *)buf[PO];
    s.exp_avg_out = buf[MO];
    s.exp_avg_sq_out = buf[VO];
    s.max_exp_avg_sq_out = a->max_exp_avg_sq_out ? buf[XO] : NULL;
    s.remainder_out = a->remainder_out ? (int16_t *)(void *)buf[RO] : NULL;
    s.param_copy = a->param_copy ? buf[CP] : NULL;
    step8(&s, k, 0, mdt, vdt, l2, ams, 0, 0);
    pad_out(a->param_out, buf[PO], psz, i, len);
    pad_out(a->exp_avg_out, buf[MO], msz, i, len);
    pad_out(a->exp_avg_sq_out, buf[VO], vsz, i, len);
    if (ams) pad_out(a->max_exp_avg_sq_out, buf[XO], vsz, i, len);
    if (a->remainder) pad_out(a->remainder_out, buf[RO], 2, i, len);
    pad_out(a->param_copy, buf[CP], 2, i, len);
}

/* one instance per (exp_avg dtype, exp_avg_sq dtype) pair, and amsgrad / L2 decay each way:
 * the loop holds no dtype or mode branch but the grad's and the outputs' */
static inline __attribute__((always_inline)) void adam_regs_body(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end, const int mdt, const int vdt)
{
    const vconsts_t k = vconsts(c);
    const int nts = hybrid_arm_streaming_stores_on && c->out_of_place, ntc = hybrid_arm_streaming_stores_on;
    const int l2 = c->l2_mode, ams = c->amsgrad;
    int64_t i = begin;
#define ADAM_LOOP(L2, AMS)                                                                    \
    for (; i + 8 <= end; i += 8) step8(a, &k, i, mdt, vdt, L2, AMS, nts, ntc);               \
    if (i < end) tail8(a, &k, i, (int)(end - i), mdt, vdt, L2, AMS);
    if (ams) {
        if (l2) { ADAM_LOOP(1, 1) } else { ADAM_LOOP(0, 1) }
    } else {
        if (l2) { ADAM_LOOP(1, 0) } else { ADAM_LOOP(0, 0) }
    }
#undef ADAM_LOOP
}

#define HAVE_ADAM_RANGE_REGS 1
static void adam_range_regs(const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end)
{
    const int mb = a->moment_dtype == DT_BF16, vb = a->exp_avg_sq_dtype == DT_BF16;
    if (mb && vb) adam_regs_body(a, c, begin, end, DT_BF16, DT_BF16);
    else if (mb) adam_regs_body(a, c, begin, end, DT_BF16, DT_F32);
    else if (vb) adam_regs_body(a, c, begin, end, DT_F32, DT_BF16);
    else adam_regs_body(a, c, begin, end, DT_F32, DT_F32);
}

/* remainder_encode / remainder_decode's blocks */
static inline void decode_block(float *dst, const uint16_t *p, const int16_t *r, int64_t off, int len)
{
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        float32x4_t m[2];
        decode8(p, r, off + i, m);
        vst1q_f32(dst + i, m[0]);
        vst1q_f32(dst + i + 4, m[1]);
    }
    for (; i < len; i++) dst[i] = remainder_decode(p[off + i], (uint16_t)r[off + i]);
}

static inline void encode_block(uint16_t *p, int16_t *r, int64_t off, const float *src, int len, int nt)
{
    (void)nt;
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        const float32x4_t m[2] = {vld1q_f32(src + i), vld1q_f32(src + i + 4)};
        uint16x8_t ph, rh;
        encode8(m, &ph, &rh);
        vst1q_u16(p + off + i, ph);
        vst1q_u16((uint16_t *)r + off + i, rh);
    }
    for (; i < len; i++) {
        const uint32_t u = f32_bits(src[i]);
        p[off + i] = remainder_param_bits(u);
        r[off + i] = (int16_t)(uint16_t)u;
    }
}

/* grad_stats' 16 fp64 lanes as 8 two-lane accumulators: element i of a 16-element step goes
 * to lane i (kernels.h); x*x is exact in fp64, so fma and mul + add agree */
static inline void chunk_sumsq(const void *g, int dt, int64_t off, int64_t len, double *lanes)
{
    float64x2_t s[8];
    for (int q = 0; q < 8; q++) s[q] = vdupq_n_f64(0.0);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        float32x4_t x[4];
        load8(g, dt, off + i, x);
        load8(g, dt, off + i + 8, x + 2);
        for (int q = 0; q < 4; q++) {
            const float64x2_t lo = vcvt_f64_f32(vget_low_f32(x[q])), hi = vcvt_high_f64_f32(x[q]);
            s[2 * q] = vfmaq_f64(s[2 * q], lo, lo);
            s[2 * q + 1] = vfmaq_f64(s[2 * q + 1], hi, hi);
        }
    }
    for (int q = 0; q < 8; q++) vst1q_f64(lanes + 2 * q, s[q]);
    for (int l = 0; i < len; i++, l++) {
        const double x = (double)load_scalar(g, dt, off + i);
        lanes[l] += x * x;
    }
}

#include "adam_body.h"

#endif
