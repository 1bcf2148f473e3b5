// NEON kernel (aarch64 baseline, e.g. NVIDIA Grace), 4 lanes.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "adam_math.h"

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
};

}  // namespace

extern "C" int64_t hso_adam_span_neon(int op, const AdamArgs* a, const AdamTensors* t,
                                      int64_t begin, int64_t end) {
  return adam_span<NeonIsa>(op, *a, *t, begin, end);
}
#endif  // __aarch64__
