/* The model's fp32 CPU hot paths as C loops (model/ops/cpu/build.py builds this file with the
 * system C compiler, model/ops/cpu/bindings.py calls it through ctypes): the element-wise
 * chains, the KDA layer's inputs and recurrence, attention over documents and the LM head's
 * loss passes.
 *
 * Element-wise operands are passed as rows of `width` contiguous floats, `*_stride` floats apart
 * (a view of a wider buffer, such as the gate half of a fused projection, needs no copy);
 * outputs are dense [rows, width] unless a stride is passed for them. Results do not depend on
 * the thread count: a thread owns whole rows (or documents and heads), and sums over rows go
 * per fixed block of rows (block_count below). The math follows the plain references operation
 * by operation; expf and tanhf come from glibc's vector math library (libmvec, declared below
 * for the vectoriser), which keeps IEEE semantics for infinities and NaN. */

#include <omp.h>
#include <stdint.h>

float expf(float) __attribute__((simd("notinbranch"), const, nothrow));
float tanhf(float) __attribute__((simd("notinbranch"), const, nothrow));
float sqrtf(float) __attribute__((const, nothrow));
float logf(float) __attribute__((const, nothrow));
#define NEG_INF (-__builtin_inff())

/* Below this many elements a second thread costs more to wake than it saves (ATen's grain). */
#define PARALLEL_GRAIN 32768

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Weight gradients are sums over all rows: each block of `block_rows` rows is summed in order
 * into its own partial (blocks run in parallel), then the partials in block order, so the bits
 * do not depend on the thread count. */
static inline int64_t block_count(int64_t rows, int64_t block_rows) {
  return (rows + block_rows - 1) / block_rows;
}

/* The first row of the next block, and the partial of this one zeroed. */
static inline int64_t start_block(float *partial, int64_t size, int64_t block,
                                  int64_t block_rows, int64_t rows) {
  for (int64_t i = 0; i < size; ++i) partial[i] = 0.0f;
  return (block + 1) * block_rows < rows ? (block + 1) * block_rows : rows;
}

static void sum_blocks(const float *partials, int64_t blocks, int64_t size, float *out) {
  for (int64_t i = 0; i < size; ++i) out[i] = 0.0f;
  for (int64_t block = 0; block < blocks; ++block)
    for (int64_t i = 0; i < size; ++i) out[i] += partials[block * size + i];
}

/* SiTU-GLU: beta_g tanh(g / beta_g) * sigmoid(g) * beta_u tanh(u / beta_u). */
void situ_glu_forward(const float *gate, const float *up, float *out, int64_t rows,
                      int64_t width, int64_t gate_stride, int64_t up_stride, float beta_gate,
                      float beta_up, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (rows * width >= PARALLEL_GRAIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gate + r * gate_stride, *u = up + r * up_stride;
    float *o = out + r * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      float capped_gate = beta_gate * tanhf(g[i] / beta_gate);
      float capped_up = beta_up * tanhf(u[i] / beta_up);
      o[i] = capped_gate * sigmoid(g[i]) * capped_up;
    }
  }
}

/* Its gradients, recomputing the tanh and sigmoid (model/activations.py _situ_glu_backward);
 * grad_gate and grad_up are rows `out_stride` floats apart (the two halves of one gradient). */
void situ_glu_backward(const float *gate, const float *up, const float *grad_out,
                       float *grad_gate, float *grad_up, int64_t rows, int64_t width,
                       int64_t gate_stride, int64_t up_stride, int64_t grad_stride,
                       int64_t out_stride, float beta_gate, float beta_up, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (rows * width >= PARALLEL_GRAIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gate + r * gate_stride, *u = up + r * up_stride;
    const float *d = grad_out + r * grad_stride;
    float *dg = grad_gate + r * out_stride, *du = grad_up + r * out_stride;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      float sigmoid_gate = sigmoid(g[i]);
      float tanh_gate = tanhf(g[i] / beta_gate);
      float tanh_up = tanhf(u[i] / beta_up);
      float grad_sigmoid = d[i] * sigmoid_gate;
      float capped_gate = tanh_gate * beta_gate;
      /* d/dx beta tanh(x / beta) = 1 - tanh^2; d/dx sigmoid = sigmoid (1 - sigmoid). */
      du[i] = (1.0f - tanh_up * tanh_up) * capped_gate * grad_sigmoid;
      float d_gate = (1.0f - sigmoid_gate) * capped_gate - tanh_gate * tanh_gate + 1.0f;
      dg[i] = d_gate * tanh_up * grad_sigmoid * beta_up;
    }
  }
}

/* The short convolution + SiLU (model/short_conv.py): x [B, T, C] contiguous, taps [K, C] (the
 * weight [C, K] transposed: taps[K - 1 - s] multiplies the input s positions back), segments
 * [B, T] document ids or NULL (one document per row). pre[t] = sum over s of
 * taps[K - 1 - s] x[t - s], a term counted only where t - s is in t's document, accumulated
 * shift by shift as the reference does. */
static inline int same_document(const int64_t *segments, int64_t t, int64_t s) {
  return segments == 0 || segments[t] == segments[t - s];
}

