// Standalone driver of the compact-state Adam kernels, built without torch so the aarch64 paths
// (NEON, SVE) can be cross-compiled and run under qemu-aarch64. tests/test_compact_kernel_cross.py
// writes the input file, runs this program, and compares its output bit for bit with the x86
// build.
//
// Input (little-endian): int64 n, int64 n_ops, then n_ops records of
//   {int32 grad_kind, int32 out_kind, CompactArgs}, then float32 master[n], the gradient as
//   float32[n], bf16 bits uint16[n] and fp16 bits uint16[n], then uint8 exp_avg[n],
//   float32 exp_avg_scale[blocks], uint8 exp_avg_sq[n], float32 exp_avg_sq_scale[blocks].
// Output: per op int64 non-finite count, then out[n] (2 or 4 bytes an element) if the op wrote
//   one; then the final master, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale.
// Usage: compact_check ISA IN OUT
#include <stdio.h>
#include <stdlib.h>

#include "compact_types.h"

namespace {

bool read_all(FILE* f, void* dst, size_t bytes) { return fread(dst, 1, bytes, f) == bytes; }

struct OpRecord {
  int32_t grad_kind;
  int32_t out_kind;
  CompactArgs args;
};

size_t out_bytes(int out_kind) { return out_kind == kOutFp32 ? 4 : out_kind ? 2 : 0; }

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
  const int64_t blocks = (n + kCompactBlock - 1) / kCompactBlock;
  OpRecord* ops = static_cast<OpRecord*>(malloc(sizeof(OpRecord) * n_ops));
  if (!read_all(in, ops, sizeof(OpRecord) * n_ops)) return 4;
  float* master = static_cast<float*>(malloc(4 * n));
  float* grad = static_cast<float*>(malloc(4 * n));
  uint16_t* grad_bf16 = static_cast<uint16_t*>(malloc(2 * n));
  uint16_t* grad_fp16 = static_cast<uint16_t*>(malloc(2 * n));
  uint8_t* exp_avg = static_cast<uint8_t*>(malloc(n));
  float* exp_avg_scale = static_cast<float*>(malloc(4 * blocks));
  uint8_t* exp_avg_sq = static_cast<uint8_t*>(malloc(n));
  float* exp_avg_sq_scale = static_cast<float*>(malloc(4 * blocks));
  void* out_buffer = malloc(4 * n);
  if (!read_all(in, master, 4 * n) || !read_all(in, grad, 4 * n) ||
      !read_all(in, grad_bf16, 2 * n) || !read_all(in, grad_fp16, 2 * n) ||
      !read_all(in, exp_avg, n) || !read_all(in, exp_avg_scale, 4 * blocks) ||
      !read_all(in, exp_avg_sq, n) || !read_all(in, exp_avg_sq_scale, 4 * blocks))
    return 4;
  fclose(in);

  FILE* out = fopen(argv[3], "wb");
  if (!out) return 5;
  for (int64_t k = 0; k < n_ops; ++k) {
    const int grad_kind = ops[k].grad_kind;
    const void* grad_data = grad_kind == kLowpBf16   ? static_cast<const void*>(grad_bf16)
                            : grad_kind == kLowpFp16 ? static_cast<const void*>(grad_fp16)
                                                     : static_cast<const void*>(grad);
    const size_t width = out_bytes(ops[k].out_kind);
    CompactTensors t{master,        grad_data,  grad_kind,        exp_avg,
                     exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, width ? out_buffer : nullptr,
                     ops[k].out_kind};
    const int64_t count = hso_compact_run(isa, &ops[k].args, &t, n, 2);
    fwrite(&count, 8, 1, out);
    if (width) fwrite(out_buffer, width, n, out);
  }
  fwrite(master, 4, n, out);
  fwrite(exp_avg, 1, n, out);
  fwrite(exp_avg_scale, 4, blocks, out);
  fwrite(exp_avg_sq, 1, n, out);
  fwrite(exp_avg_sq_scale, 4, blocks, out);
  fclose(out);
  printf("%s ok n=%lld ops=%lld\n", isa, static_cast<long long>(n), static_cast<long long>(n_ops));
  return 0;
}
