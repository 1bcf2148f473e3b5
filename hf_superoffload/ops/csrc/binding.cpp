// Torch binding of the CPU Adam kernels: argument checks, then the GIL-free dispatcher.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "adam_types.h"
#include "compact_types.h"

namespace {

void check_buffer(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device(),
                    "; keep optimizer state in host memory (e.g. tensor.cpu()).");
  TORCH_CHECK_VALUE(t.is_contiguous(), name,
                    " must be contiguous; pass tensor.contiguous() or a flat buffer view.");
  TORCH_CHECK_VALUE(t.numel() == numel, name, " has ", t.numel(),
                    " elements but param has ", numel, "; all four tensors must match.");
}

void check_fp32_buffer(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ",
                   t.scalar_type(), "; the master copy is fp32 (use tensor.float()).");
  check_buffer(t, name, numel);
}

int lowp_kind(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? kLowpBf16
         : t.scalar_type() == at::kHalf   ? kLowpFp16
                                          : kLowpNone;
}

int64_t adam_apply(int64_t op, const std::string& isa, at::Tensor param, at::Tensor grad,
                   at::Tensor exp_avg, at::Tensor exp_avg_sq,
                   const std::optional<at::Tensor>& out_lowp, double step_size,
                   double rsqrt_bias_correction2, double beta1, double beta2, double eps,
                   double weight_decay, double decay, double grad_scale, double new_grad_scale,
                   bool adamw, int64_t threads) {
  const int64_t n = param.numel();
  check_fp32_buffer(param, "param", n);
  TORCH_CHECK_TYPE(grad.scalar_type() == at::kFloat || lowp_kind(grad) != kLowpNone,
                   "grad must be float32, bfloat16 or float16, got ", grad.scalar_type(), ".");
  check_buffer(grad, "grad", n);
  check_fp32_buffer(exp_avg, "exp_avg", n);
  check_fp32_buffer(exp_avg_sq, "exp_avg_sq", n);

  AdamTensors tensors{param.data_ptr<float>(),  grad.data_ptr(),   lowp_kind(grad),
                      exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), nullptr,
                      kLowpNone};
  if (out_lowp.has_value()) {
    const at::Tensor& low = *out_lowp;
    TORCH_CHECK_VALUE(low.device().is_cpu(), "out_lowp must be a CPU tensor (pinned is fine), ",
                      "got one on ", low.device(), ".");
    TORCH_CHECK_TYPE(lowp_kind(low) != kLowpNone, "out_lowp must be bfloat16 or float16, got ",
                     low.scalar_type(), ".");
    TORCH_CHECK_VALUE(low.is_contiguous(), "out_lowp must be contiguous.");
    TORCH_CHECK_VALUE(low.numel() == n, "out_lowp has ", low.numel(),
                      " elements but param has ", n, ".");
    tensors.out_lowp = static_cast<uint16_t*>(low.data_ptr());
    tensors.lowp_kind = lowp_kind(low);
  }

  const AdamArgs args{float(step_size),    float(rsqrt_bias_correction2),
                      float(beta1),        float(beta2),
                      float(1.0 - beta1),  float(1.0 - beta2),
                      float(eps),          float(weight_decay),
                      float(decay),        float(grad_scale),
                      float(new_grad_scale), adamw ? 1 : 0};
  int64_t skipped;
  {
    pybind11::gil_scoped_release no_gil;
    skipped = hso_adam_run(isa.empty() ? nullptr : isa.c_str(), int(op), &args, &tensors, n,
                           int(threads));
  }
  TORCH_CHECK_VALUE(skipped >= 0, "instruction set '", isa,
                    "' is unknown or not supported by this CPU; see available_isas().");
  return skipped;
}

// `what`: the dtype's name and what the tensor holds, for the error.
void check_flat(const at::Tensor& t, const char* name, at::ScalarType dtype, const char* what,
                int64_t numel, const char* numel_of) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device(),
                    "; the compact state lives in host memory (e.g. tensor.cpu()).");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", what, ", got ", t.scalar_type(),
                   ".");
  TORCH_CHECK_VALUE(t.is_contiguous(), name,
                    " must be contiguous; pass tensor.contiguous() or a flat buffer view.");
  TORCH_CHECK_VALUE(t.numel() == numel, name, " has ", t.numel(), " elements but ", numel_of,
                    " ", numel, ".");
}