static void conv_row(const float *x, const float *taps, const int64_t *segments, float *pre,
                     int64_t t, int64_t C, int64_t K) {
  const float *last = taps + (K - 1) * C, *xt = x + t * C;
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) pre[c] = xt[c] * last[c];
  for (int64_t s = 1; s < K && s <= t; ++s) {
    float mask = same_document(segments, t, s) ? 1.0f : 0.0f;
    const float *tap = taps + (K - 1 - s) * C, *earlier = x + (t - s) * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) pre[c] += earlier[c] * tap[c] * mask;
  }
}

void conv_silu_forward(const float *x, const float *taps, const int64_t *segments, float *out,
                       int64_t B, int64_t T, int64_t C, int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (B * T * C >= PARALLEL_GRAIN)
  for (int64_t row = 0; row < B * T; ++row) {
    int64_t b = row / T, t = row % T;
    float *o = out + row * C;
    conv_row(x + b * T * C, taps, segments ? segments + b * T : 0, o, t, C, K);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = o[c] / (1.0f + expf(-o[c]));
  }
}

/* Its gradients, recomputing the convolution. grad_pre [B, T, C] is scratch; the weight's
 * gradient is summed per block of `block_rows` rows into partials [blocks, K, C] and then over
 * the blocks in order into grad_taps [K, C]: the same bits at any thread count. */
void conv_silu_backward(const float *x, const float *taps, const int64_t *segments,
                        const float *grad_out, float *grad_pre, float *grad_x, float *partials,
                        float *grad_taps, int64_t B, int64_t T, int64_t C, int64_t K,
                        int64_t block_rows, int threads) {
  int64_t rows = B * T, blocks = block_count(rows, block_rows);
  int parallel = rows * C >= PARALLEL_GRAIN;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t row = 0; row < rows; ++row) {
    int64_t b = row / T, t = row % T;
    float *gp = grad_pre + row * C;
    const float *d = grad_out + row * C;
    conv_row(x + b * T * C, taps, segments ? segments + b * T : 0, gp, t, C, K);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) { /* silu'(pre) = sigmoid (1 + pre (1 - sigmoid)) */
      float sig = 1.0f / (1.0f + expf(-gp[c]));
      gp[c] = d[c] * sig * (1.0f + gp[c] * (1.0f - sig));
    }
  }
  /* x[t] fed y[t + s]: its gradient gathers those, shift by shift as the reference adds them. */
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t row = 0; row < rows; ++row) {
    int64_t b = row / T, t = row % T;
    const int64_t *seg = segments ? segments + b * T : 0;
    const float *gp_b = grad_pre + b * T * C, *last = taps + (K - 1) * C;
    float *gx = grad_x + row * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) gx[c] = gp_b[t * C + c] * last[c];
    for (int64_t s = 1; s < K && t + s < T; ++s) {
      float mask = same_document(seg, t + s, s) ? 1.0f : 0.0f;
      const float *tap = taps + (K - 1 - s) * C, *later = gp_b + (t + s) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) gx[c] += later[c] * mask * tap[c];
    }
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t block = 0; block < blocks; ++block) {
    float *acc = partials + block * K * C;
    int64_t end = start_block(acc, K * C, block, block_rows, rows);
    for (int64_t row = block * block_rows; row < end; ++row) {
      int64_t b = row / T, t = row % T;
      const int64_t *seg = segments ? segments + b * T : 0;
      const float *gp = grad_pre + row * C, *xb = x + b * T * C;
      for (int64_t s = 0; s < K && s <= t; ++s) {
        float mask = same_document(seg, t, s) ? 1.0f : 0.0f;
        const float *earlier = xb + (t - s) * C;
        float *a = acc + (K - 1 - s) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) a[c] += gp[c] * mask * earlier[c];
      }
    }
  }
  sum_blocks(partials, blocks, K * C, grad_taps);
}

/* RMSNorm (model/norms.py): x rows of `width` floats `x_stride` apart, weight [width] or NULL;
 * y [rows, width] = x rstd weight and rstd [rows] = 1 / sqrt(mean(x^2) + eps). */
void rms_norm_forward(const float *x, const float *weight, float *y, float *rstd, int64_t rows,
                      int64_t width, int64_t x_stride, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (rows * width >= PARALLEL_GRAIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * x_stride;
    float *yr = y + r * width, squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) squares += xr[i] * xr[i];
    float inv = 1.0f / sqrtf(squares / (float)width + eps);
    rstd[r] = inv;
    if (weight) {
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) yr[i] = xr[i] * inv * weight[i];
    } else {
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) yr[i] = xr[i] * inv;
    }
  }
}

/* Its gradients: grad_x = rstd (g - x_hat mean(g x_hat)) with g = grad_out weight and
 * x_hat = x rstd; the weight's gradient sum(grad_out x_hat) over the rows is summed per block of
 * `block_rows` rows into partials [blocks, width] and then over the blocks in order (NULL
 * grad_weight: not needed). */
