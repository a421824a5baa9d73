// Tree attention metadata (docs/algorithms.md, Token trees): from a parent array, the mask in which
// every node sees its ancestors and itself, each node's depth (positions are prefix + depth),
// and each node's root-to-node path (so an accepted path is read out in one gather).
//
// This file holds the op schema (the one TORCH_LIBRARY of csd_engine), the CPU kernel, the
// dispatch registrations and the Python module stub; tree_mask_cuda.cu holds the CUDA kernel,
// registered here when setup.py builds CUDA (it then defines CSD_WITH_CUDA).

#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace csd_engine {

// A root's parent is -1 (a child of the committed prefix); a padded node's is -2.
constexpr int64_t kPadding = -2;

void check_parents_layout(const at::Tensor& parents) {
  TORCH_CHECK_VALUE(parents.dim() == 2, "build_tree_mask: parents must be a 2-D [batch, nodes] tensor, got ",
                    parents.dim(), " dimensions");
  TORCH_CHECK_TYPE(parents.scalar_type() == at::kLong, "build_tree_mask: parents must be int64, got ",
                   parents.scalar_type());
}

// Raises the error for the first offending node in row-major order, so every backend (and the
// Python reference) names the same row and node. Requiring parent < node makes the parent
// relation strictly decreasing, which rules out cycles by construction: walking up from any
// node reaches a root in at most `node` steps.
void check_tree_parents(const at::Tensor& parents) {
  check_parents_layout(parents);
  const at::Tensor contiguous = parents.contiguous();
  const int64_t* data = contiguous.const_data_ptr<int64_t>();
  const int64_t batch = parents.size(0);
  const int64_t nodes = parents.size(1);
  for (int64_t row = 0; row < batch; ++row) {
    bool seen_padding = false;
    for (int64_t node = 0; node < nodes; ++node) {
      const int64_t parent = data[row * nodes + node];
      TORCH_CHECK_VALUE(parent >= kPadding && parent < node, "build_tree_mask: row ", row, ", node ", node,
                        " has parent ", parent,
                        "; parent must be -1 (root), -2 (padding) or an index smaller than the node");
      TORCH_CHECK_VALUE(parent == kPadding || !seen_padding, "build_tree_mask: row ", row, ", node ", node,
                        " has parent ", parent,
                        " but follows a padded node; padded nodes (parent -2) must come after all real nodes "
                        "of the row");
      seen_padding = seen_padding || parent == kPadding;
    }
  }
}

namespace {

// One row: nodes come after their parents, so a node's mask row and path are its parent's
// plus itself.
void build_row(const int64_t* parents, int64_t nodes, bool* mask, int64_t* depth, int64_t* paths) {
  for (int64_t node = 0; node < nodes; ++node) {
    const int64_t parent = parents[node];
    bool* node_mask = mask + node * nodes;
    int64_t* node_path = paths + node * nodes;
    depth[node] = 0;
    if (parent >= 0) {
      std::copy(mask + parent * nodes, mask + (parent + 1) * nodes, node_mask);
      std::copy(paths + parent * nodes, paths + parent * nodes + depth[parent] + 1, node_path);
      depth[node] = depth[parent] + 1;
    }
    node_mask[node] = true;
    if (parent != kPadding) {
      node_path[depth[node]] = node;
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_tree_mask_cpu(const at::Tensor& parents) {
  check_tree_parents(parents);
  const at::Tensor contiguous = parents.contiguous();
  const int64_t batch = parents.size(0);
  const int64_t nodes = parents.size(1);
  at::Tensor mask = at::zeros({batch, nodes, nodes}, parents.options().dtype(at::kBool));
  at::Tensor depth = at::empty({batch, nodes}, parents.options());
  at::Tensor paths = at::full({batch, nodes, nodes}, -1, parents.options());

  const int64_t* parents_data = contiguous.const_data_ptr<int64_t>();
  bool* mask_data = mask.mutable_data_ptr<bool>();
  int64_t* depth_data = depth.mutable_data_ptr<int64_t>();
  int64_t* paths_data = paths.mutable_data_ptr<int64_t>();
  // A row costs ~nodes^2 writes; hand each thread enough rows to be worth starting it.
  constexpr int64_t kMinWritesPerTask = 32768;
  const int64_t rows_per_task = std::max<int64_t>(1, kMinWritesPerTask / std::max<int64_t>(1, nodes * nodes));
  at::parallel_for(0, batch, rows_per_task, [&](int64_t first_row, int64_t end_row) {
    for (int64_t row = first_row; row < end_row; ++row) {
      build_row(parents_data + row * nodes, nodes, mask_data + row * nodes * nodes, depth_data + row * nodes,
                paths_data + row * nodes * nodes);
    }
  });
  return {mask, depth, paths};
}

}  // namespace

TORCH_LIBRARY(csd_engine, m) {
  m.def("build_tree_mask(Tensor parents) -> (Tensor mask, Tensor depth, Tensor paths)");
}

TORCH_LIBRARY_IMPL(csd_engine, CPU, m) {
  m.impl("build_tree_mask", &build_tree_mask_cpu);
}

#ifdef CSD_WITH_CUDA
// Defined in tree_mask_cuda.cu.
std::tuple<at::Tensor, at::Tensor, at::Tensor> build_tree_mask_cuda(const at::Tensor& parents);

TORCH_LIBRARY_IMPL(csd_engine, CUDA, m) {
  m.impl("build_tree_mask", &build_tree_mask_cuda);
}
#endif

}  // namespace csd_engine

// `import csd_engine._C` only has to load this library so the registrations above run; the
// ops are reached through torch.ops.csd_engine, so the module itself stays empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "csd_engine C++/CUDA ops (see torch.ops.csd_engine)",
                                   -1, nullptr};
  return PyModule_Create(&module_def);
}
