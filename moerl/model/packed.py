"""CPU kernels of an engine's fp32 or bf16 decode step (issue 42 part 2): the routed experts' GEMMs from prepacked
weights, attention read from the paged KV cache in place, and RMSNorm in one call.

At decode's shapes (a few rows per expert, an expert's weight of a MiB) a grouped GEMM is bound by streaming the
weights, and MKL's sgemm streams them at a fraction of the rate a plain read does (BENCHMARKS.md, issue 42). The
expert kernel reads each expert's weight once per step, panel by panel, in the order it is stored: the weight
[E, K, N] packed once into panels [E, N / NT, K, NT] (NT columns, two CPU vectors), the rows of a group kept in
registers against each panel. For the gate-up projection each panel holds VW gate columns then the matching VW up
columns, so the activation (SiLU(gate) * up) and the routing weight are applied as the panel's result is stored:
the [rows, 2I] product never reaches memory. The packed copy is kept beside the parameter (``packed_weight``) and
made again when the parameter changes (a weight sync's ``copy_`` bumps its version): an engine's experts take twice
their memory for it, which is why only an engine's own model packs (``Experts.k_major``).

The attention kernel (``moerl.engine.kv_cache.StepView.attend``) computes a decode query's scores, softmax (with
GPT-OSS's sinks and a sliding window) and value sum straight from the head-major pools through the block table,
where the torch path gathers every visible key and value into new tensors first.

Weights, pools and results may be fp32 or bf16 (bf16 widened exactly in the vector lanes, results narrowed with
round-to-nearest-even); the arithmetic is fp32 throughout, so a bf16 step reads half the bytes of an fp32 one.

The kernels are C (GCC vector extensions: AVX-512, AVX2 or 128-bit vectors, whatever ``-march=native`` gives),
built by the host's C compiler on first use into inductor's cache directory (which a compiled graph needs as well),
and run on torch's own OpenMP threads. Without a compiler, or on a machine where they do not build, ``kernel()`` is
None and the engine keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from moerl.model.grouped import Groups

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__)
#define VB 64
#define MB 8
#elif defined(__AVX__)
#define VB 32
#define MB 6
#else
#define VB 16
#define MB 4
#endif
#define VW (VB / 4)
#define NT (2 * VW)
typedef float vf __attribute__((vector_size(VB)));
typedef float vfu __attribute__((vector_size(VB), aligned(4)));

int moerl_panel_vector(void) { return VW; }

/* bf16 (the high half of an fp32) in vector lanes: widened exactly, narrowed rounded to nearest even */
typedef uint16_t vh __attribute__((vector_size(VB / 2)));
typedef uint16_t vhu __attribute__((vector_size(VB / 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VB)));
static inline vf widen(const uint16_t* p) { return (vf)(__builtin_convertvector(*(const vhu*)p, vu) << 16); }
static inline float widen1(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline vh narrow(vf x) {
  vu u = (vu)x, nan = (vu)(x != x);
  u = (u & ~nan) | (((vu){0} + 0x7fc00000u) & nan);
  return __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1)) >> 16, vh);
}
static inline uint16_t narrow1(float x) { return narrow((vf){0} + x)[0]; }
/* element i of an fp32 (b = 0) or bf16 (b = 1) array, one vector or one value */
static inline vf ldv(const void* p, int64_t i, int b) {
  return b ? widen((const uint16_t*)p + i) : *(const vfu*)((const float*)p + i);
}
static inline float lds(const void* p, int64_t i, int b) {
  return b ? widen1(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline void stv(void* p, int64_t i, vf v, int b) {
  if (b) *(vhu*)((uint16_t*)p + i) = narrow(v);
  else *(vfu*)((float*)p + i) = v;
}

/* y[rows of group g] = x[rows of g] @ w[g], w packed [G][N / NT][K][NT], offs[g] the end row of group g; x fp32, w
   fp32 (wb = 0) or bf16 (wb = 1), y fp32 or bf16 (yb), the sums in fp32. mode 0: y [M, N] in w's column order.
   mode 1 (a gate-up weight, each panel VW gate then VW up columns of one range): y [M, N], gate columns first, then
   up. mode 2 (the same weight): y [M, N / 2] = SiLU(gate) * up * scale. One task: one panel of one group. */
static inline __attribute__((always_inline)) void group_mm_task(const float* x, const void* w, const int32_t* offs,
                                                                const float* scale, int K, int N, int mode, void* y,
                                                                int t, const int wb, const int yb) {
  int tiles = N / NT, ldy = mode == 2 ? N / 2 : N;
  int g = t / tiles, tile = t % tiles, r0 = g ? offs[g - 1] : 0, r1 = offs[g];
  int64_t wt = ((int64_t)g * tiles + tile) * K * NT;
  for (int m0 = r0; m0 < r1; m0 += MB) {
    int mb = r1 - m0 < MB ? r1 - m0 : MB;
    const float* xr[MB];
    for (int m = 0; m < MB; m++) xr[m] = x + (int64_t)(m0 + (m < mb ? m : 0)) * K;
    vf a0[MB], a1[MB];
    for (int m = 0; m < MB; m++) { a0[m] = (vf){0}; a1[m] = (vf){0}; }
    for (int k = 0; k < K; k++) {
      int64_t wk = wt + (int64_t)k * NT;
      __builtin_prefetch((const char*)w + (wk + 8 * NT) * (wb ? 2 : 4));
      vf w0 = ldv(w, wk, wb), w1 = ldv(w, wk + VW, wb);
      #pragma GCC unroll 16
      for (int m = 0; m < MB; m++) {
        float s = xr[m][k];
        a0[m] += s * w0;
        a1[m] += s * w1;
      }
    }
    for (int m = 0; m < mb; m++) {
      int64_t out = (int64_t)(m0 + m) * ldy;
      if (mode == 0) {
        stv(y, out + tile * NT, a0[m], yb);
        stv(y, out + tile * NT + VW, a1[m], yb);
      } else if (mode == 1) {
        stv(y, out + tile * VW, a0[m], yb);
        stv(y, out + N / 2 + tile * VW, a1[m], yb);
      } else {
        float gate[VW], up[VW], sc = scale[m0 + m];
        memcpy(gate, &a0[m], sizeof gate);
        memcpy(up, &a1[m], sizeof up);
        for (int j = 0; j < VW; j++) gate[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j] * sc;
        stv(y, out + tile * VW, *(vfu*)gate, yb);
      }
    }
  }
}

void moerl_packed_group_mm(const float* x, const void* w, const int32_t* offs, const float* scale, int G, int K,
                           int N, int mode, void* y, int wb, int yb, int threads) {
  int tasks = G * (N / NT);
  /* one loop per (weight, output) kind: the task's loads and stores made for it */
  if (!wb && !yb) {
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) group_mm_task(x, w, offs, scale, K, N, mode, y, t, 0, 0);
  } else if (!wb) {
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) group_mm_task(x, w, offs, scale, K, N, mode, y, t, 0, 1);
  } else if (!yb) {
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) group_mm_task(x, w, offs, scale, K, N, mode, y, t, 1, 0);
  } else {
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) group_mm_task(x, w, offs, scale, K, N, mode, y, t, 1, 1);
  }
}

/* The routed experts of a decode step in one call (SiLU-gated, no biases): x [N][H] (xb: bf16) with its experts idx
   [N][k] and routing weights gate [N][k] (fp32; rounded to x's dtype first, as the torch path rounds them) -> out
   [N][H] in x's dtype, each token's k rows summed in fp32 and rounded once. The pairs sorted by expert (a stable
   counting sort), then in one parallel region (its threads woken once, where the torch path takes a dozen ops):
   their rows gathered and widened, the packed gate-up GEMM with the activation, the packed down GEMM, each token's
   sum. work: fp32 [P (H + I + 1)], ints: int32 [2 E + 2 P] (P = N k). Returns -1 (nothing written) for an expert id
   outside 0..E-1. */
static inline __attribute__((always_inline)) void moe_body(const void* x, int N, int k, int E, int H, int I,
                                                           const void* gu, const void* dn, void* out, int xb,
                                                           float* work, const int32_t* ints, const int wb) {
  int P = N * k;
  const int32_t *offs = ints, *tok = ints + 2 * E, *where = ints + 2 * E + P;
  float *xs = work, *h = work + (int64_t)P * H, *scale = h + (int64_t)P * I;
  #pragma omp for schedule(static)
  for (int r = 0; r < P; r++) {
    int64_t src = (int64_t)tok[r] * H, dst = (int64_t)r * H;
    int i = 0;
    for (; i + VW <= H; i += VW) *(vfu*)(xs + dst + i) = ldv(x, src + i, xb);
    for (; i < H; i++) xs[dst + i] = lds(x, src + i, xb);
  }
  #pragma omp for schedule(static, 1)
  for (int t = 0; t < E * (2 * I / NT); t++) group_mm_task(xs, gu, offs, scale, H, 2 * I, 2, h, t, wb, 0);
  #pragma omp for schedule(static, 1)  /* the down rows written over the gathered ones (read by now) */
  for (int t = 0; t < E * (H / NT); t++) group_mm_task(h, dn, offs, NULL, I, H, 0, xs, t, wb, 0);
  #pragma omp for schedule(static)
  for (int n = 0; n < N; n++)
    for (int i = 0; i < H; i += VW) {
      vf acc = (vf){0};
      for (int j = 0; j < k; j++) acc += *(const vfu*)(xs + (int64_t)where[n * k + j] * H + i);
      stv(out, (int64_t)n * H + i, acc, xb);
    }
}

int moerl_moe_decode(const void* x, const int64_t* idx, const float* gate, int N, int k, int E, int H, int I,
                     const void* gu, const void* dn, int wb, void* out, int xb, float* work, int32_t* ints,
                     int threads) {
  int P = N * k;
  int32_t *offs = ints, *next = ints + E, *tok = ints + 2 * E, *where = ints + 2 * E + P;
  float* scale = work + (int64_t)P * (H + I);
  for (int e = 0; e < E; e++) next[e] = 0;
  for (int p = 0; p < P; p++) {
    if (idx[p] < 0 || idx[p] >= E) return -1;
    next[idx[p]]++;
  }
  for (int e = 0, end = 0; e < E; e++) { end += next[e]; offs[e] = end; next[e] = end - next[e]; }
  for (int p = 0; p < P; p++) {
    int r = next[idx[p]]++;
    tok[r] = p / k;
    where[p] = r;
    float w = gate[p];
    if (xb) w = widen1(narrow1(w));
    scale[r] = w;
  }
  if (wb) {
    #pragma omp parallel num_threads(threads)
    moe_body(x, N, k, E, H, I, gu, dn, out, xb, work, ints, 1);
  } else {
    #pragma omp parallel num_threads(threads)
    moe_body(x, N, k, E, H, I, gu, dn, out, xb, work, ints, 0);
  }
  return 0;
}

/* Decode attention over the paged cache, read in place: q [B, Hq, D] -> out [B, Hq, Dv]. Pools head-major
   [Hkv][rows][D] and [Hkv][rows][Dv]; tables [B][nb] block ids; pos [B]: the query's position (keys 0..pos visible;
   window > 0: only the last `window` of them); sinks [Hq] (a logit that joins the softmax) or NULL; scratch:
   threads x (Hq / Hkv + 2) * nb * bs floats for the scores and the keys' rows. One task per (row, KV head): each
   key and value row is read once for the query heads that share it. */
static inline float dot(const float* a, const void* b, int64_t at, int n, int kb) {
  vf acc = (vf){0};
  int i = 0;
  for (; i + VW <= n; i += VW) acc += *(const vfu*)(a + i) * ldv(b, at + i, kb);
  float s = 0, lanes[VW];
  memcpy(lanes, &acc, sizeof lanes);
  for (int j = 0; j < VW; j++) s += lanes[j];
  for (; i < n; i++) s += a[i] * lds(b, at + i, kb);
  return s;
}

typedef int32_t vi __attribute__((vector_size(VB)));

/* one level of lane_sums: pairs of the `count` * 2 vectors in u give `count` vectors of their half-sums */
#define HALVE(count, e, o) \
  for (int i = 0; i < count; i++) \
    u[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], e) + __builtin_shuffle(u[2 * i], u[2 * i + 1], o)
#if VW == 8 || VW == 16
/* the sums of VW vectors' lanes, as one vector (lane i: the sum of a[i]'s lanes): a transposing tree of shuffles
   where VW horizontal sums would each take a store and VW scalar adds. Level by level, pairs of vectors give one
   vector of their half-sums, lane blocks interleaved: e takes each block's first half, o its second. */
static inline vf lane_sums(const vf* a) {
  vf u[VW];
  for (int i = 0; i < VW; i++) u[i] = a[i];
#if VW == 8
  const vi e0 = {0, 8, 2, 10, 4, 12, 6, 14}, o0 = {1, 9, 3, 11, 5, 13, 7, 15};
  const vi e1 = {0, 1, 8, 9, 4, 5, 12, 13}, o1 = {2, 3, 10, 11, 6, 7, 14, 15};
  const vi e2 = {0, 1, 2, 3, 8, 9, 10, 11}, o2 = {4, 5, 6, 7, 12, 13, 14, 15};
  HALVE(4, e0, o0);
  HALVE(2, e1, o1);
  HALVE(1, e2, o2);
#else
  const vi e0 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi o0 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const vi e1 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi o1 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vi e2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const vi o2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const vi e3 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi o3 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  HALVE(8, e0, o0);
  HALVE(4, e1, o1);
  HALVE(2, e2, o2);
  HALVE(1, e3, o3);
#endif
  return u[0];
}
#endif

/* e^x for x <= 0 in vector lanes (the softmax's shifted scores): Cephes' expf, within 2 ulp of expf; x below
   -87 gives e^-87 (~1e-38) where expf gives a denormal or 0, nothing beside a softmax's 1 at its maximum. */
static inline vf vexp(vf x) {
  const vf lo = (vf){0} - 87.0f;
  vi below = x < lo;
  x = (vf)(((vi)lo & below) | ((vi)x & ~below));
  vf fx = x * 1.44269504088896341f + 0.5f;
  vf t = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  vi over = t > fx;  /* truncation rounds negatives up: floor is one less there */
  fx = t - (vf)((vi)((vf){0} + 1.0f) & over);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  vf z = x * x;
  vf y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x
          + 1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  vi pow2 = (__builtin_convertvector(fx, vi) + 127) << 23;
  return y * (vf)pow2;
}

/* s[0..n) = e^(s - mx) in place; returns their sum */
static inline float exp_sum(float* s, int64_t n, float mx) {
  vf acc = (vf){0};
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    vf e = vexp(*(vfu*)(s + i) - mx);
    *(vfu*)(s + i) = e;
    acc += e;
  }
  float sum = 0, lanes[VW];
  memcpy(lanes, &acc, sizeof lanes);
  for (int j = 0; j < VW; j++) sum += lanes[j];
  for (; i < n; i++) sum += s[i] = expf(s[i] - mx);
  return sum;
}

/* one task of the paged decode: row b's KV head kh, its pools fp32 (kb = 0) or bf16 (kb = 1). Each visible key's
   pool row is found once, walking the block table (no division per key: a task's keys are few, and an integer
   division costs what a dozen of their multiply-adds do) */
static inline __attribute__((always_inline)) void paged_task(const float* q, const void* kp, const void* vp,
                                                             const int64_t* tables, const int64_t* pos,
                                                             const float* sinks, int Hq, int Hkv, int D, int Dv,
                                                             int64_t rows, int nb, int bs, int64_t window,
                                                             float scale, float* out, float* scratch, int t,
                                                             const int kb) {
  int g = Hq / Hkv;
  int b = t / Hkv, kh = t % Hkv;
  int64_t p = pos[b], lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, n = p - lo + 1;
  float* s = scratch + (int64_t)omp_get_thread_num() * (g + 2) * nb * bs;  /* [g][n] scores, then [n] rows */
  int64_t* at = (int64_t*)(s + (int64_t)g * nb * bs);  /* each visible key's pool row (head kh) */
  const float* qv = q + ((int64_t)b * Hq + (int64_t)kh * g) * D;  /* the g query heads of this KV head */
  const int64_t* table = tables + (int64_t)b * nb;
  for (int64_t j = lo, blk = lo / bs, off = lo % bs; j <= p; j++) {
    at[j - lo] = (int64_t)kh * rows + table[blk] * bs + off;
    if (++off == bs) { off = 0; blk++; }
  }
  int64_t j = 0;
#if VW == 8 || VW == 16
  if (D % VW == 0)  /* VW keys at a time: their VW dot products summed together */
    for (; j + VW <= n; j += VW)
      for (int h = 0; h < g; h++) {
        const float* qh = qv + (int64_t)h * D;
        vf acc[VW];
        for (int k = 0; k < VW; k++) acc[k] = (vf){0};
        for (int i = 0; i < D; i += VW) {
          vf x = *(const vfu*)(qh + i);
          for (int k = 0; k < VW; k++) acc[k] += x * ldv(kp, at[j + k] * D + i, kb);
        }
        *(vfu*)(s + h * n + j) = lane_sums(acc) * scale;
      }
#endif
  for (; j < n; j++)
    for (int h = 0; h < g; h++) s[h * n + j] = dot(qv + (int64_t)h * D, kp, at[j] * D, D, kb) * scale;
  float* o = out + ((int64_t)b * Hq + (int64_t)kh * g) * Dv;
  for (int h = 0; h < g; h++) {
    float* sh = s + h * n;
    float mx = sinks ? sinks[kh * g + h] : -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;
    float inv = 1.0f / (exp_sum(sh, n, mx) + (sinks ? expf(sinks[kh * g + h] - mx) : 0.0f));
    for (int64_t j = 0; j < n; j++) sh[j] *= inv;
  }
  /* the value sum a head at a time, four vectors of its output held in registers over the keys (an output kept in
     memory would chain every key's add through a store and a load) */
  for (int h = 0; h < g; h++) {
    const float* sh = s + h * n;
    float* oh = o + (int64_t)h * Dv;
    int i0 = 0;
    for (; i0 + 4 * VW <= Dv; i0 += 4 * VW) {
      vf acc[4] = {(vf){0}, (vf){0}, (vf){0}, (vf){0}};
      for (int64_t j = 0; j < n; j++) {
        int64_t vr = at[j] * Dv + i0;
        for (int c = 0; c < 4; c++) acc[c] += sh[j] * ldv(vp, vr + c * VW, kb);
      }
      for (int c = 0; c < 4; c++) *(vfu*)(oh + i0 + c * VW) = acc[c];
    }
    for (; i0 + VW <= Dv; i0 += VW) {  /* a head narrower than four vectors (tiny's 32 on AVX-512) */
      vf acc = (vf){0};
      for (int64_t j = 0; j < n; j++) acc += sh[j] * ldv(vp, at[j] * Dv + i0, kb);
      *(vfu*)(oh + i0) = acc;
    }
    for (; i0 < Dv; i0++) {
      float acc = 0.0f;
      for (int64_t j = 0; j < n; j++) acc += sh[j] * lds(vp, at[j] * Dv + i0, kb);
      oh[i0] = acc;
    }
  }
}

void moerl_paged_decode(const float* q, const void* kp, const void* vp, const int64_t* tables, const int64_t* pos,
                        const float* sinks, int B, int Hq, int Hkv, int D, int Dv, int64_t rows, int nb, int bs,
                        int64_t window, float scale, float* out, float* scratch, int kb, int threads) {
  if (kb) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int t = 0; t < B * Hkv; t++)
      paged_task(q, kp, vp, tables, pos, sinks, Hq, Hkv, D, Dv, rows, nb, bs, window, scale, out, scratch, t, 1);
  } else {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int t = 0; t < B * Hkv; t++)
      paged_task(q, kp, vp, tables, pos, sinks, Hq, Hkv, D, Dv, rows, nb, bs, window, scale, out, scratch, t, 0);
  }
}

/* RMSNorm of rows x [rows][dim] -> y, as torch's CPU composite computes it: in fp32, y = x * rsqrt(mean(x^2) + eps)
   * w, rounded once to y's dtype; x and y fp32 (xb = 0) or bf16 (xb = 1), w fp32 or bf16 (wb). */
static inline __attribute__((always_inline)) void rms_row(const void* x, const void* w, void* y, int64_t r, int dim,
                                                          float eps, const int xb, const int wb) {
  int64_t at = r * dim;
  vf acc = (vf){0};
  int i = 0;
  for (; i + VW <= dim; i += VW) {
    vf v = ldv(x, at + i, xb);
    acc += v * v;
  }
  float ss = 0, lanes[VW];
  memcpy(lanes, &acc, sizeof lanes);
  for (int j = 0; j < VW; j++) ss += lanes[j];
  for (int j = i; j < dim; j++) ss += lds(x, at + j, xb) * lds(x, at + j, xb);
  float inv = 1.0f / sqrtf(ss / dim + eps);
  for (i = 0; i + VW <= dim; i += VW) stv(y, at + i, ldv(x, at + i, xb) * inv * ldv(w, i, wb), xb);
  for (; i < dim; i++) {
    float v = lds(x, at + i, xb) * inv * lds(w, i, wb);
    if (xb) ((uint16_t*)y)[at + i] = narrow1(v);
    else ((float*)y)[at + i] = v;
  }
}

void moerl_rms_norm(const void* x, const void* w, void* y, int64_t rows, int dim, float eps, int xb, int wb,
                    int threads) {
  /* a decode step's few rows: on one thread (waking the others costs more than the rows) */
  int n = rows * dim >= 65536 ? threads : 1;
  if (xb && wb) {
    #pragma omp parallel for num_threads(n)
    for (int64_t r = 0; r < rows; r++) rms_row(x, w, y, r, dim, eps, 1, 1);
  } else if (xb) {
    #pragma omp parallel for num_threads(n)
    for (int64_t r = 0; r < rows; r++) rms_row(x, w, y, r, dim, eps, 1, 0);
  } else if (wb) {
    #pragma omp parallel for num_threads(n)
    for (int64_t r = 0; r < rows; r++) rms_row(x, w, y, r, dim, eps, 0, 1);
  } else {
    #pragma omp parallel for num_threads(n)
    for (int64_t r = 0; r < rows; r++) rms_row(x, w, y, r, dim, eps, 0, 0);
  }
}
"""

