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
 * Layouts (fp32): queries [B, Hkv x G, D], rows `q_row_stride` apart (a view into the fused q/k/v
 * product will do); keys and values: row b, head h, position l at base + b * row_stride +
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

#define MAX_GROUP 16
#define AHEAD 6 /* positions prefetched ahead */

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 load(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void store(float *p, v8 x) { memcpy(p, &x, sizeof x); }

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

#define DEFINE_ATTEND(D)                                                                          \
  int attend_d##D(const float *q, long q_row_stride, const float *k, const float *v,              \
                  const int *runs, int R, float *out, float *lse, int B, int H, int G,             \
                  long row_stride, long head_stride, float scale, float *scratch,                  \
                  long scratch_stride, int threads, const float *shared, const float *shared_lse,  \
                  long shared_b, long shared_h, long lse_b, long lse_h) {                          \
    enum { C = D / 8 };                                                                          \
    if (G < 1 || G > MAX_GROUP) return 1;                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
    for (int t = 0; t < B * H; t++) {                                                            \
      int b = t / H, h = t % H;                                                                  \
      const float *kb = k + b * row_stride + h * head_stride;                                    \
      const float *vb = v + b * row_stride + h * head_stride;                                    \
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
          const float *kl = kb + (long)l * D;                                                    \
          for (int c = 0; c < D; c += 16) __builtin_prefetch(kl + AHEAD * D + c);                \
          v8 kc[C];                                                                              \
          for (int c = 0; c < C; c++) kc[c] = load(kl + 8 * c);                                 \
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
          const float *vl = vb + (long)l * D;                                                    \
          for (int c = 0; c < D; c += 16) __builtin_prefetch(vl + AHEAD * D + c);                \
          v8 vc[C];                                                                              \
          for (int c = 0; c < C; c++) vc[c] = load(vl + 8 * c);                                  \
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

DEFINE_ATTEND(64)
DEFINE_ATTEND(128)

/* ---- the step's element-wise work, one call each where torch runs several ops (one thread:
 * at a step's sizes the work is microseconds and a parallel region's wake-up costs more) ---- */

/* h += delta (where delta is not NULL), then out = weight * h / sqrt(mean(h^2) + eps), per row of
 * `hidden` features (rows `stride` floats apart in h, delta and out) */
void add_rms_norm(float *h, const float *delta, const float *weight, float eps, float *out,
                  int rows, int hidden, long stride) {
  for (int r = 0; r < rows; r++) {
    float *x = h + r * stride;
    float *y = out + r * stride;
    const float *d = delta ? delta + r * stride : 0;
    float sum = 0.f;
    for (int i = 0; i < hidden; i++) {
      float a = d ? x[i] + d[i] : x[i];
      x[i] = a;
      sum += a * a;
    }
    float inv = 1.f / sqrtf(sum / hidden + eps);
    for (int i = 0; i < hidden; i++) y[i] = weight[i] * (x[i] * inv);
  }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i], gate and up the two halves of each row of x
 * [rows, 2 x inter] */
void silu_mul(const float *x, float *out, int rows, int inter) {
  for (int r = 0; r < rows; r++) {
    const float *g = x + (long)r * 2 * inter, *u = g + inter;
    float *y = out + (long)r * inter;
    int i = 0;
    for (; i + 8 <= inter; i += 8) {
      v8 a = load(g + i);
      /* exp(-|a|) is exact for both signs: sigmoid(a) = 1 / (1 + e) or e / (1 + e) */
      v8 neg = pick(a > splat(0.f), -a, a);
      v8 e = exp_nonpositive(neg);
      v8 sig = pick(a > splat(0.f), splat(1.f) / (splat(1.f) + e), e / (splat(1.f) + e));
      store(y + i, a * sig * load(u + i));
    }
    for (; i < inter; i++) y[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
}

/* the rotary embedding (rotate-half form) of each row of x (rows `stride` floats apart: q's
 * `heads` heads of `dim`, then k's `kv_heads`, then v's), at cos and sin [rows, dim]: q rotated in
 * place, k rotated into the key cache and v copied into the value cache, row b's KV head h at
 * column `column` of keys / values + b * row_stride + h * head_stride (column * dim floats in) */
static inline void turn(const float *x, float *y, const float *c, const float *s, int dim) {
  int half = dim / 2;
  for (int i = 0; i < half; i++) {
    float a = x[i], b = x[i + half];
    y[i] = a * c[i] - b * s[i];
    y[i + half] = b * c[i + half] + a * s[i + half];
  }
}

void rotary_cache(float *x, const float *cos, const float *sin, int rows, int heads, int kv_heads,
                  int dim, long stride, float *keys, float *values, long row_stride,
                  long head_stride, long column) {
  for (int r = 0; r < rows; r++) {
    const float *c = cos + (long)r * dim, *s = sin + (long)r * dim;
    float *row = x + r * stride;
    for (int h = 0; h < heads; h++) turn(row + (long)h * dim, row + (long)h * dim, c, s, dim);
    for (int h = 0; h < kv_heads; h++) {
      long at = r * row_stride + h * head_stride + column * dim;
      turn(row + (long)(heads + h) * dim, keys + at, c, s, dim);
      memcpy(values + at, row + (long)(heads + kv_heads + h) * dim, sizeof(float) * dim);
    }
  }
}
