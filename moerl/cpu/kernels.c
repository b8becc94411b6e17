#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
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
typedef uint32_t vuu __attribute__((vector_size(VB), aligned(4)));
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
/* bf16's rounding of each lane, kept in fp32 (b = 1; b = 0: the value as it is) */
static inline vf rd(vf x, int b) { return b ? (vf)(__builtin_convertvector(narrow(x), vu) << 16) : x; }
static inline float rd1(float x, int b) { return b ? widen1(narrow1(x)) : x; }
/* the sum of a vector's lanes, lane 0 first */
static inline float hsum(vf a) {
  float s = 0, lanes[VW];
  memcpy(lanes, &a, sizeof lanes);
  for (int j = 0; j < VW; j++) s += lanes[j];
  return s;
}
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

typedef int32_t vi __attribute__((vector_size(VB)));

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

/* SiLU(g) * u * sc in vector lanes: g / (1 + e^-g) with vexp's e^x (within 2 ulp of expf; -g above 88, where e^-g
   overflows, taken as 88: the result is 0 either way) */
static inline vf silu_mul(vf g, vf u, float sc) {
  vf x = -g, hi = (vf){0} + 88.0f;
  vi over = x > hi;
  x = (vf)(((vi)hi & over) | ((vi)x & ~over));
  return g / (1.0f + vexp(x)) * u * sc;
}

/* LoRA adapter slots on the experts of moe_decode, their factors in fp32 (scale folded in nowhere: scale[s] is
   applied to each shrink). shared (shared_outer): gate-up A [S][r][H] and down B^T [S][r][H] shared by the experts;
   else [S][E][r][H] each. gate-up B in the gate-up weight's panels [S * E][2I / NT][r][NT]; down A [S][E][r][I].
   slot [N]: each token's slot, -1 for none. */
typedef struct {
  const float *gu_a, *gu_b, *dn_a, *dn_bt, *scale;
  const int64_t* slot;
  int S, E, r, shared;
  /* layers of one input run as one (bf16_linear): panel t's delta takes rb of the r shrinks, from tile_r0[t] on, and
     gate-up B holds rb rank rows a panel (NULL: all r) */
  const int32_t* tile_r0;
  int rb;
} lora_t;

/* The end of a block of rows (mb of them from row m0, group g, panel `tile`): each row's adapter delta (L) joins its
   sums a0 / a1 (the panel's two vectors of columns), then the results are stored by mode (see group_mm_task). */
static inline __attribute__((always_inline)) void store_rows(vf* a0, vf* a1, int m0, int mb, const int mbmax, int g,
                                                             int tile, int N, int mode, const float* scale, void* y,
                                                             const lora_t* L, const int32_t* tok, const float* xa,
                                                             const int yb) {
  int tiles = N / NT, ldy = mode == 2 ? N / 2 : N;
  if (L)
    #pragma GCC unroll 16
    for (int m = 0; m < mbmax; m++) {  /* unrolled: the accumulators stay registers */
      int64_t row = m0 + m, token = tok ? tok[row] : row, s = m < mb ? L->slot[token] : -1;
      if (s < 0) continue;
      int rb = L->tile_r0 ? L->rb : L->r;
      const float* a = xa + (L->shared ? token : row) * L->r + (L->tile_r0 ? L->tile_r0[tile] : 0);
      const float* b = L->gu_b + (((int64_t)s * L->E + g) * tiles + tile) * rb * NT;
      for (int j = 0; j < rb; j++) {
        a0[m] += a[j] * *(const vfu*)(b + j * NT);
        a1[m] += a[j] * *(const vfu*)(b + j * NT + VW);
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
      stv(y, out + tile * VW, silu_mul(a0[m], a1[m], scale[m0 + m]), yb);
    }
  }
}

/* y[rows of group g] = x[rows of g] @ w[g], w packed [G][N / NT][K][NT], offs[g] the end row of group g; x fp32, w
   fp32 (wb = 0) or bf16 (wb = 1), y fp32 or bf16 (yb), the sums in fp32. A bf16 panel holds K-pairs: [K / 2][NT][2],
   each 32-bit lane one column's two K rows (AMX's layout of a weight tile; widened here by a shift and a mask).
   mode 0: y [M, N] in w's column order. mode 1 (a gate-up weight, each panel VW gate then VW up columns of one
   range): y [M, N], gate columns first, then up. mode 2 (the same weight): y [M, N / 2] = SiLU(gate) * up * scale.
   One task: one panel of one group. With L (moe_decode's gate-up, groups = experts): each row's adapter delta joins
   the sums as r more K rows, the row's shrink xa (of its token, shared, or of the row) times its slot's gate-up B
   panel. */
static inline __attribute__((always_inline)) void group_mm_task(const float* x, const void* w, const int32_t* offs,
                                                                const float* scale, int K, int N, int mode, void* y,
                                                                int t, const lora_t* L, const int32_t* tok,
                                                                const float* xa, const int wb, const int yb) {
  int tiles = N / NT;
  int g = t / tiles, tile = t % tiles, r0 = g ? offs[g - 1] : 0, r1 = offs[g];
  int64_t wt = ((int64_t)g * tiles + tile) * K * NT;
  for (int m0 = r0; m0 < r1; m0 += MB) {
    int mb = r1 - m0 < MB ? r1 - m0 : MB;
    const float* xr[MB];
    for (int m = 0; m < MB; m++) xr[m] = x + (int64_t)(m0 + (m < mb ? m : 0)) * K;
    vf a0[MB], a1[MB];
    for (int m = 0; m < MB; m++) { a0[m] = (vf){0}; a1[m] = (vf){0}; }
    if (wb)
      for (int k = 0; k < K; k += 2) {  /* pair row k / 2 starts at element k NT */
        const uint16_t* wk = (const uint16_t*)w + wt + (int64_t)k * NT;
        __builtin_prefetch(wk + 16 * NT);
        vu p0 = *(const vuu*)wk, p1 = *(const vuu*)(wk + 2 * VW), hi = (vu){0} + 0xffff0000u;
        vf w0 = (vf)(p0 << 16), w0n = (vf)(p0 & hi), w1 = (vf)(p1 << 16), w1n = (vf)(p1 & hi);
        #pragma GCC unroll 16
        for (int m = 0; m < MB; m++) {
          float s = xr[m][k], sn = xr[m][k + 1];
          a0[m] += s * w0 + sn * w0n;
          a1[m] += s * w1 + sn * w1n;
        }
      }
    else
      for (int k = 0; k < K; k++) {
        int64_t wk = wt + (int64_t)k * NT;
        __builtin_prefetch((const float*)w + wk + 8 * NT);
        vf w0 = *(const vfu*)((const float*)w + wk), w1 = *(const vfu*)((const float*)w + wk + VW);
        #pragma GCC unroll 16
        for (int m = 0; m < MB; m++) {
          float s = xr[m][k];
          a0[m] += s * w0;
          a1[m] += s * w1;
        }
      }
    store_rows(a0, a1, m0, mb, MB, g, tile, N, mode, scale, y, L, tok, xa, yb);
  }
}

#if defined(__AMX_BF16__) && VW == 16
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define BF16_DOT 1
#ifndef PREFETCH_K
#define PREFETCH_K 64
#endif
/* AMX's tiles for a panel: tmm0 / tmm1 the sums of its two 16-column halves for 16 rows, tmm2 16 rows of x (32
   bf16 of K), tmm3 / tmm4 the halves' 16 pair rows of the weight (their 32 K) */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Ask Linux for AMX's tile state (once per process; oneDNN asks the same): 1 where this thread may use it */
int moerl_bf16_dot(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0; }

