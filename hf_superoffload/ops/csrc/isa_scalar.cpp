// Portable kernel: the reference for every vector path, and the choice where none applies.
#include "adam_math.h"
#include "compact_fused_math.h"
#include "compact_math.h"

extern "C" int64_t hso_adam_span_scalar(int op, const AdamArgs* a, const AdamTensors* t,
                                        int64_t begin, int64_t end) {
  return adam_span<ScalarIsa>(op, *a, *t, begin, end);
}

extern "C" int64_t hso_compact_span_scalar(const CompactArgs* a, const CompactTensors* t,
                                           int64_t n, int64_t first_block, int64_t end_block) {
  return compact_span<ScalarIsa>(*a, *t, n, first_block, end_block);
}

extern "C" CompactCounts hso_compact_fused_span_scalar(const CompactFusedArgs* a,
                                                       const CompactFusedTensors* t, int64_t n,
                                                       int64_t first_block, int64_t end_block) {
  return compact_fused_span<ScalarIsa>(*a, *t, n, first_block, end_block);
}
