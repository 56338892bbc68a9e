/*
 * Decoding's two kernels of our own, in bfloat16 (machinery/bf16_rows.py builds this file and says when each is
 * used, and why): a few rows times a weight that oneDNN has packed (bf16_rows), and one row's attention over its
 * keys and values (bf16_attend).
 *
 * bf16_rows: a few rows of bfloat16 inputs times a bfloat16 weight that oneDNN has packed for its AMX kernels.
 *
 * oneDNN's packed weight, N outputs by K inputs, is in blocks of 32 outputs, each block K/2 pairs of inputs
 * long, each pair 32 outputs x 2 inputs (128 bytes): w[block][pair][output][2], the block's K padded to Kp
 * with zeros and the outputs to a multiple of 32 (bf16_rows.py checks that a packed weight is laid out so
 * before this reads it). One AVX-512 BF16 instruction (vdpbf16ps) multiplies a pair of inputs by 16 outputs'
 * pair of weights and adds both products to 16 float32 sums: the weights are read once, in the order they lie
 * in memory, which is what decoding's speed depends on.
 *
 * Every row is summed alone and in the same order, input pair after input pair, whatever the other rows: a
 * row's result does not depend on how many rows are computed together. Then the bias is added and the sum
 * rounded to bfloat16 (to nearest even), as oneDNN rounds its output.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define KERNEL __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static inline
#define GROUP 4        /* rows computed together: each reads a block's weights once for all of them */
#define PREFETCH 128   /* 64-byte lines ahead (8 KB) that a pass over a block asks the L2 cache for, both lines of
                          each pair: 0.76-0.83 of the time without, where the L1 (T0) or one line of two was asked for */

KERNEL __m512 widen(const uint16_t *b, __mmask16 mask) {  /* 16 bfloat16 as float32 (masked off: 0) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, b)), 16));
}

/* R rows (pairs of inputs xp[r]) against one block (w): its 32 outputs' sums in lo[r] (first 16), hi[r] */
#define ROWS(R) \
KERNEL void rows##R(const __m512i *w, const uint32_t **xp, long pairs, __m512 *lo, __m512 *hi) { \
    __m512 l[R], h[R]; \
    for (int r = 0; r < R; r++) l[r] = h[r] = _mm512_setzero_ps(); \
    for (long j = 0; j < pairs; j++) { \
        _mm_prefetch((const char *)(w + 2 * j + PREFETCH), _MM_HINT_T1); \
        _mm_prefetch((const char *)(w + 2 * j + 1 + PREFETCH), _MM_HINT_T1); \
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 2 * j), w1 = (__m512bh)_mm512_loadu_si512(w + 2 * j + 1); \
        for (int r = 0; r < R; r++) { \
            __m512bh x = (__m512bh)_mm512_set1_epi32(xp[r][j]); \
            l[r] = _mm512_dpbf16_ps(l[r], w0, x); \
            h[r] = _mm512_dpbf16_ps(h[r], w1, x); \
        } \
    } \
    for (int r = 0; r < R; r++) { lo[r] = l[r]; hi[r] = h[r]; } \
}
ROWS(1) ROWS(2) ROWS(3) ROWS(4)

KERNEL void block(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,
                  long M, long N, long K, long Kp, long b) {
    const __m512i *wb = (const __m512i *)(w + b * 32 * Kp);
    long n0 = b * 32, left = N - n0;  /* the last block's outputs past N are padding: not stored */
    __mmask16 mlo = left >= 16 ? 0xffff : (1u << left) - 1;
    __mmask16 mhi = left >= 32 ? 0xffff : left <= 16 ? 0 : (1u << (left - 16)) - 1;
    __m512 blo = bias ? widen(bias + n0, mlo) : _mm512_setzero_ps();
    __m512 bhi = bias ? widen(bias + n0 + 16, mhi) : _mm512_setzero_ps();
    for (long m = 0; m < M; m += GROUP) {
        long R = M - m < GROUP ? M - m : GROUP;
        const uint32_t *xp[GROUP];
        __m512 lo[GROUP], hi[GROUP];
        for (long r = 0; r < R; r++) xp[r] = (const uint32_t *)(x + (m + r) * K);
        if (R == 4) rows4(wb, xp, K / 2, lo, hi);
        else if (R == 3) rows3(wb, xp, K / 2, lo, hi);
        else if (R == 2) rows2(wb, xp, K / 2, lo, hi);
        else rows1(wb, xp, K / 2, lo, hi);
        for (long r = 0; r < R; r++) {
            uint16_t *out = y + (m + r) * N + n0;
            _mm256_mask_storeu_epi16(out, mlo, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(lo[r], blo)));
            _mm256_mask_storeu_epi16(out + 16, mhi, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(hi[r], bhi)));
        }
    }
}