static inline void dot_begin(void) {
  tile_config cfg = {0};
  cfg.palette = 1;
  for (int i = 0; i < 5; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  _tile_loadconfig(&cfg);
}

/* group_mm_task on AMX: x and w bf16 (w in K-pairs), K a multiple of 32, blocks of 16 rows (rows read past a group
   belong to the next one or to the buffer's 16 spare rows: their sums are never stored) */
static inline __attribute__((always_inline)) void dot_task(const uint16_t* x, const uint16_t* w, const int32_t* offs,
                                                           const float* scale, int K, int N, int mode, void* y, int t,
                                                           const lora_t* L, const int32_t* tok, const float* xa,
                                                           const int yb) {
  int tiles = N / NT;
  int g = t / tiles, tile = t % tiles, r0 = g ? offs[g - 1] : 0, r1 = offs[g];
  const uint16_t* wt = w + ((int64_t)g * tiles + tile) * K * NT;
  float sums[2][16][16] __attribute__((aligned(64)));
  for (int m0 = r0; m0 < r1; m0 += 16) {
    int mb = r1 - m0 < 16 ? r1 - m0 : 16;
    _tile_zero(0);
    _tile_zero(1);
    for (int k = 0; k < K; k += 32) {
      const char* ahead = (const char*)(wt + (int64_t)(k + PREFETCH_K) * NT);  /* the panel's next K rows */
      for (int line = 0; line < 32 * NT * 2; line += 64) __builtin_prefetch(ahead + line);
      _tile_loadd(2, x + (int64_t)m0 * K + k, K * 2);
      _tile_loadd(3, wt + (int64_t)k * NT, NT * 4);
      _tile_loadd(4, wt + (int64_t)k * NT + 32, NT * 4);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    vf a0[16], a1[16];
    for (int m = 0; m < 16; m++) { a0[m] = *(const vf*)sums[0][m]; a1[m] = *(const vf*)sums[1][m]; }
    store_rows(a0, a1, m0, mb, 16, g, tile, N, mode, scale, y, L, tok, xa, yb);
  }
}
static inline void dot_end(void) { _tile_release(); }
#elif defined(__AVX512BF16__) && VW == 16
#define BF16_DOT 1
/* No AMX, AVX512-BF16's vdpbf16ps instead (AMD Zen 4 and later): the same panels and rows, each lane of a pair row
   one column's two K rows, times the row's two bf16 of x broadcast; sums in fp32 as the tiles' (products exact,
   denormal inputs as zero). Blocks of up to 8 rows, each count its own loop (decode's experts hold a few rows: no
   sums of rows that are not there), no tile state to ask for. */
int moerl_bf16_dot(void) { return 2; }
static inline void dot_begin(void) {}
static inline void dot_end(void) {}
#define DP_BLOCK(R)                                                                                \
  do {                                                                                             \
    const uint16_t* xr[R];                                                                         \
    for (int m = 0; m < R; m++) xr[m] = x + (int64_t)(m0 + m) * K; /* R: the block's rows, no more */ \
    __m512 s0[R], s1[R];                                                                           \
    for (int m = 0; m < R; m++) { s0[m] = _mm512_setzero_ps(); s1[m] = _mm512_setzero_ps(); }      \
    for (int k = 0; k < K; k += 2) {                                                               \
      const uint16_t* wk = wt + (int64_t)k * NT;                                                   \
      __builtin_prefetch(wk + 16 * NT);                                                            \
      __builtin_prefetch(wk + 16 * NT + 32);                                                       \
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32); \
      _Pragma("GCC unroll 8") for (int m = 0; m < R; m++) {                                        \
        int32_t pair;                                                                              \
        memcpy(&pair, xr[m] + k, 4);                                                               \
        __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);                                           \
        s0[m] = _mm512_dpbf16_ps(s0[m], xs, w0);                                                   \
        s1[m] = _mm512_dpbf16_ps(s1[m], xs, w1);                                                   \
      }                                                                                            \
    }                                                                                              \
    vf a0[R], a1[R];                                                                               \
    for (int m = 0; m < R; m++) { a0[m] = (vf)s0[m]; a1[m] = (vf)s1[m]; }                          \
    store_rows(a0, a1, m0, mb, R, g, tile, N, mode, scale, y, L, tok, xa, yb);                     \
  } while (0)
static inline __attribute__((always_inline)) void dot_task(const uint16_t* x, const uint16_t* w, const int32_t* offs,
                                                           const float* scale, int K, int N, int mode, void* y, int t,
                                                           const lora_t* L, const int32_t* tok, const float* xa,
                                                           const int yb) {
  int tiles = N / NT;
  int g = t / tiles, tile = t % tiles, r0 = g ? offs[g - 1] : 0, r1 = offs[g];
  const uint16_t* wt = w + ((int64_t)g * tiles + tile) * K * NT;
  for (int m0 = r0; m0 < r1; m0 += 8) {
    int mb = r1 - m0 < 8 ? r1 - m0 : 8;
    switch (mb) {
      case 8: DP_BLOCK(8); break;
      case 7: DP_BLOCK(7); break;
      case 6: DP_BLOCK(6); break;
      case 5: DP_BLOCK(5); break;
      case 4: DP_BLOCK(4); break;
      case 3: DP_BLOCK(3); break;
      case 2: DP_BLOCK(2); break;
      default: DP_BLOCK(1);
    }
  }
}
#else
#define BF16_DOT 0
int moerl_bf16_dot(void) { return 0; }
static inline void dot_begin(void) {}
static inline void dot_end(void) {}
static inline void dot_task(const uint16_t* x, const uint16_t* w, const int32_t* offs, const float* scale, int K,
                            int N, int mode, void* y, int t, const lora_t* L, const int32_t* tok, const float* xa,
                            const int yb) {}
#endif

void moerl_packed_group_mm(const float* x, const void* w, const int32_t* offs, const float* scale, int G, int K,
                           int N, int mode, void* y, int wb, int yb, int threads) {
  int tasks = G * (N / NT);
  /* one loop per (weight, output) kind: the task's loads and stores made for it */
  if (!wb && !yb) {
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) group_mm_task(x, w, offs, scale, K, N, mode, y, t, NULL, NULL, NULL, 0, 0);
  } else if (!wb) {
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) group_mm_task(x, w, offs, scale, K, N, mode, y, t, NULL, NULL, NULL, 0, 1);
  } else if (!yb) {
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) group_mm_task(x, w, offs, scale, K, N, mode, y, t, NULL, NULL, NULL, 1, 0);
  } else {
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int t = 0; t < tasks; t++) group_mm_task(x, w, offs, scale, K, N, mode, y, t, NULL, NULL, NULL, 1, 1);
  }
}

/* a . b over n floats: a fp32, b fp32 (kb = 0) or bf16 (kb = 1) from element at */
static inline float dot(const float* a, const void* b, int64_t at, int n, int kb) {
  vf acc = (vf){0};
  int i = 0;
  for (; i + VW <= n; i += VW) acc += *(const vfu*)(a + i) * ldv(b, at + i, kb);
  float s = hsum(acc);
  for (; i < n; i++) s += a[i] * lds(b, at + i, kb);
  return s;
}

/* out[j] = sc * (A[j] . v), j < r: a LoRA shrink of one row v (fp32 or bf16, vb) by A [r][n] fp32, eight rows of A
   at a time (eight independent sums: a single one would wait on each of its adds) */
static inline void shrink(const void* v, int64_t at, int vb, int n, const float* A, int r, float sc, float* out) {
  int j0 = 0;
  for (; j0 + 8 <= r; j0 += 8) {
    const float* a = A + (int64_t)j0 * n;
    vf acc[8];
    for (int j = 0; j < 8; j++) acc[j] = (vf){0};
    int i = 0;
    for (; i + VW <= n; i += VW) {
      vf x = ldv(v, at + i, vb);
      for (int j = 0; j < 8; j++) acc[j] += x * *(const vfu*)(a + (int64_t)j * n + i);
    }
    for (int j = 0; j < 8; j++) {
      float s = hsum(acc[j]);
      for (int t = i; t < n; t++) s += lds(v, at + t, vb) * a[(int64_t)j * n + t];
      out[j0 + j] = sc * s;
    }
  }
  for (; j0 < r; j0++) out[j0] = sc * dot(A + (int64_t)j0 * n, v, at, n, vb);
}

