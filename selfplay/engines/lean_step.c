/* Small kernels of the lean decoding step on CPU (hf_native.py compiles this file at run time and
 * checks each kernel against torch before the engine uses it).
 *
 * First the step's attention: one new token a row over that row's own KV cache, each KV head read
 * once for its group of query heads.
 *
 * Per (row, KV head): the scores of the group's G queries against every position the row attends
 * to (the batch's shared prefix, read from row 0, then the row's own positions, given as runs
 * [start, end) so padding and holes are never read), their softmax, and the probabilities times
 * the values. Keys and values stream through once, in position order, a cache line ahead, four
 * positions at a time (each score's sum reduced once for four); the prefix, the same for every
 * row, stays in the core's cache after the first. The (row, KV head) tasks are shared out by
 * OpenMP, which resolves to the libgomp that torch has already loaded (one thread pool, its
 * threads hot).
 *
 * Layouts: queries fp32 [B, Hkv x G, D], rows `q_row_stride` apart (a view into the fused q/k/v
 * product will do); keys and values fp32 (attend_d64, attend_d128) or bf16 (attend_bf16_d64,
 * attend_bf16_d128: each read widened to fp32, every sum in fp32; or, on a CPU with AVX-512 BF16,
 * by pair products: attend_task_dp below), row b, head h, own position l at base + b * row_stride
 * + h * head_stride + l * D (the engine's preallocated cache, any capacity), prefix position l at
 * kp / vp + h * head_stride + l * D (l < P; P = 0: none), the values' own base as far from vp as
 * the keys' from kp (the engine's: both the prefix's tensor's later columns); runs [B, R, 2]
 * int32; out [B, Hkv, G, D]; lse [B, Hkv, G] (the log-sum-exp of each query's scaled scores:
 * -inf where a row attends to nothing, its output then zero); scratch: `threads` buffers
 * `scratch_stride` floats apart, each at least (2 x G + 2) x (P + own positions + 8) + 256.
 * With `per` > 1, B counts query rows, `per` of them a cache row (a prefill's new tokens, each a
 * row of its own, its runs its causal mask's): query row b reads cache row b / per, and a
 * thread's tasks, in order, read the same cache row while it is in the core's cache.
 */
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <omp.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int i8 __attribute__((vector_size(32)));
typedef unsigned short bf16; /* bfloat16's bits: the top half of a float's */
typedef unsigned short u8x16 __attribute__((vector_size(16)));
typedef unsigned u32x8 __attribute__((vector_size(32)));