void rms_norm_backward(const float *x, const float *weight, const float *rstd,
                       const float *grad_out, float *grad_x, float *partials, float *grad_weight,
                       int64_t rows, int64_t width, int64_t x_stride, int64_t grad_stride,
                       int64_t block_rows, int threads) {
  int parallel = rows * width >= PARALLEL_GRAIN;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * x_stride, *d = grad_out + r * grad_stride;
    float *gx = grad_x + r * width, inv = rstd[r], dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < width; ++i) dot += d[i] * (weight ? weight[i] : 1.0f) * (xr[i] * inv);
    dot /= (float)width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i)
      gx[i] = inv * (d[i] * (weight ? weight[i] : 1.0f) - xr[i] * inv * dot);
  }
  if (!grad_weight) return;
  int64_t blocks = block_count(rows, block_rows);
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t block = 0; block < blocks; ++block) {
    float *acc = partials + block * width;
    int64_t end = start_block(acc, width, block, block_rows, rows);
    for (int64_t r = block * block_rows; r < end; ++r) {
      const float *xr = x + r * x_stride, *d = grad_out + r * grad_stride;
      float inv = rstd[r];
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) acc[i] += d[i] * (xr[i] * inv);
    }
  }
  sum_blocks(partials, blocks, width, grad_weight);
}

/* The AttnRes depth mix (model/attnres.py): n sources of `rows` rows of `width` floats, source j
 * at sources[j] with rows strides[j] apart. Per row: rstd_j = 1 / rms of source j, logits
 * x_j rstd_j norm_weight . query, their softmax over the sources, mixed = sum_j w_j x_j.
 * weights and rstd are [n, rows]. */
void depth_mix_forward(const float **sources, const int64_t *strides, int64_t n,
                       const float *query, const float *norm_weight, float *mixed,
                       float *weights, float *rstd, int64_t rows, int64_t width, float eps,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (n * rows * width >= PARALLEL_GRAIN)
  for (int64_t r = 0; r < rows; ++r) {
    float logits[n], top = -__builtin_inff(), total = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float *x = sources[j] + r * strides[j];
      float squares = 0.0f, logit = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) squares += x[i] * x[i];
      float inv = 1.0f / sqrtf(squares / (float)width + eps);
#pragma omp simd reduction(+ : logit)
      for (int64_t i = 0; i < width; ++i) logit += x[i] * inv * norm_weight[i] * query[i];
      rstd[j * rows + r] = inv;
      logits[j] = logit;
      top = logit > top ? logit : top;
    }
    for (int64_t j = 0; j < n; ++j) total += logits[j] = expf(logits[j] - top);
    float *out = mixed + r * width;
    for (int64_t j = 0; j < n; ++j) {
      float w = logits[j] / total;
      const float *x = sources[j] + r * strides[j];
      weights[j * rows + r] = w;
      if (j == 0) {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) out[i] = w * x[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) out[i] += w * x[i];
      }
    }
  }
}

/* Its gradients (model/attnres.py _depth_mix_backward): with u = norm_weight query and
 * x_hat_j = x_j rstd_j, dw_j = x_j . grad, dlogit_j = w_j (dw_j - sum_k w_k dw_k) and
 * dvalues_j = w_j grad + rstd_j dlogit_j (u - x_hat_j (x_hat_j . u) / width) ([n, rows, width]);
 * du = sum over sources and rows of rstd_j dlogit_j x_j, summed per block of `block_rows` rows
 * into partials [blocks, width] and then over the blocks in order. coef [n, rows] is scratch. */
void depth_mix_backward(const float **sources, const int64_t *strides, int64_t n,
                        const float *query, const float *norm_weight, const float *weights,
                        const float *rstd, const float *grad, int64_t grad_stride,
                        float *dvalues, float *coef, float *partials, float *du, int64_t rows,
                        int64_t width, int64_t block_rows, int threads) {
  int parallel = n * rows * width >= PARALLEL_GRAIN;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = grad + r * grad_stride;
    float dw[n], mean = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float *x = sources[j] + r * strides[j];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < width; ++i) dot += x[i] * g[i];
      dw[j] = dot;
      mean += weights[j * rows + r] * dot;
    }
    for (int64_t j = 0; j < n; ++j) {
      const float *x = sources[j] + r * strides[j];
      float w = weights[j * rows + r], inv = rstd[j * rows + r], logit = 0.0f;
      float dlogit = w * (dw[j] - mean);
#pragma omp simd reduction(+ : logit)
      for (int64_t i = 0; i < width; ++i) logit += x[i] * inv * (norm_weight[i] * query[i]);
      float scale = logit / (float)width, c = inv * dlogit;
      float *dv = dvalues + (j * rows + r) * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i)
        dv[i] = w * g[i] + c * (norm_weight[i] * query[i] - x[i] * inv * scale);
      coef[j * rows + r] = c;
    }
  }
  int64_t blocks = block_count(rows, block_rows);
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t block = 0; block < blocks; ++block) {
    float *acc = partials + block * width;
    int64_t end = start_block(acc, width, block, block_rows, rows);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = block * block_rows; r < end; ++r) {
        const float *x = sources[j] + r * strides[j];
        float c = coef[j * rows + r];
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) acc[i] += c * x[i];
      }
  }
  sum_blocks(partials, blocks, width, du);
}

/* The KDA layer's inputs to its recurrence (model/kda.py kda_inputs_reference, K3's bounded
 * gate), per token and head: q and k L2-normalised (F.normalize: x / max(||x||, eps)),
 * beta = sigmoid(beta_logit) and g = lower_bound sigmoid(exp(a_log[h]) z). q, k, z and their
 * outputs are [rows, H, K], beta_logits and beta [rows, H]. */
