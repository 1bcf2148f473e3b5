// The Adam arithmetic, written once over an "ISA policy" (a struct of static vector ops), and
// instantiated by each isa_*.cpp file for its own vector type.
//
// NOTE: this header is included by translation units compiled for different instruction sets
// (via `#pragma GCC target`). Everything here lives in an anonymous namespace and uses no
// standard-library templates, so no inline function compiled for AVX-512 can be picked by the
// linker for a caller on a machine without it (the classic ODR trap of per-file ISA flags).
//
// Every path performs the same IEEE operations in the same order (fused multiply-add where
// written, correctly rounded sqrt and division, no reciprocal estimates), so scalar, AVX2,
// AVX-512, NEON and SVE give bit-identical results; tests rely on that.
#pragma once

#include "adam_types.h"

namespace {

// Scalar policy: the reference semantics, also used for the tail of every vector loop.
struct ScalarIsa {
  using V = float;
  using M = bool;
  static constexpr int64_t lanes() { return 1; }
  static inline V set1(float x) { return x; }
  static inline V load(const float* p) { return *p; }
  static inline void store(float* p, V x) { *p = x; }
  static inline V add(V a, V b) { return a + b; }
  static inline V sub(V a, V b) { return a - b; }
  static inline V mul(V a, V b) { return a * b; }
  static inline V div(V a, V b) { return a / b; }
  static inline V fma(V a, V b, V c) { return __builtin_fmaf(a, b, c); }
  static inline V sqrt(V a) { return __builtin_sqrtf(a); }
  // x - x is 0 exactly for finite x and NaN for +-Inf/NaN.
  static inline M finite(V x) { return (x - x) == 0.0f; }
  static inline M gt(V a, V b) { return a > b; }
  // x, or limit where x is larger; a NaN x stays NaN (limit is never NaN).
  static inline V clamp_max(V x, V limit) { return x > limit ? limit : x; }
  static inline V select(M m, V a, V b) { return m ? a : b; }
  static inline int count_false(M m) { return m ? 0 : 1; }
  static inline V load_bf16(const uint16_t* p) {
    const uint32_t u = uint32_t(*p) << 16;
    float x;
    __builtin_memcpy(&x, &u, 4);
    return x;
  }
  static inline V load_fp16(const uint16_t* p) {
#if defined(__aarch64__)
    __fp16 h;
#else
    _Float16 h;
#endif
    __builtin_memcpy(&h, p, 2);
    return static_cast<float>(h);
  }
  static inline void store_bf16(uint16_t* out, V x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    // Round to nearest even; NaN becomes the canonical quiet NaN, as torch's scalar cast does.
    *out = (x != x) ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  static inline void store_fp16(uint16_t* out, V x) {
#if defined(__aarch64__)
    __fp16 h = static_cast<__fp16>(x);  // IEEE round to nearest even (GCC has no C++ _Float16 here)
#else
    _Float16 h = static_cast<_Float16>(x);  // IEEE round to nearest even
#endif
    __builtin_memcpy(out, &h, 2);
  }

  // 32-bit integer lanes, for the compact state's codes (compact_math.h). Arithmetic wraps
  // modulo 2^32 (done in uint32_t: no signed overflow); right shifts are logical (shr) or
  // arithmetic (sar).
  using VI = int32_t;
  static inline M lt(V a, V b) { return a < b; }
  static inline VI seti(int32_t x) { return x; }
  static inline VI iota() { return 0; }
  static inline VI bits(V x) {
    VI u;
    __builtin_memcpy(&u, &x, 4);
    return u;
  }
  static inline V from_bits(VI u) {
    V x;
    __builtin_memcpy(&x, &u, 4);
    return x;
  }
  static inline VI addi(VI a, VI b) { return VI(uint32_t(a) + uint32_t(b)); }
  static inline VI muli(VI a, VI b) { return VI(uint32_t(a) * uint32_t(b)); }
  static inline VI andi(VI a, VI b) { return a & b; }
  static inline VI ori(VI a, VI b) { return a | b; }
  static inline VI xori(VI a, VI b) { return a ^ b; }
  template <int k>
  static inline VI shl(VI a) {
    return VI(uint32_t(a) << k);
  }
  template <int k>
  static inline VI shr(VI a) {
    return VI(uint32_t(a) >> k);
  }
  template <int k>
  static inline VI sar(VI a) {
    return a >> k;  // arithmetic in GCC (and by definition since C++20)
  }
  static inline VI maxi(VI a, VI b) { return a > b ? a : b; }
  static inline int32_t reduce_maxi(VI a) { return a; }
  static inline M eqi(VI a, VI b) { return a == b; }
  static inline bool any(M m) { return m; }
  static inline VI selecti(M m, VI a, VI b) { return m ? a : b; }
  static inline V to_float(VI a) { return float(a); }
  // Toward zero; out of range (and NaN) gives INT32_MIN as x86 does, instead of undefined
  // behaviour. Callers only use lanes in range, where every instruction set agrees.
  static inline VI trunc_int(V x) {
    return (x >= -2147483648.0f && x < 2147483648.0f) ? VI(x) : VI(-2147483647 - 1);
  }
  static inline VI load_u8(const uint8_t* p) { return *p; }
  static inline void store_u8(uint8_t* p, VI x) { *p = uint8_t(uint32_t(x)); }
};

// adam_forward and adam_inverse run once a vector: always inlined, since GCC's own choice
// depends on the size of the whole translation unit (each isa_*.cpp file also holds the
// compact kernels), and where it called them out of line a rollback took ~10% longer.
#define HSO_VECTOR_INLINE inline __attribute__((always_inline))

// One AdamW/Adam update of (p, m, v) with effective gradient g, in place; lanes whose
// gradient term is not finite keep their old values. Returns the finite mask.
template <class I, bool kAdamW>
HSO_VECTOR_INLINE typename I::M adam_forward(const AdamArgs& a, typename I::V g,
                                             typename I::V& p, typename I::V& m,
                                             typename I::V& v) {
  using V = typename I::V;
  using M = typename I::M;
  if (!kAdamW) g = I::fma(I::set1(a.weight_decay), p, g);  // L2: g + wd * p
  const V g2 = I::mul(I::mul(I::set1(a.one_minus_beta2), g), g);
  // Non-finite g, or g so large that its square overflows: the lane is left untouched, which
  // is what makes a speculative step with bad gradients exactly undoable.
  const M ok = I::finite(g2);
  const V m1 = I::fma(I::set1(a.beta1), m, I::mul(I::set1(a.one_minus_beta1), g));
  const V v1 = I::fma(I::set1(a.beta2), v, g2);
  const V denom = I::fma(I::sqrt(v1), I::set1(a.rsqrt_bias_correction2), I::set1(a.eps));
  const V update = I::div(m1, denom);
  const V decayed = kAdamW ? I::mul(p, I::set1(a.decay)) : p;
  const V p1 = I::fma(I::set1(-a.step_size), update, decayed);
  p = I::select(ok, p1, p);
  m = I::select(ok, m1, m);
  v = I::select(ok, v1, v);
  return ok;
}

// The algebraic inverse of adam_forward with the same arguments and gradient. The update term
// is recomputed bit-identically from the stored (m1, v1), so the param is restored to within
// one or two roundings; the moments to within a few ulps of the largest term of the step.
// exp_avg_sq is clamped at +0 so cancellation can never leave it negative.
template <class I, bool kAdamW>
HSO_VECTOR_INLINE typename I::M adam_inverse(const AdamArgs& a, typename I::V g,
                                             typename I::V& p, typename I::V& m,
                                             typename I::V& v) {
  using V = typename I::V;
  using M = typename I::M;
  const V zero = I::set1(0.0f);
  const V denom = I::fma(I::sqrt(v), I::set1(a.rsqrt_bias_correction2), I::set1(a.eps));
  const V update = I::div(m, denom);
  const V decayed = I::fma(I::set1(a.step_size), update, p);
  const V p0 = kAdamW ? I::div(decayed, I::set1(a.decay)) : decayed;
  if (!kAdamW) g = I::fma(I::set1(a.weight_decay), p0, g);
  const V g2 = I::mul(I::mul(I::set1(a.one_minus_beta2), g), g);
  const M ok = I::finite(g2);
  const V m0 = I::div(I::sub(m, I::mul(I::set1(a.one_minus_beta1), g)), I::set1(a.beta1));
  const V v0_raw = I::div(I::sub(v, g2), I::set1(a.beta2));
  const V v0 = I::select(I::gt(v0_raw, zero), v0_raw, zero);
  p = I::select(ok, p0, p);
  m = I::select(ok, m0, m);
  v = I::select(ok, v0, v);
  return ok;
}

// One block of I::lanes() elements starting at i. Returns the number of skipped lanes.
template <class I, int kGrad>
inline typename I::V load_grad(const AdamTensors& t, int64_t i) {
  if constexpr (kGrad == kLowpBf16) {
    return I::load_bf16(static_cast<const uint16_t*>(t.grad) + i);
  } else if constexpr (kGrad == kLowpFp16) {
    return I::load_fp16(static_cast<const uint16_t*>(t.grad) + i);
  } else {
    return I::load(static_cast<const float*>(t.grad) + i);
  }
}

template <class I, int kOp, int kLowp, bool kAdamW, int kGrad>
inline int adam_block(const AdamArgs& a, const AdamTensors& t, int64_t i) {
  using V = typename I::V;
  using M = typename I::M;
  V p = I::load(t.param + i);
  V m = I::load(t.exp_avg + i);
  V v = I::load(t.exp_avg_sq + i);
  const V grad = load_grad<I, kGrad>(t, i);
  M ok;
  if constexpr (kOp == kOpStep) {
    ok = adam_forward<I, kAdamW>(a, I::mul(grad, I::set1(a.grad_scale)), p, m, v);
  } else if constexpr (kOp == kOpRollback) {
    ok = adam_inverse<I, kAdamW>(a, I::mul(grad, I::set1(a.grad_scale)), p, m, v);
  } else {
    adam_inverse<I, kAdamW>(a, I::mul(grad, I::set1(a.grad_scale)), p, m, v);
    ok = adam_forward<I, kAdamW>(a, I::mul(grad, I::set1(a.new_grad_scale)), p, m, v);
  }
  I::store(t.param + i, p);
  I::store(t.exp_avg + i, m);
  I::store(t.exp_avg_sq + i, v);
  if constexpr (kLowp == kLowpBf16) I::store_bf16(t.out_lowp + i, p);
  if constexpr (kLowp == kLowpFp16) I::store_fp16(t.out_lowp + i, p);
  return I::count_false(ok);
}

template <class I, int kOp, int kLowp, bool kAdamW, int kGrad>
int64_t adam_span_impl(const AdamArgs& a, const AdamTensors& t, int64_t begin, int64_t end) {
  const int64_t lanes = I::lanes();
  int64_t skipped = 0;
  int64_t i = begin;
  for (; i + lanes <= end; i += lanes)
    skipped += adam_block<I, kOp, kLowp, kAdamW, kGrad>(a, t, i);
  for (; i < end; ++i) skipped += adam_block<ScalarIsa, kOp, kLowp, kAdamW, kGrad>(a, t, i);
  return skipped;
}

// Turns the runtime (op, lowp, adamw, grad kind) into one of the 54 instantiations.
template <class I, int kOp, int kLowp, bool kAdamW>
int64_t adam_span_grad(const AdamArgs& a, const AdamTensors& t, int64_t b, int64_t e) {
  switch (t.grad_kind) {
    case kLowpBf16: return adam_span_impl<I, kOp, kLowp, kAdamW, kLowpBf16>(a, t, b, e);
    case kLowpFp16: return adam_span_impl<I, kOp, kLowp, kAdamW, kLowpFp16>(a, t, b, e);
    default: return adam_span_impl<I, kOp, kLowp, kAdamW, kLowpNone>(a, t, b, e);
  }
}

template <class I, int kOp, int kLowp>
int64_t adam_span_adamw(const AdamArgs& a, const AdamTensors& t, int64_t b, int64_t e) {
  return a.adamw ? adam_span_grad<I, kOp, kLowp, true>(a, t, b, e)
                 : adam_span_grad<I, kOp, kLowp, false>(a, t, b, e);
}

template <class I, int kOp>
int64_t adam_span_lowp(const AdamArgs& a, const AdamTensors& t, int64_t b, int64_t e) {
  switch (t.lowp_kind) {
    case kLowpBf16: return adam_span_adamw<I, kOp, kLowpBf16>(a, t, b, e);
    case kLowpFp16: return adam_span_adamw<I, kOp, kLowpFp16>(a, t, b, e);
    default: return adam_span_adamw<I, kOp, kLowpNone>(a, t, b, e);
  }
}

template <class I>
int64_t adam_span(int op, const AdamArgs& a, const AdamTensors& t, int64_t b, int64_t e) {
  switch (op) {
    case kOpStep: return adam_span_lowp<I, kOpStep>(a, t, b, e);
    case kOpRollback: return adam_span_lowp<I, kOpRollback>(a, t, b, e);
    default: return adam_span_lowp<I, kOpReplay>(a, t, b, e);
  }
}

}  // namespace
