/* cpu_kernels, SVE level (AArch64 Scalable Vector Extension), vector-length agnostic.
 *
 * Chosen at run time where the kernel reports HWCAP_SVE (dispatch.c); nothing here assumes
 * a vector length: a step covers two fp32 vectors (2 x svcntw() elements; 8 on Grace's 128
 * bits, 128 at 2048), each 16-bit stream one full vector of halfwords split or joined by a
 * zip / unzip, and the last step runs under whilelt predicates (no scalar tail). The
 * arithmetic is adam_body.h's adam_math with fused multiply-adds (FMLA), so the bits are
 * those of the NEON and x86 AVX2/AVX-512 levels at every vector length. grad_stats keeps
 * its 16 logical fp64 lanes whatever the length: ceil(16 / svcntd()) accumulators, the last
 * (or only) one predicated to the lanes that exist. bf16 rounding is integer (see
 * kernels_neon.c for why not BFCVT).
 */
#include "kernels.h"
#define LEVEL sve
#define LEVEL_HAS_FMA 1

#ifdef HYBRID_HAVE_SVE
#pragma GCC target("+sve")
#include <arm_sve.h>

int hybrid_sve_vector_bits(void) { return (int)svcntb() * 8; }

/* adam_math on one vector (t: all lanes; inactive ones hold zeros and are never stored).
 * svmla(a, b, c) = a + b * c rounded once. */
static inline __attribute__((always_inline)) void adam_vec(
    svbool_t t, const int l2, const int ams, svfloat32_t w1, svfloat32_t b2, svfloat32_t w2, svfloat32_t eps,
    svfloat32_t nss, svfloat32_t ib, svfloat32_t decay, svfloat32_t wd, svfloat32_t gs,
    svfloat32_t p, svfloat32_t g, svfloat32_t m0, svfloat32_t v0, svfloat32_t x0,
    svfloat32_t *pn, svfloat32_t *mi, svfloat32_t *vi, svfloat32_t *vv)
{
    svfloat32_t gi = svmul_f32_x(t, g, gs);
    if (l2) gi = svmla_f32_x(t, gi, wd, p);
    *mi = svmla_f32_x(t, m0, w1, svsub_f32_x(t, gi, m0));
    *vi = svmla_f32_x(t, svmul_f32_x(t, v0, b2), w2, svmul_f32_x(t, gi, gi));
    /* maxps' rule: (vmax > v) ? vmax : v — a NaN on either side gives v (FMAX would not) */
    *vv = ams ? svsel_f32(svcmpgt_f32(t, x0, *vi), x0, *vi) : *vi;
    const svfloat32_t denom = svmla_f32_x(t, eps, svsqrt_f32_x(t, *vv), ib);
    *pn = svmla_f32_x(t, svmul_f32_x(t, nss, svdiv_f32_x(t, *mi, denom)), p, decay);
}

/* A step's predicates: ph over its 2 x svcntw() halfwords, p0 / p1 over its two fp32 halves */
typedef struct { int64_t i, nw; } pos_t;

/* 2 x svcntw() values of a stream in dtype dt from element i: x0 the first half, x1 the second */
static inline __attribute__((always_inline)) void load_pair(
    svbool_t ph, svbool_t p0, svbool_t p1, const void *src, int dt, pos_t s, svfloat32_t *x0, svfloat32_t *x1)
{
    if (dt == DT_F32) {
        const float *f = (const float *)src + s.i;
        *x0 = svld1_f32(p0, f);
        *x1 = svld1_f32(p1, f + s.nw);
        return;
    }
    const svuint16_t h = svld1_u16(ph, (const uint16_t *)src + s.i);
    if (dt == DT_BF16) {  /* each halfword into the top of its own 32-bit lane */
        const svuint16_t z = svdup_n_u16(0);
        *x0 = svreinterpret_f32_u16(svzip1_u16(z, h));
        *x1 = svreinterpret_f32_u16(svzip2_u16(z, h));
    } else {  /* FCVT reads the even (low) halfword of each 32-bit lane */
        const svfloat16_t f = svreinterpret_f16_u16(h);
        *x0 = svcvt_f32_f16_x(p0, svzip1_f16(f, f));
        *x1 = svcvt_f32_f16_x(p1, svzip2_f16(f, f));
    }
}