// The master weights (fp32) and a gradient of as many elements (fp32, bf16 or fp16) named
// `grad_name`: returns their element count.
int64_t check_master_and_grad(const at::Tensor& master, const at::Tensor& grad,
                              const char* grad_name) {
  const int64_t n = master.numel();
  check_flat(master, "master", at::kFloat, "float32 (the master weights; use tensor.float())", n,
             "master has");
  TORCH_CHECK_TYPE(grad.scalar_type() == at::kFloat || lowp_kind(grad) != kLowpNone, grad_name,
                   " must be float32, bfloat16 or float16, got ", grad.scalar_type(), ".");
  check_flat(grad, grad_name, grad.scalar_type(), "", n, "master has");
  return n;
}

// Both moments' codes of n elements, one uint8 an element.
void check_codes(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t n) {
  const char* codes = "uint8 (8-bit codes, as CompactMoments holds them)";
  check_flat(exp_avg, "exp_avg", at::kByte, codes, n, "master has");
  check_flat(exp_avg_sq, "exp_avg_sq", at::kByte, codes, n, "master has");
}

// The four compact state tensors of a master of n elements: both moments' codes, one uint8 an
// element, and their scales, one float32 a block of kCompactBlock elements.
void check_compact_state(const at::Tensor& exp_avg, const at::Tensor& exp_avg_scale,
                         const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_sq_scale,
                         int64_t n) {
  static_assert(kCompactBlock == 256, "the messages below name blocks of 256 elements");
  const int64_t blocks = (n + kCompactBlock - 1) / kCompactBlock;
  check_codes(exp_avg, exp_avg_sq, n);
  const char* scales = "float32 (one scale per block of 256 elements)";
  check_flat(exp_avg_scale, "exp_avg_scale", at::kFloat, scales, blocks,
             "master's blocks of 256 number");
  check_flat(exp_avg_sq_scale, "exp_avg_sq_scale", at::kFloat, scales, blocks,
             "master's blocks of 256 number");
}

// One compact_adam_pass (compact_adamw.py) over flat CPU tensors; the Python side
// (compact.py) checks the scalars and derives the constants.
int64_t compact_apply(const std::string& isa, at::Tensor master, at::Tensor grad,
                      at::Tensor exp_avg, at::Tensor exp_avg_scale, at::Tensor exp_avg_sq,
                      at::Tensor exp_avg_sq_scale, const std::optional<at::Tensor>& out_lowp,
                      double grad_scale, double weight_decay, double beta1,
                      double one_minus_beta1, double beta2, double one_minus_beta2,
                      double rsqrt_bias_correction2, double eps, double decay,
                      double neg_step_size, int64_t key_exp_avg, int64_t key_exp_avg_sq,
                      int64_t index_base, bool adamw, bool stochastic, bool commit,
                      int64_t threads) {
  const int64_t n = check_master_and_grad(master, grad, "grad");
  check_compact_state(exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, n);
  CompactTensors tensors{master.data_ptr<float>(),
                         grad.data_ptr(),
                         lowp_kind(grad),
                         exp_avg.data_ptr<uint8_t>(),
                         exp_avg_scale.data_ptr<float>(),
                         exp_avg_sq.data_ptr<uint8_t>(),
                         exp_avg_sq_scale.data_ptr<float>(),
                         nullptr,
                         kLowpNone};
  if (out_lowp.has_value()) {
    const at::Tensor& out = *out_lowp;
    const bool fp32 = out.scalar_type() == at::kFloat;
    TORCH_CHECK_TYPE(fp32 || lowp_kind(out) != kLowpNone,
                     "out_lowp must be bfloat16, float16 or float32, got ", out.scalar_type(),
                     ".");
    check_flat(out, "out_lowp", out.scalar_type(), "", n, "master has");
    tensors.out = out.data_ptr();
    tensors.out_kind = fp32 ? kOutFp32 : lowp_kind(out);
  }
  TORCH_CHECK_VALUE(commit || out_lowp.has_value(),
                    "a speculative pass (commit=False) writes only out_lowp: pass one.");
  const CompactArgs args{float(grad_scale),
                         float(weight_decay),
                         float(beta1),
                         float(one_minus_beta1),
                         float(beta2),
                         float(one_minus_beta2),
                         float(rsqrt_bias_correction2),
                         float(eps),
                         float(decay),
                         float(neg_step_size),
                         uint32_t(key_exp_avg),
                         uint32_t(key_exp_avg_sq),
                         uint32_t(index_base),
                         adamw ? 1 : 0,
                         stochastic ? 1 : 0,
                         commit ? 1 : 0};
  int64_t skipped;
  {
    pybind11::gil_scoped_release no_gil;
    skipped = hso_compact_run(isa.empty() ? nullptr : isa.c_str(), &args, &tensors, n,
                              int(threads));
  }
  TORCH_CHECK_VALUE(skipped >= 0, "instruction set '", isa,
                    "' is unknown or not supported by this CPU; see available_isas().");
  return skipped;
}

