// Paged decode attention on the CPU, float32: one query token per sequence, all sequences of an
// iteration in one call, reading K and V straight out of the paged pool through each sequence's
// block table (no gather, no padding).
//
// Pool layout of one layer: kv[2][num_kv_heads][num_slots][head_dim], slot = block * block_size + offset.
// Work is split over (sequence, kv head) pairs; each pair serves the num_heads / num_kv_heads query
// heads that share its kv head, so every key and value row is read from memory once.
//
// Per pair: scores s[j][i] = scale * <q_j, k_i> over the context, a max-subtracted softmax p[j][i],
// then out_j = sum_i p[j][i] v_i. The same arithmetic as SDPA's math path, in another order.

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

// Built with -O3 -ffast-math: reductions may reassociate (so they vectorise) and expf runs 8 wide.
// Scores are finite, so -FLT_MAX stands in for minus infinity.

static inline float dot(const float *restrict a, const float *restrict b, const int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

// One (sequence, kv head) pair: g query heads q[g][d] against len context rows; out[g][d].
// `static inline` with a constant d (see attend_one below) lets the compiler unroll over the head dim.
static inline void attend(const float *restrict q, const float *restrict k_head, const float *restrict v_head,
                          const int32_t *restrict blocks, const int64_t len, const int64_t g, const int64_t d,
                          const int64_t block_size, const float scale, float *restrict scores,
                          float *restrict out) {
    for (int64_t i = 0; i < len; i += block_size) {  // pass 1: scores, block by block
        const int64_t n = len - i < block_size ? len - i : block_size;
        const float *k = k_head + (int64_t)blocks[i / block_size] * block_size * d;
        for (int64_t j = 0; j < g; ++j)
            for (int64_t t = 0; t < n; ++t) scores[j * len + i + t] = scale * dot(q + j * d, k + t * d, d);
    }
    for (int64_t j = 0; j < g; ++j) {  // pass 2: softmax weights, normalised
        float *s = scores + j * len, m = -FLT_MAX, sum = 0.0f;
        for (int64_t i = 0; i < len; ++i) m = s[i] > m ? s[i] : m;
        for (int64_t i = 0; i < len; ++i) {
            s[i] = expf(s[i] - m);
            sum += s[i];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < len; ++i) s[i] *= inv;
        for (int64_t e = 0; e < d; ++e) out[j * d + e] = 0.0f;
    }
    for (int64_t i = 0; i < len; i += block_size) {  // pass 3: weighted sum of values
        const int64_t n = len - i < block_size ? len - i : block_size;
        const float *v = v_head + (int64_t)blocks[i / block_size] * block_size * d;
        for (int64_t j = 0; j < g; ++j) {
            float *o = out + j * d;
            const float *p = scores + j * len + i;
            for (int64_t t = 0; t < n; ++t)
                for (int64_t e = 0; e < d; ++e) o[e] += p[t] * v[t * d + e];
        }
    }
}

static void attend_one(const float *q, const float *k_head, const float *v_head, const int32_t *blocks,
                       int64_t len, int64_t g, int64_t d, int64_t block_size, float scale, float *scores,
                       float *out) {
    switch (d) {  // the common head dims get their own unrolled copy
    case 64:
        attend(q, k_head, v_head, blocks, len, g, 64, block_size, scale, scores, out);
        break;
    case 128:
        attend(q, k_head, v_head, blocks, len, g, 128, block_size, scale, scores, out);
        break;
    default:
        attend(q, k_head, v_head, blocks, len, g, d, block_size, scale, scores, out);
    }
}

// q: [B, H, d]; kv: one layer, [2, Hkv, S, d]; block_tables: [B, max_blocks]; lens: [B]; out: [B, H, d].
// Returns 0, or -1 when a scratch buffer could not be allocated.
int pd_decode_attention(const float *q, const float *kv, int64_t num_slots, const int32_t *block_tables,
                        int64_t max_blocks, const int32_t *lens, int64_t batch, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *out,
                        int num_threads) {
    const int64_t g = num_heads / num_kv_heads, d = head_dim, pairs = batch * num_kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t b = p / num_kv_heads, h = p % num_kv_heads, len = lens[b];
        float *scores = malloc(sizeof(float) * (size_t)(g * len));
        if (!scores) {
            failed |= 1;
            continue;
        }
        const float *k_head = kv + h * num_slots * d;
        const float *v_head = kv + (num_kv_heads + h) * num_slots * d;
        attend_one(q + (b * num_heads + h * g) * d, k_head, v_head, block_tables + b * max_blocks, len, g, d,
                   block_size, scale, scores, out + (b * num_heads + h * g) * d);
        free(scores);
    }
    return failed ? -1 : 0;
}
