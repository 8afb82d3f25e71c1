// Run-time choice of the CPU instruction set the kernels use.
#pragma once

#include <string>
#include <vector>

namespace sylvie_comm {
namespace cpu {

// Names of the instruction sets this build and this CPU can run, best last.
std::vector<std::string> available_isas();
// The instruction set in use: the best available, or SYLVIE_COMM_CPU_ISA if set.
std::string current_isa();
// Select an instruction set by name; false (and nothing changed) if it is not available. No exception: it
// would cross pybind11's boundary into Python (sylvie_comm._ops.set_cpu_isa raises the ValueError).
bool set_isa(const std::string& name);

}  // namespace cpu
}  // namespace sylvie_comm
