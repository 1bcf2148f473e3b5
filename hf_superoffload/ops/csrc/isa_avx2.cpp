// AVX2 + FMA + F16C kernel (x86-64), 8 lanes. Selected at run time by dispatch.cpp.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "adam_math.h"
#include "compact_fused_math.h"
#include "compact_math.h"

namespace {

struct Avx2Isa {
  using V = __m256;
  using M = __m256;  // all-ones lanes where true
  static constexpr int64_t lanes() { return 8; }
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V div(V a, V b) { return _mm256_div_ps(a, b); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static inline M finite(V x) {
    return _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_EQ_OQ);
  }
  static inline M gt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  // minps returns its second operand where either is NaN: a NaN x stays.
  static inline V clamp_max(V x, V limit) { return _mm256_min_ps(limit, x); }
  static inline V select(M m, V a, V b) { return _mm256_blendv_ps(b, a, m); }
  static inline int count_false(M m) { return 8 - __builtin_popcount(_mm256_movemask_ps(m)); }
  static inline V load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline V load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_bf16(uint16_t* out, V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Values are <= 0xFFFF, so the unsigned-saturating pack is exact.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
  }
  static inline void store_fp16(uint16_t* out, V x) {
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
  }

  // 32-bit integer lanes (compact_math.h).
  using VI = __m256i;
  static inline M lt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static inline VI seti(int32_t x) { return _mm256_set1_epi32(x); }
  static inline VI iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static inline VI bits(V x) { return _mm256_castps_si256(x); }
  static inline V from_bits(VI x) { return _mm256_castsi256_ps(x); }
  static inline VI addi(VI a, VI b) { return _mm256_add_epi32(a, b); }
  static inline VI muli(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
  static inline VI andi(VI a, VI b) { return _mm256_and_si256(a, b); }
  static inline VI ori(VI a, VI b) { return _mm256_or_si256(a, b); }
  static inline VI xori(VI a, VI b) { return _mm256_xor_si256(a, b); }
  template <int k>
  static inline VI shl(VI a) {
    return _mm256_slli_epi32(a, k);
  }
  template <int k>
  static inline VI shr(VI a) {
    return _mm256_srli_epi32(a, k);
  }
  template <int k>
  static inline VI sar(VI a) {
    return _mm256_srai_epi32(a, k);
  }
  static inline VI maxi(VI a, VI b) { return _mm256_max_epi32(a, b); }
  static inline int32_t reduce_maxi(VI a) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));  // lanes 2,3,0,1
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));  // lanes 1,0,3,2
    return _mm_cvtsi128_si32(m);
  }
  static inline M eqi(VI a, VI b) { return _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)); }
  static inline bool any(M m) { return _mm256_movemask_ps(m) != 0; }
  static inline VI selecti(M m, VI a, VI b) {
    return _mm256_blendv_epi8(b, a, _mm256_castps_si256(m));
  }
  static inline V to_float(VI a) { return _mm256_cvtepi32_ps(a); }
  static inline VI trunc_int(V x) { return _mm256_cvttps_epi32(x); }
  static inline VI load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_u8(uint8_t* p, VI x) {
    // Low bytes of the lanes: mask, then the unsigned-saturating packs are exact.
    const __m256i low = _mm256_and_si256(x, _mm256_set1_epi32(0xFF));
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
  }
};

}  // namespace

extern "C" int64_t hso_adam_span_avx2(int op, const AdamArgs* a, const AdamTensors* t,
                                      int64_t begin, int64_t end) {
  return adam_span<Avx2Isa>(op, *a, *t, begin, end);
}

extern "C" int64_t hso_compact_span_avx2(const CompactArgs* a, const CompactTensors* t,
                                         int64_t n, int64_t first_block, int64_t end_block) {
  return compact_span<Avx2Isa>(*a, *t, n, first_block, end_block);
}

extern "C" CompactCounts hso_compact_fused_span_avx2(const CompactFusedArgs* a,
                                                     const CompactFusedTensors* t, int64_t n,
                                                     int64_t first_block, int64_t end_block) {
  return compact_fused_span<Avx2Isa>(*a, *t, n, first_block, end_block);
}
#endif  // __x86_64__