static inline float l2_norm(const float *x, int64_t K) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < K; ++i) squares += x[i] * x[i];
  return sqrtf(squares);
}

/* max(norm, eps) as torch's clamp_min: a NaN norm stays NaN. */
static inline float clamp_norm(float norm, float eps) { return norm < eps ? eps : norm; }

static void l2_normalize(const float *restrict x, float *restrict y, int64_t K, float eps) {
  float denom = clamp_norm(l2_norm(x, K), eps);
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) y[i] = x[i] / denom;
}

void kda_inputs_forward(const float *q, const float *k, const float *beta_logits,
                        const float *z, const float *a_log, float *q_out, float *k_out,
                        float *beta, float *g, int64_t rows, int64_t H, int64_t K,
                        float lower_bound, float eps, int threads) {
  float decay_scale[H];  /* exp(A_h), once per call rather than per token */
  for (int64_t h = 0; h < H; ++h) decay_scale[h] = expf(a_log[h]);
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (rows * H * K >= PARALLEL_GRAIN)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) {
      int64_t x = (r * H + h) * K;
      l2_normalize(q + x, q_out + x, K, eps);
      l2_normalize(k + x, k_out + x, K, eps);
      beta[r * H + h] = sigmoid(beta_logits[r * H + h]);
#pragma omp simd
      for (int64_t i = 0; i < K; ++i) g[x + i] = lower_bound * sigmoid(decay_scale[h] * z[x + i]);
    }
}

/* F.normalize's gradient as autograd forms it: dy / d, plus (where ||x|| >= eps, clamp_min's
 * mask) the norm's share -(dy . x) / d^2 * x / ||x||. */
static void l2_normalize_backward(const float *restrict x, const float *restrict dy,
                                  float *restrict dx, int64_t K, float eps) {
  float norm = l2_norm(x, K), denom = clamp_norm(norm, eps), dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < K; ++i) dot += dy[i] * x[i];
  if (!(norm >= eps)) {
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) dx[i] = dy[i] / denom;
    return;
  }
  float norm_grad = -dot / (denom * denom);
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) dx[i] = dy[i] / denom + norm_grad * (x[i] / norm);
}

/* Its gradients from those of q_out, k_out, beta and g, recomputing the forward; d a_log [H]
 * sums over all rows, per block of `block_rows` rows into partials [blocks, H], then over the
 * blocks in order (see block_count). */
void kda_inputs_backward(const float *q, const float *k, const float *beta_logits,
                         const float *z, const float *a_log, const float *grad_q,
                         const float *grad_k, const float *grad_beta, const float *grad_g,
                         float *dq, float *dk, float *dbeta_logits, float *dz, float *partials,
                         float *da_log, int64_t rows, int64_t H, int64_t K, float lower_bound,
                         float eps, int64_t block_rows, int threads) {
  int64_t blocks = block_count(rows, block_rows);
  float decay_scale[H];
  for (int64_t h = 0; h < H; ++h) decay_scale[h] = expf(a_log[h]);
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (rows * H * K >= PARALLEL_GRAIN)
  for (int64_t block = 0; block < blocks; ++block) {
    float *acc = partials + block * H;
    int64_t end = start_block(acc, H, block, block_rows, rows);
    for (int64_t r = block * block_rows; r < end; ++r)
      for (int64_t h = 0; h < H; ++h) {
        int64_t x = (r * H + h) * K, y = r * H + h;
        float sum = 0.0f;
        l2_normalize_backward(q + x, grad_q + x, dq + x, K, eps);
        l2_normalize_backward(k + x, grad_k + x, dk + x, K, eps);
        float b = sigmoid(beta_logits[y]);
        dbeta_logits[y] = grad_beta[y] * (1.0f - b) * b;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < K; ++i) {
          float s = sigmoid(decay_scale[h] * z[x + i]);
          float d_pre = grad_g[x + i] * lower_bound * (1.0f - s) * s;
          dz[x + i] = d_pre * decay_scale[h];
          sum += d_pre * z[x + i];
        }
        acc[h] += sum;
      }
  }
  sum_blocks(partials, blocks, H, da_log);
  for (int64_t h = 0; h < H; ++h) da_log[h] *= decay_scale[h];
}

/* Kimi Delta Attention token by token (model/ops/kda/naive.py kda_recurrent, the reference).
 * Per head, with the state S [K, V] (row i: key channel i), G = max(g_t, floor) the log decay:
 *   S' = Diag(exp(G)) S;  r = v_t - S'^T k_t;  S = S' + k_t (beta_t r)^T;  o_t = S^T (scale q_t)
 * The state stays in cache for the whole sequence: each token is two passes over it. The
 * tokens are token-major ([tokens, H, K], [tokens, H, V], beta [tokens, H]); a sequence is the
 * tokens bounds[n] .. bounds[n + 1] - 1, and each (sequence, head) is one thread's work from its
 * first token to its last, so results do not depend on the thread count. The forward keeps the
 * state entering every `segment`-th token of a sequence (its checkpoints); the backward
 * recomputes a segment's states from its checkpoint, then walks the segment in reverse. */

