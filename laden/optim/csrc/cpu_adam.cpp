// Host AdamW kernels for laden's CPU-offloaded optimizer step.
//
// Plain C ABI on raw pointers, called from Python through ctypes: the file includes no
// PyTorch header, so the lazy build takes seconds instead of the better part of a minute,
// and ctypes drops the GIL for the whole call, so an engine thread can run the update
// while the main thread keeps feeding the GPU.
//
// One fused pass per tensor: read param, grad and both moments once, write them once
// (and optionally the bf16 upload copy of the param). The loop is memory bound, so it is
// written as a simple element loop that the compiler vectorizes (`omp simd`) and OpenMP
// splits statically over threads. Floating-point contraction is disabled at build time
// (-ffp-contract=off) so each element is rounded op by op like PyTorch's CPU kernels, with
// an explicit std::fma exactly where those kernels fuse (lerp, addcmul): the result agrees
// with torch.optim.AdamW on CPU to about one ulp; the rest of the gap is PyTorch's own
// vectorized sqrt, which is not always correctly rounded. FMA elsewhere would buy nothing:
// the loop is memory bound.
// -fno-math-errno lets sqrtf vectorize (the errno branch is the only control flow).
//
// bf16 <-> fp32 conversions are bit operations: widening is a 16-bit shift, narrowing is
// round-to-nearest-even, as PyTorch's `.to(torch.bfloat16)`, so a bf16 copy written here
// equals `param.to(bf16)` bit for bit; NaN becomes the quiet NaN 0x7FC0 (PyTorch's scalar
// path; its vectorized paths pick other NaN payloads).

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? 0x7FC0u : rounded);
}

inline float load_grad(const float* g, int64_t i) { return g[i]; }
inline float load_grad(const uint16_t* g, int64_t i) { return bf16_to_f32(g[i]); }

// Scalars precomputed in Python exactly as torch.optim.AdamW computes them (in double),
// then narrowed to float once, as PyTorch narrows a Python scalar for a float tensor op.
struct Scalars {
  float one_minus_beta1;  // lerp weight of the first moment
  float beta2;
  float one_minus_beta2;
  float step_size;  // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float decay;  // 1 - lr * weight_decay (decoupled weight decay)
};

// First moment as torch's CPU lerp with a weight below 0.5: fma(w, g - m, m).
inline float next_exp_avg(float m, float g, const Scalars& s) {
  return std::fma(s.one_minus_beta1, g - m, m);
}

// Second moment as torch's CPU mul_(beta2) then addcmul_(g, g, value=1 - beta2), whose
// vectorized kernel computes fma(value * g, g, v).
inline float next_exp_avg_sq(float v, float g, const Scalars& s) {
  float decayed = v * s.beta2;
  return std::fma(s.one_minus_beta2 * g, g, decayed);
}

// New (master) weight: p * (1 - lr * wd) + (-step_size) * m / (sqrt(v) / bc2_sqrt + eps).
inline float next_param(float p, float m, float v, const Scalars& s) {
  float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
  float decayed = p * s.decay;
  return decayed + (-s.step_size) * m / denom;
}

template <typename GradT, bool kWriteBf16>
void adamw_fp32(float* __restrict p, const GradT* __restrict g, float* __restrict m,
                float* __restrict v, uint16_t* __restrict p_bf16, int64_t n, Scalars s,
                int num_threads) {
#pragma omp parallel for simd schedule(static) num_threads(num_threads) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    float grad = load_grad(g, i);
    float exp_avg = next_exp_avg(m[i], grad, s);
    float exp_avg_sq = next_exp_avg_sq(v[i], grad, s);
    float param = next_param(p[i], exp_avg, exp_avg_sq, s);
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
    p[i] = param;
    if (kWriteBf16) p_bf16[i] = f32_to_bf16(param);
  }
}

