// Standalone driver of the CPU Adam kernels, built without torch so the aarch64 paths (NEON,
// SVE) can be cross-compiled and run under qemu-aarch64. tests/test_cpu_adam_cross.py writes
// the input file, runs this program, and compares its output bit for bit with the x86 build.
//
// Input (little-endian): int64 n, int64 n_ops, then n_ops records of
//   {int32 op, int32 lowp_kind, int32 grad_kind, AdamArgs}, then float32 param[n], grad[n],
//   exp_avg[n], exp_avg_sq[n], then the same gradients as uint16 bf16[n] and fp16[n].
// Output: per op int64 skipped, then uint16 lowp[n] if the op wrote one; then the final
//   float32 param[n], exp_avg[n], exp_avg_sq[n].
// Usage: kernel_check ISA IN OUT
#include <stdio.h>
#include <stdlib.h>

#include "adam_types.h"

namespace {

bool read_all(FILE* f, void* dst, size_t bytes) { return fread(dst, 1, bytes, f) == bytes; }

struct OpRecord {
  int32_t op;
  int32_t lowp_kind;
  int32_t grad_kind;
  AdamArgs args;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s ISA IN OUT\n", argv[0]);
    return 2;
  }
  const char* isa = argv[1];
  if (!hso_isa_supported(isa)) {
    fprintf(stderr, "ISA %s not supported on this CPU (best: %s)\n", isa, hso_best_isa());
    return 3;
  }
  FILE* in = fopen(argv[2], "rb");
  int64_t n = 0, n_ops = 0;
  if (!in || !read_all(in, &n, 8) || !read_all(in, &n_ops, 8)) return 4;
  OpRecord* ops = static_cast<OpRecord*>(malloc(sizeof(OpRecord) * n_ops));
  if (!read_all(in, ops, sizeof(OpRecord) * n_ops)) return 4;
  float* param = static_cast<float*>(malloc(4 * n));
  float* grad = static_cast<float*>(malloc(4 * n));
  float* exp_avg = static_cast<float*>(malloc(4 * n));
  float* exp_avg_sq = static_cast<float*>(malloc(4 * n));
  uint16_t* lowp = static_cast<uint16_t*>(malloc(2 * n));
  uint16_t* grad_bf16 = static_cast<uint16_t*>(malloc(2 * n));
  uint16_t* grad_fp16 = static_cast<uint16_t*>(malloc(2 * n));
  if (!read_all(in, param, 4 * n) || !read_all(in, grad, 4 * n) ||
      !read_all(in, exp_avg, 4 * n) || !read_all(in, exp_avg_sq, 4 * n) ||
      !read_all(in, grad_bf16, 2 * n) || !read_all(in, grad_fp16, 2 * n))
    return 4;
  fclose(in);

  FILE* out = fopen(argv[3], "wb");
  if (!out) return 5;
  for (int64_t k = 0; k < n_ops; ++k) {
    const int grad_kind = ops[k].grad_kind;
    const void* grad_data = grad_kind == kLowpBf16   ? static_cast<const void*>(grad_bf16)
                            : grad_kind == kLowpFp16 ? static_cast<const void*>(grad_fp16)
                                                     : static_cast<const void*>(grad);
    AdamTensors t{param,      grad_data, grad_kind, exp_avg, exp_avg_sq,
                  ops[k].lowp_kind ? lowp : nullptr, ops[k].lowp_kind};
    const int64_t skipped = hso_adam_run(isa, ops[k].op, &ops[k].args, &t, n, 2);
    fwrite(&skipped, 8, 1, out);
    if (ops[k].lowp_kind) fwrite(lowp, 2, n, out);
  }
  fwrite(param, 4, n, out);
  fwrite(exp_avg, 4, n, out);
  fwrite(exp_avg_sq, 4, n, out);
  fclose(out);
  printf("%s ok n=%lld ops=%lld\n", isa, static_cast<long long>(n), static_cast<long long>(n_ops));
  return 0;
}
