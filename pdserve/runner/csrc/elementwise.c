// Fused elementwise ops of a decoder layer, float32, row-major. At decode sizes ([16, 512]) torch
// runs RMSNorm as about eight small ops of ~6 us each; these are one pass over the data each.
//
//   pd_rms_norm:      out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w
//   pd_add_rms_norm:  h[r] += x[r] (in place, the residual), then out[r] = rms_norm(h[r])
//   pd_silu_mul:      out[r] = silu(gu[r, :n]) * gu[r, n:]   (the gated MLP's activation)
//   pd_rope_store:    rotary embedding of q and k, and k, v written into the paged pool

#include <math.h>
#include <stdint.h>

#define PARALLEL_ROWS 64  // below this many rows one thread is faster than waking another

static inline void norm_row(const float *restrict x, const float *restrict w, float *restrict out,
                            const int64_t dim, const float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; ++i) out[i] = w[i] * (x[i] * inv);
}

void pd_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps,
                 int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * dim, w, out + r * dim, dim, eps);
}

void pd_add_rms_norm(float *h, const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps,
                     int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        float *hr = h + r * dim;
        const float *xr = x + r * dim;
        for (int64_t i = 0; i < dim; ++i) hr[i] += xr[i];
        norm_row(hr, w, out + r * dim, dim, eps);
    }
}

void pd_silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        // exp's argument is capped: exp(89) overflows to inf, and the fast reciprocal turns g / inf into NaN
        for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + expf(fminf(-g[i], 80.0f))) * u[i];
    }
}

// Rotary embedding of q and k (HF's rotate_half convention: x * cos + [-x2, x1] * sin, cos/sin [T, d]
// with both halves equal), then k and v written into one layer's pool kv[2][Hkv][S][d] at `slots`.
// q, k, v are [T, heads, d] with heads and d contiguous and a token stride of their own (they may be
// views into the fused QKV output); q_out is a contiguous [T, H, d].
static inline void rope_row(const float *restrict x, const float *restrict cos, const float *restrict sin,
                            float *restrict out, const int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

void pd_rope_store(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, const float *cos, const float *sin, float *q_out, float *kv,
                   int64_t num_slots, const int64_t *slots, int64_t tokens, int64_t heads, int64_t kv_heads,
                   int64_t d, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads; ++h) rope_row(q + t * q_stride + h * d, c, s, q_out + (t * heads + h) * d, d);
        for (int64_t h = 0; h < kv_heads; ++h) {
            float *k_dst = kv + (h * num_slots + slots[t]) * d;
            float *v_dst = kv + ((kv_heads + h) * num_slots + slots[t]) * d;
            rope_row(k + t * k_stride + h * d, c, s, k_dst, d);
            for (int64_t e = 0; e < d; ++e) v_dst[e] = v[t * v_stride + h * d + e];
        }
    }
}
