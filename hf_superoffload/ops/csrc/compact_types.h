// Plain-C types of the compact-state Adam (both moments as 8-bit codes with one fp32 scale per
// block of kCompactBlock elements), shared by the kernels, their dispatcher, the torch binding
// and the standalone aarch64 check program. No torch and no standard-library templates here.
#pragma once

#include <stdint.h>

#include "adam_types.h"

enum { kCompactBlock = 256 };
// Formats of out_lowp beyond adam_types.h's kLowpNone/kLowpBf16/kLowpFp16: an fp32 copy.
enum { kOutFp32 = 3 };

// Per-call constants: the fp32 roundings of the reference's constants (compact_adamw.py),
// each derived in double by the caller exactly as the reference derives it.
struct CompactArgs {
  float grad_scale;
  float weight_decay;  // L2 Adam only
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float rsqrt_bias_correction2;  // 1 / sqrt(1 - beta2^step)
  float eps;
  float decay;           // 1 - lr * weight_decay (AdamW only)
  float neg_step_size;   // -lr / (1 - beta1^step)
  uint32_t key_exp_avg;  // rounding-bit keys of the two moments (CompactFormat.key)
  uint32_t key_exp_avg_sq;
  uint32_t index_base;  // element_offset mod 2^32: the rounding bits' index of element 0
  int32_t adamw;
  int32_t stochastic;
  int32_t commit;  // 0: speculative (only out is written)
};

struct CompactTensors {
  float* master;
  const void* grad;  // fp32, or bf16/fp16 bits per grad_kind
  int32_t grad_kind;
  uint8_t* exp_avg;
  float* exp_avg_scale;
  uint8_t* exp_avg_sq;
  float* exp_avg_sq_scale;
  void* out;  // bf16/fp16 bits or fp32 per out_kind, or null (kLowpNone)
  int32_t out_kind;
};

// One instruction set's kernel over the blocks [first_block, end_block) of n elements. Returns
// how many elements had a non-finite gradient term.
typedef int64_t (*CompactSpanFn)(const CompactArgs* args, const CompactTensors* tensors,
                                 int64_t n, int64_t first_block, int64_t end_block);

// The fused pass (compact_commit_speculate.compact_adam_commit_speculate): the commit of one step, then
// the speculative update of the next from the committed state, one block at a time.
struct CompactFusedArgs {
  CompactArgs commit;     // the committed step's constants (its commit field unused)
  CompactArgs speculate;  // the speculative step's (its keys unused: it encodes nothing)
};

struct CompactFusedTensors {
  CompactTensors state;  // grad: the pending gradient (the commit's); out: required
  const void* grad_new;  // the next step's gradient, of state.grad_kind
  void* grad_keep;       // where grad_new is copied (the pending gradient's buffer), or null
};

// Non-finite gradient terms of each half.
struct CompactCounts {
  int64_t commit;
  int64_t speculate;
};

typedef CompactCounts (*CompactFusedSpanFn)(const CompactFusedArgs* args,
                                            const CompactFusedTensors* tensors, int64_t n,
                                            int64_t first_block, int64_t end_block);

extern "C" {
int64_t hso_compact_span_scalar(const CompactArgs*, const CompactTensors*, int64_t, int64_t,
                                int64_t);
int64_t hso_compact_span_avx2(const CompactArgs*, const CompactTensors*, int64_t, int64_t,
                              int64_t);
int64_t hso_compact_span_avx512(const CompactArgs*, const CompactTensors*, int64_t, int64_t,
                                int64_t);
int64_t hso_compact_span_neon(const CompactArgs*, const CompactTensors*, int64_t, int64_t,
                              int64_t);
int64_t hso_compact_span_sve(const CompactArgs*, const CompactTensors*, int64_t, int64_t,
                             int64_t);
CompactCounts hso_compact_fused_span_scalar(const CompactFusedArgs*, const CompactFusedTensors*,
                                            int64_t, int64_t, int64_t);
CompactCounts hso_compact_fused_span_avx2(const CompactFusedArgs*, const CompactFusedTensors*,
                                          int64_t, int64_t, int64_t);
CompactCounts hso_compact_fused_span_avx512(const CompactFusedArgs*, const CompactFusedTensors*,
                                            int64_t, int64_t, int64_t);
CompactCounts hso_compact_fused_span_neon(const CompactFusedArgs*, const CompactFusedTensors*,
                                          int64_t, int64_t, int64_t);
CompactCounts hso_compact_fused_span_sve(const CompactFusedArgs*, const CompactFusedTensors*,
                                         int64_t, int64_t, int64_t);

// Dispatcher (compact_dispatch.cpp): the kernel of `isa` (null: the best supported, as
// hso_best_isa) over n elements on up to `threads` OpenMP threads, which split the range on
// block boundaries. Returns the non-finite count, or -1 if `isa` is unknown/unsupported.
int64_t hso_compact_run(const char* isa, const CompactArgs* args, const CompactTensors* tensors,
                        int64_t n, int threads);
// The fused pass, threaded as hso_compact_run; both counts into `counts`. Returns 0, or -1 if
// `isa` is unknown/unsupported.
int hso_compact_fused_run(const char* isa, const CompactFusedArgs* args,
                          const CompactFusedTensors* tensors, int64_t n, int threads,
                          CompactCounts* counts);
}
