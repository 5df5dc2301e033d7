/* Small kernels of the lean decoding step on CPU (hf_native.py compiles this file at run time and
 * checks each kernel against torch before the engine uses it).
 *
 * First the step's attention: one new token a row over that row's own KV cache, each KV head read
 * once for its group of query heads.
 *
 * Per (row, KV head): the scores of the group's G queries against every position the row attends
 * to (given as runs [start, end) of positions, so padding and holes are never read), their
 * softmax, and the probabilities times the values. Keys and values stream through once, in
 * position order, a cache line ahead; the (row, KV head) tasks are shared out by OpenMP, which
 * resolves to the libgomp that torch has already loaded (one thread pool, its threads hot).
 *
 * Layouts: queries fp32 [B, Hkv x G, D], rows `q_row_stride` apart (a view into the fused q/k/v
 * product will do); keys and values fp32 (attend_d64, attend_d128) or bf16 (attend_bf16_d64,
 * attend_bf16_d128: each read widened to fp32, every sum in fp32), row b, head h, position l at
 * base + b * row_stride +
 * h * head_stride + l * D (the engine's preallocated cache, any capacity); runs [B, R, 2] int32;
 * out [B, Hkv, G, D]; lse [B, Hkv, G] (the log-sum-exp of each query's scaled scores: -inf where a
 * row attends to nothing, its output then zero); scratch: `threads` buffers `scratch_stride`
 * floats apart, each at least G x (positions + 8).
 *
 * Where `shared` is not NULL, each query's output and log-sum-exp over a shared prefix (the
 * cascade's, computed apart: query head j of row b at shared + b * shared_b + j * shared_h, its
 * log-sum-exp at shared_lse + b * lse_b + j * lse_h) are joined with the row's own by their
 * log-sum-exps: out = own + sigmoid(lse_shared - lse_own) (shared - own), lse their logaddexp.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int i8 __attribute__((vector_size(32)));
typedef unsigned short bf16; /* bfloat16's bits: the top half of a float's */
typedef unsigned short u8x16 __attribute__((vector_size(16)));
typedef unsigned u32x8 __attribute__((vector_size(32)));