/* torch's bf16 rounding (nearest even, NaN -> 0x7FC0), the result in each lane's top half */
static inline __attribute__((always_inline)) svuint32_t bf16_high(svbool_t t, svfloat32_t x)
{
    const svuint32_t u = svreinterpret_u32_f32(x);
    const svuint32_t bias = svadd_n_u32_x(t, svand_n_u32_x(t, svlsr_n_u32_x(t, u, 16), 1), 0x7fff);
    return svsel_u32(svcmpuo_f32(t, x, x), svdup_n_u32(0x7fc00000u), svadd_u32_x(t, u, bias));
}

static inline __attribute__((always_inline)) void store_u16(svbool_t ph, uint16_t *d, svuint16_t x, int nt)
{
    if (nt) svstnt1_u16(ph, d, x); else svst1_u16(ph, d, x);
}

static inline __attribute__((always_inline)) void store_pair(
    svbool_t t, svbool_t ph, svbool_t p0, svbool_t p1, void *dst, int dt, pos_t s, svfloat32_t x0,
    svfloat32_t x1, int nt)
{
    if (dt == DT_F32) {
        float *f = (float *)dst + s.i;
        if (nt) { svstnt1_f32(p0, f, x0); svstnt1_f32(p1, f + s.nw, x1); }
        else { svst1_f32(p0, f, x0); svst1_f32(p1, f + s.nw, x1); }
        return;
    }
    svuint16_t h;
    if (dt == DT_BF16) {
        h = svuzp2_u16(svreinterpret_u16_u32(bf16_high(t, x0)), svreinterpret_u16_u32(bf16_high(t, x1)));
    } else {  /* FCVT writes the even halfword of each lane; round to nearest even as F16C */
        h = svreinterpret_u16_f16(svuzp1_f16(svcvt_f16_f32_x(t, x0), svcvt_f16_f32_x(t, x1)));
    }
    store_u16(ph, (uint16_t *)dst + s.i, h, nt);
}

/* remainders (kernels.h): the carry subtracted in 16-bit lanes, zip puts each remainder
 * below its param; the inverse unzips low halves (remainder) and high halves + carry */
static inline __attribute__((always_inline)) void decode_pair(
    svbool_t t, svbool_t ph, const uint16_t *p, const int16_t *r, pos_t s, svfloat32_t *m0, svfloat32_t *m1)
{
    const svuint16_t rr = svld1_u16(ph, (const uint16_t *)r + s.i);
    const svuint16_t h = svsub_u16_x(t, svld1_u16(ph, p + s.i), svlsr_n_u16_x(t, rr, 15));
    *m0 = svreinterpret_f32_u16(svzip1_u16(rr, h));
    *m1 = svreinterpret_f32_u16(svzip2_u16(rr, h));
}

static inline __attribute__((always_inline)) void encode_pair(
    svbool_t t, svfloat32_t m0, svfloat32_t m1, svuint16_t *ph, svuint16_t *rh)
{
    const svuint16_t u0 = svreinterpret_u16_f32(m0), u1 = svreinterpret_u16_f32(m1);
    *rh = svuzp1_u16(u0, u1);
    *ph = svadd_u16_x(t, svuzp2_u16(u0, u1), svlsr_n_u16_x(t, *rh, 15));
}

