// mfa::attention and attention_backward: check the arguments against the op's
// declaration (binder.hpp) and attention's options (attention_problem.hpp),
// then run the bundle entry's pass for the problem (attention_runner.hpp).
#include <map>

#include "attention_runner.hpp"
#include "mfa/attention.hpp"

namespace mfa {

namespace {

using attention_problem::Problem;
using namespace attention_runner;

// The entry's forward or backward pass for the call's sizes, run on its views.
void run(const Device& device, CommandBatch* batch, const Binder& binder, const Problem& p,
         const AttentionOptions& options, const Bundle& bundle, bool backward) {
  run_entry(device, batch, bundle, facts_of(p, device.tuning().family, backward), binder, p, options);
}

void forward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
             const TensorView& k, const TensorView& v, const TensorView& out, const AttentionOptions& options,
             const TensorView* lse) {
  Binder binder(bundle.contents().declaration("attention"), attention_problem::layout_name(options.layout),
                attention_problem::with_option_arrays({{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", lse}}, options));
  const Problem p = attention_problem::checked_problem(binder, options);
  if (p.empty()) return write_empty_forward(binder, p, options);
  run(device, batch, binder, p, options, bundle, false);
}

void backward(const Device& device, CommandBatch* batch, const Bundle& bundle, const TensorView& q,
              const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse,
              const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
              const AttentionOptions& options, const TensorView* dsinks) {
  Binder binder(bundle.contents().declaration("attention_backward"), attention_problem::layout_name(options.layout),
                attention_problem::with_option_arrays({{"q", &q}, {"k", &k}, {"v", &v}, {"o", &o}, {"lse", &lse}, {"do", &dout}, {"dq", &dq},
                       {"dk", &dk}, {"dv", &dv}, {"dsinks", dsinks}}, options));
  const Problem p = attention_problem::checked_problem(binder, options);
  if (p.empty()) return write_empty_backward(binder);
  run(device, batch, binder, p, options, bundle, true);
}

}  // namespace

void attention(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
               const TensorView& v, const TensorView& out, const AttentionOptions& options, const TensorView* lse) {
  forward(device, nullptr, bundle, q, k, v, out, options, lse);
}

void attention(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
               const TensorView& v, const TensorView& out, const AttentionOptions& options, const TensorView* lse) {
  forward(batch.device(), &batch, bundle, q, k, v, out, options, lse);
}

void attention_backward(const Device& device, const Bundle& bundle, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options, const TensorView* dsinks) {
  backward(device, nullptr, bundle, q, k, v, o, lse, dout, dq, dk, dv, options, dsinks);
}

void attention_backward(CommandBatch& batch, const Bundle& bundle, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& o, const TensorView& lse, const TensorView& dout,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options, const TensorView* dsinks) {
  backward(batch.device(), &batch, bundle, q, k, v, o, lse, dout, dq, dk, dv, options, dsinks);
}

}  // namespace mfa
