// Signature reflection: what each kernel binds, read from its MSL text.
// (FunctionInfo::buffer is defined with the pipeline, in pipeline.cpp.)
#include "core/msl_syntax.hpp"
#include "mfa/reflection.hpp"

namespace mfa {

std::vector<FunctionInfo> reflect_msl(const std::string& source) {
  msl::ProgramSyntax program = msl::parse_program(source, "kernel.metal");
  std::vector<FunctionConstantInfo> constants;
  for (const msl::FunctionConstantSyntax& constant : program.constants) {
    constants.push_back(constant.info);
  }
  std::vector<FunctionInfo> functions;
  for (msl::KernelSyntax& kernel : program.kernels) {
    functions.push_back(std::move(kernel.info));
    functions.back().constants = constants;
  }
  return functions;
}

}  // namespace mfa