#define MAX_GROUP 16
#define MAX_ROTARY_DIM 256 /* rotary_cache's buffer of one rotated key (hf_native.MAX_ROTARY_DIM) */
#define AHEAD 6 /* positions prefetched ahead */
#define LINE 64 /* bytes a cache line */
#define WRITE_AHEAD 4 /* rows whose cache lines rotary_cache fetches ahead */

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 load(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void store(float *p, v8 x) { memcpy(p, &x, sizeof x); }

/* eight bf16 widened to fp32 (exact: a bf16 is a float's top 16 bits); with AVX2 one widening
 * load and a shift (GCC's generic conversion splits it into halves) */
static inline v8 load_bf16(const bf16 *p) {
#ifdef __AVX2__
  __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
  return (v8)_mm256_castsi256_ps(w);
#else
  u8x16 h;
  memcpy(&h, p, sizeof h);
  i8 w = __builtin_convertvector(h, i8) << 16;
  v8 r;
  memcpy(&r, &w, sizeof r);
  return r;
#endif
}

/* fp32 to bf16, rounded to nearest, ties to even (as torch's .to(torch.bfloat16)); NaN stays NaN */
static inline bf16 to_bf16(float x) {
  unsigned u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
  return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* eight fp32 to bf16 as to_bf16 does each (with AVX-512 BF16 one instruction, which also
 * flushes values below bf16's normal range, under 1.2e-38, to zero) */
static inline void store_bf16(bf16 *p, v8 x) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  __m128bh narrow = _mm256_cvtneps_pbh((__m256)x);
  memcpy(p, &narrow, sizeof narrow);
#else
  u32x8 u;
  memcpy(&u, &x, sizeof u);
  u32x8 nan = (u32x8)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
  u32x8 up = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  u32x8 bits = (nan & ((u >> 16) | 0x40u)) | (~nan & up);
  u8x16 h = __builtin_convertvector(bits, u8x16);
  memcpy(p, &h, sizeof h);
#endif
}

static inline float from_bf16(bf16 x) {
  unsigned u = (unsigned)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline v8 pick(i8 when, v8 a, v8 b) {
  i8 ia, ib, r;
  memcpy(&ia, &a, sizeof ia);
  memcpy(&ib, &b, sizeof ib);
  r = (when & ia) | (~when & ib);
  v8 out;
  memcpy(&out, &r, sizeof out);
  return out;
}

static inline float total(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* exp(x) for x <= 0 (a score minus its row's max): 2^n p(r) with r in [-ln2/2, ln2/2] (Cephes'
 * single-precision polynomial, about 1e-7 relative); below -87 it reads as exp(-87), and the
 * caller zeroes -inf scores itself */
static inline v8 exp_nonpositive(v8 x) {
  x = pick(x < splat(-87.f), splat(-87.f), x);
  v8 t = x * splat(1.44269504088896341f);
  v8 n = __builtin_convertvector(__builtin_convertvector(t - splat(0.5f), i8), v8);
  n = pick(n > t, n - splat(1.f), n); /* floor(t + 0.5) */
  v8 r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.f);
  i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  v8 scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/* positions a block of the score and value loops takes at once, and query heads a block of the
 * score loop (its GB x KB sums stay in registers: 32 of them with AVX-512, 16 with AVX2) */
#define KB 4
#ifdef __AVX512F__
#define GB 3
#else
#define GB 2
#endif

#define INLINE static inline __attribute__((always_inline))

/* eight fp32, or eight bf16 widened, from p's i-th element on */
INLINE v8 load_kv(const void *p, long i, int is_bf16) {
  return is_bf16 ? load_bf16((const bf16 *)p + i) : load((const float *)p + i);
}

INLINE void prefetch_kv(const void *p, long i, int D, int is_bf16) {
  const char *at = (const char *)p + i * (is_bf16 ? 2 : 4);
  for (int c = 0; c < D * (is_bf16 ? 2 : 4); c += LINE) __builtin_prefetch(at + c);
}

/* the four sums of a0..a3's lanes, into out[0..3] */
INLINE void sum4(v8 a0, v8 a1, v8 a2, v8 a3, float *out) {
#ifdef __AVX__
  __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1),
                            _mm256_hadd_ps((__m256)a2, (__m256)a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  out[0] = total(a0), out[1] = total(a1), out[2] = total(a2), out[3] = total(a3);
#endif
}

struct attend_args {
  const float *q;
  long q_row_stride;
  const void *k, *v;
  const int *runs;
  int R;
  float *out, *lse;
  int H, G;
  long row_stride, head_stride;
  float scale;
  float *scratch;
  long scratch_stride;
  const void *kp, *vp; /* the shared prefix's keys and values: row 0's, P positions */
  int P;
  int per; /* query rows a cache row: row b's keys and values are cache row b / per */
  int tasks; /* B x H */
};

/* Lines of the next task's own keys or values, a few at a time into the core's L2 while this
 * task computes: a row's own positions come from memory (two cores read them at about 18 GB/s
 * on the AVX-512 BF16 EPYC) in about the time the task's arithmetic takes, so the two overlap
 * rather than follow each other. */
struct span {
  const char *at;
  long lines;
};

INLINE void fetch_some(struct span *next, long count) {
  for (long c = 0; c < count && next->lines > 0; c++, next->lines--, next->at += LINE)
    __builtin_prefetch(next->at, 0, 2); /* into L2 */
}

/* task t's own positions from the first to the last, in `own` (the own keys' or values' base),
 * `size` bytes an element */
INLINE struct span own_span(int D, int size, const struct attend_args *a, int t, const void *own) {
  struct span none = {0, 0};
  if (t >= a->tasks) return none;
  int b = t / a->H, h = t % a->H, first = -1, last = -1;
  const int *rr = a->runs + (long)b * a->R * 2;
  for (int r = 0; r < a->R; r++)
    if (rr[2 * r + 1] > rr[2 * r]) {
      first = first < 0 || rr[2 * r] < first ? rr[2 * r] : first;
      last = rr[2 * r + 1] > last ? rr[2 * r + 1] : last;
    }
  if (first < 0) return none;
  long at = (long)(b / a->per) * a->row_stride + h * a->head_stride + (long)first * D;
  struct span next = {(const char *)own + at * size, ((long)(last - first) * D * size + LINE - 1) / LINE};
  return next;
}

/* scores s[g * padded + i] of the G queries qt against the positions of runs rr, from the i-th
 * on: KB positions at once (GB queries' sums at a time, each reduced once), the rest one by one */
INLINE void scores(int D, int is_bf16, const float *qt, const void *kb, const int *rr, int R,
                   int G, float scale, float *s, int padded, int i, struct span *next, long each) {
  const int C = D / 8;
  for (int r = 0; r < R; r++) {
    int l = rr[2 * r], end = rr[2 * r + 1];
    for (; l + KB <= end; l += KB, i += KB) {
      for (int j = 0; j < KB; j++) prefetch_kv(kb, (long)(l + AHEAD + j) * D, D, is_bf16);
      fetch_some(next, each);
      for (int g0 = 0; g0 < G; g0 += GB) {
        v8 acc[GB][KB];
        for (int g = 0; g < GB; g++)
          for (int j = 0; j < KB; j++) acc[g][j] = splat(0.f);
        for (int c = 0; c < C; c++) {
          v8 kc[KB];
          for (int j = 0; j < KB; j++) kc[j] = load_kv(kb, (long)(l + j) * D + 8 * c, is_bf16);
          for (int g = 0; g < GB; g++) {
            /* a block past the last query repeats it (its sums are not kept) */
            v8 qv = load(qt + (g0 + g < G ? g0 + g : G - 1) * D + 8 * c);
            for (int j = 0; j < KB; j++) acc[g][j] += qv * kc[j];
          }
        }
        for (int g = 0; g < GB && g0 + g < G; g++) {
          float *sg = s + (g0 + g) * padded + i;
          sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], sg);
          for (int j = 0; j < KB; j++) sg[j] *= scale;
        }
      }
    }
    for (; l < end; l++, i++) {
      v8 kc[16];
      for (int c = 0; c < C; c++) kc[c] = load_kv(kb, (long)l * D + 8 * c, is_bf16);
      for (int g = 0; g < G; g++) {
        const float *qg = qt + g * D;
        v8 acc = load(qg) * kc[0];
        for (int c = 1; c < C; c++) acc += load(qg + 8 * c) * kc[c];
        s[g * padded + i] = total(acc) * scale;
      }
    }
  }
}

/* o[g] += s[g * padded + i] x value of the position the i-th score is of (from the i-th on, at
 * the positions of runs rr), KB positions at once */
INLINE void values(int D, int is_bf16, const void *vb, const int *rr, int R, int G,
                   const float *s, int padded, float *o, int i, struct span *next, long each) {
  const int C = D / 8;
  for (int r = 0; r < R; r++) {
    int l = rr[2 * r], end = rr[2 * r + 1];
    for (; l + KB <= end; l += KB, i += KB) {
      for (int j = 0; j < KB; j++) prefetch_kv(vb, (long)(l + AHEAD + j) * D, D, is_bf16);
      fetch_some(next, each);
      for (int c = 0; c < C; c++) {
        v8 vc[KB];
        for (int j = 0; j < KB; j++) vc[j] = load_kv(vb, (long)(l + j) * D + 8 * c, is_bf16);
        for (int g = 0; g < G; g++) {
          const float *p = s + g * padded + i;
          float *og = o + g * D + 8 * c;
          v8 acc = load(og);
          for (int j = 0; j < KB; j++) acc += splat(p[j]) * vc[j];
          store(og, acc);
        }
      }
    }
    for (; l < end; l++, i++) {
      for (int c = 0; c < C; c++) {
        v8 vc = load_kv(vb, (long)l * D + 8 * c, is_bf16);
        for (int g = 0; g < G; g++) {
          float *og = o + g * D + 8 * c;
          store(og, load(og) + splat(s[g * padded + i]) * vc);
        }
      }
    }
  }
}

/* a query's scores sg[0, width) turned into exp(score - their max) in place, and zeros up to
 * `padded` (a multiple of 8); their sum returned, their log-sum-exp in *lse (a row's softmax is
 * these over the sum) */
INLINE float exponentials(float *sg, int width, int padded, float *lse) {
  for (int j = width; j < padded; j++) sg[j] = -INFINITY;
  v8 most = splat(-INFINITY);
  for (int j = 0; j < padded; j += 8) {
    v8 x = load(sg + j);
    most = pick(x > most, x, most);
  }
  float top = most[0];
  for (int j = 1; j < 8; j++) top = most[j] > top ? most[j] : top;
  v8 sum = splat(0.f);
  for (int j = 0; j < padded; j += 8) {
    v8 x = load(sg + j);
    v8 e = pick(x == splat(-INFINITY), splat(0.f), exp_nonpositive(x - splat(top)));
    store(sg + j, e);
    sum += e;
  }
  float all = total(sum);
  *lse = top + logf(all);
  return all;
}

/* one (row, KV head) task: the scores over the shared prefix and the row's own positions, their
 * softmax (and log-sum-exp), the values */
INLINE void attend_task(int D, int is_bf16, int t, const struct attend_args *a) {
  int G = a->G, P = a->P, b = t / a->H, h = t % a->H, size = is_bf16 ? 2 : 4;
  const int *rr = a->runs + (long)b * a->R * 2;
  const int prefix[2] = {0, P};
  long at = (long)(b / a->per) * a->row_stride + h * a->head_stride;
  const void *kb = (const char *)a->k + at * size, *vb = (const char *)a->v + at * size;
  const void *kp = (const char *)a->kp + h * a->head_stride * size;
  const void *vp = (const char *)a->vp + h * a->head_stride * size;
  const float *qt = a->q + b * a->q_row_stride + (long)h * G * D;
  float *o = a->out + (long)t * G * D, *lse = a->lse + (long)t * G;
  float *s = a->scratch + a->scratch_stride * omp_get_thread_num();
  int width = P;
  for (int r = 0; r < a->R; r++) width += rr[2 * r + 1] - rr[2 * r];
  memset(o, 0, sizeof(float) * G * D);
  if (width <= 0) {
    for (int g = 0; g < G; g++) lse[g] = -INFINITY;
    return;
  }
  int padded = (width + 7) & ~7;
  /* the next task's keys and values fetched a few lines a block of four positions */
  long blocks = (width + KB - 1) / KB;
  struct span next = own_span(D, size, a, t + 1, a->k);
  long each = (next.lines + blocks - 1) / blocks;
  if (P) scores(D, is_bf16, qt, kp, prefix, 1, G, a->scale, s, padded, 0, &next, each);
  scores(D, is_bf16, qt, kb, rr, a->R, G, a->scale, s, padded, P, &next, each);
  for (int g = 0; g < G; g++) {
    float *sg = s + g * padded;
    float inv = 1.f / exponentials(sg, width, padded, lse + g);
    for (int j = 0; j < width; j++) sg[j] *= inv;
  }
  next = own_span(D, size, a, t + 1, a->v);
  each = (next.lines + blocks - 1) / blocks;
  if (P) values(D, is_bf16, vp, prefix, 1, G, s, padded, o, 0, &next, each);
  values(D, is_bf16, vb, rr, a->R, G, s, padded, o, P, &next, each);
}

#ifdef __AVX512BF16__
/* On a CPU with AVX-512 BF16 a bf16 cache is read as it is: VDPBF16PS multiplies bf16 pairs and
 * sums them into fp32 (a bf16 product is exact in fp32), 32 products an instruction against 8 for
 * a widened key's FMA. Each query is split into two bf16 parts, hi (its top 16 bits) and lo (the
 * rest, rounded), whose products with a key sum to the score to about 2^-16 of the query
 * (fp32's 2^-24, a bf16 query's 2^-9); the probabilities are rounded to bf16 for the values (as
 * attention's bf16 output is). The positions a task reads (the prefix's from row 0, then the
 * row's own runs) are listed first as element offsets from the cache's start, so that both
 * passes take them in blocks whatever the runs. */
#define DP 1
_Static_assert(AHEAD + 6 <= 128, "the offsets past a task's positions fit the 256 floats of slack");

typedef __m512bh pairs; /* 32 bf16: 16 pairs */

/* the 16 fp32 sums of x's lanes in halves, as eight */
INLINE v8 halves(__m512 x) {
  return (v8)_mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}

/* a task's positions as offsets (elements) from the cache's row 0, the prefix's first; padded to
 * a multiple of four and AHEAD + 2 past it by repeating the last; returns how many */
INLINE int offsets(int D, const struct attend_args *a, const int *rr, int b, int h, long *off) {
  int n = 0;
  long at = (const bf16 *)a->k - (const bf16 *)a->kp + (long)(b / a->per) * a->row_stride +
            h * a->head_stride;
  for (int l = 0; l < a->P; l++) off[n++] = h * a->head_stride + (long)l * D;
  for (int r = 0; r < a->R; r++)
    for (int l = rr[2 * r]; l < rr[2 * r + 1]; l++) off[n++] = at + (long)l * D;
  for (int j = n; j < ((n + 3) & ~3) + AHEAD + 2; j++) off[j] = off[n - 1];
  return n;
}

/* scores s[g * padded + i] of the G queries qt against the n positions off lists (read from k),
 * four positions at once, each score the sum of its query's hi and lo parts' products; the
 * next task's keys fetched along the way */
INLINE void dp_scores(int D, const float *qt, const bf16 *k, const long *off, int n, int G,
                      float scale, float *s, int padded, struct span next) {
  long each = (next.lines + (n + KB - 1) / KB - 1) / ((n + KB - 1) / KB);
  const int C = D / 32;
  pairs hi[MAX_GROUP][4], lo[MAX_GROUP][4];
  const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
  for (int g = 0; g < G; g++)
    for (int c = 0; c < C; c++) {
      __m512 x0 = _mm512_loadu_ps(qt + g * D + 32 * c), x1 = _mm512_loadu_ps(qt + g * D + 32 * c + 16);
      __m512 h0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x0), top));
      __m512 h1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x1), top));
      hi[g][c] = _mm512_cvtne2ps_pbh(h1, h0); /* exact: h0, h1 are bf16 values */
      lo[g][c] = _mm512_cvtne2ps_pbh(x1 - h1, x0 - h0);
    }
  for (int i = 0; i < n; i += KB) {
    for (int j = 0; j < KB; j++) prefetch_kv(k, off[i + AHEAD + j], D, 1);
    fetch_some(&next, each);
    for (int g0 = 0; g0 < G; g0 += GB) {
      __m512 acc[GB][KB];
      for (int g = 0; g < GB; g++)
        for (int j = 0; j < KB; j++) acc[g][j] = _mm512_setzero_ps();
      for (int c = 0; c < C; c++) {
        pairs kc[KB];
        for (int j = 0; j < KB; j++) kc[j] = (pairs)_mm512_loadu_si512(k + off[i + j] + 32 * c);
        for (int g = 0; g < GB; g++) {
          int q = g0 + g < G ? g0 + g : G - 1; /* a block past the last query repeats it */
          for (int j = 0; j < KB; j++) {
            acc[g][j] = _mm512_dpbf16_ps(acc[g][j], hi[q][c], kc[j]);
            acc[g][j] = _mm512_dpbf16_ps(acc[g][j], lo[q][c], kc[j]);
          }
        }
      }
      for (int g = 0; g < GB && g0 + g < G; g++) {
        float *sg = s + (g0 + g) * padded + i;
        sum4(halves(acc[g][0]), halves(acc[g][1]), halves(acc[g][2]), halves(acc[g][3]), sg);
        for (int j = 0; j < KB; j++) sg[j] *= scale;
      }
    }
  }
}