/* acc[c] += sum_j u[j] * bt[j][i + c VW] over the c < cb (<= 4) vectors from column i: a LoRA expand of u [r] by
   B^T [r][ld] fp32, into up to four independent sums */
static inline void expand(vf* acc, int cb, const float* u, const float* bt, int r, int64_t ld, int i) {
  for (int j = 0; j < r; j++)
    #pragma GCC unroll 4
    for (int c = 0; c < 4; c++)
      if (c < cb) acc[c] += u[j] * *(const vfu*)(bt + j * ld + i + c * VW);
}

/* The routed experts of a decode step in one call (SiLU-gated, no biases): x [N][H] (xb: bf16) with its experts idx
   [N][k] and routing weights gate [N][k] (fp32; rounded to x's dtype first, as the torch path rounds them) -> out
   [N][H] in x's dtype, each token's k rows summed in fp32 and rounded once. The pairs sorted by expert (a stable
   counting sort), then in one parallel region (its threads woken once, where the torch path takes a dozen ops):
   their rows gathered, the packed gate-up GEMM with the activation, the packed down GEMM, each token's sum. With dot
   (bf16 rows and weights, H and I multiples of 32): the GEMMs on the bf16 dot products, the gathered rows and the activations
   bf16 (the activations rounded once, as torch's bf16 experts round them); else fp32 FMAs on rows widened to fp32.
   With L (LoRA slots): the gate-up shrinks (one per token where A is shared, else per row) before the gate-up GEMM,
   which adds each row's expand as r more K rows; the down shrinks beside the down GEMM; their expand in each token's
   sum (where B is shared, once, on the shrinks summed in rank space). work: fp32 [moe_work(...)]; ints: int32
   [2 E + 3 P] (P = N k). Returns -1 (nothing written) for an expert id outside 0..E-1, -2 for a slot past the
   adapters'. */
static inline int64_t moe_head(int N, int k, int R, int shared) {  /* scale, xa, ha: floats, rounded up to 64 B */
  int64_t P = (int64_t)N * k;
  return (P + ((shared ? N : P) + P) * R + 15) / 16 * 16;
}

int64_t moerl_moe_work(int N, int k, int H, int I, int R, int shared) {
  int64_t P = (int64_t)N * k;
  return moe_head(N, k, R, shared) + P * H + (P + 16) * (H + I);
}

static inline __attribute__((always_inline)) void moe_body(const void* x, int N, int k, int E, int H, int I,
                                                           const void* gu, const void* dn, void* out, int xb,
                                                           float* work, const int32_t* ints, const lora_t* L,
                                                           const int wb, const int dot) {
  int P = N * k, R = L ? L->r : 0;
  const int32_t *offs = ints, *tok = ints + 2 * E, *where = ints + 2 * E + P, *ex = ints + 2 * E + 2 * P;
  float *scale = work, *xa = work + P, *ha = xa + (int64_t)(L && L->shared ? N : P) * R;
  float* rows = work + moe_head(N, k, R, L && L->shared);  /* fp32: the gathered rows, then the down rows */
  float* h = rows + (int64_t)P * H;                         /* fp32: the activations */
  uint16_t* rows16 = (uint16_t*)h;                          /* dot: bf16 rows [P + 16][H], activations [P + 16][I] */
  uint16_t* h16 = rows16 + (int64_t)(P + 16) * H;
  if (dot) dot_begin();
  #pragma omp for schedule(static)
  for (int r = 0; r < P; r++) {
    int64_t src = (int64_t)tok[r] * H, dst = (int64_t)r * H;
    if (dot) memcpy(rows16 + dst, (const uint16_t*)x + src, (size_t)H * 2);
    else {
      int i = 0;
      for (; i + VW <= H; i += VW) *(vfu*)(rows + dst + i) = ldv(x, src + i, xb);
      for (; i < H; i++) rows[dst + i] = lds(x, src + i, xb);
    }
    if (L && !L->shared) {
      int64_t s = L->slot[tok[r]];
      const float* a = L->gu_a + ((s * E + ex[r]) * R) * H;
      if (s >= 0) shrink(dot ? (const void*)rows16 : rows, dst, dot, H, a, R, L->scale[s], xa + (int64_t)r * R);
    }
  }
  if (L && L->shared) {
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
      int64_t s = L->slot[n];
      if (s >= 0) shrink(x, (int64_t)n * H, xb, H, L->gu_a + s * R * H, R, L->scale[s], xa + (int64_t)n * R);
    }
  }
  #pragma omp for schedule(dynamic, 8)  /* runs of adjacent panels: long streams, balanced */
  for (int t = 0; t < E * (2 * I / NT); t++)
    if (dot) dot_task(rows16, gu, offs, scale, H, 2 * I, 2, h16, t, L, tok, xa, 1);
    else group_mm_task(rows, gu, offs, scale, H, 2 * I, 2, h, t, L, tok, xa, wb, 0);
  #pragma omp for schedule(dynamic, 8) nowait  /* the down rows written over the gathered ones (read by now) */
  for (int t = 0; t < E * (H / NT); t++)
    if (dot) dot_task(h16, dn, offs, NULL, I, H, 0, rows, t, NULL, NULL, NULL, 0);
    else group_mm_task(h, dn, offs, NULL, I, H, 0, rows, t, NULL, NULL, NULL, wb, 0);
  if (L) {
    #pragma omp for schedule(static) nowait
    for (int r = 0; r < P; r++) {
      int64_t s = L->slot[tok[r]];
      const float* a = L->dn_a + ((s * E + ex[r]) * R) * I;
      if (s >= 0) shrink(dot ? (const void*)h16 : h, (int64_t)r * I, dot, I, a, R, L->scale[s], ha + r * R);
    }
  }
  if (dot) dot_end();
  #pragma omp barrier
  #pragma omp for schedule(static)
  for (int n = 0; n < N; n++) {
    int64_t s = L ? L->slot[n] : -1;
    float u[R > 0 ? R : 1];  /* shared B: the token's down shrinks summed in rank space */
    if (s >= 0 && L->shared)
      for (int j = 0; j < R; j++) {
        u[j] = 0.0f;
        for (int kk = 0; kk < k; kk++) u[j] += ha[(int64_t)where[n * k + kk] * R + j];
      }
    for (int i = 0; i < H; i += 4 * VW) {  /* four vectors at a time: independent sums */
      int cb = (H - i) / VW < 4 ? (H - i) / VW : 4;
      vf acc[4] = {(vf){0}, (vf){0}, (vf){0}, (vf){0}};
      for (int j = 0; j < k; j++)
        for (int c = 0; c < cb; c++) acc[c] += *(const vfu*)(rows + (int64_t)where[n * k + j] * H + i + c * VW);
      if (s >= 0 && L->shared) expand(acc, cb, u, L->dn_bt + s * R * H, R, H, i);
      else if (s >= 0)
        for (int kk = 0; kk < k; kk++) {
          int64_t row = where[n * k + kk];
          expand(acc, cb, ha + row * R, L->dn_bt + (s * E + ex[row]) * R * H, R, H, i);
        }
      for (int c = 0; c < cb; c++) stv(out, (int64_t)n * H + i + c * VW, acc[c], xb);
    }
  }
}

/* A softmax top-k router on rows x [N][H] (fp32 or bf16, xb) in fp32: logits = x w^T (+ bias) against w [E][H]
   (fp32), probabilities by softmax, the k most probable experts (highest first; a tie to the lower index) into idx
   [N][k] with their probabilities into gate [N][k], divided by their sum where norm, times scale. replay (NULL: none)
   [N][k]: a row whose first entry is >= 0 takes those experts (R3) and their probabilities. Each logit a 16-lane dot
   product summed lane 0 first; e^x by expf. */
