// SVE kernel (aarch64, e.g. NVIDIA Grace's 128-bit SVE2), vector-length agnostic. Selected at
// run time by dispatch.cpp when the kernel reports HWCAP_SVE.
#if defined(__aarch64__)
#pragma GCC target("+sve")
#include <arm_sve.h>

#include "adam_math.h"
#include "compact_fused_math.h"
#include "compact_math.h"

namespace {

struct SveIsa {
  using V = svfloat32_t;
  using M = svbool_t;
  static inline int64_t lanes() { return int64_t(svcntw()); }
  static inline svbool_t all() { return svptrue_b32(); }
  static inline V set1(float x) { return svdup_n_f32(x); }
  static inline V load(const float* p) { return svld1_f32(all(), p); }
  static inline void store(float* p, V x) { svst1_f32(all(), p, x); }
  static inline V add(V a, V b) { return svadd_f32_x(all(), a, b); }
  static inline V sub(V a, V b) { return svsub_f32_x(all(), a, b); }
  static inline V mul(V a, V b) { return svmul_f32_x(all(), a, b); }
  static inline V div(V a, V b) { return svdiv_f32_x(all(), a, b); }
  static inline V fma(V a, V b, V c) { return svmla_f32_x(all(), c, a, b); }
  static inline V sqrt(V a) { return svsqrt_f32_x(all(), a); }
  static inline M finite(V x) { return svcmpeq_n_f32(all(), svsub_f32_x(all(), x, x), 0.0f); }
  static inline M gt(V a, V b) { return svcmpgt_f32(all(), a, b); }
  static inline V clamp_max(V x, V limit) { return svmin_f32_x(all(), x, limit); }  // NaN stays
  static inline V select(M m, V a, V b) { return svsel_f32(m, a, b); }
  static inline int count_false(M m) { return int(svcntw() - svcntp_b32(all(), m)); }
  static inline V load_bf16(const uint16_t* p) {
    return svreinterpret_f32_u32(svlsl_n_u32_x(all(), svld1uh_u32(all(), p), 16));
  }
  static inline V load_fp16(const uint16_t* p) {
    // Each fp16 lands in the low half of its 32-bit container, where the widening convert
    // reads it.
    return svcvt_f32_f16_x(all(), svreinterpret_f16_u32(svld1uh_u32(all(), p)));
  }
  static inline void store_bf16(uint16_t* out, V x) {
    const svuint32_t u = svreinterpret_u32_f32(x);
    const svuint32_t lsb = svand_n_u32_x(all(), svlsr_n_u32_x(all(), u, 16), 1);
    svuint32_t r = svadd_u32_x(all(), svadd_n_u32_x(all(), u, 0x7FFF), lsb);
    r = svlsr_n_u32_x(all(), r, 16);
    r = svsel_u32(svcmpuo_f32(all(), x, x), svdup_n_u32(0x7FC0), r);
    svst1h_u32(all(), out, r);  // stores the low 16 bits of each 32-bit lane
  }
  static inline void store_fp16(uint16_t* out, V x) {
    // The fp16 result sits in the low half of each 32-bit container.
    const svfloat16_t h = svcvt_f16_f32_x(all(), x);
    svst1h_u32(all(), out, svreinterpret_u32_f16(h));
  }

  // 32-bit integer lanes (compact_math.h).
  using VI = svint32_t;
  static inline M lt(V a, V b) { return svcmplt_f32(all(), a, b); }
  static inline VI seti(int32_t x) { return svdup_n_s32(x); }
  static inline VI iota() { return svindex_s32(0, 1); }
  static inline VI bits(V x) { return svreinterpret_s32_f32(x); }
  static inline V from_bits(VI x) { return svreinterpret_f32_s32(x); }
  static inline svuint32_t u(VI x) { return svreinterpret_u32_s32(x); }
  static inline VI s(svuint32_t x) { return svreinterpret_s32_u32(x); }
  static inline VI addi(VI a, VI b) { return s(svadd_u32_x(all(), u(a), u(b))); }
  static inline VI muli(VI a, VI b) { return s(svmul_u32_x(all(), u(a), u(b))); }
  static inline VI andi(VI a, VI b) { return svand_s32_x(all(), a, b); }
  static inline VI ori(VI a, VI b) { return svorr_s32_x(all(), a, b); }
  static inline VI xori(VI a, VI b) { return sveor_s32_x(all(), a, b); }
  template <int k>
  static inline VI shl(VI a) {
    return s(svlsl_n_u32_x(all(), u(a), k));
  }
  template <int k>
  static inline VI shr(VI a) {
    return s(svlsr_n_u32_x(all(), u(a), k));
  }
  template <int k>
  static inline VI sar(VI a) {
    return svasr_n_s32_x(all(), a, k);
  }
  static inline VI maxi(VI a, VI b) { return svmax_s32_x(all(), a, b); }
  static inline int32_t reduce_maxi(VI a) { return svmaxv_s32(all(), a); }
  static inline M eqi(VI a, VI b) { return svcmpeq_s32(all(), a, b); }
  static inline bool any(M m) { return svptest_any(all(), m); }
  static inline VI selecti(M m, VI a, VI b) { return svsel_s32(m, a, b); }
  static inline V to_float(VI a) { return svcvt_f32_s32_x(all(), a); }
  static inline VI trunc_int(V x) { return svcvt_s32_f32_x(all(), x); }  // toward zero
  static inline VI load_u8(const uint8_t* p) { return s(svld1ub_u32(all(), p)); }
  static inline void store_u8(uint8_t* p, VI x) {
    svst1b_s32(all(), reinterpret_cast<int8_t*>(p), x);  // the low byte of each lane
  }
};

}  // namespace

extern "C" int64_t hso_adam_span_sve(int op, const AdamArgs* a, const AdamTensors* t,
                                     int64_t begin, int64_t end) {
  return adam_span<SveIsa>(op, *a, *t, begin, end);
}

extern "C" int64_t hso_compact_span_sve(const CompactArgs* a, const CompactTensors* t,
                                        int64_t n, int64_t first_block, int64_t end_block) {
  return compact_span<SveIsa>(*a, *t, n, first_block, end_block);
}

extern "C" CompactCounts hso_compact_fused_span_sve(const CompactFusedArgs* a,
                                                    const CompactFusedTensors* t, int64_t n,
                                                    int64_t first_block, int64_t end_block) {
  return compact_fused_span<SveIsa>(*a, *t, n, first_block, end_block);
}
#endif  // __aarch64__
