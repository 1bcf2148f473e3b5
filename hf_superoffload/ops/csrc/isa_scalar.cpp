// Portable kernel: the reference for every vector path, and the choice where none applies.
#include "adam_math.h"

extern "C" int64_t hso_adam_span_scalar(int op, const AdamArgs* a, const AdamTensors* t,
                                        int64_t begin, int64_t end) {
  return adam_span<ScalarIsa>(op, *a, *t, begin, end);
}