void moerl_router_topk(const void* x, int xb, const float* w, const float* bias, int N, int H, int E, int k,
                       int norm, float scale, const int64_t* replay, float* gate, int64_t* idx, float* work,
                       int threads) {
  int n = (int64_t)N * E * H >= (1 << 18) ? threads : 1;
  #pragma omp parallel for num_threads(n)
  for (int r = 0; r < N; r++) {
    float* p = work + (int64_t)omp_get_thread_num() * E;
    const int64_t at = (int64_t)r * H;
    int e = 0;
    for (; e + 4 <= E; e += 4) {  /* four experts a pass: each vector of the row widened once for them */
      vf a0 = (vf){0}, a1 = a0, a2 = a0, a3 = a0;
      const float* w0 = w + (int64_t)e * H;
      int i = 0;
      for (; i + VW <= H; i += VW) {
        vf v = ldv(x, at + i, xb);
        a0 += v * *(const vfu*)(w0 + i);
        a1 += v * *(const vfu*)(w0 + H + i);
        a2 += v * *(const vfu*)(w0 + 2 * H + i);
        a3 += v * *(const vfu*)(w0 + 3 * H + i);
      }
      p[e] = hsum(a0), p[e + 1] = hsum(a1), p[e + 2] = hsum(a2), p[e + 3] = hsum(a3);
      for (; i < H; i++)
        for (int j = 0; j < 4; j++) p[e + j] += lds(x, at + i, xb) * w0[j * H + i];
    }
    for (; e < E; e++) {
      vf acc = (vf){0};
      int i = 0;
      for (; i + VW <= H; i += VW) acc += ldv(x, at + i, xb) * *(const vfu*)(w + (int64_t)e * H + i);
      p[e] = hsum(acc);
      for (; i < H; i++) p[e] += lds(x, at + i, xb) * w[(int64_t)e * H + i];
    }
    float mx = -INFINITY;
    for (e = 0; e < E; e++) {
      if (bias) p[e] += bias[e];
      if (p[e] > mx) mx = p[e];
    }
    float sum = 0;
    for (int e = 0; e < E; e++) sum += p[e] = expf(p[e] - mx);
    const int64_t* given = replay && replay[(int64_t)r * k] >= 0 ? replay + (int64_t)r * k : NULL;
    float* g = gate + (int64_t)r * k;
    float total = 0;
    for (int j = 0; j < k; j++) {
      int best = 0;
      if (given) best = (int)given[j];
      else
        for (int e = 1; e < E; e++)
          if (p[e] > p[best]) best = e;
      total += g[j] = p[best] / sum;
      idx[(int64_t)r * k + j] = best;
      if (!given) p[best] = -1.0f;
    }
    for (int j = 0; j < k; j++) g[j] = (norm ? g[j] / total : g[j]) * scale;
  }
}

typedef double vd __attribute__((vector_size(2 * VB)));

/* A step's next tokens from logits [N][V] (fp32 or bf16, lb) as the sampler's torch ops draw them: z = logits / temp
   (fp32), logprob of the token = z - logsumexp(z) (the exps summed in fp64); u[r] < 0: the first argmax of z
   (greedy), else inverse-CDF sampling: the first token whose cumulative softmax probability (fp32 probabilities
   summed in fp64) exceeds min(u * total, the double below total). */
void moerl_sample(const void* logits, int lb, int N, int V, const float* temps, const double* u, int64_t* tokens,
                  float* logprobs, float* work, int threads) {
  int n = (int64_t)N * V >= (1 << 16) ? threads : 1;
  #pragma omp parallel for num_threads(n)
  for (int r = 0; r < N; r++) {
    float* e = work + (int64_t)omp_get_thread_num() * 3 * V;  /* z, then e^(z - max), then the probabilities */
    double* cdf = (double*)(e + V);
    float mx = -INFINITY;
    int arg = 0, v = 0;
    for (; v < V; v++) {
      e[v] = lds(logits, (int64_t)r * V + v, lb) / temps[r];
      if (e[v] > mx) mx = e[v], arg = v;
    }
    float z_arg = e[arg];
    vd lanes = (vd){0};  /* the sum of e^(z - max) in fp64: a long vocabulary's fp32 sum would drift from torch's */
    for (v = 0; v + VW <= V; v += VW) {
      vf x = vexp(*(const vfu*)(e + v) - mx);
      *(vfu*)(e + v) = x;
      lanes += __builtin_convertvector(x, vd);
    }
    double total_e = 0;
    for (int l = 0; l < VW; l++) total_e += lanes[l];
    for (; v < V; v++) total_e += e[v] = expf(e[v] - mx);
    float sum = (float)total_e, lse = mx + logf(sum);
    int tok = arg;
    float zt = z_arg;
    if (u[r] >= 0) {
      double c = 0;
      for (v = 0; v < V; v++) cdf[v] = c += (double)(e[v] / sum);
      double point = u[r] * c, below = nextafter(c, 0.0);
      if (point > below) point = below;
      int lo = 0, hi = V - 1;  /* the first token whose cumulative mass exceeds the point */
      while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (cdf[mid] > point) hi = mid;
        else lo = mid + 1;
      }
      tok = lo;
      zt = lds(logits, (int64_t)r * V + tok, lb) / temps[r];
    }
    tokens[r] = tok;
    logprobs[r] = zt - lse;
  }
}

int moerl_moe_decode(const void* x, const int64_t* idx, const float* gate, int N, int k, int E, int H, int I,
                     const void* gu, const void* dn, int wb, void* out, int xb, float* work, int32_t* ints,
                     const lora_t* L, int dot, int threads) {
  int P = N * k;
  int32_t *offs = ints, *next = ints + E, *tok = ints + 2 * E, *where = ints + 2 * E + P, *ex = ints + 2 * E + 2 * P;
  float* scale = work;
  for (int e = 0; e < E; e++) next[e] = 0;
  for (int p = 0; p < P; p++) {
    if (idx[p] < 0 || idx[p] >= E) return -1;
    next[idx[p]]++;
  }
  if (L)
    for (int n = 0; n < N; n++)
      if (L->slot[n] >= L->S) return -2;
  for (int e = 0, end = 0; e < E; e++) { end += next[e]; offs[e] = end; next[e] = end - next[e]; }
  for (int p = 0; p < P; p++) {
    int r = next[idx[p]]++;
    tok[r] = p / k;
    ex[r] = idx[p];
    where[p] = r;
    scale[r] = rd1(gate[p], xb);
  }
  dot = BF16_DOT && dot && wb && xb && H % 32 == 0 && I % 32 == 0;
  if (dot) {
    #pragma omp parallel num_threads(threads)
    moe_body(x, N, k, E, H, I, gu, dn, out, xb, work, ints, L, 1, 1);
  } else if (wb) {
    #pragma omp parallel num_threads(threads)
    moe_body(x, N, k, E, H, I, gu, dn, out, xb, work, ints, L, 1, 0);
  } else {
    #pragma omp parallel num_threads(threads)
    moe_body(x, N, k, E, H, I, gu, dn, out, xb, work, ints, L, 0, 0);
  }
  return 0;
}

/* LoRA slots on a linear layer's rows: out[n] = y[n] + scale[s] (x[n] A[s]^T) B[s]^T for row n's slot s (slot NULL:
   `single` for every row; -1: none, y[n] as it is). x [N][in], y and out [N][dout], fp32 or bf16 (xb, yb); A [S][r][in]
   and B^T [S][r][dout] fp32. The sums in fp32, the result rounded once. A decode step's few rows on one thread.
   Returns -2 (nothing written) for a slot past the adapters'. */
