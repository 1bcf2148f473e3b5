// Plain-C types shared by the kernels, the dispatcher, the torch binding and the standalone
// aarch64 check program. No torch and no standard-library templates here (see adam_math.h).
#pragma once

#include <stdint.h>

enum { kOpStep = 0, kOpRollback = 1, kOpReplay = 2 };
// 16-bit formats of out_lowp, and of the gradient (kLowpNone there means fp32).
enum { kLowpNone = 0, kLowpBf16 = 1, kLowpFp16 = 2 };

// Per-call constants, derived in double precision by the caller and rounded to fp32 once.
struct AdamArgs {
  float step_size;               // lr / (1 - beta1^step), or lr without bias correction
  float rsqrt_bias_correction2;  // 1 / sqrt(1 - beta2^step), or 1
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float eps;
  float weight_decay;
  float decay;  // 1 - lr * weight_decay (AdamW), unused for Adam
  float grad_scale;      // step/rollback scale; the old scale for replay
  float new_grad_scale;  // replay only
  int adamw;
};

struct AdamTensors {
  float* param;
  const void* grad;  // fp32, or bf16/fp16 bits (upcast exactly per element) per grad_kind
  int grad_kind;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* out_lowp;  // bf16/fp16 bits, or null
  int lowp_kind;
};

// One instruction set's kernel over elements [begin, end). Returns how many elements were
// skipped because their gradient term was not finite.
typedef int64_t (*AdamSpanFn)(int op, const AdamArgs* args, const AdamTensors* tensors,
                              int64_t begin, int64_t end);

extern "C" {
int64_t hso_adam_span_scalar(int op, const AdamArgs*, const AdamTensors*, int64_t, int64_t);
int64_t hso_adam_span_avx2(int op, const AdamArgs*, const AdamTensors*, int64_t, int64_t);
int64_t hso_adam_span_avx512(int op, const AdamArgs*, const AdamTensors*, int64_t, int64_t);
int64_t hso_adam_span_neon(int op, const AdamArgs*, const AdamTensors*, int64_t, int64_t);
int64_t hso_adam_span_sve(int op, const AdamArgs*, const AdamTensors*, int64_t, int64_t);

// Dispatcher (dispatch.cpp). ISA names: "scalar", "avx2", "avx512", "neon", "sve".
const char* hso_best_isa(void);
int hso_isa_supported(const char* name);
// Runs the kernel of `isa` (null: the best supported) over n elements on up to `threads`
// OpenMP threads. Returns the skipped-element count, or -1 if `isa` is unknown/unsupported.
int64_t hso_adam_run(const char* isa, int op, const AdamArgs* args, const AdamTensors* tensors,
                     int64_t n, int threads);
}
