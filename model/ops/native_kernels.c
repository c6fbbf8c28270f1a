/* Element-wise chains of the model as one loop each, for fp32 CPU tensors (model/ops/native.py
 * builds this file with the system C compiler and calls it through ctypes).
 *
 * Every tensor is passed as rows of `width` contiguous floats, `*_stride` floats apart (a view
 * of a wider buffer, such as the gate half of a fused projection, needs no copy); outputs are
 * dense [rows, width]. The loops are element by element with no reductions, so results do not
 * depend on the thread count. The math follows the plain references in model/activations.py
 * operation by operation; expf and tanhf come from glibc's vector math library (libmvec,
 * declared below for the vectoriser), which keeps IEEE semantics for infinities and NaN. */

#include <stdint.h>

float expf(float) __attribute__((simd("notinbranch"), const, nothrow));
float tanhf(float) __attribute__((simd("notinbranch"), const, nothrow));

/* Below this many elements a second thread costs more to wake than it saves (ATen's grain). */
#define PARALLEL_GRAIN 32768

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

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

/* Its gradients, recomputing the tanh and sigmoid (model/activations.py _situ_glu_backward). */
void situ_glu_backward(const float *gate, const float *up, const float *grad_out,
                       float *grad_gate, float *grad_up, int64_t rows, int64_t width,
                       int64_t gate_stride, int64_t up_stride, int64_t grad_stride,
                       float beta_gate, float beta_up, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (rows * width >= PARALLEL_GRAIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gate + r * gate_stride, *u = up + r * up_stride;
    const float *d = grad_out + r * grad_stride;
    float *dg = grad_gate + r * width, *du = grad_up + r * width;
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