int moerl_lora_add(const void* x, const void* y, const int64_t* slot, int64_t single, const float* A,
                   const float* BT, const float* scale, int64_t N, int S, int r, int din, int dout, void* out, int xb,
                   int yb, int threads) {
  for (int64_t n = 0; n < (slot ? N : 1); n++)
    if ((slot ? slot[n] : single) >= S) return -2;
  int n_threads = N * (int64_t)r * (din + dout) >= (1 << 18) ? threads : 1;
  #pragma omp parallel for schedule(static) num_threads(n_threads)
  for (int64_t n = 0; n < N; n++) {
    int64_t s = slot ? slot[n] : single;
    float a[r > 0 ? r : 1];
    if (s >= 0) shrink(x, n * din, xb, din, A + s * r * din, r, scale[s], a);
    int i = 0;
    for (; i + VW <= dout; i += 4 * VW) {  /* four vectors at a time (fewer at the end) */
      int cb = (dout - i) / VW < 4 ? (dout - i) / VW : 4;
      vf acc[4];
      for (int c = 0; c < cb; c++) acc[c] = ldv(y, n * dout + i + c * VW, yb);
      if (s >= 0) expand(acc, cb, a, BT + s * r * dout, r, dout, i);
      for (int c = 0; c < cb; c++) stv(out, n * dout + i + c * VW, acc[c], yb);
    }
    i = dout / VW * VW;
    for (; i < dout; i++) {
      float acc = lds(y, n * dout + i, yb);
      if (s >= 0)
        for (int j = 0; j < r; j++) acc += a[j] * BT[(s * r + j) * dout + i];
      if (yb) ((uint16_t*)out)[n * dout + i] = narrow1(acc);
      else ((float*)out)[n * dout + i] = acc;
    }
  }
  return 0;
}

/* A dense layer's rows on the bf16 dot products: y [M][N] (yb: bf16) = x [M][K] @ w, x bf16 with 16 spare rows after its M, w one bf16
   panel set [N / NT][K][NT] in K-pairs, K a multiple of 32 (the caller checks; -1 where the build has no bf16 dot products). With
   L (LoRA slots, E = 1, shared): each row's delta scale (x A^T) B^T joins its sums before they are stored, A [S][r][K]
   and B^T in panels [S][N / NT][r][NT] (fp32), the shrinks into xa [M][r]. Returns -2 for a slot past the adapters'. */
int moerl_bf16_linear(const uint16_t* x, const uint16_t* w, int M, int K, int N, void* y, int yb, const lora_t* L,
                     float* xa, int threads) {
  if (!BF16_DOT) return -1;
  if (L)
    for (int m = 0; m < M; m++)
      if (L->slot[m] >= L->S) return -2;
  int32_t offs[1] = {M};
  int tasks = N / NT, n = (int64_t)M * K * N >= (1 << 20) ? threads : 1;
  #pragma omp parallel num_threads(n)
  {
    if (L) {
      #pragma omp for schedule(static)
      for (int m = 0; m < M; m++) {
        int64_t s = L->slot[m];
        if (s >= 0) shrink(x, (int64_t)m * K, 1, K, L->gu_a + s * L->r * K, L->r, L->scale[s], xa + (int64_t)m * L->r);
      }
    }
    dot_begin();
    if (yb) {
      #pragma omp for schedule(static)
      for (int t = 0; t < tasks; t++) dot_task(x, w, offs, NULL, K, N, 0, y, t, L, NULL, xa, 1);
    } else {
      #pragma omp for schedule(static)
      for (int t = 0; t < tasks; t++) dot_task(x, w, offs, NULL, K, N, 0, y, t, L, NULL, xa, 0);
    }
    dot_end();
  }
  return 0;
}

/* Decode attention over the paged cache, read in place: q [B][Hq * D] (rows ldq apart) -> out [B, Hq, Dv], both in
   the pools' dtype (kb; the sums in fp32, rounded once). Pools head-major [Hkv][rows][D] and [Hkv][rows][Dv]; tables
   [B][nb] block ids; pos [B]: the query's position (keys 0..pos visible; window > 0: only the last `window` of them;
   window < 0: those of the query's aligned chunk of -window positions, from pos - pos % -window: first_key);
   sinks [Hq] (a logit that joins the softmax) or NULL; scratch: threads x ((Hq / Hkv + 2) * nb * bs + Hq / Hkv * D)
   floats for the scores, the keys' rows and the queries in fp32. One task per (row, KV head): each key and value
   row is read once for the query heads that share it. new_slot [B] (NULL: none): the pool row of each row's new key
   and value (knew [B][Hkv * D], vnew [B][Hkv * Dv], rows ldk / ldv apart, the pools' dtype; -1: none), written by the
   row's tasks before they read it (an eager step's KV write, where the torch path takes six ops a layer). */


/* one level of lane_sums: pairs of the `count` * 2 vectors in u give `count` vectors of their half-sums */
#define HALVE(count, e, o) \
  for (int i = 0; i < count; i++) \
    u[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], e) + __builtin_shuffle(u[2 * i], u[2 * i + 1], o)
#if VW == 16
/* lane_sums' shuffles on 16 lanes: level l pairs lane blocks of 2^l, E taking each block's first half, O its second */
static const vi E0 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
static const vi O0 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
static const vi E1 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
static const vi O1 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
static const vi E2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
static const vi O2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
static const vi E3 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const vi O3 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
#endif
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
  HALVE(8, E0, O0);
  HALVE(4, E1, O1);
  HALVE(2, E2, O2);
  HALVE(1, E3, O3);
#endif
  return u[0];
}
#endif
#if VW == 16
/* the sums of 8 vectors' lanes, as 8 lanes (lane i: the sum of a[i]'s): lane_sums' tree, three levels, leaves each
   vector's sum in two lanes (i and i + 8), added last */
typedef float vf8 __attribute__((vector_size(32)));
static inline vf8 lane_sums8(const vf* a) {
  vf u[8];
  for (int i = 0; i < 8; i++) u[i] = a[i];
  HALVE(4, E0, O0);
  HALVE(2, E1, O1);
  HALVE(1, E2, O2);
  vf8 lo, hi;
  memcpy(&lo, &u[0], sizeof lo);
  memcpy(&hi, (const char*)&u[0] + sizeof lo, sizeof hi);
  return lo + hi;
}
#endif

/* s[0..n) = e^(s - mx) in place; returns their sum */
static inline float exp_sum(float* s, int64_t n, float mx) {
  vf acc = (vf){0};
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    vf e = vexp(*(vfu*)(s + i) - mx);
    *(vfu*)(s + i) = e;
    acc += e;
  }
  float sum = hsum(acc);
  for (; i < n; i++) sum += s[i] = expf(s[i] - mx);
  return sum;
}

/* rows at[from..to) of a pool (bytes a row) asked for from memory, a cache line at a time */
static inline void prefetch_rows(const void* pool, const int64_t* at, int64_t from, int64_t to, int bytes) {
  for (int64_t k = from; k < to; k++)
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch((const char*)pool + at[k] * bytes + o);
}

/* the first key a query at position p sees: the last `window` keys (window > 0), those of its aligned chunk of
   -window positions (window < 0: Llama 4's chunked layers), or every one (0) */
static inline int64_t first_key(int64_t p, int64_t window) {
  if (window > 0) return p - window + 1 > 0 ? p - window + 1 : 0;
  return window < 0 ? p - p % -window : 0;
}

/* the key and value rows task t (row t / Hkv, KV head t % Hkv) reads, asked for a task ahead: its blocks are
   whole runs of rows in the pools (bs rows of a head side by side), so a task's cold reads wait on memory together,
   not one block after another */
static inline void prefetch_task(const void* kp, const void* vp, const int64_t* tables, const int64_t* pos, int Hkv,
                                 int D, int Dv, int64_t rows, int nb, int bs, int64_t window, int t, int64_t es) {
  int b = t / Hkv, kh = t % Hkv;
  int64_t p = pos[b], lo = first_key(p, window);
  for (int64_t blk = lo / bs; blk <= p / bs && blk < nb; blk++) {
    int64_t first = (int64_t)kh * rows + tables[(int64_t)b * nb + blk] * bs;
    int64_t n = blk == p / bs ? p % bs + 1 : bs;
    for (int64_t o = 0; o < n * D * es; o += 64) __builtin_prefetch((const char*)kp + first * D * es + o);
    for (int64_t o = 0; o < n * Dv * es; o += 64) __builtin_prefetch((const char*)vp + first * Dv * es + o);
  }
}

