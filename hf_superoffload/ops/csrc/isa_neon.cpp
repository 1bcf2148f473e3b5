// NEON kernel (aarch64 baseline, e.g. NVIDIA Grace), 4 lanes.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "adam_math.h"
#include "compact_fused_math.h"
#include "compact_math.h"

namespace {

struct NeonIsa {
  using V = float32x4_t;
  using M = uint32x4_t;  // all-ones lanes where true
  static constexpr int64_t lanes() { return 4; }
  static inline V set1(float x) { return vdupq_n_f32(x); }
  static inline V load(const float* p) { return vld1q_f32(p); }
  static inline void store(float* p, V x) { vst1q_f32(p, x); }
  static inline V add(V a, V b) { return vaddq_f32(a, b); }
  static inline V sub(V a, V b) { return vsubq_f32(a, b); }
  static inline V mul(V a, V b) { return vmulq_f32(a, b); }
  static inline V div(V a, V b) { return vdivq_f32(a, b); }
  static inline V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static inline V sqrt(V a) { return vsqrtq_f32(a); }
  static inline M finite(V x) { return vceqq_f32(vsubq_f32(x, x), vdupq_n_f32(0.0f)); }
  static inline M gt(V a, V b) { return vcgtq_f32(a, b); }
  static inline V clamp_max(V x, V limit) { return vminq_f32(x, limit); }  // NaN stays
  static inline V select(M m, V a, V b) { return vbslq_f32(m, a, b); }
  static inline int count_false(M m) { return 4 - int(vaddvq_u32(vshrq_n_u32(m, 31))); }
  static inline V load_bf16(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
  static inline V load_fp16(const uint16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  static inline void store_bf16(uint16_t* out, V x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb), 16);
    r = vbslq_u32(vceqq_f32(x, x), r, vdupq_n_u32(0x7FC0));
    vst1_u16(out, vmovn_u32(r));
  }
  static inline void store_fp16(uint16_t* out, V x) {
    vst1_u16(out, vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }

  // 32-bit integer lanes (compact_math.h); wrapping arithmetic through the unsigned forms.
  using VI = int32x4_t;
  static inline M lt(V a, V b) { return vcltq_f32(a, b); }
  static inline VI seti(int32_t x) { return vdupq_n_s32(x); }
  static inline VI iota() {
    static const int32_t kIota[4] = {0, 1, 2, 3};
    return vld1q_s32(kIota);
  }
  static inline VI bits(V x) { return vreinterpretq_s32_f32(x); }
  static inline V from_bits(VI x) { return vreinterpretq_f32_s32(x); }
  static inline uint32x4_t u(VI x) { return vreinterpretq_u32_s32(x); }
  static inline VI s(uint32x4_t x) { return vreinterpretq_s32_u32(x); }
  static inline VI addi(VI a, VI b) { return s(vaddq_u32(u(a), u(b))); }
  static inline VI muli(VI a, VI b) { return s(vmulq_u32(u(a), u(b))); }
  static inline VI andi(VI a, VI b) { return vandq_s32(a, b); }
  static inline VI ori(VI a, VI b) { return vorrq_s32(a, b); }
  static inline VI xori(VI a, VI b) { return veorq_s32(a, b); }
  template <int k>
  static inline VI shl(VI a) {
    return s(vshlq_n_u32(u(a), k));
  }
  template <int k>
  static inline VI shr(VI a) {
    return s(vshrq_n_u32(u(a), k));
  }
  template <int k>
  static inline VI sar(VI a) {
    return vshrq_n_s32(a, k);
  }
  static inline VI maxi(VI a, VI b) { return vmaxq_s32(a, b); }
  static inline int32_t reduce_maxi(VI a) { return vmaxvq_s32(a); }
  static inline M eqi(VI a, VI b) { return vceqq_s32(a, b); }
  static inline bool any(M m) { return vmaxvq_u32(m) != 0; }
  static inline VI selecti(M m, VI a, VI b) { return vbslq_s32(m, a, b); }
  static inline V to_float(VI a) { return vcvtq_f32_s32(a); }
  static inline VI trunc_int(V x) { return vcvtq_s32_f32(x); }  // toward zero
  static inline VI load_u8(const uint8_t* p) {
    uint32_t word;
    __builtin_memcpy(&word, p, 4);
    const uint8x8_t bytes = vreinterpret_u8_u32(vdup_n_u32(word));
    return s(vmovl_u16(vget_low_u16(vmovl_u8(bytes))));
  }
  static inline void store_u8(uint8_t* p, VI x) {
    const uint16x4_t half = vmovn_u32(u(x));  // low 16, then low 8 bits of each lane
    const uint8x8_t bytes = vmovn_u16(vcombine_u16(half, half));
    const uint32_t word = vget_lane_u32(vreinterpret_u32_u8(bytes), 0);
    __builtin_memcpy(p, &word, 4);
  }
};

}  // namespace

extern "C" int64_t hso_adam_span_neon(int op, const AdamArgs* a, const AdamTensors* t,
                                      int64_t begin, int64_t end) {
  return adam_span<NeonIsa>(op, *a, *t, begin, end);
}

extern "C" int64_t hso_compact_span_neon(const CompactArgs* a, const CompactTensors* t,
                                         int64_t n, int64_t first_block, int64_t end_block) {
  return compact_span<NeonIsa>(*a, *t, n, first_block, end_block);
}

extern "C" CompactCounts hso_compact_fused_span_neon(const CompactFusedArgs* a,
                                                     const CompactFusedTensors* t, int64_t n,
                                                     int64_t first_block, int64_t end_block) {
  return compact_fused_span<NeonIsa>(*a, *t, n, first_block, end_block);
}
#endif  // __aarch64__
