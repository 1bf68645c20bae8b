/*
 * HOT_LOOP: a function attribute for the C extensions' per-element loops. GCC and clang build an AVX2 copy of
 * the function next to the baseline (x86-64, SSE2) one and pick at load time; GCC adds an x86-64-v4 (AVX-512)
 * copy. Every copy computes the same integers and IEEE results; the wider ones only take more lanes per
 * instruction (the baseline cannot even vectorize a byte swap: SSE2 has no byte shuffle). Elsewhere (no
 * target_clones, not x86-64) it is nothing. Used by hostlib/_quantize.h and softswitch/_swcore.c.
 */
#ifndef LTA_HOTLOOP_H
#define LTA_HOTLOOP_H

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones) && !defined(__APPLE__)
#if defined(__GNUC__) && !defined(__clang__)
#define HOT_LOOP __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define HOT_LOOP __attribute__((target_clones("avx2", "default")))
#endif
#endif
#endif
#ifndef HOT_LOOP
#define HOT_LOOP
#endif

#endif