/* Where each sequence's checkpoints start (first[N] is their count); -1 where the bounds do not
 * start at 0, decrease or end past `tokens`. */
static int64_t checkpoint_starts(const int64_t *bounds, int64_t N, int64_t tokens,
                                 int64_t segment, int64_t *first) {
  if (bounds[0] != 0 || bounds[N] != tokens) return -1;
  first[0] = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (bounds[n + 1] < bounds[n]) return -1;
    first[n + 1] = first[n] + (bounds[n + 1] - bounds[n] + segment - 1) / segment;
  }
  return first[N];
}

/* decay <- exp(max(g, floor)) for one token's K channels (one vector loop, libmvec's expf). */
static inline __attribute__((always_inline)) void token_decay(const float *restrict g,
                                                              float floor,
                                                              float *restrict decay, int64_t K) {
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) decay[i] = expf(g[i] < floor ? floor : g[i]);
}

/* One token: S <- the state after it and o <- its output; decay [K], r [V], u [V] are scratch. */
static inline __attribute__((always_inline)) void kda_token(
    float *restrict S, const float *restrict q, const float *restrict k, const float *restrict v,
    const float *restrict g, float beta, float scale, float floor, float *restrict decay,
    float *restrict r, float *restrict u, float *restrict o, int64_t K, int64_t V) {
  token_decay(g, floor, decay, K);
  for (int64_t j = 0; j < V; ++j) r[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    float key = k[i], row_decay = decay[i];
    float *restrict row = S + i * V;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      row[j] *= row_decay;
      r[j] += key * row[j];
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) {
    r[j] = v[j] - r[j];
    u[j] = beta * r[j];
  }
  for (int64_t j = 0; j < V; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    float key = k[i], query = q[i] * scale;
    float *restrict row = S + i * V;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      row[j] += key * u[j];
      o[j] += query * row[j];
    }
  }
}

static void copy_floats(float *restrict dst, const float *restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

static void zero_floats(float *dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = 0.0f;
}

/* The head sizes of the K3 configs get loops with constant bounds (the vectoriser unrolls them
 * into whole vectors, which loops with run-time bounds are not). */
#define FOR_HEAD_SIZES(call)                  \
  if (K == 32 && V == 32)                     \
    call(32, 32);                             \
  else if (K == 128 && V == 128)              \
    call(128, 128);                           \
  else                                        \
    call(K, V)

/* One (sequence, head)'s forward: o, its final state S and its checkpoints. */
static inline __attribute__((always_inline)) void kda_forward_item(
    const float *q, const float *k, const float *v, const float *g, const float *beta,
    const float *initial, int64_t start, int64_t end, int64_t h, int64_t H, float scale,
    float floor, int64_t segment, float *o, float *S, float *checkpoints, float *work,
    const int64_t K, const int64_t V) {
  float *decay = work, *r = decay + K, *u = r + V;
  if (initial != 0)
    copy_floats(S, initial, K * V);
  else
    zero_floats(S, K * V);
  for (int64_t t = start; t < end; ++t) {
    int64_t c = t - start, x = t * H + h;
    if (c % segment == 0) copy_floats(checkpoints + (c / segment) * H * K * V, S, K * V);
    kda_token(S, q + x * K, k + x * K, v + x * V, g + x * K, beta[x], scale, floor, decay, r,
              u, o + x * V, K, V);
  }
}

/* o [tokens, H, V] and the final states [N, H, K, V] from the initial ones (NULL: zeros); the
 * checkpoints [count, H, K, V]. `first` [N + 1] and `work` [threads, K + 2 V] are scratch.
 * Returns the checkpoints' count, or -1 for invalid bounds (nothing written then). */
int64_t kda_forward(const float *q, const float *k, const float *v, const float *g,
                    const float *beta, const float *initial, const int64_t *bounds, int64_t N,
                    int64_t tokens, int64_t H, int64_t K, int64_t V, float scale, float floor,
                    int64_t segment, float *o, float *final, float *checkpoints, int64_t *first,
                    float *work, int threads) {
  int64_t count = checkpoint_starts(bounds, N, tokens, segment, first);
  if (count < 0) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (N * H > 1)
  for (int64_t item = 0; item < N * H; ++item) {
    int64_t n = item / H, h = item % H;
#define FORWARD_ITEM(K_, V_)                                                                   \
  kda_forward_item(q, k, v, g, beta, initial == 0 ? 0 : initial + item * K * V, bounds[n],     \
                   bounds[n + 1], h, H, scale, floor, segment, o, final + item * K * V,         \
                   checkpoints + (first[n] * H + h) * K * V,                                    \
                   work + omp_get_thread_num() * (K + 2 * V), K_, V_)
    FOR_HEAD_SIZES(FORWARD_ITEM);
#undef FORWARD_ITEM
  }
  return count;
}

/* dst [cols, rows] <- src [rows, cols] transposed. */
static void transpose(float *restrict dst, const float *restrict src, int64_t rows,
                      int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * cols + j];
}

/* One token on the transposed state (row j: value channel j, [V, K]): next <- the state after
 * the token from prev, r <- v - S'^T k. The backward works on S^T: there the sums over key
 * channels, which per row of S would each be a horizontal vector sum, are vector sums over
 * rows, and one row at a time carries the whole token. */