// bf16 storage with Kahan-compensated weights (see laden/optim/adamw_foreach.py for the
// derivation): master = p - comp; the moments are updated in fp32 and stored rounded to
// bf16, the update uses the unrounded fp32 moments; p_new = bf16(t) and
// comp = bf16(p_new - t), where t is the new master weight in fp32.
template <typename GradT>
void adamw_bf16_kahan(uint16_t* __restrict p, uint16_t* __restrict comp,
                      const GradT* __restrict g, uint16_t* __restrict m,
                      uint16_t* __restrict v, int64_t n, Scalars s, int num_threads) {
#pragma omp parallel for simd schedule(static) num_threads(num_threads) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    float grad = load_grad(g, i);
    float exp_avg = next_exp_avg(bf16_to_f32(m[i]), grad, s);
    float exp_avg_sq = next_exp_avg_sq(bf16_to_f32(v[i]), grad, s);
    float master = bf16_to_f32(p[i]) - bf16_to_f32(comp[i]);
    float target = next_param(master, exp_avg, exp_avg_sq, s);
    uint16_t p_new = f32_to_bf16(target);
    m[i] = f32_to_bf16(exp_avg);
    v[i] = f32_to_bf16(exp_avg_sq);
    p[i] = p_new;
    comp[i] = f32_to_bf16(bf16_to_f32(p_new) - target);
  }
}

Scalars make_scalars(double one_minus_beta1, double beta2, double one_minus_beta2,
                     double step_size, double bias_correction2_sqrt, double eps,
                     double decay) {
  return Scalars{static_cast<float>(one_minus_beta1), static_cast<float>(beta2),
                 static_cast<float>(one_minus_beta2), static_cast<float>(step_size),
                 static_cast<float>(bias_correction2_sqrt), static_cast<float>(eps),
                 static_cast<float>(decay)};
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 for an unsupported grad dtype code. grad_is_bf16: 0 = fp32, 1 = bf16.
// param_bf16 may be null (no upload copy).
int laden_adamw_fp32(float* param, const void* grad, int grad_is_bf16, float* exp_avg,
                     float* exp_avg_sq, uint16_t* param_bf16, int64_t numel,
                     double one_minus_beta1, double beta2, double one_minus_beta2,
                     double step_size, double bias_correction2_sqrt, double eps,
                     double decay, int num_threads) {
  Scalars s = make_scalars(one_minus_beta1, beta2, one_minus_beta2, step_size,
                           bias_correction2_sqrt, eps, decay);
  if (grad_is_bf16 == 0) {
    auto g = static_cast<const float*>(grad);
    if (param_bf16) adamw_fp32<float, true>(param, g, exp_avg, exp_avg_sq, param_bf16, numel, s, num_threads);
    else adamw_fp32<float, false>(param, g, exp_avg, exp_avg_sq, nullptr, numel, s, num_threads);
  } else if (grad_is_bf16 == 1) {
    auto g = static_cast<const uint16_t*>(grad);
    if (param_bf16) adamw_fp32<uint16_t, true>(param, g, exp_avg, exp_avg_sq, param_bf16, numel, s, num_threads);
    else adamw_fp32<uint16_t, false>(param, g, exp_avg, exp_avg_sq, nullptr, numel, s, num_threads);
  } else {
    return 1;
  }
  return 0;
}

int laden_adamw_bf16_kahan(uint16_t* param, uint16_t* comp, const void* grad, int grad_is_bf16,
                           uint16_t* exp_avg, uint16_t* exp_avg_sq, int64_t numel,
                           double one_minus_beta1, double beta2, double one_minus_beta2,
                           double step_size, double bias_correction2_sqrt, double eps,
                           double decay, int num_threads) {
  Scalars s = make_scalars(one_minus_beta1, beta2, one_minus_beta2, step_size,
                           bias_correction2_sqrt, eps, decay);
  if (grad_is_bf16 == 0) {
    adamw_bf16_kahan<float>(param, comp, static_cast<const float*>(grad), exp_avg, exp_avg_sq,
                            numel, s, num_threads);
  } else if (grad_is_bf16 == 1) {
    adamw_bf16_kahan<uint16_t>(param, comp, static_cast<const uint16_t*>(grad), exp_avg,
                               exp_avg_sq, numel, s, num_threads);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
