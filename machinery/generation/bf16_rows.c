/*
 * Decoding's kernels of our own, in bfloat16 (machinery/bf16_rows.py builds this file and says when each is
 * used, and why): rows times a weight that oneDNN has packed (bf16_rows), one row's attention over its keys and
 * values (bf16_attend), and a whole Block of some rows, one new position each (bf16_block).
 *
 * bf16_rows: rows of bfloat16 inputs times a bfloat16 weight that oneDNN has packed for its AMX kernels, by
 * AMX's tiles.
 *
 * oneDNN's packed weight, N outputs by K inputs, is in blocks of 32 outputs, each block K/2 pairs of inputs
 * long, each pair 32 outputs x 2 inputs (128 bytes): w[block][pair][output][2], the block's K padded to Kp
 * with zeros and the outputs to a multiple of 32 (bf16_rows.py checks that a packed weight is laid out so
 * before this reads it). That is the layout of AMX's second operand: 16 pairs of a block's first 16 outputs are
 * one tile (16 rows of 64 bytes, 128 bytes apart), its other 16 outputs the next. One tdpbf16ps multiplies 16
 * rows of 32 inputs (the rows copied, padded with zeros to a multiple of 16 rows and Kp inputs) by such a tile
 * and adds the products to 16 x 16 float32 sums: a block's weights are read once, in the order they lie in
 * memory, for up to 32 rows at a time, which is what decoding's speed depends on. (AMX reads bfloat16 subnormals
 * as 0 and flushes float32 ones: far below any weight's or input's size.)
 *
 * Every row is summed alone and in the same order, 32 inputs at a time (the instruction computes each row of a
 * tile alone), whatever the other rows: a row's result does not depend on how many rows are computed together.
 * Then the bias is added and the sum rounded to bfloat16 (to nearest even), as oneDNN rounds its output.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define KERNEL TARGET static inline
#define TILES __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX TILES static inline
#define PREFETCH 8192  /* bytes ahead in a block's weights that a pass over it asks the L2 cache for (measured for
                          AVX-512's kernel before this one: 0.76-0.83 of the time without) */

KERNEL __m512 widen(const uint16_t *b, __mmask16 mask) {  /* 16 bfloat16 as float32 (masked off: 0) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, b)), 16));
}

KERNEL void store(uint16_t *y, __m512 v, __mmask16 mask) {  /* 16 float32 as bfloat16, rounded to nearest even */
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Linux lends a process AMX's tile registers once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA): 0 if so. */
int bf16_amx(void) {
    return (int)syscall(SYS_arch_prctl, 0x1023, 18);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];  /* a tile's row, in bytes */
    uint8_t rows[16];
} __attribute__((packed)) tiles;

AMX void configure(void) {  /* every tile 16 rows of 64 bytes: 0-3 sums (rows x 16 float32), 4-5 rows, 6-7 weights */
    tiles t;
    memset(&t, 0, sizeof t);
    t.palette = 1;
    for (int i = 0; i < 8; i++) { t.rows[i] = 16; t.bytes[i] = 64; }
    _tile_loadconfig(&t);
}

/* sums (two rows' tiles' worth: 32 x 32 float32) + bias, rounded, into the first `rows` rows of y's block b */
AMX void store_rows(const float *sums, const uint16_t *bias, uint16_t *y, long rows, long N, long b) {
    long n0 = b * 32, left = N - n0;  /* the last block's outputs past N are padding: not stored */
    __mmask16 mlo = left >= 16 ? 0xffff : (1u << left) - 1;
    __mmask16 mhi = left >= 32 ? 0xffff : left <= 16 ? 0 : (1u << (left - 16)) - 1;
    __m512 blo = bias ? widen(bias + n0, mlo) : _mm512_setzero_ps();
    __m512 bhi = bias ? widen(bias + n0 + 16, mhi) : _mm512_setzero_ps();
    for (long m = 0; m < rows; m++) {
        uint16_t *out = y + m * N + n0;
        store(out, _mm512_add_ps(_mm512_loadu_ps(sums + m * 32), blo), mlo);
        store(out + 16, _mm512_add_ps(_mm512_loadu_ps(sums + m * 32 + 16), bhi), mhi);
    }
}

/* tile_block: block b of the weights times rows (Mp x Kp, Mp a multiple of 16), 32 rows at a time, into y's
 * first M rows */