/* y (M x N, bfloat16) = x (M x K, bfloat16, K even) times w (packed, as above) + bias (N, or NULL), the
 * blocks shared out among `threads` threads of the OpenMP runtime that PyTorch runs (bf16_rows.py links it) */
void bf16_rows(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,
               long M, long N, long K, long Kp, int threads) {
    long blocks = (N + 31) / 32;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++) block(w, x, bias, y, M, N, K, Kp, b);
}

/* bf16_attend: one row's attention, each head over its first n positions (the row's own), in float32: the
 * scores q.k * scale, their softmax (minus the largest first), and the values' sum weighted by it, rounded to
 * bfloat16 (to nearest even). q, and the new key and value kn, vn: heads x size, stored first at position n - 1 of
 * k, v: heads x (stride / size) positions x size, of which n are read; size a multiple of 16 (bf16_rows.py
 * checks). The heads are shared out among the threads; each head is summed in position order, whatever the
 * threads. */
#define AHEAD 32  /* positions ahead whose key (value) the L1 cache is asked for: 0.75-0.8 of the time without
                     (2 threads, 12 heads of 64, 200-1024 positions) */

KERNEL void ask_ahead(const uint16_t *row, long size) {  /* a position's key or value: a prefetch never faults */
    for (long i = 0; i < size; i += 32) _mm_prefetch((const char *)(row + i), _MM_HINT_T0);
}

KERNEL void attend_head(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, long n,
                        long size, float scale) {
    __m512 qv[16], o[16];  /* a head of up to 256 */
    float s[n];
    long c = size / 16;
    for (long i = 0; i < c; i++) { qv[i] = widen(q + 16 * i, 0xffff); o[i] = _mm512_setzero_ps(); }
    float top = -INFINITY, sum = 0;
    for (long j = 0; j < n; j++) {
        ask_ahead(k + (j + AHEAD) * size, size);
        __m512 acc = _mm512_mul_ps(qv[0], widen(k + j * size, 0xffff));
        for (long i = 1; i < c; i++) acc = _mm512_fmadd_ps(qv[i], widen(k + j * size + 16 * i, 0xffff), acc);
        s[j] = _mm512_reduce_add_ps(acc) * scale;
        top = s[j] > top ? s[j] : top;
    }
    for (long j = 0; j < n; j++) { s[j] = expf(s[j] - top); sum += s[j]; }
    for (long j = 0; j < n; j++) {
        __m512 p = _mm512_set1_ps(s[j]);
        ask_ahead(v + (j + AHEAD) * size, size);
        for (long i = 0; i < c; i++) o[i] = _mm512_fmadd_ps(p, widen(v + j * size + 16 * i, 0xffff), o[i]);
    }
    for (long i = 0; i < c; i++)
        _mm256_storeu_si256((__m256i *)(out + 16 * i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_div_ps(o[i], _mm512_set1_ps(sum))));
}

void bf16_attend(const uint16_t *q, const uint16_t *kn, const uint16_t *vn, uint16_t *k, uint16_t *v,
                 uint16_t *out, long heads, long n, long size, long stride, float scale, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long h = 0; h < heads; h++) {
        for (long i = 0; i < size; i++) {
            k[h * stride + (n - 1) * size + i] = kn[h * size + i];
            v[h * stride + (n - 1) * size + i] = vn[h * size + i];
        }
        attend_head(q + h * size, k + h * stride, v + h * stride, out + h * size, n, size, scale);
    }
}
