// A build smoke test for the extension builder: y = 2x + 1.
#include <torch/extension.h>

torch::Tensor affine(torch::Tensor x) { return x * 2 + 1; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("affine", &affine, "2x + 1"); }