KINDS = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' weight and cache dtypes, as their flag
_lib: ctypes.CDLL | None | bool = False  # False: not built yet; None: it does not build here


def kernel() -> ctypes.CDLL | None:
    """The built kernel (built on first use, kept on disk by its source, compiler and CPU), or None where it does
    not build (no C compiler, or not a CPU it compiles for)."""
    global _lib
    if _lib is False:
        _lib = _build()
    return _lib


def _build() -> ctypes.CDLL | None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        return None
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    tag = hashlib.sha256("\0".join([SOURCE, cc, *flags, _cpu_flags(cpu)]).encode()).hexdigest()[:16]
    lib = Path(cache_dir()) / "moerl_kernels" / f"decode_kernels_{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as d:
            src, out = Path(d) / "packed.c", Path(d) / "packed.so"
            src.write_text(SOURCE)
            if subprocess.run([cc, *flags, str(src), "-o", str(out)], capture_output=True).returncode:
                return None
            os.replace(out, lib)  # whole or absent: another process may be building it too
    # loaded after torch, so the kernel's OpenMP is torch's own runtime (one pool of threads, not two)
    return ctypes.CDLL(str(lib))


def _cpu_flags(cpuinfo: str) -> str:
    """The CPU's feature flags (``-march=native`` builds for them: another CPU gets its own build)."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return line
    return ""


def vector_width() -> int:
    """Floats in one of the kernel's vectors (VW): a panel is 2 VW columns."""
    return kernel().moerl_panel_vector()