/* paged_task's value sums of heads h0 and h0 + 1 (C vectors a head), each value row widened once for both; the
   same adds in the same order as a head at a time */
#define VALUE_SUMS2(C)                                                      \
  do {                                                                      \
    const float *s0 = s + h0 * n, *s1 = s0 + n;                             \
    vf a0[C], a1[C];                                                        \
    for (int c = 0; c < C; c++) a0[c] = a1[c] = (vf){0};                    \
    for (int64_t j = 0; j < n; j++) {                                       \
      int64_t vr = at[j] * Dv;                                              \
      vf p0 = (vf){0} + s0[j], p1 = (vf){0} + s1[j];                        \
      for (int c = 0; c < C; c++) {                                         \
        vf vv = ldv(vp, vr + c * VW, kb);                                   \
        a0[c] += p0 * vv;                                                   \
        a1[c] += p1 * vv;                                                   \
      }                                                                     \
    }                                                                       \
    int64_t oh = o + (int64_t)h0 * Dv;                                      \
    for (int c = 0; c < C; c++) {                                           \
      stv(out, oh + c * VW, a0[c], kb);                                     \
      stv(out, oh + Dv + c * VW, a1[c], kb);                                \
    }                                                                       \
  } while (0)

/* one task of the paged decode: row b's KV head kh, its pools fp32 (kb = 0) or bf16 (kb = 1). Each visible key's
   pool row is found once, walking the block table (no division per key: a task's keys are few, and an integer
   division costs what a dozen of their multiply-adds do) */
static inline __attribute__((always_inline)) void paged_task(const void* q, int64_t ldq, const void* kp,
                                                             const void* vp, const int64_t* tables,
                                                             const int64_t* pos, const float* sinks, int Hq, int Hkv,
                                                             int D, int Dv, int64_t rows, int nb, int bs,
                                                             int64_t window, float scale, void* out, float* scratch,
                                                             int t, const void* knew, int64_t ldk, const void* vnew,
                                                             int64_t ldvn, const int64_t* new_slot, const int kb) {
  int g = Hq / Hkv;
  int b = t / Hkv, kh = t % Hkv;
  int64_t es = kb ? 2 : 4;
  if (new_slot && new_slot[b] >= 0) {  /* this step's key and value of row b, head kh, into their pool rows */
    int64_t at = (int64_t)kh * rows + new_slot[b];
    memcpy((char*)kp + at * D * es, (const char*)knew + ((int64_t)b * ldk + (int64_t)kh * D) * es, D * es);
    memcpy((char*)vp + at * Dv * es, (const char*)vnew + ((int64_t)b * ldvn + (int64_t)kh * Dv) * es, Dv * es);
  }
  int64_t p = pos[b], lo = first_key(p, window), n = p - lo + 1;
  float* s = scratch + (int64_t)omp_get_thread_num() * ((g + 2) * nb * bs + g * D);  /* [g][n] scores, [n] rows */
  int64_t* at = (int64_t*)(s + (int64_t)g * nb * bs);  /* each visible key's pool row (head kh) */
  float* qv = s + (int64_t)(g + 2) * nb * bs;  /* the g query heads of this KV head, in fp32 */
  for (int i = 0; i < g * D; i++) qv[i] = lds(q, (int64_t)b * ldq + (int64_t)kh * g * D + i, kb);
  const int64_t* table = tables + (int64_t)b * nb;
  for (int64_t j = lo, blk = lo / bs, off = lo % bs; j <= p; j++) {
    at[j - lo] = (int64_t)kh * rows + table[blk] * bs + off;
    if (++off == bs) { off = 0; blk++; }
  }
  /* a row's blocks are scattered over the pools: read as the sums reach them, each block's first lines would wait
     on memory in turn, so the rows are asked for ahead */
  int64_t j = 0;
#if VW == 16
  if (D % VW == 0 && g % 2 == 0) {  /* 8 keys and two heads at a time: each key row widened once for both */
    prefetch_rows(kp, at, 0, n < 16 ? n : 16, D * es);
    for (; j + 8 <= n; j += 8) {
      /* the keys two chunks on and this chunk's values asked for while these sums run */
      prefetch_rows(kp, at, j + 16, n < j + 24 ? n : j + 24, D * es);
      prefetch_rows(vp, at, j, j + 8, Dv * es);
      for (int h = 0; h < g; h += 2) {
        const float *q0 = qv + (int64_t)h * D, *q1 = q0 + D;
        vf a0[8], a1[8];
        for (int k = 0; k < 8; k++) a0[k] = a1[k] = (vf){0};
#if defined(__AVX512BF16__)
        if (kb && D % 32 == 0) {  /* bf16 q and keys: vdpbf16ps, 32 of D a step, no widening */
          const uint16_t* qb = (const uint16_t*)q + (int64_t)b * ldq + ((int64_t)kh * g + h) * D;
          for (int i = 0; i < D; i += 32) {
            __m512bh x0 = (__m512bh)_mm512_loadu_si512(qb + i), x1 = (__m512bh)_mm512_loadu_si512(qb + D + i);
            for (int k = 0; k < 8; k++) {
              __m512bh kv = (__m512bh)_mm512_loadu_si512((const uint16_t*)kp + at[j + k] * D + i);
              a0[k] = (vf)_mm512_dpbf16_ps((__m512)a0[k], x0, kv);
              a1[k] = (vf)_mm512_dpbf16_ps((__m512)a1[k], x1, kv);
            }
          }
        } else
#endif
        for (int i = 0; i < D; i += VW) {
          vf x0 = *(const vfu*)(q0 + i), x1 = *(const vfu*)(q1 + i);
          for (int k = 0; k < 8; k++) {
            vf kv = ldv(kp, at[j + k] * D + i, kb);
            a0[k] += x0 * kv;
            a1[k] += x1 * kv;
          }
        }
        vf8 r0 = lane_sums8(a0) * scale, r1 = lane_sums8(a1) * scale;
        memcpy(s + h * n + j, &r0, sizeof r0);
        memcpy(s + (h + 1) * n + j, &r1, sizeof r1);
      }
    }
    prefetch_rows(vp, at, j, n, Dv * es);
  } else
#endif
  {  /* every visible key's and value's row asked for at once */
    prefetch_rows(kp, at, 0, n, D * es);
    prefetch_rows(vp, at, 0, n, Dv * es);
  }
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
  int64_t o = ((int64_t)b * Hq + (int64_t)kh * g) * Dv;  /* the output's rows, in the pools' dtype */
  for (int h = 0; h < g; h++) {
    float* sh = s + h * n;
    float mx = sinks ? sinks[kh * g + h] : -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;
    float inv = 1.0f / (exp_sum(sh, n, mx) + (sinks ? expf(sinks[kh * g + h] - mx) : 0.0f));
    for (int64_t j = 0; j < n; j++) sh[j] *= inv;
  }
  /* the value sum two heads at a time where the heads fill four vectors (each value row widened once for both),
     else a head at a time: four vectors of its output held in registers over the keys (an output kept in memory
     would chain every key's add through a store and a load) */
  int h0 = 0;
  if (Dv == 4 * VW)
    for (; h0 + 2 <= g; h0 += 2) VALUE_SUMS2(4);
  else if (Dv == 2 * VW)  /* tiny's 32 on AVX-512: four sums in flight, where one head's two would wait on theirs */
    for (; h0 + 2 <= g; h0 += 2) VALUE_SUMS2(2);
  for (int h = h0; h < g; h++) {
    const float* sh = s + h * n;
    int64_t oh = o + (int64_t)h * Dv;
    int i0 = 0;
    for (; i0 + 4 * VW <= Dv; i0 += 4 * VW) {
      vf acc[4] = {(vf){0}, (vf){0}, (vf){0}, (vf){0}};
      for (int64_t j = 0; j < n; j++) {
        int64_t vr = at[j] * Dv + i0;
        for (int c = 0; c < 4; c++) acc[c] += sh[j] * ldv(vp, vr + c * VW, kb);
      }
      for (int c = 0; c < 4; c++) stv(out, oh + i0 + c * VW, acc[c], kb);
    }
    for (; i0 + VW <= Dv; i0 += VW) {  /* a head narrower than four vectors (tiny's 32 on AVX-512) */
      vf acc = (vf){0};
      for (int64_t j = 0; j < n; j++) acc += sh[j] * ldv(vp, at[j] * Dv + i0, kb);
      stv(out, oh + i0, acc, kb);
    }
    for (; i0 < Dv; i0++) {
      float acc = 0.0f;
      for (int64_t j = 0; j < n; j++) acc += sh[j] * lds(vp, at[j] * Dv + i0, kb);
      if (kb) ((uint16_t*)out)[oh + i0] = narrow1(acc);
      else ((float*)out)[oh + i0] = acc;
    }
  }
}