/* o[g] = the probabilities p (bf16, [G][padded]) times the values of the n positions off lists
 * (read from v): two positions a pass, their value rows interleaved into pairs (within each
 * 128-bit lane, so that the sums land in a lane order undone at the end); the next task's
 * values fetched along the way */
INLINE void dp_values(int D, const bf16 *v, const long *off, int n, int G, const bf16 *p,
                      int padded, float *o, struct span next) {
  long each = (next.lines + (n + 1) / 2 - 1) / ((n + 1) / 2);
  const int C = D / 32;
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int g0 = 0; g0 < G; g0 += GB) {
    __m512 acc[GB][2 * 4]; /* [g][2c]: the low pairs of part c, [g][2c + 1]: the high */
    for (int g = 0; g < GB; g++)
      for (int c = 0; c < 2 * C; c++) acc[g][c] = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 2) {
      prefetch_kv(v, off[i + AHEAD], D, 1);
      prefetch_kv(v, off[i + AHEAD + 1], D, 1);
      fetch_some(&next, each);
      for (int c = 0; c < C; c++) {
        __m512i a = _mm512_loadu_si512(v + off[i] + 32 * c);
        __m512i b = _mm512_loadu_si512(v + off[i + 1] + 32 * c);
        pairs low = (pairs)_mm512_unpacklo_epi16(a, b), high = (pairs)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < GB; g++) {
          int q = g0 + g < G ? g0 + g : G - 1;
          int two;
          memcpy(&two, p + q * padded + i, sizeof two);
          pairs w = (pairs)_mm512_set1_epi32(two);
          acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], w, low);
          acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], w, high);
        }
      }
    }
    for (int g = 0; g < GB && g0 + g < G; g++)
      for (int c = 0; c < C; c++) {
        float *og = o + (g0 + g) * D + 32 * c;
        _mm512_storeu_ps(og, _mm512_permutex2var_ps(acc[g][2 * c], first, acc[g][2 * c + 1]));
        _mm512_storeu_ps(og + 16, _mm512_permutex2var_ps(acc[g][2 * c], second, acc[g][2 * c + 1]));
      }
  }
}

