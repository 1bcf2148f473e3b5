// The fused commit-and-speculate pass (compact_commit_speculate.compact_adam_commit_speculate): the
// commit of one step (compact_math.h's commit pass, with the pending gradient), then the
// speculative update of the next step (with the new gradient) from the just-committed state,
// one block at a time, so that master, codes, scales and both gradients cross memory once.
// The speculative half decodes the codes it has just encoded while they are still in
// registers (the low byte of each lane, what decode() reads back from memory), with the
// block's new scales. Instantiated by each isa_*.cpp file, like compact_math.h.
#pragma once

#include "compact_math.h"

namespace {

// The block's codes (stored) and, from them, the speculative update of the lanes at element
// i (j within the block, whose new scales are scale_m and scale_v, reciprocals rm and rv):
// writes out. Returns how many lanes had a non-finite gradient term.
template <class I, int kGrad, int kOut, bool kStochastic>
inline int encode_then_speculate(const CompactFusedArgs& a, const CompactFusedTensors& t,
                                 const float* m_buf, const float* v_buf, int64_t i, int64_t j,
                                 const BlockReciprocal& rm, const BlockReciprocal& rv,
                                 typename I::V scale_m, typename I::V scale_v,
                                 typename I::VI product) {
  using V = typename I::V;
  using VI = typename I::VI;
  VI code_m, code_v;
  encode_codes<I, kStochastic>(a.commit, m_buf, v_buf, j, rm, rv, product, code_m, code_v);
  I::store_u8(t.state.exp_avg + i, code_m);
  I::store_u8(t.state.exp_avg_sq + i, code_v);
  const VI low_byte = I::seti(0xFF);
  const V m0 = decode<I, ExpAvgCode>(I::andi(code_m, low_byte), scale_m);
  const V v0 = decode<I, ExpAvgSqCode>(I::andi(code_v, low_byte), scale_v);
  const V p = I::load(t.state.master + i);  // the committed param
  const V g = compact_gradient<I, kGrad>(a.speculate, t.grad_new, i, p);
  V m1, v1, p1;
  const typename I::M ok = compact_adam_lanes<I>(a.speculate, p, g, m0, v0, m1, v1, p1);
  store_out<I, kOut>(t.state.out, i, p1);
  return I::count_false(ok);
}

// One block of len (<= kCompactBlock) elements from element `begin`.
template <class I, int kGrad, int kOut, bool kStochastic>
inline void compact_fused_block(const CompactFusedArgs& a, const CompactFusedTensors& t,
                                int64_t block, int64_t begin, int64_t len,
                                CompactCounts& counts) {
  float m_buf[kCompactBlock];
  float v_buf[kCompactBlock];
  float scale_m, scale_v;
  counts.commit += update_block<I, kGrad, kLowpNone, true>(a.commit, t.state, block, begin, len,
                                                           m_buf, v_buf, scale_m, scale_v);
  t.state.exp_avg_scale[block] = scale_m;
  t.state.exp_avg_sq_scale[block] = scale_v;
  const BlockReciprocal rm = block_reciprocal(scale_m);
  const BlockReciprocal rv = block_reciprocal(scale_v);
  const uint32_t index = a.commit.index_base + uint32_t(begin);
  for_block_lanes<I>(index, len, [&](auto isa, int64_t j, auto product) {
    using J = decltype(isa);
    counts.speculate += encode_then_speculate<J, kGrad, kOut, kStochastic>(
        a, t, m_buf, v_buf, begin + j, j, rm, rv, J::set1(scale_m), J::set1(scale_v), product);
  });
  if (t.grad_keep != nullptr) {  // the new gradient becomes the pending one (just read: cached)
    const int64_t width = kGrad == kLowpNone ? 4 : 2;
    __builtin_memcpy(static_cast<char*>(t.grad_keep) + begin * width,
                     static_cast<const char*>(t.grad_new) + begin * width, len * width);
  }
}

template <class I, int kGrad, int kOut, bool kStochastic>
CompactCounts compact_fused_span_impl(const CompactFusedArgs& a, const CompactFusedTensors& t,
                                      int64_t n, int64_t first_block, int64_t end_block) {
  CompactCounts counts{0, 0};
  for (int64_t block = first_block; block < end_block; ++block) {
    const int64_t begin = block * kCompactBlock;
    const int64_t len = n - begin < kCompactBlock ? n - begin : kCompactBlock;
    compact_fused_block<I, kGrad, kOut, kStochastic>(a, t, block, begin, len, counts);
  }
  return counts;
}

// Turns the runtime (grad kind, out kind, rounding) into one of the 18 instantiations.
template <class I, int kOut, bool kStochastic>
CompactCounts compact_fused_span_grad(const CompactFusedArgs& a, const CompactFusedTensors& t,
                                      int64_t n, int64_t b, int64_t e) {
  switch (t.state.grad_kind) {
    case kLowpBf16: return compact_fused_span_impl<I, kLowpBf16, kOut, kStochastic>(a, t, n, b, e);
    case kLowpFp16: return compact_fused_span_impl<I, kLowpFp16, kOut, kStochastic>(a, t, n, b, e);
    default: return compact_fused_span_impl<I, kLowpNone, kOut, kStochastic>(a, t, n, b, e);
  }
}

template <class I, bool kStochastic>
CompactCounts compact_fused_span_out(const CompactFusedArgs& a, const CompactFusedTensors& t,
                                     int64_t n, int64_t b, int64_t e) {
  switch (t.state.out_kind) {
    case kLowpBf16: return compact_fused_span_grad<I, kLowpBf16, kStochastic>(a, t, n, b, e);
    case kLowpFp16: return compact_fused_span_grad<I, kLowpFp16, kStochastic>(a, t, n, b, e);
    default: return compact_fused_span_grad<I, kOutFp32, kStochastic>(a, t, n, b, e);
  }
}

template <class I>
CompactCounts compact_fused_span(const CompactFusedArgs& a, const CompactFusedTensors& t,
                                 int64_t n, int64_t b, int64_t e) {
  return a.commit.stochastic ? compact_fused_span_out<I, true>(a, t, n, b, e)
                             : compact_fused_span_out<I, false>(a, t, n, b, e);
}

}  // namespace