static inline __attribute__((always_inline)) void kda_token_transposed(
    float *restrict next, const float *restrict prev, const float *restrict k,
    const float *restrict v, float beta, const float *restrict decay, float *restrict r,
    int64_t K, int64_t V) {
  for (int64_t j = 0; j < V; ++j) {
    float *restrict row = next + j * K;
    const float *restrict before = prev + j * K;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < K; ++i) {
      row[i] = before[i] * decay[i];
      dot += row[i] * k[i];
    }
    r[j] = v[j] - dot;
    float u = beta * r[j];
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) row[i] += u * k[i];
  }
}

/* One (sequence, head)'s backward, from the gradient of its final state, transposed, in dT
 * ([V, K], as the states here). */
static inline __attribute__((always_inline)) void kda_backward_item(
    const float *q, const float *k, const float *v, const float *g, const float *beta,
    const float *checkpoints, int64_t start, int64_t end, int64_t h, int64_t H, float scale,
    float floor, int64_t segment, const float *grad_o, float *dq, float *dk, float *dv,
    float *dg, float *dbeta, float *dT, float *work, const int64_t K, const int64_t V) {
  /* states [segment + 1, V, K]: the one entering the segment, then after each token. */
  float *states = work, *rs = states + (segment + 1) * K * V;  /* rs [segment, V] */
  float *decay = rs + segment * V, *dq_t = decay + K, *dk_t = dq_t + K, *dg_t = dk_t + K;
  for (int64_t c = (end - start + segment - 1) / segment - 1; c >= 0; --c) {
    int64_t a0 = start + c * segment, a1 = a0 + segment < end ? a0 + segment : end;
    transpose(states, checkpoints + c * H * K * V, K, V);
    for (int64_t t = a0; t < a1; ++t) {  /* the segment's states, recomputed */
      int64_t x = t * H + h;
      token_decay(g + x * K, floor, decay, K);
      kda_token_transposed(states + (t - a0 + 1) * K * V, states + (t - a0) * K * V, k + x * K,
                           v + x * V, beta[x], decay, rs + (t - a0) * V, K, V);
    }
    for (int64_t t = a1 - 1; t >= a0; --t) {
      int64_t x = t * H + h;
      const float *after = states + (t - a0 + 1) * K * V, *before = after - K * V;
      const float *r = rs + (t - a0) * V, *qt = q + x * K, *kt = k + x * K, *gt = g + x * K;
      const float *dot = grad_o + x * V;
      float b = beta[x], dbeta_t = 0.0f;
      token_decay(gt, floor, decay, K);
      for (int64_t i = 0; i < K; ++i) dq_t[i] = dk_t[i] = dg_t[i] = 0.0f;
      for (int64_t j = 0; j < V; ++j) {
        const float *row = after + j * K, *row_before = before + j * K;
        float *drow = dT + j * K;
        float d_out = dot[j], scaled_d_out = scale * dot[j], u = b * r[j], du = 0.0f;
        /* o = S^T (scale q) and S = S' + k u^T: dS += scale q do^T, du = dS^T k, dk = dS u. */
#pragma omp simd reduction(+ : du)
        for (int64_t i = 0; i < K; ++i) {
          dq_t[i] += d_out * row[i];
          drow[i] += scaled_d_out * qt[i];
          du += drow[i] * kt[i];
          dk_t[i] += u * drow[i];
        }
        /* u = beta (v - S'^T k): dv, dbeta, and dp = -beta du for S' = Diag(exp(G)) S_prev:
         * dS' = dS + k dp^T, dk += S' dp, dG += rows of dS' * S', dS_prev = Diag(exp(G)) dS'. */
        float dp = -b * du;
        dv[x * V + j] = b * du;
        dbeta_t += du * r[j];
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) {
          float decayed = row_before[i] * decay[i], d = drow[i] + kt[i] * dp;
          dk_t[i] += dp * decayed;
          dg_t[i] += d * decayed;
          drow[i] = decay[i] * d;
        }
      }
      dbeta[x] = dbeta_t;
      for (int64_t i = 0; i < K; ++i) {
        dq[x * K + i] = scale * dq_t[i];
        dk[x * K + i] = dk_t[i];
        dg[x * K + i] = gt[i] < floor ? 0.0f : dg_t[i];  /* no gradient where G held g */
      }
    }
  }
}

/* The gradients of q, k, v, g, beta (token-major like them) and, where `grad_initial` is given,
 * of the initial states, from those of o and of the final states (NULL: zero). `first` [N + 1]
 * and `work` [threads, (segment + 2) K V + segment V + 4 K] are scratch. */