/* attend_task for a bf16 cache by the pair products above; scratch: the scores, then the
 * probabilities in bf16, then the offsets */
INLINE void attend_task_dp(int D, int t, const struct attend_args *a) {
  int G = a->G, b = t / a->H, h = t % a->H;
  const int *rr = a->runs + (long)b * a->R * 2;
  const float *qt = a->q + b * a->q_row_stride + (long)h * G * D;
  float *o = a->out + (long)t * G * D, *lse = a->lse + (long)t * G;
  float *s = a->scratch + a->scratch_stride * omp_get_thread_num();
  int width = a->P;
  for (int r = 0; r < a->R; r++) width += rr[2 * r + 1] - rr[2 * r];
  if (width <= 0) {
    memset(o, 0, sizeof(float) * G * D);
    for (int g = 0; g < G; g++) lse[g] = -INFINITY;
    return;
  }
  int padded = (width + 7) & ~7;
  bf16 *p = (bf16 *)(s + G * padded);
  long *off = (long *)(s + 2 * G * padded);
  const bf16 *k = (const bf16 *)a->kp, *v = (const bf16 *)a->vp;
  int n = offsets(D, a, rr, b, h, off);
  dp_scores(D, qt, k, off, n, G, a->scale, s, padded, own_span(D, 2, a, t + 1, a->k));
  for (int g = 0; g < G; g++) {
    float *sg = s + g * padded;
    float inv = 1.f / exponentials(sg, width, padded, lse + g);
    for (int j = 0; j < padded; j += 8) store_bf16(p + g * padded + j, load(sg + j) * splat(inv));
  }
  dp_values(D, v, off, n, G, p, padded, o, own_span(D, 2, a, t + 1, a->v));
}
#endif