def packs(w: torch.Tensor, gate_up: bool) -> bool:
    """Whether weight ``w`` [E, K, N] (fp32 or bf16, on the CPU) fits the kernel's panels: N a multiple of a panel,
    and for a gate-up weight each half (gate, up) a multiple of a vector."""
    if kernel() is None or w.dtype not in KINDS or w.device.type != "cpu" or w.dim() != 3:
        return False
    vw = vector_width()
    return w.shape[2] % (2 * vw) == 0 and (not gate_up or (w.shape[2] // 2) % vw == 0)


def _panel_view(w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """``w`` [E, K, N] seen in its panels' order, [E, N / NT, K, NT] (a gate-up weight's as [E, N / NT, K, 2, VW]:
    the gate's VW columns of a range, then the up's): a view where ``w`` is contiguous."""
    e, k, n = w.shape
    vw = vector_width()
    if gate_up:
        return w.reshape(e, k, 2, n // (2 * vw), vw).permute(0, 3, 1, 2, 4)
    return w.reshape(e, k, n // (2 * vw), 2 * vw).permute(0, 2, 1, 3)


def pack(w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """``w`` [E, K, N] -> its panels [E, N / NT, K, NT]; a gate-up weight's panels each hold VW gate columns then the
    VW up columns of the same range."""
    view = _panel_view(w, gate_up)
    return view.contiguous().view(*view.shape[:3], -1)


def packed_weight(owner: torch.nn.Module, name: str, w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """``pack(w, gate_up)``, kept on ``owner`` under ``name`` while ``w`` is unchanged (an engine's weights change at
    a sync only, by an in-place copy that bumps the tensor's version). Packed again into the same tensor: a compiled
    graph reading it (``graph_panels``) keeps its address and sees the new values."""
    kept = owner.__dict__.setdefault("_packed", {})
    stamp = (w.data_ptr(), w._version, tuple(w.shape), w.stride(), gate_up)
    hit = kept.get(name)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    view = _panel_view(w, gate_up)
    if hit is not None and hit[1].shape[:3] == view.shape[:3]:  # the same experts, tiles and K: the same panels
        with torch.inference_mode(hit[1].is_inference()):  # made in an engine's step, maybe refreshed outside one
            hit[1].view(view.shape).copy_(view)  # one pass over the weight, no new tensor
        panels = hit[1]
    else:
        panels = pack(w, gate_up)
        # a compiled graph takes it as it takes a parameter: its shape fixed, its address kept
        torch._dynamo.mark_static(panels)
        torch._dynamo.mark_static_address(panels)
        owner.__dict__.setdefault("_packed_graph", {})[name] = panels  # never replaced: the graph's guards hold
    kept[name] = (stamp, panels)
    return panels


def graph_panels(owner: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The panels ``packed_weight`` keeps for ``name``, as a compiled graph reads them (made and brought up to date
    outside the graph, before each step: ``moerl.engine.compiled``), or None where none are made yet."""
    return owner.__dict__.get("_packed_graph", {}).get(name)


def packed_group_mm(
    x: torch.Tensor,
    packed: torch.Tensor,
    offs: torch.Tensor,
    mode: int = 0,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows ``x`` [M, K] sorted by group (``offs`` [G] int32: each group's end row) times their group's packed weight
    -> [M, N] (mode 0: ``packed`` from a plain weight; mode 1: from a gate-up weight, gate columns first), or for
    mode 2 the gate-up weight's ``SiLU(gate) * up * scale`` [M, N / 2] (``scale`` [M]: each row's routing weight).
    Weights fp32 or bf16; the sums in fp32 (bf16 rows widened first); the result in ``out_dtype`` (x's dtype by
    default; bf16 rounded to nearest even)."""
    g, tiles, k, nt = packed.shape
    n = tiles * nt
    if x.shape[1] != k or offs.numel() != g:
        raise ValueError(f"packed_group_mm: rows {tuple(x.shape)}, {offs.numel()} groups, weight [{g}, {k}, {n}]")
    out_dtype = out_dtype or x.dtype
    if packed.dtype not in KINDS or out_dtype not in KINDS:
        raise ValueError(f"packed_group_mm: weight {packed.dtype}, result {out_dtype}: fp32 or bf16 only")
    x, offs = x.to(torch.float32).contiguous(), offs.to(torch.int32).contiguous()
    y = x.new_empty(x.shape[0], n // 2 if mode == 2 else n, dtype=out_dtype)
    sc = scale.reshape(-1).to(torch.float32).contiguous() if scale is not None else None
    if mode == 2 and (sc is None or sc.numel() != x.shape[0]):
        raise ValueError("packed_group_mm: mode 2 needs a scale per row")
    ptr = ctypes.c_void_p
    kernel().moerl_packed_group_mm(
        ptr(x.data_ptr()),
        ptr(packed.data_ptr()),
        ptr(offs.data_ptr()),
        ptr(sc.data_ptr() if sc is not None else 0),
        g,
        k,
        n,
        mode,
        ptr(y.data_ptr()),
        KINDS[packed.dtype],
        KINDS[out_dtype],
        torch.get_num_threads(),
    )
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dim (fp32 or bf16, CPU) in one call of the kernel: what ``F.rms_norm`` computes there
    (fp32 statistics, one rounding to x's dtype after the weight), without its eight ops a call."""
    d = x.shape[-1]
    if x.dtype not in KINDS or weight.dtype not in KINDS or weight.shape != (d,):
        raise ValueError(f"rms_norm: rows {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    rows, weight = x.reshape(-1, d).contiguous(), weight.contiguous()
    y = torch.empty_like(rows)
    kernel().moerl_rms_norm(
        ctypes.c_void_p(rows.data_ptr()),
        ctypes.c_void_p(weight.data_ptr()),
        ctypes.c_void_p(y.data_ptr()),
        ctypes.c_int64(rows.shape[0]),
        d,
        ctypes.c_float(eps),
        KINDS[x.dtype],
        KINDS[weight.dtype],
        torch.get_num_threads(),
    )
    return y.view(x.shape)


@torch.library.custom_op("moerl::moe_decode", mutates_args=())
def moe_decode(
    x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """A decode step's routed experts in one kernel call (one op, eager and in a compiled graph): rows ``x`` [N, H]
    (fp32 or bf16), their experts ``idx`` [N, k] and routing weights ``gate`` [N, k] (rounded to x's dtype, as
    ``Route`` rounds them) through the packed SiLU-gated ``gate_up`` [E, 2I / NT, H, NT] and ``down`` [E, H / NT, I,
    NT] panels (``pack``) -> sum_k gate * down(SiLU(gate) * up) [N, H] in x's dtype. The sort by expert, the gather,
    both GEMMs and the per-token sum in fp32, rounded once."""
    n, hid = x.shape
    e, _, hk, nt = gate_up.shape
    inter = down.shape[2]
    good = (
        x.dtype in KINDS
        and gate_up.dtype == down.dtype in KINDS
        and hk == hid
        and tuple(down.shape[:2]) == (e, hid // nt)
        and gate_up.shape[1] * nt == 2 * inter
        and idx.shape == gate.shape
        and idx.shape[0] == n
    )
    if not good:
        raise ValueError(
            f"moe_decode: rows {x.dtype} {tuple(x.shape)}, idx {tuple(idx.shape)}, gate {tuple(gate.shape)}, "
            f"gate_up {gate_up.dtype} {tuple(gate_up.shape)}, down {down.dtype} {tuple(down.shape)}"
        )
    k = idx.shape[1]
    x, out = x.contiguous(), torch.empty_like(x)
    idx, gate = idx.to(torch.int64).contiguous(), gate.to(torch.float32).contiguous()
    work = x.new_empty(n * k * (hid + inter + 1), dtype=torch.float32)
    ints = torch.empty(2 * e + 2 * n * k, dtype=torch.int32)
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    rc = kernel().moerl_moe_decode(
        *(ptr(t.data_ptr()) for t in (x, idx, gate)),
        *(i32(v) for v in (n, k, e, hid, inter)),
        ptr(gate_up.data_ptr()),
        ptr(down.data_ptr()),
        i32(KINDS[down.dtype]),
        ptr(out.data_ptr()),
        i32(KINDS[x.dtype]),
        ptr(work.data_ptr()),
        ptr(ints.data_ptr()),
        i32(torch.get_num_threads()),
    )
    if rc:
        raise ValueError(f"moe_decode: an expert id outside 0..{e - 1} in idx (max {int(idx.max())})")
    return out


@moe_decode.register_fake
def _(x, idx, gate, gate_up, down):
    return torch.empty_like(x)


@torch.library.custom_op("moerl::packed_group_mm", mutates_args=())
def packed_group_mm_op(
    x: torch.Tensor,
    panels: torch.Tensor,
    keys: torch.Tensor,
    n_groups: int,
    mode: int,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``packed_group_mm`` as one op a compiled graph calls, over rows grouped by the sorted ``keys`` [M]."""
    return packed_group_mm(x, panels, Groups(keys, n_groups).offs, mode, scale, out_dtype)


@packed_group_mm_op.register_fake
def _(x, panels, keys, n_groups, mode, scale, out_dtype):
    n = panels.shape[1] * panels.shape[3]
    return x.new_empty(x.shape[0], n // 2 if mode == 2 else n, dtype=out_dtype)


@torch.library.custom_op("moerl::paged_decode", mutates_args=())
def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    pos: torch.Tensor,
    sinks: torch.Tensor | None,
    block_size: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention of queries ``q`` [B, Hq, D] over the keys and values of head-major pools [Hkv, rows, D]
    through block tables [B, nb]: keys 0..``pos`` [B] of each row (the last ``window`` of them where > 0), with
    ``sinks`` [Hq] joining each softmax -> [B, Hq, Dv] in q's dtype (CPU; pools fp32 or bf16, the sums in fp32). One
    op, eager and in a compiled graph."""
    b, hq, d = q.shape
    hkv, rows, dv = v_pool.shape
    nb, threads = tables.shape[1], torch.get_num_threads()
    if k_pool.dtype != v_pool.dtype or k_pool.dtype not in KINDS:
        raise ValueError(f"paged_decode: pools {k_pool.dtype} / {v_pool.dtype}: both fp32 or both bf16")
    dtype, q = q.dtype, q.to(torch.float32).contiguous()
    tables, pos = tables.to(torch.int64).contiguous(), pos.to(torch.int64).contiguous()
    sinks = sinks.float().contiguous() if sinks is not None else None
    out, scratch = q.new_empty(b, hq, dv), q.new_empty(threads, (hq // hkv + 2) * nb * block_size)
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    kernel().moerl_paged_decode(
        *(ptr(t.data_ptr()) for t in (q, k_pool, v_pool, tables, pos)),
        ptr(sinks.data_ptr() if sinks is not None else 0),
        *(i32(n) for n in (b, hq, hkv, d, dv)),
        ctypes.c_int64(rows),
        i32(nb),
        i32(block_size),
        ctypes.c_int64(window),
        ctypes.c_float(scale),
        ptr(out.data_ptr()),
        ptr(scratch.data_ptr()),
        i32(KINDS[k_pool.dtype]),
        i32(threads),
    )
    return out.to(dtype)


@paged_decode.register_fake
def _(q, k_pool, v_pool, tables, pos, sinks, block_size, window, scale):
    return q.new_empty(q.shape[0], q.shape[1], v_pool.shape[2])
