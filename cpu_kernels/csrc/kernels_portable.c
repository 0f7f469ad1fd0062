/* cpu_kernels, portable level: plain C that any compiler vectorises for the baseline ISA. */
#include "kernels.h"
#define LEVEL portable

static inline void load_block(float *dst, const void *src, int dt, int64_t off, int len, float scale)
{
    if (dt == DT_F32) {
        const float *p = (const float *)src + off;
        for (int i = 0; i < len; i++) dst[i] = p[i] * scale;
    } else {
        for (int i = 0; i < len; i++) dst[i] = load_scalar(src, dt, off + i) * scale;
    }
}

static inline void store_block(void *dst, int dt, int64_t off, const float *src, int len, int nt)
{
    (void)nt;
    if (dt == DT_F32) memcpy((float *)dst + off, src, (size_t)len * sizeof(float));
    else for (int i = 0; i < len; i++) store_scalar(dst, dt, off + i, src[i]);
}

static inline void finish_stores(void) {}

static inline void decode_block(float *dst, const uint16_t *p, const int16_t *r, int64_t off, int len)
{
    for (int i = 0; i < len; i++) dst[i] = remainder_decode(p[off + i], (uint16_t)r[off + i]);
}

static inline void encode_block(uint16_t *p, int16_t *r, int64_t off, const float *src, int len, int nt)
{
    (void)nt;
    for (int i = 0; i < len; i++) {
        const uint32_t u = f32_bits(src[i]);
        p[off + i] = remainder_param_bits(u);
        r[off + i] = (int16_t)(uint16_t)u;
    }
}

static inline void chunk_sumsq(const void *g, int dt, int64_t off, int64_t len, double *lanes)
{
    for (int l = 0; l < GRAD_STATS_LANES; l++) lanes[l] = 0.0;
    for (int64_t i = 0; i < len; i++) {
        const double x = (double)load_scalar(g, dt, off + i);
        lanes[i % GRAD_STATS_LANES] += x * x;
    }
}

#include "adam_body.h"