#define MAX_GROUP 16
#define AHEAD 6 /* positions prefetched ahead */
#define LINE 64 /* bytes a cache line */

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 load(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void store(float *p, v8 x) { memcpy(p, &x, sizeof x); }

/* eight bf16 widened to fp32 (exact: a bf16 is a float's top 16 bits) */
static inline v8 load_bf16(const bf16 *p) {
  u8x16 h;
  memcpy(&h, p, sizeof h);
  i8 w = __builtin_convertvector(h, i8) << 16;
  v8 r;
  memcpy(&r, &w, sizeof r);
  return r;
}

/* fp32 to bf16, rounded to nearest, ties to even (as torch's .to(torch.bfloat16)); NaN stays NaN */
static inline bf16 to_bf16(float x) {
  unsigned u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
  return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* eight fp32 to bf16 as to_bf16 does each */
static inline void store_bf16(bf16 *p, v8 x) {
  u32x8 u;
  memcpy(&u, &x, sizeof u);
  u32x8 nan = (u32x8)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
  u32x8 up = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  u32x8 bits = (nan & ((u >> 16) | 0x40u)) | (~nan & up);
  u8x16 h = __builtin_convertvector(bits, u8x16);
  memcpy(p, &h, sizeof h);
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

/* join G outputs of `dim` (query heads first.. of row b) and their log-sum-exps with the shared
 * prefix's */
static void join(float *o, float *lse, const float *shared, const float *shared_lse, int b,
                 int first, int G, int dim, long shared_b, long shared_h, long lse_b, long lse_h) {
  for (int g = 0; g < G; g++) {
    const float *os = shared + b * shared_b + (first + g) * shared_h;
    float ls = shared_lse[b * lse_b + (first + g) * lse_h], lo = lse[g];
    float w = lo == -INFINITY ? 1.f : 1.f / (1.f + expf(lo - ls));
    float *og = o + (long)g * dim;
    for (int i = 0; i < dim; i++) og[i] += w * (os[i] - og[i]);
    float top = lo > ls ? lo : ls;
    lse[g] = top == -INFINITY ? top : top + logf(expf(lo - top) + expf(ls - top));
  }
}

#define DEFINE_ATTEND(NAME, D, KV, LOAD)                                                          \
  int NAME(const float *q, long q_row_stride, const KV *k, const KV *v,                           \
                  const int *runs, int R, float *out, float *lse, int B, int H, int G,             \
                  long row_stride, long head_stride, float scale, float *scratch,                  \
                  long scratch_stride, int threads, const float *shared, const float *shared_lse,  \
                  long shared_b, long shared_h, long lse_b, long lse_h) {                          \
    enum { C = D / 8 };                                                                          \
    if (G < 1 || G > MAX_GROUP) return 1;                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
    for (int t = 0; t < B * H; t++) {                                                            \
      int b = t / H, h = t % H;                                                                  \
      const KV *kb = k + b * row_stride + h * head_stride;                                       \
      const KV *vb = v + b * row_stride + h * head_stride;                                       \
      const int *rr = runs + (long)b * R * 2;                                                    \
      const float *qt = q + b * q_row_stride + (long)h * G * D;                                  \
      float *o = out + (long)t * G * D;                                                          \
      float *s = scratch + scratch_stride * omp_get_thread_num();                                \
      int width = 0;                                                                             \
      for (int r = 0; r < R; r++) width += rr[2 * r + 1] - rr[2 * r];                            \
      if (width <= 0) {                                                                          \
        memset(o, 0, sizeof(float) * G * D);                                                     \
        for (int g = 0; g < G; g++) lse[(long)t * G + g] = -INFINITY;                            \
        if (shared) join(o, lse + (long)t * G, shared, shared_lse, b, h * G, G, D, shared_b,    \
                         shared_h, lse_b, lse_h);                                                \
        continue;                                                                                \
      }                                                                                          \
      int padded = (width + 7) & ~7;                                                             \
      float top[MAX_GROUP];                                                                      \
      for (int g = 0; g < G; g++) top[g] = -INFINITY;                                            \
      int i = 0;                                                                                 \
      for (int r = 0; r < R; r++) {                                                              \
        for (int l = rr[2 * r]; l < rr[2 * r + 1]; l++, i++) {                                   \
          const KV *kl = kb + (long)l * D;                                                       \
          for (int c = 0; c < D; c += LINE / sizeof(KV)) __builtin_prefetch(kl + AHEAD * D + c); \
          v8 kc[C];                                                                              \
          for (int c = 0; c < C; c++) kc[c] = LOAD(kl + 8 * c);                                  \
          for (int g = 0; g < G; g++) {                                                          \
            const float *qg = qt + g * D;                                                        \
            v8 acc = load(qg) * kc[0];                                                           \
            for (int c = 1; c < C; c++) acc += load(qg + 8 * c) * kc[c];                         \
            float x = total(acc) * scale;                                                        \
            s[g * padded + i] = x;                                                               \
            top[g] = x > top[g] ? x : top[g];                                                    \
          }                                                                                      \
        }                                                                                        \
      }                                                                                          \
      for (int g = 0; g < G; g++) {                                                              \
        float *sg = s + g * padded;                                                              \
        for (int j = width; j < padded; j++) sg[j] = -INFINITY;                                  \
        v8 sum = splat(0.f);                                                                     \
        for (int j = 0; j < padded; j += 8) {                                                    \
          v8 x = load(sg + j);                                                                   \
          v8 e = pick(x == splat(-INFINITY), splat(0.f), exp_nonpositive(x - splat(top[g])));    \
          store(sg + j, e);                                                                      \
          sum += e;                                                                              \
        }                                                                                        \
        float all = total(sum), inv = 1.f / all;                                                 \
        for (int j = 0; j < width; j++) sg[j] *= inv;                                            \
        lse[(long)t * G + g] = top[g] + logf(all);                                               \
        memset(o + g * D, 0, sizeof(float) * D);                                                 \
      }                                                                                          \
      i = 0;                                                                                     \
      for (int r = 0; r < R; r++) {                                                              \
        for (int l = rr[2 * r]; l < rr[2 * r + 1]; l++, i++) {                                   \
          const KV *vl = vb + (long)l * D;                                                       \
          for (int c = 0; c < D; c += LINE / sizeof(KV)) __builtin_prefetch(vl + AHEAD * D + c); \
          v8 vc[C];                                                                              \
          for (int c = 0; c < C; c++) vc[c] = LOAD(vl + 8 * c);                                  \
          for (int g = 0; g < G; g++) {                                                          \
            v8 p = splat(s[g * padded + i]);                                                     \
            float *og = o + g * D;                                                               \
            for (int c = 0; c < C; c++) store(og + 8 * c, load(og + 8 * c) + p * vc[c]);         \
          }                                                                                      \
        }                                                                                        \
      }                                                                                          \
      if (shared) join(o, lse + (long)t * G, shared, shared_lse, b, h * G, G, D, shared_b,      \
                       shared_h, lse_b, lse_h);                                                  \
    }                                                                                            \
    return 0;                                                                                    \
  }

DEFINE_ATTEND(attend_d64, 64, float, load)
DEFINE_ATTEND(attend_d128, 128, float, load)
DEFINE_ATTEND(attend_bf16_d64, 64, bf16, load_bf16)
DEFINE_ATTEND(attend_bf16_d128, 128, bf16, load_bf16)

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
    float sum = 0.f;
    for (int i = 0; i < hidden; i++) {
      float a = delta ? x[i] + get(delta, delta_bf16, at + i) : x[i];
      x[i] = a;
      sum += a * a;
    }
    float inv = 1.f / sqrtf(sum / hidden + eps);
    for (int i = 0; i < hidden; i++) put(out, out_bf16, at + i, weight[i] * (x[i] * inv));
  }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i], gate and up the two halves of each row of x
 * [rows, 2 x inter]; x and out fp32, or both bf16 (widened, computed in fp32, rounded) */
void silu_mul(const void *x, void *out, int rows, int inter, int is_bf16) {
  for (int r = 0; r < rows; r++) {
    long g0 = (long)r * 2 * inter, u0 = g0 + inter, y0 = (long)r * inter;
    int i = 0;
    for (; i + 8 <= inter; i += 8) {
      v8 a, u;
      if (is_bf16) {
        a = load_bf16((const bf16 *)x + g0 + i);
        u = load_bf16((const bf16 *)x + u0 + i);
      } else {
        a = load((const float *)x + g0 + i);
        u = load((const float *)x + u0 + i);
      }
      /* exp(-|a|) is exact for both signs: sigmoid(a) = 1 / (1 + e) or e / (1 + e) */
      v8 neg = pick(a > splat(0.f), -a, a);
      v8 e = exp_nonpositive(neg);
      v8 sig = pick(a > splat(0.f), splat(1.f) / (splat(1.f) + e), e / (splat(1.f) + e));
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
  int half = dim / 2;
  for (int i = 0; i < half; i++) {
    float a = get(x, x_bf16, from + i), b = get(x, x_bf16, from + i + half);
    y[i] = a * c[i] - b * s[i];
    y[i + half] = b * c[i + half] + a * s[i + half];
  }
}

void rotary_cache(const void *x, int x_bf16, float *q_out, long q_stride, const float *cos,
                  const float *sin, int rows, int heads, int kv_heads, int dim, long stride,
                  void *keys, void *values, int cache_bf16, long row_stride, long head_stride,
                  long column) {
  float k[256];
  if (dim > 256) return;
  for (int r = 0; r < rows; r++) {
    const float *c = cos + (long)r * dim, *s = sin + (long)r * dim;
    long row = r * stride;
    for (int h = 0; h < heads; h++)
      turn(x, x_bf16, row + (long)h * dim, q_out + r * q_stride + (long)h * dim, c, s, dim);
    for (int h = 0; h < kv_heads; h++) {
      long at = r * row_stride + h * head_stride + column * dim;
      turn(x, x_bf16, row + (long)(heads + h) * dim, k, c, s, dim);
      long v = row + (long)(heads + kv_heads + h) * dim;
      for (int i = 0; i < dim; i++) {
        put(keys, cache_bf16, at + i, k[i]);
        put(values, cache_bf16, at + i, get(x, x_bf16, v + i));
      }
    }
  }
}