// compact_adam_pieces (compact_pieces.py): the commit of several pieces of one partition's flat
// CPU tensors in one call, the GIL released once. `pieces` (int64, [k, 4]) holds each piece's
// first element, elements, first block among the scales and rounding index base; `constants`
// (float64, [k, 12]) its twelve constants as compact.py's constants() derives them.
// compact_pieces.py checks every piece's bounds first; the checks here keep memory safe.
int64_t compact_apply_pieces(const std::string& isa, at::Tensor master, at::Tensor grad,
                             at::Tensor exp_avg, at::Tensor exp_avg_scale, at::Tensor exp_avg_sq,
                             at::Tensor exp_avg_sq_scale, at::Tensor pieces,
                             at::Tensor constants, bool adamw, bool stochastic,
                             int64_t threads) {
  const int64_t n = check_master_and_grad(master, grad, "grad");
  check_codes(exp_avg, exp_avg_sq, n);
  const int64_t blocks = exp_avg_scale.numel();
  const char* scales = "float32 (one scale per block of 256 elements)";
  check_flat(exp_avg_scale, "exp_avg_scale", at::kFloat, scales, blocks, "exp_avg_scale has");
  check_flat(exp_avg_sq_scale, "exp_avg_sq_scale", at::kFloat, scales, blocks,
             "exp_avg_scale has");
  TORCH_CHECK_TYPE(pieces.scalar_type() == at::kLong && pieces.dim() == 2 &&
                       pieces.size(1) == 4 && pieces.is_contiguous() && pieces.device().is_cpu(),
                   "pieces must be a contiguous CPU int64 tensor of shape [k, 4].");
  const int64_t k = pieces.size(0);
  TORCH_CHECK_TYPE(constants.scalar_type() == at::kDouble && constants.dim() == 2 &&
                       constants.size(0) == k && constants.size(1) == 12 &&
                       constants.is_contiguous() && constants.device().is_cpu(),
                   "constants must be a contiguous CPU float64 tensor of shape [k, 12].");
  const int64_t* rows = pieces.data_ptr<int64_t>();
  const double* c = constants.data_ptr<double>();
  for (int64_t i = 0; i < k; ++i) {
    const int64_t at = rows[4 * i], numel = rows[4 * i + 1], first_block = rows[4 * i + 2];
    // Written so that no sum can overflow, whatever the rows hold.
    TORCH_CHECK_VALUE(at >= 0 && at <= n && numel >= 0 && numel <= n - at && first_block >= 0 &&
                          first_block <= blocks &&
                          numel / kCompactBlock + (numel % kCompactBlock != 0) <=
                              blocks - first_block,
                      "a piece lies outside the tensors.");
  }
  char* grad_bytes = static_cast<char*>(grad.data_ptr());
  const int64_t grad_size = grad.element_size();
  const char* chosen = isa.empty() ? nullptr : isa.c_str();
  int64_t skipped = 0;
  bool known = true;
  {
    pybind11::gil_scoped_release no_gil;
    for (int64_t i = 0; i < k && known; ++i) {
      const int64_t at = rows[4 * i], numel = rows[4 * i + 1], first_block = rows[4 * i + 2];
      const double* row = c + 12 * i;
      const CompactArgs args{float(row[0]), float(row[1]), float(row[2]), float(row[3]),
                             float(row[4]), float(row[5]), float(row[6]), float(row[7]),
                             float(row[8]), float(row[9]), uint32_t(int64_t(row[10])),
                             uint32_t(int64_t(row[11])), uint32_t(rows[4 * i + 3]),
                             adamw ? 1 : 0, stochastic ? 1 : 0, 1};
      const CompactTensors tensors{master.data_ptr<float>() + at,
                                   grad_bytes + at * grad_size,
                                   lowp_kind(grad),
                                   exp_avg.data_ptr<uint8_t>() + at,
                                   exp_avg_scale.data_ptr<float>() + first_block,
                                   exp_avg_sq.data_ptr<uint8_t>() + at,
                                   exp_avg_sq_scale.data_ptr<float>() + first_block,
                                   nullptr,
                                   kLowpNone};
      const int64_t piece_skipped = hso_compact_run(chosen, &args, &tensors, numel, int(threads));
      known = piece_skipped >= 0;
      skipped += known ? piece_skipped : 0;
    }
  }
  TORCH_CHECK_VALUE(known, "instruction set '", isa,
                    "' is unknown or not supported by this CPU; see available_isas().");
  return skipped;
}