#ifdef DP
#define TASK(D, IS_BF16, t, a) ((IS_BF16) ? attend_task_dp(D, t, a) : attend_task(D, IS_BF16, t, a))
#else
#define TASK attend_task
#endif

#define DEFINE_ATTEND(NAME, D, IS_BF16)                                                           \
  int NAME(const float *q, long q_row_stride, const void *k, const void *v, const int *runs,      \
           int R, float *out, float *lse, int B, int H, int G, long row_stride, long head_stride, \
           float scale, float *scratch, long scratch_stride, int threads, const void *kp,         \
           const void *vp, int P, int per) {                                                      \
    if (G < 1 || G > MAX_GROUP || per < 1) return 1;                                             \
    struct attend_args a = {q,     q_row_stride, k,       v,       runs,           R,            \
                            out,   lse,          H,       G,       row_stride,     head_stride,  \
                            scale, scratch,      scratch_stride,   kp, vp, P, per, B * H};       \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
    for (int t = 0; t < B * H; t++) TASK(D, IS_BF16, t, &a);                                    \
    return 0;                                                                                    \
  }

/* 1 where a bf16 cache is read by pair products (attend_task_dp), 0 where widened to fp32 */
int pair_products(void) {
#ifdef DP
  return 1;
#else
  return 0;
#endif
}