AMX void tile_block(const char *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,
               long M, long Mp, long N, long Kp, long b) {
    float sums[32 * 32];
    w += b * 32 * Kp * 2;
    for (long g = 0; g < Mp; g += 32) {
        const uint16_t *rows = x + g * Kp;
        int two = Mp - g > 16;  /* a second tile of rows */
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (long k = 0; k < Kp; k += 32) {
            const char *p = w + k * 64;  /* 16 pairs of 128 bytes */
            for (int line = 0; line < 2048; line += 64) _mm_prefetch(p + PREFETCH + line, _MM_HINT_T1);
            _tile_loadd(6, p, 128);
            _tile_loadd(7, p + 64, 128);
            _tile_loadd(4, rows + k, Kp * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, rows + 16 * Kp + k, Kp * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, sums, 128);
        _tile_stored(1, sums + 16, 128);
        _tile_stored(2, sums + 16 * 32, 128);
        _tile_stored(3, sums + 16 * 32 + 16, 128);
        store_rows(sums, bias, y + g * N, M - g < 32 ? M - g : 32, N, b);
    }
}

/* y (M x N, bfloat16) = x (M x K, bfloat16, K even) times w (packed, as above) + bias (N, or NULL), the blocks
 * shared out among `threads` threads of the OpenMP runtime that PyTorch runs (bf16_rows.py links it); the rows
 * copied first, padded with zeros to a multiple of 16 rows and Kp inputs; each thread's tiles configured for it.
 * Needs AMX, lent (bf16_amx); -1 where memory ran out, else 0. */
TILES int bf16_rows(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y,
                    long M, long N, long K, long Kp, int threads) {
    long blocks = (N + 31) / 32, Mp = (M + 15) / 16 * 16;
    uint16_t *rows = calloc(Mp * Kp, sizeof *rows);
    if (!rows)
        return -1;
    for (long m = 0; m < M; m++) memcpy(rows + m * Kp, x + m * K, K * sizeof *rows);
    #pragma omp parallel num_threads(threads)
    {
        configure();
        #pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) tile_block((const char *)w, rows, bias, y, M, Mp, N, Kp, b);
        _tile_release();
    }
    free(rows);
    return 0;
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
    for (long i = 0; i < c; i++) store(out + 16 * i, _mm512_div_ps(o[i], _mm512_set1_ps(sum)), 0xffff);
}

KERNEL void store_and_attend(const uint16_t *q, const uint16_t *kn, const uint16_t *vn, uint16_t *k, uint16_t *v,
                             uint16_t *out, long n, long size, float scale) {  /* one head */
    for (long i = 0; i < size; i++) {
        k[(n - 1) * size + i] = kn[i];
        v[(n - 1) * size + i] = vn[i];
    }
    attend_head(q, k, v, out, n, size, scale);
}

void bf16_attend(const uint16_t *q, const uint16_t *kn, const uint16_t *vn, uint16_t *k, uint16_t *v,
                 uint16_t *out, long heads, long n, long size, long stride, float scale, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long h = 0; h < heads; h++)
        store_and_attend(q + h * size, kn + h * size, vn + h * size, k + h * stride, v + h * stride, out + h * size,
                         n, size, scale);
}

/*
 * bf16_layer_norm, bf16_gelu, bf16_block: a whole transformer block (model.py's Block) for a decoding pass's
 * rows, one new position each, in one call: a pass spends a third of its time between the products in
 * PyTorch's operations and Python around them otherwise (BENCHMARKS.md). Each step rounds to bfloat16 where
 * PyTorch's bfloat16 Block rounds, and computes in float32 between, as PyTorch's CPU kernels do: a result may
 * differ from PyTorch's in its last bit where the two float32 values lie either side of a rounding boundary.
 */
#define LANES(C) for (long c = 0; c < (C); c += 16)
#define MASK(C) ((C) - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << ((C) - c)) - 1))

/* M rows of C: (x - mean) / sqrt(variance + eps) * g + b (b may be NULL), mean and variance over the row's C in
 * float32 (the variance from the mean: two passes) */
TARGET void bf16_layer_norm(const uint16_t *x, const uint16_t *g, const uint16_t *b, uint16_t *y, long M, long C,
                     float eps) {
    for (long m = 0; m < M; m++, x += C, y += C) {
        __m512 sum = _mm512_setzero_ps(), squares = _mm512_setzero_ps();
        LANES(C) sum = _mm512_add_ps(sum, widen(x + c, MASK(C)));
        float mean = _mm512_reduce_add_ps(sum) / C;
        LANES(C) {
            __m512 d = _mm512_maskz_sub_ps(MASK(C), widen(x + c, MASK(C)), _mm512_set1_ps(mean));
            squares = _mm512_fmadd_ps(d, d, squares);
        }
        float rstd = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / C + eps);
        __m512 scale = _mm512_set1_ps(rstd), shift = _mm512_set1_ps(-mean * rstd);
        LANES(C) {
            __m512 v = _mm512_mul_ps(_mm512_fmadd_ps(widen(x + c, MASK(C)), scale, shift), widen(g + c, MASK(C)));
            store(y + c, b ? _mm512_add_ps(v, widen(b + c, MASK(C))) : v, MASK(C));
        }
    }
}

KERNEL __m512 exp_ps(__m512 x) {  /* e^x, within 2 units in float32's last place (x clamped to [-104, 88]: 0 below,
                                    the largest float32 e^x above) */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-104.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);  /* x - k ln 2, ln 2 in two parts */
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);  /* e^r's Taylor series to r^7: |r| <= 0.35, error below 6e-9 */
    static const float c[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, k);
}

