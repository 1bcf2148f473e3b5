// Runs the compact-state kernel of the chosen instruction set over OpenMP threads, which claim
// whole blocks (the scale of a block depends on all of its elements). Torch-free, so the same
// file builds into the aarch64 check program.
#include <omp.h>
#include <string.h>

#include "compact_types.h"

namespace {

// Below this many blocks (32K elements) a thread costs more than it saves.
constexpr int64_t kMinBlocksPerThread = 128;
// The unit threads claim, as the exact kernel's (dispatch.cpp): 64K elements.
constexpr int64_t kChunkBlocks = 256;

CompactSpanFn find_compact_kernel(const char* name) {
  if (!hso_isa_supported(name)) return nullptr;  // unknown, or not on this CPU
  if (strcmp(name, "scalar") == 0) return hso_compact_span_scalar;
#if defined(__x86_64__)
  if (strcmp(name, "avx512") == 0) return hso_compact_span_avx512;
  if (strcmp(name, "avx2") == 0) return hso_compact_span_avx2;
#elif defined(__aarch64__)
  if (strcmp(name, "neon") == 0) return hso_compact_span_neon;
  if (strcmp(name, "sve") == 0) return hso_compact_span_sve;
#endif
  return nullptr;
}

CompactFusedSpanFn find_compact_fused_kernel(const char* name) {
  if (!hso_isa_supported(name)) return nullptr;
  if (strcmp(name, "scalar") == 0) return hso_compact_fused_span_scalar;
#if defined(__x86_64__)
  if (strcmp(name, "avx512") == 0) return hso_compact_fused_span_avx512;
  if (strcmp(name, "avx2") == 0) return hso_compact_fused_span_avx2;
#elif defined(__aarch64__)
  if (strcmp(name, "neon") == 0) return hso_compact_fused_span_neon;
  if (strcmp(name, "sve") == 0) return hso_compact_fused_span_sve;
#endif
  return nullptr;
}

// Threads worth starting for `blocks` blocks, at most `threads`.
int thread_count(int64_t blocks, int threads) {
  int64_t max_useful = blocks / kMinBlocksPerThread;
  if (max_useful < 1) max_useful = 1;
  return threads < max_useful ? (threads < 1 ? 1 : threads) : int(max_useful);
}

}  // namespace

extern "C" int64_t hso_compact_run(const char* isa, const CompactArgs* args,
                                   const CompactTensors* tensors, int64_t n, int threads) {
  const CompactSpanFn kernel = find_compact_kernel(isa != nullptr ? isa : hso_best_isa());
  if (kernel == nullptr) return -1;
  const int64_t blocks = (n + kCompactBlock - 1) / kCompactBlock;
  const int nthreads = thread_count(blocks, threads);
  if (nthreads == 1) return kernel(args, tensors, n, 0, blocks);

  // Dynamic claims, as dispatch.cpp's: a thread that loses its core does fewer chunks.
  const int64_t chunks = (blocks + kChunkBlocks - 1) / kChunkBlocks;
  int64_t skipped = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(+ : skipped)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t first = chunk * kChunkBlocks;
    const int64_t end = first + kChunkBlocks < blocks ? first + kChunkBlocks : blocks;
    skipped += kernel(args, tensors, n, first, end);
  }
  return skipped;
}

extern "C" int hso_compact_fused_run(const char* isa, const CompactFusedArgs* args,
                                     const CompactFusedTensors* tensors, int64_t n, int threads,
                                     CompactCounts* counts) {
  const CompactFusedSpanFn kernel =
      find_compact_fused_kernel(isa != nullptr ? isa : hso_best_isa());
  if (kernel == nullptr) return -1;
  const int64_t blocks = (n + kCompactBlock - 1) / kCompactBlock;
  const int nthreads = thread_count(blocks, threads);
  if (nthreads == 1) {
    *counts = kernel(args, tensors, n, 0, blocks);
    return 0;
  }
  const int64_t chunks = (blocks + kChunkBlocks - 1) / kChunkBlocks;
  int64_t commit = 0, speculate = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) \
    reduction(+ : commit, speculate)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t first = chunk * kChunkBlocks;
    const int64_t end = first + kChunkBlocks < blocks ? first + kChunkBlocks : blocks;
    const CompactCounts part = kernel(args, tensors, n, first, end);
    commit += part.commit;
    speculate += part.speculate;
  }
  counts->commit = commit;
  counts->speculate = speculate;
  return 0;
}