void moerl_paged_decode(const void* q, int64_t ldq, const void* kp, const void* vp, const int64_t* tables,
                        const int64_t* pos, const float* sinks, int B, int Hq, int Hkv, int D, int Dv, int64_t rows,
                        int nb, int bs, int64_t window, float scale, void* out, float* scratch, const void* knew,
                        int64_t ldk, const void* vnew, int64_t ldvn, const int64_t* new_slot, int kb, int threads) {
  /* a thread's tasks in turn (static, 1): the next one is known, and its rows are asked for before this one runs */
  int tasks = B * Hkv;
  #pragma omp parallel num_threads(threads)
  {
    int step = omp_get_num_threads();
    int64_t es = kb ? 2 : 4;
    if (omp_get_thread_num() < tasks)
      prefetch_task(kp, vp, tables, pos, Hkv, D, Dv, rows, nb, bs, window, omp_get_thread_num(), es);
    #pragma omp for schedule(static, 1)
    for (int t = 0; t < tasks; t++) {
      if (t + step < tasks) prefetch_task(kp, vp, tables, pos, Hkv, D, Dv, rows, nb, bs, window, t + step, es);
      if (kb)
        paged_task(q, ldq, kp, vp, tables, pos, sinks, Hq, Hkv, D, Dv, rows, nb, bs, window, scale, out, scratch,
                   t, knew, ldk, vnew, ldvn, new_slot, 1);
      else
        paged_task(q, ldq, kp, vp, tables, pos, sinks, Hq, Hkv, D, Dv, rows, nb, bs, window, scale, out, scratch,
                   t, knew, ldk, vnew, ldvn, new_slot, 0);
    }
  }
}

/* RMSNorm of rows x [rows][dim] -> y, as torch's CPU composite computes it: in fp32, y = x * rsqrt(mean(x^2) + eps)
   * w, rounded once to y's dtype; x and y fp32 (xb = 0) or bf16 (xb = 1), w fp32 or bf16 (wb). */
/* 1 / sqrt(mean(x^2) + eps) of the dim values of x (fp32 or bf16, xb) from element at: RMSNorm's statistics, one
   piece of code for every kernel that normalizes (their bits must agree) */
static inline float rms_inv(const void* x, int64_t at, int dim, float eps, int xb) {
  vf acc = (vf){0};
  int i = 0;
  for (; i + VW <= dim; i += VW) {
    vf v = ldv(x, at + i, xb);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; i < dim; i++) ss += lds(x, at + i, xb) * lds(x, at + i, xb);
  return 1.0f / sqrtf(ss / dim + eps);
}