KERNEL __m512 gelu_erf(__m512 x) {  /* x * P(X <= x), X standard normal: through erfc, accurate in both tails */
    __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.707106781f));
    /* erfc(z) = t exp(-z^2 + poly(t)), t = 1 / (1 + z / 2): fractional error below 1.2e-7 for z >= 0 (Numerical
     * Recipes' erfcc, a Chebyshev fit) */
    __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f)));
    static const float c[] = {1.48851587f, -1.13520398f, 0.27886807f, -0.18628806f, 0.09678418f, 0.37409196f,
                              1.00002368f, -1.26551223f};
    __m512 p = _mm512_set1_ps(0.17087277f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.82215223f));
    for (int i = 0; i < 8; i++) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(c[i]));
    __m512 half_erfc = _mm512_mul_ps(_mm512_mul_ps(t, exp_ps(_mm512_fnmadd_ps(z, z, p))), _mm512_set1_ps(0.5f));
    __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    /* x >= 0: x (1 - erfc / 2); x < 0: x erfc / 2 */
    __m512 p_x = _mm512_mask_blend_ps(negative, _mm512_sub_ps(_mm512_set1_ps(1.0f), half_erfc), half_erfc);
    return _mm512_mul_ps(x, p_x);
}

KERNEL __m512 gelu_tanh(__m512 x) {  /* x (1 + tanh(u)) / 2, u = sqrt(2/pi) (x + 0.044715 x^3), as x / (1 + e^(-2u))
                                       for u >= 0 and x e^(2u) / (1 + e^(2u)) below: accurate in both tails */
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.797884561f),
                             _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(x, x), x), _mm512_set1_ps(0.044715f), x));
    __m512 e = exp_ps(_mm512_mul_ps(_mm512_abs_ps(u), _mm512_set1_ps(-2.0f)));
    __mmask16 negative = _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_div_ps(_mm512_mask_mul_ps(x, negative, x, e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* y = GELU(x), n values (y may be x): tanh's approximation (GPT-2's) or the exact one (erf) */
TARGET void bf16_gelu(const uint16_t *x, uint16_t *y, long n, int tanh) {
    LANES(n) store(y + c, tanh ? gelu_tanh(widen(x + c, MASK(n))) : gelu_erf(widen(x + c, MASK(n))), MASK(n));
}

KERNEL void add_to(uint16_t *x, const uint16_t *a, long n) {  /* x += a, rounded to bfloat16 */
    LANES(n) store(x + c, _mm512_add_ps(widen(x + c, MASK(n)), widen(a + c, MASK(n))), MASK(n));
}

/* One Block for M rows x (M x C, bfloat16, updated in place), one new position each: row m's keys and values
 * k[m], v[m] (heads x stride), its new ones stored at position n[m] - 1. w: the block's tensors, in order LayerNorm
 * 1's weight and bias, the q/k/v product's packed weight and bias, W_O's, LayerNorm 2's, the MLP's two products'
 * (a bias may be NULL); d: C, the MLP's width, heads, head size, each packed weight's padded inputs (4), GELU's
 * kind (1: tanh). The rows' attention heads are shared out among the threads, as each product's blocks. -1
 * where memory ran out (x then not the Block's output), else 0. */
TILES int bf16_block(const void *const *w, const long *d, float eps, uint16_t *x, long M, uint16_t *const *k,
                     uint16_t *const *v, const long *n, long stride, int threads) {
    long C = d[0], H = d[1], heads = d[2], size = d[3];
    uint16_t *h = malloc(M * (6 * C + H) * sizeof *h);
    if (!h)
        return -1;
    uint16_t *qkv = h + M * C, *y = qkv + M * 3 * C, *a = y + M * C, *f = a + M * C;
    float scale = 1.0f / sqrtf((float)size);
    int failed = 0;
    bf16_layer_norm(x, w[0], w[1], h, M, C, eps);
    failed |= bf16_rows(w[2], h, w[3], qkv, M, 3 * C, C, d[4], threads);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long i = 0; i < M * heads; i++) {
        long m = i / heads, j = i % heads;
        const uint16_t *row = qkv + m * 3 * C + j * size;
        store_and_attend(row, row + C, row + 2 * C, k[m] + j * stride, v[m] + j * stride, y + m * C + j * size,
                         n[m], size, scale);
    }
    failed |= bf16_rows(w[4], y, w[5], a, M, C, C, d[5], threads);
    add_to(x, a, M * C);
    bf16_layer_norm(x, w[6], w[7], h, M, C, eps);
    failed |= bf16_rows(w[8], h, w[9], f, M, H, C, d[6], threads);
    bf16_gelu(f, f, M * H, d[8]);
    failed |= bf16_rows(w[10], f, w[11], a, M, C, H, d[7], threads);
    add_to(x, a, M * C);
    free(h);
    return failed;
}
