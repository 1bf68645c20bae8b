/*
 * The quantize loop shared by hostlib._codec (the codec's fast path) and hostlib._engine (the reduce
 * engine's native path, which quantizes straight into its packet rows): one definition, so the two give
 * the same integers for the same seed. See hostlib/_codec.c for the contract of quantize.
 */
#ifndef LTA_QUANTIZE_H
#define LTA_QUANTIZE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define GOLDEN_GAMMA 0x9E3779B97F4A7C15ULL

/* The loops below are branch-free selects over lanes; GCC only turns a select whose arm is a float-to-int
 * conversion into a lane mask when it may assume floating-point operations do not trap (clang assumes so
 * by default). Nothing here enables FP traps, and the option changes no result. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

/* HOT_LOOP (hostlib/_hotloop.h): an AVX2 and, with GCC, an x86-64-v4 (AVX-512) copy of each loop next to the
 * baseline one; the v4 copy's native 64-bit lane multiply halves the cost of the splitmix64 draws (AVX2 has
 * none: it builds each from three 32-bit ones). Every copy gives identical results: the same IEEE
 * operations, and no fused multiply-add (x86-64-v4 has FMA; contraction is off below, and the products are
 * exact anyway). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "_hotloop.h"

static inline uint64_t splitmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Random bits for one row: k / 2 + 1 words of the splitmix64 stream from ``counter`` (two values each). */
HOT_LOOP
static void draw_bits(uint64_t *words, Py_ssize_t n, uint64_t counter) {
    for (Py_ssize_t p = 0; p < n; p++)
        words[p] = splitmix64(counter + (uint64_t)(p + 1) * GOLDEN_GAMMA);
}

/* One row: x * 2^shift in float32 (exact, as in the reference: a power of two only moves the exponent),
 * then floor(v) + (u < v - floor(v)) with u a 24-bit uniform: for |v| >= 1 the fraction has at most 23
 * bits, so the round-up probability is exactly the fraction; below 1 it is within 2^-24. Values past the
 * limit are flagged and clamped; NaN and Inf are flagged in *bad (the caller refuses the row). The body is
 * branch-free over 32-bit lanes so that it vectorizes (the comparisons are the quiet ones, which the compiler
 * may turn into lane masks); ``swap`` is a constant in each instance. */
static inline __attribute__((always_inline)) void quantize_body(const char *src, char *dst, Py_ssize_t k,
                                                                float scale, float limit, const int swap,
                                                                const uint32_t *bits, int *bad, int *sat) {
    int b = 0, s = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        float x;
        memcpy(&x, src + 4 * j, 4);
        b |= !__builtin_islessequal(fabsf(x), 3.40282347e38f);
        float v = x * scale;
        /* floor(v): adding and removing 2^23 rounds |v| < 2^23 to an integer (exact float32 steps, in the
         * default rounding mode), one is taken off where that went up; from 2^23 on v is an integer. This
         * vectorizes with or without SSE4.1's round instruction, floorf does not. */
        float c = copysignf(0x1p23f, v);
        float t = (v + c) - c;
        float f = __builtin_isless(fabsf(v), 0x1p23f) ? t - (__builtin_isgreater(t, v) ? 1.0f : 0.0f) : v;
        float u = (float)(int32_t)(bits[j] >> 8) * 0x1p-24f;
        float q = f + (__builtin_isless(u, v - f) ? 1.0f : 0.0f);
        int over = __builtin_isgreater(q, limit), under = __builtin_isless(q, -limit);
        s |= over | under;
        q = over ? limit : q;
        q = under ? -limit : q;
        /* NaN: the row is refused afterwards; until then keep the conversion below defined. */
        q = __builtin_isunordered(q, q) ? 0.0f : q;
        uint32_t w = (uint32_t)(int32_t)q;
        if (swap)
            w = __builtin_bswap32(w);
        memcpy(dst + 4 * j, &w, 4);
    }
    *bad = b;
    *sat = s;
}

HOT_LOOP
static void quantize_row(const char *src, char *dst, Py_ssize_t k, float scale, float limit, int swap,
                         const uint32_t *bits, int *bad, int *sat) {
    if (swap)
        quantize_body(src, dst, k, scale, limit, 1, bits, bad, sat);
    else
        quantize_body(src, dst, k, scale, limit, 0, bits, bad, sat);
}

/* One row of sums back to float32: float32(double(int32) * scale), one rounding (the reference's
 * arithmetic). ``swap``: the int32 are stored in the other byte order. Shared by hostlib._codec's dequantize
 * and hostlib._engine's settle (which reads the big-endian payload of a RESULT in place). */
static inline __attribute__((always_inline)) void dequantize_body(const char *src, char *dst, Py_ssize_t k,
                                                                  double scale, const int swap) {
    for (Py_ssize_t j = 0; j < k; j++) {
        uint32_t w;
        memcpy(&w, src + 4 * j, 4);
        if (swap)
            w = __builtin_bswap32(w);
        float y = (float)((double)(int32_t)w * scale);
        memcpy(dst + 4 * j, &y, 4);
    }
}

HOT_LOOP
static void dequantize_row(const char *src, char *dst, Py_ssize_t k, double scale, int swap) {
    if (swap)
        dequantize_body(src, dst, k, scale, 1);
    else
        dequantize_body(src, dst, k, scale, 0);
}

/* Rows rows[i] (i < n; rows None: row i) of the source quantized into the same rows of ``dst`` with shift
 * shifts[i], the random bits of row i drawn from the splitmix64 stream at seed + i * words * GAMMA (words
 * = k / 2 + 1, held in ``bits``); saturated[i] set. Returns the first row holding NaN or Inf, or -1. The
 * source: row r lies at src + r * src_stride below row ``split``, at tail + r * src_stride from it on (a
 * reduce quantizes the caller's full chunks where they lie and only its last rows from staging; split 0:
 * every row from tail). The random bits depend on i alone, wherever the row is read from. */
static Py_ssize_t quantize_rows(const char *src, Py_ssize_t split, const char *tail, Py_ssize_t src_stride,
                                char *dst, Py_ssize_t dst_stride, Py_ssize_t k, const int64_t *rows, Py_ssize_t n,
                                const int32_t *shifts, float limit, int swap, uint64_t seed, uint64_t *bits,
                                uint8_t *saturated) {
    const Py_ssize_t words = k / 2 + 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t r = rows ? (Py_ssize_t)rows[i] : i;
        int shift = shifts[i] < -149 ? -149 : (shifts[i] > 127 ? 127 : shifts[i]);
        int bad, s;
        /* Row i takes the next stretch of one splitmix64 sequence: rows never share random bits. */
        draw_bits(bits, words, seed + (uint64_t)i * (uint64_t)words * GOLDEN_GAMMA);
        quantize_row((r < split ? src : tail) + r * src_stride, dst + r * dst_stride, k, ldexpf(1.0f, shift), limit, swap,
                     (const uint32_t *)bits, &bad, &s);
        if (bad)
            return r;
        saturated[i] = (uint8_t)s;
    }
    return -1;
}

#endif