DEFINE_ATTEND(attend_d64, 64, 0)
DEFINE_ATTEND(attend_d128, 128, 0)
DEFINE_ATTEND(attend_bf16_d64, 64, 1)
DEFINE_ATTEND(attend_bf16_d128, 128, 1)

/* ---- the step's element-wise work, one call each where torch runs several ops (one thread:
 * at a step's sizes the work is microseconds and a parallel region's wake-up costs more). A step
 * of a bf16 model keeps its residual stream, norms and rotary embedding in fp32 and hands its
 * products bf16: the kernels below read and write either, a flag per tensor (1: bf16) ---- */

static inline float get(const void *p, int is_bf16, long i) {
  return is_bf16 ? from_bf16(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int is_bf16, long i, float x) {
  if (is_bf16)
    ((bf16 *)p)[i] = to_bf16(x);
  else
    ((float *)p)[i] = x;
}

/* h += delta (where delta is not NULL), then out = weight * h / sqrt(mean(h^2) + eps), per row of
 * `hidden` features; h fp32 (rows `stride` floats apart), delta and out rows `stride` apart too */
void add_rms_norm(float *h, const void *delta, int delta_bf16, const float *weight, float eps,
                  void *out, int out_bf16, int rows, int hidden, long stride) {
  for (int r = 0; r < rows; r++) {
    float *x = h + r * stride;
    long at = r * stride;
    v8 squares = splat(0.f);
    int i = 0;
    for (; i + 8 <= hidden; i += 8) {
      v8 a = delta ? load(x + i) + load_kv(delta, at + i, delta_bf16) : load(x + i);
      store(x + i, a);
      squares += a * a;
    }
    float sum = total(squares);
    for (; i < hidden; i++) {
      float a = delta ? x[i] + get(delta, delta_bf16, at + i) : x[i];
      x[i] = a;
      sum += a * a;
    }
    float inv = 1.f / sqrtf(sum / hidden + eps);
    for (i = 0; i + 8 <= hidden; i += 8) {
      v8 y = load(weight + i) * (load(x + i) * splat(inv));
      if (out_bf16)
        store_bf16((bf16 *)out + at + i, y);
      else
        store((float *)out + at + i, y);
    }
    for (; i < hidden; i++) put(out, out_bf16, at + i, weight[i] * (x[i] * inv));
  }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i], gate and up the two halves of each row of x
 * [rows, 2 x inter]; x and out fp32, or both bf16 (widened, computed in fp32, rounded) */
void silu_mul(const void *x, void *out, int rows, int inter, int is_bf16) {
  for (int r = 0; r < rows; r++) {
    long g0 = (long)r * 2 * inter, u0 = g0 + inter, y0 = (long)r * inter;
    int i = 0;
    for (; i + 8 <= inter; i += 8) {
      v8 a = load_kv(x, g0 + i, is_bf16), u = load_kv(x, u0 + i, is_bf16);
      /* exp(-|a|) is exact for both signs: sigmoid(a) = 1 / (1 + e) or e / (1 + e) */
      v8 neg = pick(a > splat(0.f), -a, a);
      v8 e = exp_nonpositive(neg), inv = splat(1.f) / (splat(1.f) + e);
      v8 sig = pick(a > splat(0.f), inv, e * inv);
      if (is_bf16)
        store_bf16((bf16 *)out + y0 + i, a * sig * u);
      else
        store((float *)out + y0 + i, a * sig * u);
    }
    for (; i < inter; i++) {
      float a = get(x, is_bf16, g0 + i);
      put(out, is_bf16, y0 + i, a / (1.f + expf(-a)) * get(x, is_bf16, u0 + i));
    }
  }
}

/* the rotary embedding (rotate-half form) of each row of x (rows `stride` elements apart, fp32 or
 * bf16: q's `heads` heads of `dim`, then k's `kv_heads`, then v's), at cos and sin [rows, dim]:
 * q rotated into q_out (fp32, rows `q_stride` floats apart: x itself will do where x is fp32), k
 * rotated into the key cache and v copied into the value cache (fp32 or bf16: `cache_bf16`), row
 * b's KV head h at column `column` of keys / values + b * row_stride + h * head_stride (column *
 * dim elements in) */
static inline void turn(const void *x, int x_bf16, long from, float *y, const float *c,
                        const float *s, int dim) {
  int half = dim / 2, i = 0;
  for (; i + 8 <= half; i += 8) {
    v8 a = load_kv(x, from + i, x_bf16), b = load_kv(x, from + i + half, x_bf16);
    store(y + i, a * load(c + i) - b * load(s + i));
    store(y + i + half, b * load(c + i + half) + a * load(s + i + half));
  }
  for (; i < half; i++) {
    float a = get(x, x_bf16, from + i), b = get(x, x_bf16, from + i + half);
    y[i] = a * c[i] - b * s[i];
    y[i + half] = b * c[i + half] + a * s[i + half];
  }
}

void rotary_cache(const void *x, int x_bf16, float *q_out, long q_stride, const float *cos,
                  const float *sin, int rows, int heads, int kv_heads, int dim, long stride,
                  void *keys, void *values, int cache_bf16, long row_stride, long head_stride,
                  long column) {
  float k[MAX_ROTARY_DIM];
  if (dim > MAX_ROTARY_DIM) return; /* hf_native checks it first */
  int size = cache_bf16 ? 2 : 4;
  for (int r = 0; r < rows; r++) {
    const float *c = cos + (long)r * dim, *s = sin + (long)r * dim;
    long row = r * stride;
    /* the cache's lines a few rows on, fetched to be written (each row's are far apart, in
     * memory the step has not touched yet) */
    if (r + WRITE_AHEAD < rows)
      for (int h = 0; h < kv_heads; h++) {
        long ahead = ((r + WRITE_AHEAD) * row_stride + h * head_stride + column * dim) * size;
        for (int i = 0; i < dim * size; i += LINE) {
          __builtin_prefetch((char *)keys + ahead + i, 1, 3);
          __builtin_prefetch((char *)values + ahead + i, 1, 3);
        }
      }
    for (int h = 0; h < heads; h++)
      turn(x, x_bf16, row + (long)h * dim, q_out + r * q_stride + (long)h * dim, c, s, dim);
    for (int h = 0; h < kv_heads; h++) {
      long at = r * row_stride + h * head_stride + column * dim;
      turn(x, x_bf16, row + (long)(heads + h) * dim, k, c, s, dim);
      long v = row + (long)(heads + kv_heads + h) * dim;
      int i = 0;
      for (; i + 8 <= dim; i += 8) {
        v8 value = load_kv(x, v + i, x_bf16);
        if (cache_bf16) {
          store_bf16((bf16 *)keys + at + i, load(k + i));
          store_bf16((bf16 *)values + at + i, value);
        } else {
          store((float *)keys + at + i, load(k + i));
          store((float *)values + at + i, value);
        }
      }
      for (; i < dim; i++) {
        put(keys, cache_bf16, at + i, k[i]);
        put(values, cache_bf16, at + i, get(x, x_bf16, v + i));
      }
    }
  }
}

/* ---- the KV cache's copies: a finished row's KV out of the batch, kept rows' KV into a new
 * batch. Spans of bytes, each copied (src[i] not 0) or zeroed (src[i] 0), shared out by OpenMP:
 * one call where torch ran a slice assignment per layer, head and run ---- */
void copy_spans(const long *src, const long *dst, const long *bytes, long n, int threads) {
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
  for (long i = 0; i < n; i++) {
    if (src[i])
      memcpy((void *)dst[i], (const void *)src[i], (size_t)bytes[i]);
    else
      memset((void *)dst[i], 0, (size_t)bytes[i]);
  }
}

/* ---- sampling a decoding step's rows: inverse CDF in vocabulary order, one draw a row ---- */

/* eight logits from x's j-th on, -inf past n */
static inline v8 load_tail(const float *x, int j, int n) {
  v8 r = splat(-INFINITY);
  for (int k = 0; k < 8 && j + k < n; k++) r[k] = x[j + k];
  return r;
}

/* the weights exp((x - top) * inv) of eight logits (0 for -inf) */
static inline v8 weights(v8 x, float top, float inv) {
  return pick(x == splat(-INFINITY), splat(0.f), exp_nonpositive((x - splat(top)) * splat(inv)));
}

/* Row r of `logits` (fp32, rows `stride` apart, `vocab` each) at temperature temps[r] (0:
 * greedy) with the uniform draw u[r] in [0, 1): tok[r], the first token whose cumulative weight
 * exp((x - max) / T), summed in vocabulary order, passes u x the row's total (where rounding
 * leaves none past it, the last token with weight), or greedy the first largest logit; and
 * lp[r], its log-softmax (x - max) / T - log(total) (greedy: of the logits themselves). Rows
 * are shared out among `threads`, each with its `scratch` of vocab + 8 floats (`vocab + 8`
 * apart) for a row's weights, each weight computed once. */
void sample_rows(const float *logits, long stride, int rows, int vocab, const float *temps,
                 const float *u, long *tok, float *lp, float *scratch, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int r = 0; r < rows; r++) {
    const float *x = logits + (long)r * stride;
    float *w = scratch + (long)omp_get_thread_num() * (vocab + 8);
    float t = temps[r], inv = t > 0 ? 1.f / t : 1.f;
    v8 most = splat(-INFINITY);
    for (int j = 0; j < vocab; j += 8) {
      v8 a = j + 8 <= vocab ? load(x + j) : load_tail(x, j, vocab);
      most = pick(a > most, a, most);
    }
    float top = most[0];
    for (int k = 1; k < 8; k++) top = most[k] > top ? most[k] : top;
    v8 sum = splat(0.f);
    for (int j = 0; j < vocab; j += 8) {
      v8 e = weights(j + 8 <= vocab ? load(x + j) : load_tail(x, j, vocab), top, inv);
      store(w + j, e);
      sum += e;
    }
    float all = total(sum);
    long at = vocab - 1;
    if (t <= 0) {
      for (int j = 0; j < vocab; j++)
        if (x[j] == top) {
          at = j;
          break;
        }
    } else {
      float target = u[r] * all, cum = 0.f;
      long last = -1; /* the last token with weight so far */
      for (int j = 0; j < vocab; j += 8) {
        v8 e = load(w + j);
        float block = total(e);
        if (block > 0.f) {
          for (int k = 7; k >= 0; k--)
            if (e[k] > 0.f) {
              last = j + k;
              break;
            }
        }
        if (cum + block <= target) {
          cum += block;
          continue;
        }
        for (int k = 0; k < 8; k++) {
          cum += e[k];
          if (cum > target) {
            at = j + k;
            break;
          }
        }
        if (cum > target) break;
      }
      if (!(cum > target) && last >= 0) at = last;
    }
    tok[r] = at;
    lp[r] = (x[at] - top) * inv - logf(all);
  }
}
