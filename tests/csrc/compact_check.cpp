// Standalone driver of the compact-state Adam kernels, built without torch so the aarch64 paths
// (NEON, SVE) can be cross-compiled and run under qemu-aarch64. tests/test_compact_kernel_cross.py
// writes the input file, runs this program, and compares its output bit for bit with the x86
// build.
//
// Input (little-endian): int64 n, int64 n_ops, int64 n_fused, then n_ops records of
//   {int32 grad_kind, int32 out_kind, CompactArgs}, n_fused records of {int32 grad_kind,
//   int32 out_kind, int32 keep_new_grad, CompactArgs commit, CompactArgs speculate}, then
//   float32 master[n], the gradient as float32[n], bf16 bits uint16[n] and fp16 bits
//   uint16[n], the new gradient (the fused ops') likewise, then uint8 exp_avg[n],
//   float32 exp_avg_scale[blocks], uint8 exp_avg_sq[n], float32 exp_avg_sq_scale[blocks].
// The plain ops run first (hso_compact_run), then the fused ones (hso_compact_fused_run),
//   whose pending gradient is the gradient buffer of their kind (which keep_new_grad changes).
// Output: per op int64 non-finite count, then out[n] (2 or 4 bytes an element) if the op wrote
//   one; per fused op both counts, out[n], then its pending gradient buffer; then the final
//   master, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale.
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

struct FusedRecord {
  int32_t grad_kind;
  int32_t out_kind;
  int32_t keep_new_grad;
  CompactArgs commit;
  CompactArgs speculate;
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
  int64_t n = 0, n_ops = 0, n_fused = 0;
  if (!in || !read_all(in, &n, 8) || !read_all(in, &n_ops, 8) || !read_all(in, &n_fused, 8))
    return 4;
  const int64_t blocks = (n + kCompactBlock - 1) / kCompactBlock;
  OpRecord* ops = static_cast<OpRecord*>(malloc(sizeof(OpRecord) * n_ops));
  if (!read_all(in, ops, sizeof(OpRecord) * n_ops)) return 4;
  FusedRecord* fused = static_cast<FusedRecord*>(malloc(sizeof(FusedRecord) * n_fused));
  if (!read_all(in, fused, sizeof(FusedRecord) * n_fused)) return 4;
  float* master = static_cast<float*>(malloc(4 * n));
  float* grad = static_cast<float*>(malloc(4 * n));
  uint16_t* grad_bf16 = static_cast<uint16_t*>(malloc(2 * n));
  uint16_t* grad_fp16 = static_cast<uint16_t*>(malloc(2 * n));
  float* new_grad = static_cast<float*>(malloc(4 * n));
  uint16_t* new_grad_bf16 = static_cast<uint16_t*>(malloc(2 * n));
  uint16_t* new_grad_fp16 = static_cast<uint16_t*>(malloc(2 * n));
  uint8_t* exp_avg = static_cast<uint8_t*>(malloc(n));
  float* exp_avg_scale = static_cast<float*>(malloc(4 * blocks));
  uint8_t* exp_avg_sq = static_cast<uint8_t*>(malloc(n));
  float* exp_avg_sq_scale = static_cast<float*>(malloc(4 * blocks));
  void* out_buffer = malloc(4 * n);
  if (!read_all(in, master, 4 * n) || !read_all(in, grad, 4 * n) ||
      !read_all(in, grad_bf16, 2 * n) || !read_all(in, grad_fp16, 2 * n) ||
      !read_all(in, new_grad, 4 * n) || !read_all(in, new_grad_bf16, 2 * n) ||
      !read_all(in, new_grad_fp16, 2 * n) ||
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
  for (int64_t k = 0; k < n_fused; ++k) {
    const int grad_kind = fused[k].grad_kind;
    void* pending = grad_kind == kLowpBf16   ? static_cast<void*>(grad_bf16)
                    : grad_kind == kLowpFp16 ? static_cast<void*>(grad_fp16)
                                             : static_cast<void*>(grad);
    const void* fresh = grad_kind == kLowpBf16   ? static_cast<const void*>(new_grad_bf16)
                        : grad_kind == kLowpFp16 ? static_cast<const void*>(new_grad_fp16)
                                                 : static_cast<const void*>(new_grad);
    const CompactFusedArgs args{fused[k].commit, fused[k].speculate};
    const CompactFusedTensors t{
        CompactTensors{master, pending, grad_kind, exp_avg, exp_avg_scale, exp_avg_sq,
                       exp_avg_sq_scale, out_buffer, fused[k].out_kind},
        fresh, fused[k].keep_new_grad ? pending : nullptr};
    CompactCounts counts{0, 0};
    if (hso_compact_fused_run(isa, &args, &t, n, 2, &counts) != 0) return 6;
    fwrite(&counts.commit, 8, 1, out);
    fwrite(&counts.speculate, 8, 1, out);
    fwrite(out_buffer, out_bytes(fused[k].out_kind), n, out);
    const bool half = grad_kind == kLowpBf16 || grad_kind == kLowpFp16;  // else fp32
    fwrite(pending, half ? 2 : 4, n, out);
  }
  fwrite(master, 4, n, out);
  fwrite(exp_avg, 1, n, out);
  fwrite(exp_avg_scale, 4, blocks, out);
  fwrite(exp_avg_sq, 1, n, out);
  fwrite(exp_avg_sq_scale, 4, blocks, out);
  fclose(out);
  printf("%s ok n=%lld ops=%lld fused=%lld\n", isa, static_cast<long long>(n),
         static_cast<long long>(n_ops), static_cast<long long>(n_fused));
  return 0;
}