/* one instance per (exp_avg dtype, exp_avg_sq dtype) pair, as on the other levels */
static inline __attribute__((always_inline)) void adam_regs_body(
    const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end, const int mdt, const int vdt)
{
    const svbool_t t = svptrue_b32();
    const svfloat32_t w1 = svdup_n_f32(c->one_minus_beta1), b2 = svdup_n_f32(c->beta2);
    const svfloat32_t w2 = svdup_n_f32(c->one_minus_beta2), eps = svdup_n_f32(c->eps);
    const svfloat32_t nss = svdup_n_f32(c->neg_step_size), ib = svdup_n_f32(c->inv_bias_correction2_sqrt);
    const svfloat32_t decay = svdup_n_f32(c->decay), wd = svdup_n_f32(c->l2), gs = svdup_n_f32(c->grad_scale);
    const int l2 = c->l2_mode, ams = c->amsgrad, rem = a->remainder != NULL, gdt = a->grad_dtype;
    const int nts = hybrid_arm_streaming_stores_on && c->out_of_place, ntc = hybrid_arm_streaming_stores_on;
    const uint16_t *p16 = (const uint16_t *)(const void *)a->param;
    uint16_t *po16 = (uint16_t *)(void *)a->param_out;
    const int64_t nw = (int64_t)svcntw();
    const svfloat32_t zero = svdup_n_f32(0.0f);
    for (int64_t i = begin; i < end; i += 2 * nw) {
        const pos_t s = {i, nw};
        const svbool_t ph = svwhilelt_b16_s64(i, end);
        const svbool_t p0 = svwhilelt_b32_s64(i, end), p1 = svwhilelt_b32_s64(i + nw, end);
        svfloat32_t q0, q1, g0, g1, m0, m1, v0, v1, x0 = zero, x1 = zero;
        svfloat32_t pn0, pn1, mi0, mi1, vi0, vi1, vv0, vv1;
        if (rem) decode_pair(t, ph, p16, a->remainder, s, &q0, &q1);
        else load_pair(ph, p0, p1, a->param, DT_F32, s, &q0, &q1);
        load_pair(ph, p0, p1, a->grad, gdt, s, &g0, &g1);
        load_pair(ph, p0, p1, a->exp_avg, mdt, s, &m0, &m1);
        load_pair(ph, p0, p1, a->exp_avg_sq, vdt, s, &v0, &v1);
        if (ams) load_pair(ph, p0, p1, a->max_exp_avg_sq, vdt, s, &x0, &x1);
        adam_vec(t, l2, ams, w1, b2, w2, eps, nss, ib, decay, wd, gs, q0, g0, m0, v0, x0, &pn0, &mi0, &vi0, &vv0);
        adam_vec(t, l2, ams, w1, b2, w2, eps, nss, ib, decay, wd, gs, q1, g1, m1, v1, x1, &pn1, &mi1, &vi1, &vv1);
        if (rem) {
            svuint16_t hp, hr;
            encode_pair(t, pn0, pn1, &hp, &hr);
            store_u16(ph, po16 + i, hp, nts);
            store_u16(ph, (uint16_t *)a->remainder_out + i, hr, nts);
        } else {
            store_pair(t, ph, p0, p1, a->param_out, DT_F32, s, pn0, pn1, nts);
        }
        store_pair(t, ph, p0, p1, a->exp_avg_out, mdt, s, mi0, mi1, nts);
        store_pair(t, ph, p0, p1, a->exp_avg_sq_out, vdt, s, vi0, vi1, nts);
        if (ams) store_pair(t, ph, p0, p1, a->max_exp_avg_sq_out, vdt, s, vv0, vv1, nts);
        if (a->param_copy) store_pair(t, ph, p0, p1, a->param_copy, a->copy_dtype, s, pn0, pn1, ntc);
    }
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

/* remainder_encode / remainder_decode's blocks: one fp32 vector a step, 16-bit streams
 * through extending loads and truncating stores */
static inline void decode_block(float *dst, const uint16_t *p, const int16_t *r, int64_t off, int len)
{
    const svbool_t t = svptrue_b32();
    for (int i = 0; i < len; i += (int)svcntw()) {
        const svbool_t pg = svwhilelt_b32_s32(i, len);
        const svuint32_t rr = svld1uh_u32(pg, (const uint16_t *)r + off + i);
        const svuint32_t h = svsub_u32_x(t, svld1uh_u32(pg, p + off + i), svlsr_n_u32_x(t, rr, 15));
        svst1_f32(pg, dst + i, svreinterpret_f32_u32(svorr_u32_x(t, svlsl_n_u32_x(t, h, 16), rr)));
    }
}

static inline void encode_block(uint16_t *p, int16_t *r, int64_t off, const float *src, int len, int nt)
{
    (void)nt;
    const svbool_t t = svptrue_b32();
    for (int i = 0; i < len; i += (int)svcntw()) {
        const svbool_t pg = svwhilelt_b32_s32(i, len);
        const svuint32_t u = svreinterpret_u32_f32(svld1_f32(pg, src + i));
        const svuint32_t hi = svadd_u32_x(t, svlsr_n_u32_x(t, u, 16), svand_n_u32_x(t, svlsr_n_u32_x(t, u, 15), 1));
        svst1h_u32(pg, p + off + i, hi);  /* truncating: the 16-bit wrap-around of the carry */
        svst1h_u32(pg, (uint16_t *)r + off + i, u);
    }
}

/* fp64 squares of the elements j.. in pk's lanes */
static inline __attribute__((always_inline)) svfloat64_t squares_f64(const void *g, int dt, int64_t j, svbool_t pk)
{
    svfloat64_t x;
    if (dt == DT_F32) {
        x = svcvt_f64_f32_x(pk, svreinterpret_f32_u64(svld1uw_u64(pk, (const uint32_t *)g + j)));
    } else {
        const svuint64_t h = svld1uh_u64(pk, (const uint16_t *)g + j);
        x = dt == DT_BF16 ? svcvt_f64_f32_x(pk, svreinterpret_f32_u64(svlsl_n_u64_x(pk, h, 16)))
                          : svcvt_f64_f16_x(pk, svreinterpret_f16_u64(h));
    }
    return svmul_f64_x(pk, x, x);  /* exact: 24-bit significands */
}

/* grad_stats with R = ceil(16 / svcntd()) accumulators: accumulator k holds logical lanes
 * [k * svcntd(), min(16, (k + 1) * svcntd())), lanes past 16 predicated off, so every lane
 * sums its elements in element order at any vector length */
#define ACC(k)                                                                                 \
    if (R > k) acc##k = svadd_f64_m(q##k, acc##k, squares_f64(g, dt, off + i + k * nd, q##k));
#define ACC_DECL(k) const svbool_t q##k = svwhilelt_b64_s64(k * nd, 16); svfloat64_t acc##k = svdup_n_f64(0.0);
#define ACC_STORE(k) if (R > k) svst1_f64(q##k, lanes + k * nd, acc##k);

static inline __attribute__((always_inline)) void sumsq_r(const void *g, int dt, int64_t off, int64_t len,
                                                          double *lanes, const int R)
{
    const int64_t nd = (int64_t)svcntd();
    ACC_DECL(0) ACC_DECL(1) ACC_DECL(2) ACC_DECL(3) ACC_DECL(4) ACC_DECL(5) ACC_DECL(6) ACC_DECL(7)
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    }
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5) ACC_STORE(6) ACC_STORE(7)
    for (int l = 0; i < len; i++, l++) {
        const double x = (double)load_scalar(g, dt, off + i);
        lanes[l] += x * x;
    }
}
#undef ACC
#undef ACC_DECL
#undef ACC_STORE

static inline void chunk_sumsq(const void *g, int dt, int64_t off, int64_t len, double *lanes)
{
    switch ((int)((16 + svcntd() - 1) / svcntd())) {  /* 8 at 128 bits ... 1 from 1024 */
    case 1: sumsq_r(g, dt, off, len, lanes, 1); break;
    case 2: sumsq_r(g, dt, off, len, lanes, 2); break;
    case 3: sumsq_r(g, dt, off, len, lanes, 3); break;
    case 4: sumsq_r(g, dt, off, len, lanes, 4); break;
    case 5: sumsq_r(g, dt, off, len, lanes, 5); break;
    case 6: sumsq_r(g, dt, off, len, lanes, 6); break;
    case 7: sumsq_r(g, dt, off, len, lanes, 7); break;
    default: sumsq_r(g, dt, off, len, lanes, 8); break;
    }
}

#include "adam_body.h"

#endif
