// Python module of the extension. The ops themselves live in the torch
// dispatcher (torch.ops.sylvie_comm.*); importing this module registers them.
// pybind11 carries only what the dispatcher does not fit: the CPU
// instruction-set switch the tests use to check every code path. None of these
// functions throws (an unknown name is a False, raised as ValueError in Python:
// sylvie_comm/_ops.py), so no C++ exception crosses pybind11's boundary, for the
// reason csrc/cpu/kernels.cpp gives for the ops.
#include <torch/extension.h>

#include "cpu/isa.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "sylvie_comm compiled kernels (ops are registered under torch.ops.sylvie_comm)";
  m.def("available_cpu_isas", &sylvie_comm::cpu::available_isas,
        "CPU instruction sets this build can use on this machine, best last.");
  m.def("cpu_isa", &sylvie_comm::cpu::current_isa, "The CPU instruction set the kernels use now.");
  m.def("set_cpu_isa", &sylvie_comm::cpu::set_isa,
        "Select the CPU instruction set by name; False if this build or CPU has none of that name.",
        pybind11::arg("name"));
}