void kda_backward(const float *q, const float *k, const float *v, const float *g,
                  const float *beta, const float *checkpoints, const int64_t *bounds, int64_t N,
                  int64_t tokens, int64_t H, int64_t K, int64_t V, float scale, float floor,
                  int64_t segment, const float *grad_o, const float *grad_final, float *dq,
                  float *dk, float *dv, float *dg, float *dbeta, float *grad_initial,
                  int64_t *first, float *work, int threads) {
  checkpoint_starts(bounds, N, tokens, segment, first); /* checked by the forward */
  int64_t per_thread = (segment + 2) * K * V + segment * V + 4 * K;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (N * H > 1)
  for (int64_t item = 0; item < N * H; ++item) {
    int64_t n = item / H, h = item % H;
    float *thread_work = work + omp_get_thread_num() * per_thread;
    float *dT = thread_work + per_thread - K * V;  /* the running state's gradient, [V, K] */
    if (grad_final != 0)
      transpose(dT, grad_final + item * K * V, K, V);
    else
      zero_floats(dT, K * V);
#define BACKWARD_ITEM(K_, V_)                                                                  \
  kda_backward_item(q, k, v, g, beta, checkpoints + (first[n] * H + h) * K * V, bounds[n],      \
                    bounds[n + 1], h, H, scale, floor, segment, grad_o, dq, dk, dv, dg, dbeta,  \
                    dT, thread_work, K_, V_)
    FOR_HEAD_SIZES(BACKWARD_ITEM);
#undef BACKWARD_ITEM
    if (grad_initial != 0) transpose(grad_initial + item * K * V, dT, V, K);
  }
}

/* Attention over documents (model/ops/attention.py _BlockwiseAttention, the same softmax per
 * query): q [BH, T, D], k [BH, Tk, D], v [BH, Tk, Dv] contiguous per (row, head) item, segment
 * ids q_seg [B, T] and k_seg [B, Tk] (NULL: one segment per row), non-decreasing along each
 * row. Query i attends key j when their ids match and, with `causal`, j <= q_offset + i: one
 * contiguous range of keys, so only those are computed (the torch tiles compute and mask whole
 * tiles). Each item is one thread's work, queries in order: results do not depend on the
 * thread count. */

/* 0 where every row's ids are non-decreasing, else -1. */
static int check_sorted(const float *seg, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 1; i < n; ++i)
      if (!(seg[r * n + i - 1] <= seg[r * n + i])) return -1;
  return 0;
}

/* The first index in sorted[0, n) whose value is >= x (upper: > x). */
static int64_t bound(const float *sorted, int64_t n, float x, int upper) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if (upper ? sorted[mid] <= x : sorted[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The keys [*lo, *hi) query i of row b attends. */
static void key_range(const float *q_seg, const float *k_seg, int64_t b, int64_t i, int64_t T,
                      int64_t Tk, int causal, int64_t q_offset, int64_t *lo, int64_t *hi) {
  int64_t end = causal && q_offset + i + 1 < Tk ? q_offset + i + 1 : Tk;
  *lo = 0;
  *hi = end;
  if (q_seg != 0) {
    float id = q_seg[b * T + i];
    const float *row = k_seg + b * Tk;
    int64_t first = bound(row, Tk, id, 0), last = bound(row, Tk, id, 1);
    *lo = first;
    *hi = last < end ? last : end;
  }
  if (*hi < *lo) *hi = *lo;
}

/* out[j] = x . m_{lo + j} for j < n, from the transposed rows mt [D, Tk] (the scores from the
 * scaled query and the keys; dP from dO and the values). */
static void dot_with_rows(const float *restrict x, const float *restrict mt, int64_t lo,
                          int64_t n, int64_t D, int64_t Tk, float *restrict out) {
  for (int64_t j = 0; j < n; ++j) out[j] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    float xd = x[d];
    const float *restrict column = mt + d * Tk + lo;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] += xd * column[j];
  }
}

/* o [BH, T, Dv], lse and row_max [BH, T] (the logsumexp and the max of each query's allowed
 * logits, -inf where it has none; o is then 0 / 0 as in the torch tiles). `work` [threads,
 * D + D Tk + Tk] is scratch. Returns -1, writing nothing, where ids are not sorted. */
int64_t attention_forward(const float *q, const float *k, const float *v, const float *q_seg,
                          const float *k_seg, int64_t B, int64_t H, int64_t T, int64_t Tk,
                          int64_t D, int64_t Dv, float scale, int causal, int64_t q_offset,
                          float *o, float *lse, float *row_max, float *work, int threads) {
  if (q_seg != 0 && (check_sorted(q_seg, B, T) || check_sorted(k_seg, B, Tk))) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (B * H > 1)
  for (int64_t item = 0; item < B * H; ++item) {
    float *q_scaled = work + omp_get_thread_num() * (D + D * Tk + Tk);
    float *kt = q_scaled + D, *scores = kt + D * Tk;
    transpose(kt, k + item * Tk * D, Tk, D);
    const float *values = v + item * Tk * Dv;
    for (int64_t i = 0; i < T; ++i) {
      int64_t lo, hi, x = item * T + i;
      key_range(q_seg, k_seg, item / H, i, T, Tk, causal, q_offset, &lo, &hi);
      int64_t n = hi - lo;
      for (int64_t d = 0; d < D; ++d) q_scaled[d] = q[x * D + d] * scale;
      dot_with_rows(q_scaled, kt, lo, n, D, Tk, scores);
      float m = NEG_INF, denom = 0.0f;
      for (int64_t j = 0; j < n; ++j) m = scores[j] > m ? scores[j] : m;
      float shift = m == NEG_INF ? 0.0f : m;
#pragma omp simd reduction(+ : denom)
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = expf(scores[j] - shift);
        denom += scores[j];
      }
      float *out = o + x * Dv;
      for (int64_t e = 0; e < Dv; ++e) out[e] = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        float p = scores[j];
        const float *restrict row = values + (lo + j) * Dv;
#pragma omp simd
        for (int64_t e = 0; e < Dv; ++e) out[e] += p * row[e];
      }
      for (int64_t e = 0; e < Dv; ++e) out[e] /= denom;
      lse[x] = m + logf(denom);
      row_max[x] = m;
    }
  }
  return 0;
}

