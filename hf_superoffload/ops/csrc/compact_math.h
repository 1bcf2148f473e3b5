// The compact-state Adam (hf_superoffload/ops/compact_adamw.py, compact_adam_pass), written
// once over an ISA policy (adam_math.h's, with its integer lanes) and instantiated by each
// isa_*.cpp file, like adam_math.h.
//
// Both moments are 8-bit codes relative to their block's largest magnitude (the block's fp32
// scale). One block at a time: decode, the Adam arithmetic in fp32 (separate multiplies and
// adds as the reference, no fused multiply-add: -ffp-contract=off), then, for a commit, the
// block's new scale (the largest |moment| compared as integers: the bits of non-negative
// floats order as their values, and a NaN beats every number, as torch's amax propagates it),
// and the codes (magnitudes times the block's reciprocal of its scale: one division a block,
// not one an element), with the reference's rounding bits. Every step is an exact IEEE
// operation or integer bit manipulation, so each instruction set gives the reference's bits.
//
// Same rule as adam_math.h: anonymous namespace, no standard-library templates.
#pragma once

#include "adam_math.h"
#include "compact_types.h"

namespace {

// 2**e as fp32, for -126 <= e <= 127.
inline float pow2(int e) {
  const uint32_t u = uint32_t(e + 127) << 23;
  float x;
  __builtin_memcpy(&x, &u, 4);
  return x;
}

// A code format: kExp exponent and kMant mantissa bits of the magnitude, and a sign bit
// (0x80) if kSigned. Exponent bias 2**kExp - 1 puts 1.0 (the block's largest) at the top.
template <int kExp, int kMant, bool kSigned>
struct CodeFormat {
  static constexpr int kBias = (1 << kExp) - 1;
  static constexpr int kShift = 23 - kMant;  // fp32 mantissa bits below the code's
  static constexpr bool kHasSign = kSigned;
};
using ExpAvgCode = CodeFormat<4, 3, true>;
using ExpAvgSqCode = CodeFormat<5, 3, false>;

// The values of codes (one per lane, 0..255) of blocks with largest magnitude `scale`.
template <class I, class F>
inline typename I::V decode(typename I::VI code, typename I::V scale) {
  using V = typename I::V;
  using VI = typename I::VI;
  const VI magnitude = F::kHasSign ? I::andi(code, I::seti(0x7F)) : code;
  // The reference's ((exponent - bias + 127) << 23) | (fraction << kShift), exponent and
  // fraction the code's fields: the same bits in two steps.
  const VI normal = I::addi(I::template shl<F::kShift>(magnitude), I::seti((127 - F::kBias) << 23));
  // No exponent bits (one masked test where the ISA has it).
  const typename I::M zero_exponent =
      I::eqi(I::andi(magnitude, I::seti(-(1 << (23 - F::kShift)))), I::seti(0));
  V unit = I::from_bits(normal);
  if (I::any(zero_exponent)) {
    // Below the smallest normal code (the code is its fraction): multiples of the subnormal
    // step, exact products.
    const V step = I::set1(pow2(1 - F::kBias - (23 - F::kShift)));
    unit = I::select(zero_exponent, I::mul(I::to_float(magnitude), step), unit);
  }
  const V value = I::mul(unit, scale);
  if (!F::kHasSign) return value;
  // The sign bit of the code flips the value's (negation).
  return I::from_bits(I::xori(I::bits(value), I::andi(I::template shl<24>(code),
                                                      I::seti(int32_t(0x80000000u)))));
}

// The reference's counter-based hash (compact_format.rounding_bits) of element indices whose
// first product index * 0x9E3779B1 is `product`, and `key`: both moments share the product,
// and consecutive vectors' products differ by lanes * 0x9E3779B1 (mod 2**32).
constexpr uint32_t kIndexFactor = 0x9E3779B1u;

template <class I>
inline typename I::VI index_product(uint32_t first, int64_t j) {
  const typename I::VI index = I::addi(I::seti(int32_t(first + uint32_t(j))), I::iota());
  return I::muli(index, I::seti(int32_t(kIndexFactor)));
}

template <class I>
inline typename I::VI rounding_bits(typename I::VI product, uint32_t key) {
  using VI = typename I::VI;
  VI x = I::addi(product, I::seti(int32_t(key)));
  x = I::xori(x, I::template shr<16>(x));
  x = I::muli(x, I::seti(int32_t(0x7FEB352Du)));
  x = I::xori(x, I::template shr<15>(x));
  x = I::muli(x, I::seti(int32_t(0x846CA68Bu)));
  return I::xori(x, I::template shr<16>(x));
}

// Codes (without sign) of r in [0, 1]: to nearest even, or up with the dropped share of
// `noise` (32 random bits a lane) if kStochastic.
template <class I, class F, bool kStochastic>
inline typename I::VI encode_unit(typename I::V r, typename I::VI noise) {
  using V = typename I::V;
  using VI = typename I::VI;
  constexpr int kMant = 23 - F::kShift;
  const VI bits = I::bits(r);
  VI rounded;
  if (kStochastic) {
    rounded = I::addi(bits, I::template shr<32 - F::kShift>(noise));
  } else {
    rounded = I::addi(I::addi(bits, I::seti((1 << (F::kShift - 1)) - 1)),
                      I::andi(I::template sar<F::kShift>(bits), I::seti(1)));
  }
  // The reference's (exponent << kMant) | mantissa with exponent = (rounded >> 23) - 127 +
  // bias and mantissa = (rounded >> kShift) & (2**kMant - 1): the same bits in two steps.
  const VI normal =
      I::addi(I::template sar<F::kShift>(rounded), I::seti((F::kBias - 127) * (1 << kMant)));
  const typename I::M below = I::lt(r, I::set1(pow2(1 - F::kBias)));
  if (!I::any(below)) return normal;  // no lane below the smallest normal code
  // Below the smallest normal: r scaled so that the subnormal step is 1, rounded to an
  // integer. The lanes that use it hold 0 <= scaled < 2**kMant.
  const V scaled = I::mul(r, I::set1(pow2(F::kBias - 1 + kMant)));
  VI subnormal;
  if (kStochastic) {
    // floor(scaled + u), u the top 24 noise bits over 2**24; truncation is floor here.
    const V u = I::mul(I::to_float(I::template shr<8>(noise)), I::set1(pow2(-24)));
    subnormal = I::trunc_int(I::add(scaled, u));
  } else {
    // Adding 2**23 rounds to an integer (nearest even) in the low mantissa bits.
    subnormal = I::addi(I::bits(I::add(scaled, I::set1(8388608.0f))), I::seti(-0x4B000000));
  }
  return I::selecti(below, subnormal, normal);
}

// What a block's codes scale its magnitudes by (compact_format.block_reciprocals): `safe` the
// scale (1 where it is 0 or NaN); `rcp` 1 / safe rounded to nearest, one ulp up where
// safe * rcp < 1, so that the largest magnitude lands on 1.0 or above and clamps to exactly
// 1.0; `by_rcp` where rcp is a normal number (elsewhere the codes divide by safe).
struct BlockReciprocal {
  float safe;
  float rcp;
  bool by_rcp;
};

inline BlockReciprocal block_reciprocal(float scale) {
  BlockReciprocal b;
  b.safe = scale > 0.0f ? scale : 1.0f;
  b.rcp = 1.0f / b.safe;
  // The next float up: rcp is positive (or 0 for an infinite scale, whose product is NaN).
  if (b.safe * b.rcp < 1.0f) b.rcp = ScalarIsa::from_bits(ScalarIsa::bits(b.rcp) + 1);
  b.by_rcp = b.rcp >= pow2(-126) && b.rcp < ScalarIsa::from_bits(0x7F800000);
  return b;
}

// The code (sign included) of buf[j]'s lanes in format F, in a block scaled by `b`, rounded
// with `noise` if kStochastic. Lanes may hold more than 8 bits (a NaN's): the stored code is
// the low byte.
template <class I, class F, bool kStochastic>
inline typename I::VI encode_code(const float* buf, int64_t j, const BlockReciprocal& b,
                                  typename I::VI noise) {
  using V = typename I::V;
  using VI = typename I::VI;
  const V x = I::load(buf + j);
  const V magnitude = I::from_bits(I::andi(I::bits(x), I::seti(0x7FFFFFFF)));
  V r;
  if (b.by_rcp) {
    // Clamped at 1 (NaN stays NaN, as torch.clamp keeps it).
    r = I::clamp_max(I::mul(magnitude, I::set1(b.rcp)), I::set1(1.0f));
  } else {
    r = I::div(magnitude, I::set1(b.safe));
  }
  VI code = encode_unit<I, F, kStochastic>(r, noise);
  if (F::kHasSign)
    code = I::selecti(I::lt(x, I::set1(0.0f)), I::ori(code, I::seti(0x80)), code);
  return code;
}

// Both moments' codes (encode_code's) of the block's lanes at j; `product` is index_product of
// the lanes.
template <class I, bool kStochastic>
inline void encode_codes(const CompactArgs& a, const float* m_buf, const float* v_buf, int64_t j,
                         const BlockReciprocal& rm, const BlockReciprocal& rv,
                         typename I::VI product, typename I::VI& code_m,
                         typename I::VI& code_v) {
  using VI = typename I::VI;
  VI noise_m = I::seti(0), noise_v = I::seti(0);
  if (kStochastic) {
    noise_m = rounding_bits<I>(product, a.key_exp_avg);
    noise_v = rounding_bits<I>(product, a.key_exp_avg_sq);
  }
  code_m = encode_code<I, ExpAvgCode, kStochastic>(m_buf, j, rm, noise_m);
  code_v = encode_code<I, ExpAvgSqCode, kStochastic>(v_buf, j, rv, noise_v);
}

// Calls body(isa, j, product) over a block of len elements: a vector of I at a time, then the
// tail an element at a time (isa a ScalarIsa); j numbers the lanes' first element within the
// block and `product` is their index_product (`index` numbers the block's first element),
// advanced by an addition a vector. The encoding loops of the commit and of the fused pass;
// both inline, body (a lambda) included, so each loop compiles as if written out in place.
template <class I, class Body>
inline void for_block_lanes(uint32_t index, int64_t len, Body&& body) {
  using VI = typename I::VI;
  const int64_t lanes = I::lanes();
  VI product = index_product<I>(index, 0);
  const VI advance = I::seti(int32_t(uint32_t(lanes) * kIndexFactor));
  int64_t j = 0;
  for (; j + lanes <= len; j += lanes) {
    body(I(), j, product);
    product = I::addi(product, advance);
  }
  for (; j < len; ++j) body(ScalarIsa(), j, index_product<ScalarIsa>(index, j));
}

template <class I, bool kStochastic>
inline void encode_block(const CompactArgs& a, const float* m_buf, const float* v_buf,
                         int64_t len, float scale_m, float scale_v, uint8_t* codes_m,
                         uint8_t* codes_v, uint32_t index) {
  const BlockReciprocal rm = block_reciprocal(scale_m);
  const BlockReciprocal rv = block_reciprocal(scale_v);
  for_block_lanes<I>(index, len, [&](auto isa, int64_t j, auto product) {
    using J = decltype(isa);
    typename J::VI code_m, code_v;
    encode_codes<J, kStochastic>(a, m_buf, v_buf, j, rm, rv, product, code_m, code_v);
    J::store_u8(codes_m + j, code_m);
    J::store_u8(codes_v + j, code_v);
  });
}

template <class I, int kGrad>
inline typename I::V load_gradient(const void* grad, int64_t i) {
  if constexpr (kGrad == kLowpBf16) {
    return I::load_bf16(static_cast<const uint16_t*>(grad) + i);
  } else if constexpr (kGrad == kLowpFp16) {
    return I::load_fp16(static_cast<const uint16_t*>(grad) + i);
  } else {
    return I::load(static_cast<const float*>(grad) + i);
  }
}

// The effective gradient of the lanes at element i: grad * grad_scale, plus wd * p for L2 Adam.
template <class I, int kGrad>
inline typename I::V compact_gradient(const CompactArgs& a, const void* grad, int64_t i,
                                      typename I::V p) {
  const typename I::V g = I::mul(load_gradient<I, kGrad>(grad, i), I::set1(a.grad_scale));
  return a.adamw ? g : I::add(I::mul(I::set1(a.weight_decay), p), g);  // L2: wd * p + g
}

// The Adam arithmetic of the lanes: the new moments m1, v1 and param p1 from param p,
// effective gradient g and the decoded moments m0, v0; p1 is p where the gradient term is not
// finite. Returns where it is finite.
template <class I>
inline typename I::M compact_adam_lanes(const CompactArgs& a, typename I::V p, typename I::V g,
                                        typename I::V m0, typename I::V v0, typename I::V& m1,
                                        typename I::V& v1, typename I::V& p1) {
  using V = typename I::V;
  const V g2 = I::mul(I::mul(I::set1(a.one_minus_beta2), g), g);
  // Non-finite gradient terms keep their param and moments. g2 is never below +0 (a product
  // of g with itself and 1 - beta2 >= 0), so being finite is being below +inf: one compare.
  const typename I::M ok = I::lt(g2, I::set1(__builtin_inff()));
  m1 = I::add(I::mul(I::set1(a.beta1), m0), I::mul(I::set1(a.one_minus_beta1), g));
  v1 = I::add(I::mul(I::set1(a.beta2), v0), g2);
  const V denom =
      I::add(I::mul(I::sqrt(v1), I::set1(a.rsqrt_bias_correction2)), I::set1(a.eps));
  const V update = I::div(m1, denom);
  const V decayed = a.adamw ? I::mul(p, I::set1(a.decay)) : p;
  p1 = I::select(ok, I::add(decayed, I::mul(I::set1(a.neg_step_size), update)), p);
  return ok;
}

template <class I, int kOut>
inline void store_out(void* out, int64_t i, typename I::V p1) {
  if constexpr (kOut == kLowpBf16) I::store_bf16(static_cast<uint16_t*>(out) + i, p1);
  if constexpr (kOut == kLowpFp16) I::store_fp16(static_cast<uint16_t*>(out) + i, p1);
  if constexpr (kOut == kOutFp32) I::store(static_cast<float*>(out) + i, p1);
}

// One update of the lanes at element i (j within its block, whose old scales are scale_m and
// scale_v): writes out (and, for a commit, the master) and, for a commit, the new moments into
// the block buffers and their magnitudes' bits into the running maxima. Returns how many lanes
// had a non-finite gradient term.
template <class I, int kGrad, int kOut, bool kCommit>
inline int update_lanes(const CompactArgs& a, const CompactTensors& t, int64_t i, int64_t j,
                        typename I::V scale_m, typename I::V scale_v, float* m_buf,
                        float* v_buf, typename I::VI& max_m, typename I::VI& max_v) {
  using V = typename I::V;
  const V p = I::load(t.master + i);
  const V g = compact_gradient<I, kGrad>(a, t.grad, i, p);
  const V m0 = decode<I, ExpAvgCode>(I::load_u8(t.exp_avg + i), scale_m);
  const V v0 = decode<I, ExpAvgSqCode>(I::load_u8(t.exp_avg_sq + i), scale_v);
  V m1, v1, p1;
  const typename I::M ok = compact_adam_lanes<I>(a, p, g, m0, v0, m1, v1, p1);
  store_out<I, kOut>(t.out, i, p1);
  if constexpr (kCommit) {
    I::store(t.master + i, p1);
    const V m = I::select(ok, m1, m0);
    const V v = I::select(ok, v1, v0);
    I::store(m_buf + j, m);
    I::store(v_buf + j, v);
    max_m = I::maxi(max_m, I::andi(I::bits(m), I::seti(0x7FFFFFFF)));
    max_v = I::maxi(max_v, I::andi(I::bits(v), I::seti(0x7FFFFFFF)));
  }
  return I::count_false(ok);
}

// The update of one block of len (<= kCompactBlock) elements from element `begin`; for a
// commit, its new moments into the buffers and its new scales (not yet stored) into
// scale_m/scale_v. Returns the non-finite count.
template <class I, int kGrad, int kOut, bool kCommit>
inline int64_t update_block(const CompactArgs& a, const CompactTensors& t, int64_t block,
                            int64_t begin, int64_t len, float* m_buf, float* v_buf,
                            float& scale_m, float& scale_v) {
  using VI = typename I::VI;
  const float old_m = t.exp_avg_scale[block];
  const float old_v = t.exp_avg_sq_scale[block];
  const int64_t lanes = I::lanes();
  int64_t skipped = 0;
  int64_t j = 0;
  VI max_m = I::seti(0), max_v = I::seti(0);
  for (; j + lanes <= len; j += lanes)
    skipped += update_lanes<I, kGrad, kOut, kCommit>(a, t, begin + j, j, I::set1(old_m),
                                                     I::set1(old_v), m_buf, v_buf, max_m, max_v);
  int32_t tail_m = I::reduce_maxi(max_m), tail_v = I::reduce_maxi(max_v);
  for (; j < len; ++j)
    skipped += update_lanes<ScalarIsa, kGrad, kOut, kCommit>(a, t, begin + j, j, old_m, old_v,
                                                             m_buf, v_buf, tail_m, tail_v);
  scale_m = ScalarIsa::from_bits(tail_m);
  scale_v = ScalarIsa::from_bits(tail_v);
  return skipped;
}

// One block of len (<= kCompactBlock) elements from element `begin`.
template <class I, int kGrad, int kOut, bool kCommit>
inline int64_t compact_block(const CompactArgs& a, const CompactTensors& t, int64_t block,
                             int64_t begin, int64_t len) {
  float m_buf[kCompactBlock];
  float v_buf[kCompactBlock];
  float scale_m, scale_v;
  const int64_t skipped = update_block<I, kGrad, kOut, kCommit>(a, t, block, begin, len, m_buf,
                                                                v_buf, scale_m, scale_v);
  if constexpr (kCommit) {
    t.exp_avg_scale[block] = scale_m;
    t.exp_avg_sq_scale[block] = scale_v;
    const uint32_t index = a.index_base + uint32_t(begin);
    uint8_t* codes_m = t.exp_avg + begin;
    uint8_t* codes_v = t.exp_avg_sq + begin;
    if (a.stochastic)
      encode_block<I, true>(a, m_buf, v_buf, len, scale_m, scale_v, codes_m, codes_v, index);
    else
      encode_block<I, false>(a, m_buf, v_buf, len, scale_m, scale_v, codes_m, codes_v, index);
  }
  return skipped;
}

template <class I, int kGrad, int kOut, bool kCommit>
int64_t compact_span_impl(const CompactArgs& a, const CompactTensors& t, int64_t n,
                          int64_t first_block, int64_t end_block) {
  int64_t skipped = 0;
  for (int64_t block = first_block; block < end_block; ++block) {
    const int64_t begin = block * kCompactBlock;
    const int64_t len = n - begin < kCompactBlock ? n - begin : kCompactBlock;
    skipped += compact_block<I, kGrad, kOut, kCommit>(a, t, block, begin, len);
  }
  return skipped;
}

// Turns the runtime (grad kind, out kind, commit) into one of the 24 instantiations.
template <class I, int kOut, bool kCommit>
int64_t compact_span_grad(const CompactArgs& a, const CompactTensors& t, int64_t n, int64_t b,
                          int64_t e) {
  switch (t.grad_kind) {
    case kLowpBf16: return compact_span_impl<I, kLowpBf16, kOut, kCommit>(a, t, n, b, e);
    case kLowpFp16: return compact_span_impl<I, kLowpFp16, kOut, kCommit>(a, t, n, b, e);
    default: return compact_span_impl<I, kLowpNone, kOut, kCommit>(a, t, n, b, e);
  }
}

template <class I, bool kCommit>
int64_t compact_span_out(const CompactArgs& a, const CompactTensors& t, int64_t n, int64_t b,
                         int64_t e) {
  switch (t.out_kind) {
    case kLowpBf16: return compact_span_grad<I, kLowpBf16, kCommit>(a, t, n, b, e);
    case kLowpFp16: return compact_span_grad<I, kLowpFp16, kCommit>(a, t, n, b, e);
    case kOutFp32: return compact_span_grad<I, kOutFp32, kCommit>(a, t, n, b, e);
    default: return compact_span_grad<I, kLowpNone, kCommit>(a, t, n, b, e);
  }
}

template <class I>
int64_t compact_span(const CompactArgs& a, const CompactTensors& t, int64_t n, int64_t b,
                     int64_t e) {
  return a.commit ? compact_span_out<I, true>(a, t, n, b, e)
                  : compact_span_out<I, false>(a, t, n, b, e);
}

}  // namespace
