// AVX-512F kernel (x86-64), 16 lanes with mask registers. Selected at run time by dispatch.cpp.
#if defined(__x86_64__)
#pragma GCC target("avx512f,fma,f16c")
#include <immintrin.h>

#include "adam_math.h"
#include "compact_fused_math.h"
#include "compact_math.h"

namespace {

struct Avx512Isa {
  using V = __m512;
  using M = __mmask16;
  static constexpr int64_t lanes() { return 16; }
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V div(V a, V b) { return _mm512_div_ps(a, b); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static inline M finite(V x) {
    return _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_EQ_OQ);
  }
  static inline M gt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  // minps returns its second operand where either is NaN: a NaN x stays.
  static inline V clamp_max(V x, V limit) { return _mm512_min_ps(limit, x); }
  // blend(k, x, y) takes y where k is set.
  static inline V select(M m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }
  static inline int count_false(M m) { return 16 - __builtin_popcount(m); }
  static inline V load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline V load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void store_bf16(uint16_t* out, V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
  }
  static inline void store_fp16(uint16_t* out, V x) {
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  }

  // 32-bit integer lanes (compact_math.h).
  using VI = __m512i;
  static inline M lt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static inline VI seti(int32_t x) { return _mm512_set1_epi32(x); }
  static inline VI iota() {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  static inline VI bits(V x) { return _mm512_castps_si512(x); }
  static inline V from_bits(VI x) { return _mm512_castsi512_ps(x); }
  static inline VI addi(VI a, VI b) { return _mm512_add_epi32(a, b); }
  static inline VI muli(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
  static inline VI andi(VI a, VI b) { return _mm512_and_si512(a, b); }
  static inline VI ori(VI a, VI b) { return _mm512_or_si512(a, b); }
  static inline VI xori(VI a, VI b) { return _mm512_xor_si512(a, b); }
  template <int k>
  static inline VI shl(VI a) {
    return _mm512_slli_epi32(a, k);
  }
  template <int k>
  static inline VI shr(VI a) {
    return _mm512_srli_epi32(a, k);
  }
  template <int k>
  static inline VI sar(VI a) {
    return _mm512_srai_epi32(a, k);
  }
  static inline VI maxi(VI a, VI b) { return _mm512_max_epi32(a, b); }
  static inline int32_t reduce_maxi(VI a) { return _mm512_reduce_max_epi32(a); }
  static inline M eqi(VI a, VI b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static inline bool any(M m) { return m != 0; }
  static inline VI selecti(M m, VI a, VI b) { return _mm512_mask_blend_epi32(m, b, a); }
  static inline V to_float(VI a) { return _mm512_cvtepi32_ps(a); }
  static inline VI trunc_int(V x) { return _mm512_cvttps_epi32(x); }
  static inline VI load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_u8(uint8_t* p, VI x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));  // low bytes
  }
};

}  // namespace

extern "C" int64_t hso_adam_span_avx512(int op, const AdamArgs* a, const AdamTensors* t,
                                        int64_t begin, int64_t end) {
  return adam_span<Avx512Isa>(op, *a, *t, begin, end);
}

extern "C" int64_t hso_compact_span_avx512(const CompactArgs* a, const CompactTensors* t,
                                           int64_t n, int64_t first_block, int64_t end_block) {
  return compact_span<Avx512Isa>(*a, *t, n, first_block, end_block);
}

extern "C" CompactCounts hso_compact_fused_span_avx512(const CompactFusedArgs* a,
                                                       const CompactFusedTensors* t, int64_t n,
                                                       int64_t first_block, int64_t end_block) {
  return compact_fused_span<Avx512Isa>(*a, *t, n, first_block, end_block);
}
#endif  // __x86_64__
