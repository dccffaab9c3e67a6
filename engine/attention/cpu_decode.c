/* Decode attention over the paged KV cache on CPU, bfloat16, reading the blocks in place.
 *
 * Why a native kernel: on CPU the torch path gathers every decode's K and V rows out of the
 * paged cache into a padded batch (one index_select per layer) and then runs SDPA over the copy.
 * At batch 16 x 500 positions that is ~2 ms per layer, 60% of a bf16 decode step, and most of it
 * is moving the same bytes twice. Here each work item walks one sequence's block table and reads
 * its K and V rows where they lie, once (docs/engine.md, "CPU decode attention").
 *
 * Numerics: bf16 inputs widened to float32, scores, softmax and the weighted sum of V in float32,
 * the output rounded once to bf16 (round to nearest even, as torch does). Positions are taken in
 * chunks of CHUNK with the usual running-max rescale, so the score buffer stays small for long
 * contexts. The softmax weights are not rounded to bf16 before they meet V (torch's CPU flash
 * kernel rounds them), so this is closer to the exact result than SDPA: see tests/test_cpu_decode.py.
 *
 * Layout (same as engine/attention/backend.py):
 *   kv      one layer viewed flat as [N * 2 * bs, Hkv, D]: block b's K rows at b * 2 * bs + o,
 *           its V rows bs rows further;
 *   q, out  [T, Hq, D], token q_start[s] is sequence s's one query;
 *   tables  [n, W] int32 block ids, row s for sequence s; seq_len[s] includes the new token.
 *
 * Work is split over (sequence, group of KV heads) items with OpenMP; torch's own OpenMP runtime
 * (libgomp, already loaded) runs them, so torch.set_num_threads applies here too.
 *
 * Compiled with -ffast-math for the vectorized expf, but linked without it: gcc links
 * crtfastmath.o into a -ffast-math shared object, which sets flush-to-zero for the whole process
 * when it loads. Nothing here relies on infinities: -FLT_MAX stands for "no score yet".
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 512

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Per-thread scratch, grown on demand and kept: a fresh allocation per call would page-fault. */
static __thread float *scratch_buf = NULL;
static __thread size_t scratch_cap = 0;

static float *scratch(size_t n) {
    if (n > scratch_cap) {
        free(scratch_buf);
        scratch_buf = malloc(n * sizeof(float));
        scratch_cap = scratch_buf ? n : 0;
    }
    return scratch_buf;
}

/* Every index the kernel will follow, checked before any is followed: a query row inside q,
   1 <= seq_len <= the table's width in positions, every block id it reads inside the cache. */
static int check(const int32_t *tables, int64_t W, const int32_t *seq_len, const int32_t *q_start, int64_t n,
                 int64_t T, int64_t N, int64_t bs) {
    for (int64_t s = 0; s < n; s++) {
        const int64_t L = seq_len[s];
        if (q_start[s] < 0 || q_start[s] >= T || L < 1 || L > W * bs) return 0;
        for (int64_t b = 0; b < (L + bs - 1) / bs; b++)
            if (tables[s * W + b] < 0 || tables[s * W + b] >= N) return 0;
    }
    return 1;
}

/* Returns 0; -2 for an index out of range or heads that do not divide (nothing written); -1 when
   a thread could not get scratch memory (out is then incomplete). q and out have T rows, the
   cache N blocks. */
int pd_decode_attention_bf16(const uint16_t *q, int64_t T, const uint16_t *kv, int64_t N, const int32_t *tables,
                             int64_t W, const int32_t *seq_len, const int32_t *q_start, int64_t n, int64_t Hq,
                             int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t heads_per_item,
                             uint16_t *out) {
    if (Hkv < 1 || Hq % Hkv || heads_per_item < 1 || Hkv % heads_per_item || D < 1 || bs < 1 || W < 0 ||
        !check(tables, W, seq_len, q_start, n, T, N, bs))
        return -2;
    const int64_t G = Hq / Hkv, row = Hkv * D, nh = heads_per_item, parts = Hkv / nh, nq = nh * G;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < n * parts; item++) {
        const int64_t s = item / parts, h0 = (item % parts) * nh;
        const int64_t L = seq_len[s];
        const int32_t *table = tables + s * W;
        /* qf [nq, D], acc [nq, D], sc [nq, CHUNK], mx / sum / cmx [nq], x [nh * D] */
        float *qf = scratch((size_t)(2 * nq * D + nq * CHUNK + 3 * nq + nh * D));
        if (!qf) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *acc = qf + nq * D, *sc = acc + nq * D, *mx = sc + nq * CHUNK, *sum = mx + nq;
        float *cmx = sum + nq, *x = cmx + nq;
        const uint16_t *qs = q + (q_start[s] * Hq + h0 * G) * D;
        for (int64_t j = 0; j < nq * D; j++) qf[j] = bf16_to_f32(qs[j]);
        for (int64_t j = 0; j < nq; j++) {
            mx[j] = -FLT_MAX;
            sum[j] = 0.f;
        }
        memset(acc, 0, sizeof(float) * nq * D);
        for (int64_t c0 = 0; c0 < L; c0 += CHUNK) {
            const int64_t c1 = c0 + CHUNK < L ? c0 + CHUNK : L;
            for (int64_t j = 0; j < nq; j++) cmx[j] = -FLT_MAX;
            for (int64_t p = c0; p < c1; p++) { /* scores: the item's heads read one K row */
                const uint16_t *k = kv + ((int64_t)table[p / bs] * 2 * bs + p % bs) * row + h0 * D;
                for (int64_t d = 0; d < nh * D; d++) x[d] = bf16_to_f32(k[d]);
                for (int64_t j = 0; j < nq; j++) {
                    const float *qq = qf + j * D, *kk = x + (j / G) * D;
                    float a = 0.f;
                    for (int64_t d = 0; d < D; d++) a += qq[d] * kk[d];
                    a *= scale;
                    sc[j * CHUNK + p - c0] = a;
                    cmx[j] = a > cmx[j] ? a : cmx[j];
                }
            }
            for (int64_t j = 0; j < nq; j++) { /* exp against the running max; rescale what came before */
                const float m = cmx[j] > mx[j] ? cmx[j] : mx[j];
                float total = 0.f, *r = sc + j * CHUNK;
                for (int64_t p = 0; p < c1 - c0; p++) {
                    const float e = expf(r[p] - m);
                    total += e;
                    r[p] = e;
                }
                if (c0) {
                    const float shrink = expf(mx[j] - m);
                    sum[j] *= shrink;
                    for (int64_t d = 0; d < D; d++) acc[j * D + d] *= shrink;
                }
                sum[j] += total;
                mx[j] = m;
            }
            for (int64_t p = c0; p < c1; p++) { /* weighted sum of one V row per position */
                const uint16_t *v = kv + ((int64_t)table[p / bs] * 2 * bs + bs + p % bs) * row + h0 * D;
                for (int64_t d = 0; d < nh * D; d++) x[d] = bf16_to_f32(v[d]);
                for (int64_t j = 0; j < nq; j++) {
                    const float w = sc[j * CHUNK + p - c0], *vv = x + (j / G) * D;
                    float *a = acc + j * D;
                    for (int64_t d = 0; d < D; d++) a[d] += w * vv[d];
                }
            }
        }
        uint16_t *o = out + (q_start[s] * Hq + h0 * G) * D;
        for (int64_t j = 0; j < nq; j++) {
            const float inv = 1.f / sum[j];
            for (int64_t d = 0; d < D; d++) o[j * D + d] = f32_to_bf16(acc[j * D + d] * inv);
        }
    }
    return failed ? -1 : 0;
}