static inline __attribute__((always_inline)) void rms_row(const void* x, const void* w, void* y, int64_t r, int dim,
                                                          float eps, const int xb, const int wb) {
  int64_t at = r * dim;
  float inv = rms_inv(x, at, dim, eps, xb);
  int i = 0;
  for (; i + VW <= dim; i += VW) stv(y, at + i, ldv(x, at + i, xb) * inv * ldv(w, i, wb), xb);
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

/* The residual add and the norm after it, one call: s = x + a (x, a, s fp32 or bf16 rows [rows][dim], xb; the sum
   rounded once to the dtype, as torch's add rounds it), y = RMSNorm(s) * w as rms_row computes it */
void moerl_add_rms_norm(const void* x, const void* a, void* s, const void* w, void* y, int64_t rows, int dim,
                        float eps, int xb, int wb, int threads) {
  int n = rows * dim >= 16384 ? threads : 1;  /* a decode step of 64 rows of 512 on two threads: 18 -> 10 us */
  #pragma omp parallel for num_threads(n)
  for (int64_t r = 0; r < rows; r++) {
    int64_t at = r * dim;
    int i = 0;
    for (; i + VW <= dim; i += VW) stv(s, at + i, ldv(x, at + i, xb) + ldv(a, at + i, xb), xb);
    for (; i < dim; i++) {
      float v = lds(x, at + i, xb) + lds(a, at + i, xb);
      if (xb) ((uint16_t*)s)[at + i] = narrow1(v);
      else ((float*)s)[at + i] = v;
    }
    if (xb && wb) rms_row(s, w, y, r, dim, eps, 1, 1);
    else if (xb) rms_row(s, w, y, r, dim, eps, 1, 0);
    else if (wb) rms_row(s, w, y, r, dim, eps, 0, 1);
    else rms_row(s, w, y, r, dim, eps, 0, 0);
  }
}

/* One head's D values at x (in place): RMSNorm by w (NULL: none) as RMSNorm's kernel computes it, rounded to the
   dtype, then the rotate-half rotation by cos / sin [D] as torch's ops compute it: x * cos and rotated * sin each
   rounded to the dtype, then their sum (no fused multiply-add: fp32 as torch's three ops give it). xb: bf16 values,
   cos and sin (else fp32); wb: bf16 weight. */
/* v [D] (fp32 holding the dtype's values) RMSNorm-ed by w as rms_row computes it, each result rounded to the dtype;
   not inlined into norm_rope_head, whose fp-contract=off would change the sums' bits */
__attribute__((noinline)) static void norm_head(float* v, int D, const void* w, float eps, int xb, int wb) {
  float inv = rms_inv(v, 0, D, eps, 0);
  int i = 0;
  for (; i + VW <= D; i += VW) *(vfu*)(v + i) = rd(*(vfu*)(v + i) * inv * ldv(w, i, wb), xb);
  for (; i < D; i++) v[i] = rd1(v[i] * inv * lds(w, i, wb), xb);
}

__attribute__((optimize("fp-contract=off"))) static void norm_rope_head(void* x, int64_t at, int D, const void* w,
                                                                         float eps, const void* cs, const void* sn,
                                                                         int64_t ct, int xb, int wb) {
  float v[D];
  int i = 0;
  /* whole vectors, as norm_head and the rotation read them back (a vector load of values stored one by one waits
     for those stores) */
  for (; i + VW <= D; i += VW) *(vfu*)(v + i) = ldv(x, at + i, xb);
  for (; i < D; i++) v[i] = lds(x, at + i, xb);
  if (w) norm_head(v, D, w, eps, xb, wb);
  int h = D / 2;
  i = 0;
  for (; i + VW <= h; i += VW) {
    vf x1 = *(vfu*)(v + i), x2 = *(vfu*)(v + h + i);
    vf a = rd(rd(x1 * ldv(cs, ct + i, xb), xb) + rd(-x2 * ldv(sn, ct + i, xb), xb), xb);
    vf b = rd(rd(x2 * ldv(cs, ct + h + i, xb), xb) + rd(x1 * ldv(sn, ct + h + i, xb), xb), xb);
    stv(x, at + i, a, xb);
    stv(x, at + h + i, b, xb);
  }
  for (; i < h; i++) {
    float x1 = v[i], x2 = v[h + i];
    float a = rd1(rd1(x1 * lds(cs, ct + i, xb), xb) + rd1(-x2 * lds(sn, ct + i, xb), xb), xb);
    float b = rd1(rd1(x2 * lds(cs, ct + h + i, xb), xb) + rd1(x1 * lds(sn, ct + h + i, xb), xb), xb);
    if (xb) {
      ((uint16_t*)x)[at + i] = narrow1(a);
      ((uint16_t*)x)[at + h + i] = narrow1(b);
    } else {
      ((float*)x)[at + i] = a;
      ((float*)x)[at + h + i] = b;
    }
  }
}

/* A decode step's queries q [rows][Hq][D] and keys k [rows][Hk][D] (rows ldq / ldk elements apart), in place: each
   head RMSNorm-ed by qw / kw (NULL: none) and rotated by its row's cos / sin [rows][D] (norm_rope_head). One call
   where torch takes a dozen ops; two threads from 16k values (small's 64 rows of 12 heads: 119 -> 73 us a call). */
void moerl_norm_rope(void* q, void* k, int64_t rows, int64_t ldq, int64_t ldk, int Hq, int Hk, int D, const void* qw,
                     const void* kw, float eps, const void* cs, const void* sn, int xb, int wb, int threads) {
  int64_t tasks = rows * (Hq + Hk);
  int n = tasks * D >= 16384 ? threads : 1;
  #pragma omp parallel for num_threads(n)
  for (int64_t t = 0; t < tasks; t++) {
    int64_t r = t / (Hq + Hk), h = t % (Hq + Hk);
    if (h < Hq) norm_rope_head(q, r * ldq + h * D, D, qw, eps, cs, sn, r * D, xb, wb);
    else norm_rope_head(k, r * ldk + (h - Hq) * D, D, kw, eps, cs, sn, r * D, xb, wb);
  }
}

/* ---- training: the backward of RMSNorm and of norm_rope, in fp32, each result rounded once to its dtype ---- */

/* One row's RMSNorm backward from x [dim] (at `at`, xb) and the grad g of y (xb): dx = inv * g * w - x * inv^3 *
   sum(g * w * x) / dim, inv as rms_inv gives it (the forward's bits); dwp [dim] += g * x * inv (NULL: none). x and g
   may be fp32 buffers (xb = 0) holding a bf16 row's values: norm_rope_grad's heads. */
static inline void rms_grad_row(const void* x, const void* g, const void* w, void* dx, int64_t at, int64_t gat,
                                int64_t dat, int dim, float eps, int xb, int gb, int wb, int db, float* dwp) {
  float inv = rms_inv(x, at, dim, eps, xb);
  vf acc = (vf){0};
  int i = 0;
  for (; i + VW <= dim; i += VW) acc += ldv(g, gat + i, gb) * ldv(w, i, wb) * ldv(x, at + i, xb);
  float s = hsum(acc);
  for (; i < dim; i++) s += lds(g, gat + i, gb) * lds(w, i, wb) * lds(x, at + i, xb);
  float c = s * inv * inv * inv / dim;
  for (i = 0; i + VW <= dim; i += VW) {
    vf gv = ldv(g, gat + i, gb), xv = ldv(x, at + i, xb);
    stv(dx, dat + i, inv * gv * ldv(w, i, wb) - c * xv, db);
    if (dwp) *(vfu*)(dwp + i) += gv * xv * inv;
  }
  for (; i < dim; i++) {
    float gv = lds(g, gat + i, gb), xv = lds(x, at + i, xb), d = inv * gv * lds(w, i, wb) - c * xv;
    if (db) ((uint16_t*)dx)[dat + i] = narrow1(d);
    else ((float*)dx)[dat + i] = d;
    if (dwp) dwp[i] += gv * xv * inv;
  }
}

/* RMSNorm's backward over rows x [rows][dim] and g [rows][dim] (both xb): dx [rows][dim] (xb), and each thread's
   share of the weight's grad in dw_part [threads][dim] (fp32, zeroed by the caller, summed by it; NULL: none). */
void moerl_rms_norm_backward(const void* x, const void* w, const void* g, void* dx, float* dw_part, int64_t rows,
                             int dim, float eps, int xb, int wb, int threads) {
  int n = rows * dim >= 65536 ? threads : 1;
  #pragma omp parallel num_threads(n)
  {
    float* dwp = dw_part ? dw_part + (int64_t)omp_get_thread_num() * dim : NULL;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_grad_row(x, g, w, dx, r * dim, r * dim, r * dim, dim, eps, xb, xb, wb, xb, dwp);
  }
}

/* One head's backward of norm_rope_head: g [D] (the grad of the rotated head) rotated back (the transpose of the
   rotation: u1 = g1 c1 + g2 s2, u2 = g2 c2 - g1 s1), then through the head's RMSNorm of x (its input before the norm;
   w NULL: no norm) into dx; dwp [D] += its weight's grad. */
static void norm_rope_grad_head(const void* x, const void* g, void* dx, int64_t at, int D, const void* w, float eps,
                                const void* cs, const void* sn, int64_t ct, int xb, int wb, float* dwp) {
  float u[D];
  int h = D / 2, i = 0;
  for (; i + VW <= h; i += VW) {
    vf g1 = ldv(g, at + i, xb), g2 = ldv(g, at + h + i, xb);
    *(vfu*)(u + i) = g1 * ldv(cs, ct + i, xb) + g2 * ldv(sn, ct + h + i, xb);
    *(vfu*)(u + h + i) = g2 * ldv(cs, ct + h + i, xb) - g1 * ldv(sn, ct + i, xb);
  }
  for (; i < h; i++) {
    float g1 = lds(g, at + i, xb), g2 = lds(g, at + h + i, xb);
    u[i] = g1 * lds(cs, ct + i, xb) + g2 * lds(sn, ct + h + i, xb);
    u[h + i] = g2 * lds(cs, ct + h + i, xb) - g1 * lds(sn, ct + i, xb);
  }
  if (w) {
    rms_grad_row(x, u, w, dx, at, 0, at, D, eps, xb, 0, wb, xb, dwp);
    return;
  }
  for (i = 0; i + VW <= D; i += VW) stv(dx, at + i, *(vfu*)(u + i), xb);
  for (; i < D; i++) {
    if (xb) ((uint16_t*)dx)[at + i] = narrow1(u[i]);
    else ((float*)dx)[at + i] = u[i];
  }
}

/* norm_rope's backward: q [rows][Hq][D] and k [rows][Hk][D] (the inputs before the norms), gq / gk the grads of its
   outputs -> dq / dk (their dtype), and each thread's share of the norms' weight grads in dqw_part / dkw_part
   [threads][D] (fp32, zeroed by the caller; NULL: not wanted). qw / kw NULL: no norms. */
void moerl_norm_rope_backward(const void* q, const void* k, const void* gq, const void* gk, void* dq, void* dk,
                              int64_t rows, int Hq, int Hk, int D, const void* qw, const void* kw, float eps,
                              const void* cs, const void* sn, int xb, int wb, float* dqw_part, float* dkw_part,
                              int threads) {
  int64_t tasks = rows * (Hq + Hk);
  int n = tasks * D >= 65536 ? threads : 1;
  #pragma omp parallel num_threads(n)
  {
    int64_t t0 = (int64_t)omp_get_thread_num() * D;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
      int64_t r = t / (Hq + Hk), h = t % (Hq + Hk);
      if (h < Hq)
        norm_rope_grad_head(q, gq, dq, (r * Hq + h) * D, D, qw, eps, cs, sn, r * D, xb, wb,
                            dqw_part ? dqw_part + t0 : NULL);
      else
        norm_rope_grad_head(k, gk, dk, (r * Hk + h - Hq) * D, D, kw, eps, cs, sn, r * D, xb, wb,
                            dkw_part ? dkw_part + t0 : NULL);
    }
  }
}