/* dq, dk, dv (zeroed here) from do [BH, T, Dv] and the forward's o and lse (FlashAttention-2's
 * backward: P recomputed from lse, dS = P (dP - rowsum(dO O))). `work` [threads,
 * 2 D + (D + Dv) Tk + 2 Tk] is scratch. */
void attention_backward(const float *q, const float *k, const float *v, const float *q_seg,
                        const float *k_seg, const float *o, const float *lse,
                        const float *grad_o, int64_t B, int64_t H, int64_t T, int64_t Tk,
                        int64_t D, int64_t Dv, float scale, int causal, int64_t q_offset,
                        float *dq, float *dk, float *dv, float *work, int threads) {
  int64_t per_thread = 2 * D + (D + Dv) * Tk + 2 * Tk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (B * H > 1)
  for (int64_t item = 0; item < B * H; ++item) {
    float *q_scaled = work + omp_get_thread_num() * per_thread, *dq_row = q_scaled + D;
    float *kt = dq_row + D, *vt = kt + D * Tk, *p = vt + Dv * Tk, *ds = p + Tk;
    const float *keys = k + item * Tk * D, *values = v + item * Tk * Dv;
    float *dkeys = dk + item * Tk * D, *dvalues = dv + item * Tk * Dv;
    transpose(kt, keys, Tk, D);
    transpose(vt, values, Tk, Dv);
    zero_floats(dkeys, Tk * D);
    zero_floats(dvalues, Tk * Dv);
    for (int64_t i = 0; i < T; ++i) {
      int64_t lo, hi, x = item * T + i;
      key_range(q_seg, k_seg, item / H, i, T, Tk, causal, q_offset, &lo, &hi);
      int64_t n = hi - lo;
      const float *d_out = grad_o + x * Dv, *out = o + x * Dv;
      float delta = 0.0f, row_lse = lse[x];
      for (int64_t e = 0; e < Dv; ++e) delta += d_out[e] * out[e];
      for (int64_t d = 0; d < D; ++d) q_scaled[d] = q[x * D + d] * scale;
      dot_with_rows(q_scaled, kt, lo, n, D, Tk, p);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) p[j] = expf(p[j] - row_lse);
      dot_with_rows(d_out, vt, lo, n, Dv, Tk, ds);  /* dP = dO V^T over the range */
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - delta);
      for (int64_t d = 0; d < D; ++d) dq_row[d] = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        float pj = p[j], dsj = ds[j];
        const float *restrict key = keys + (lo + j) * D;
        float *restrict dkey = dkeys + (lo + j) * D, *restrict dvalue = dvalues + (lo + j) * Dv;
#pragma omp simd
        for (int64_t e = 0; e < Dv; ++e) dvalue[e] += pj * d_out[e];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          dq_row[d] += dsj * key[d];
          dkey[d] += dsj * q_scaled[d];
        }
      }
      for (int64_t d = 0; d < D; ++d) dq[x * D + d] = dq_row[d] * scale;
    }
  }
}

/* The LM head's token cross entropy (model/head.py _ChunkedLinearCrossEntropy) on one chunk's
 * logits [rows, V], a row at a time (a row of the vocabulary stays in L1 between its passes;
 * torch makes five passes over the chunk, 8 MiB in k3_tiny, for each). The forward's
 * lse[r] = log(sum_i exp(x_i - max)) + max, the max taken as 0 where it is infinite (as
 * model/head.py _log_sum_exp_ and torch.logsumexp). */
void log_sum_exp_rows(const float *logits, float *lse, int64_t rows, int64_t V, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * V >= PARALLEL_GRAIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = logits + r * V;
    float top = NEG_INF, total = 0.0f;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < V; ++i) top = x[i] > top ? x[i] : top;
    if (top == NEG_INF || top == -NEG_INF) top = 0.0f;  /* a NaN in the row: a NaN sum */
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < V; ++i) total += expf(x[i] - top);
    lse[r] = logf(total) + top;
  }
}

/* Its backward: each row of logits turned in place into scale[r] (softmax - one_hot(target[r]))
 * with softmax = exp(x - lse[r]), in the torch form's order. Returns the number of targets
 * outside [0, V) (those rows are left as they were). */
int64_t softmax_grad_rows(float *logits, const float *lse, const int64_t *targets,
                          const float *scale, int64_t rows, int64_t V, int threads) {
  int64_t bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : bad) \
    if (rows * V >= PARALLEL_GRAIN)
  for (int64_t r = 0; r < rows; ++r) {
    float *x = logits + r * V, m = lse[r], s = scale[r];
    if (targets[r] < 0 || targets[r] >= V) {
      ++bad;
      continue;
    }
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) x[i] = expf(x[i] - m);
    x[targets[r]] += -1.0f;
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) x[i] *= s;
  }
  return bad;
}