// CompactArgs of the twelve constants compact.py's constants() derives (grad_scale ...
// neg_step_size as doubles, the two keys as integers).
CompactArgs compact_args(const std::vector<double>& c, int64_t index_base, bool adamw,
                         bool stochastic, bool commit) {
  TORCH_CHECK_VALUE(c.size() == 12, "expected 12 constants, got ", c.size(), ".");
  return CompactArgs{float(c[0]),          float(c[1]),          float(c[2]),
                     float(c[3]),          float(c[4]),          float(c[5]),
                     float(c[6]),          float(c[7]),          float(c[8]),
                     float(c[9]),          uint32_t(int64_t(c[10])), uint32_t(int64_t(c[11])),
                     uint32_t(index_base), adamw ? 1 : 0,        stochastic ? 1 : 0,
                     commit ? 1 : 0};
}

// compact_adam_commit_speculate (compact_commit_speculate.py) over flat CPU tensors: the
// commit with grad_pending, the speculative update with grad_new into out_lowp, then
// (keep_new_grad) grad_new copied into grad_pending, in one pass. compact.py checks sizes and
// scalars first.
std::tuple<int64_t, int64_t> compact_fused_apply(
    const std::string& isa, at::Tensor master, at::Tensor grad_pending, at::Tensor grad_new,
    at::Tensor exp_avg, at::Tensor exp_avg_scale, at::Tensor exp_avg_sq,
    at::Tensor exp_avg_sq_scale, at::Tensor out_lowp, const std::vector<double>& commit,
    const std::vector<double>& speculate, int64_t index_base, bool adamw, bool stochastic,
    bool keep_new_grad, int64_t threads) {
  const int64_t n = check_master_and_grad(master, grad_pending, "grad_pending");
  check_flat(grad_new, "grad_new", grad_pending.scalar_type(), "grad_pending's dtype", n,
             "master has");
  check_compact_state(exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, n);
  const bool fp32 = out_lowp.scalar_type() == at::kFloat;
  TORCH_CHECK_TYPE(fp32 || lowp_kind(out_lowp) != kLowpNone,
                   "out_lowp must be bfloat16, float16 or float32, got ", out_lowp.scalar_type(),
                   ".");
  check_flat(out_lowp, "out_lowp", out_lowp.scalar_type(), "", n, "master has");
  const CompactFusedArgs args{compact_args(commit, index_base, adamw, stochastic, true),
                              compact_args(speculate, index_base, adamw, stochastic, false)};
  const CompactFusedTensors tensors{
      CompactTensors{master.data_ptr<float>(), grad_pending.data_ptr(), lowp_kind(grad_pending),
                     exp_avg.data_ptr<uint8_t>(), exp_avg_scale.data_ptr<float>(),
                     exp_avg_sq.data_ptr<uint8_t>(), exp_avg_sq_scale.data_ptr<float>(),
                     out_lowp.data_ptr(), fp32 ? int32_t(kOutFp32) : int32_t(lowp_kind(out_lowp))},
      grad_new.data_ptr(), keep_new_grad ? grad_pending.data_ptr() : nullptr};
  CompactCounts counts{0, 0};
  int status;
  {
    pybind11::gil_scoped_release no_gil;
    status = hso_compact_fused_run(isa.empty() ? nullptr : isa.c_str(), &args, &tensors, n,
                                   int(threads), &counts);
  }
  TORCH_CHECK_VALUE(status == 0, "instruction set '", isa,
                    "' is unknown or not supported by this CPU; see available_isas().");
  return std::make_tuple(counts.commit, counts.speculate);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_apply", &adam_apply, "Adam step/rollback/replay over flat fp32 CPU tensors");
  m.def("compact_apply", &compact_apply,
        "One compact-state Adam pass (8-bit moments) over flat CPU tensors");
  m.def("compact_apply_pieces", &compact_apply_pieces,
        "The commit of several pieces of flat CPU tensors in one call (8-bit moments)");
  m.def("compact_fused_apply", &compact_fused_apply,
        "A compact-state commit and the next step's speculative update in one pass");
  m.def("best_isa", []() { return std::string(hso_best_isa()); });
  m.def("isa_supported", [](const std::string& name) { return bool(hso_isa_supported(name.c_str())); });
}
