// CUDA kernel for torch.ops.csd_engine.build_tree_mask. The schema, the CPU kernel and the
// registration of build_tree_mask_cuda (under CSD_WITH_CUDA) live in tree_mask.cpp, which keeps
// torch/library.h, the slowest header to compile, away from nvcc. Compiled only when setup.py
// builds CUDA sources.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <tuple>

namespace csd_engine {

// Defined in tree_mask.cpp: the layout checks and the CPU tree check that raises the error.
void check_parents_layout(const at::Tensor& parents);
void check_tree_parents(const at::Tensor& parents);

namespace {

constexpr int64_t kPadding = -2;
constexpr int kThreadsPerBlock = 128;

// One block per row. The block first clears the row's outputs with coalesced stores, then each
// thread takes nodes and walks each one's ancestor chain (depth is small, so O(depth) per node
// beats sharing partial results between threads).
//
// A kernel cannot raise, so a node that breaks the tree rules sets *invalid_tree; the launcher
// reads it and raises. The walk only follows parents smaller than the current node, so it ends
// even on such input.
__global__ void build_tree_mask_kernel(const int64_t* __restrict__ parents, int64_t nodes, bool* __restrict__ mask,
                                       int64_t* __restrict__ depth, int64_t* __restrict__ paths,
                                       int* __restrict__ invalid_tree) {
  const int64_t row = blockIdx.x;
  const int64_t* row_parents = parents + row * nodes;
  bool* row_mask = mask + row * nodes * nodes;
  int64_t* row_paths = paths + row * nodes * nodes;
  for (int64_t k = threadIdx.x; k < nodes * nodes; k += blockDim.x) {
    row_mask[k] = false;
    row_paths[k] = -1;
  }
  __syncthreads();

  for (int64_t node = threadIdx.x; node < nodes; node += blockDim.x) {
    const int64_t parent = row_parents[node];
    const bool padded = parent == kPadding;
    const bool parent_out_of_range = parent < kPadding || parent >= node;
    const bool real_after_padding = !padded && node > 0 && row_parents[node - 1] == kPadding;
    if (parent_out_of_range || real_after_padding) {
      *invalid_tree = 1;  // every writer stores the same value, so the race is harmless
    }
    bool* node_mask = row_mask + node * nodes;
    int64_t* node_path = row_paths + node * nodes;
    node_mask[node] = true;
    int64_t node_depth = 0;
    if (!padded) {
      for (int64_t child = node, up = parent; up >= 0 && up < child; child = up, up = row_parents[up]) {
        ++node_depth;
      }
      node_path[node_depth] = node;
      int64_t level = node_depth;
      for (int64_t child = node, up = parent; up >= 0 && up < child; child = up, up = row_parents[up]) {
        node_mask[up] = true;
        node_path[--level] = up;
      }
    }
    depth[row * nodes + node] = node_depth;
  }
}

}  // namespace

// Synchronises the device once: the host must read the kernel's invalid-tree flag to raise the
// same error as the CPU op. On a bad tree the parents are copied to the host and checked there,
// which produces the CPU op's message (first offending row and node).
std::tuple<at::Tensor, at::Tensor, at::Tensor> build_tree_mask_cuda(const at::Tensor& parents) {
  check_parents_layout(parents);
  const c10::cuda::CUDAGuard device_guard(parents.device());
  const at::Tensor contiguous = parents.contiguous();
  const int64_t batch = parents.size(0);
  const int64_t nodes = parents.size(1);
  at::Tensor mask = at::empty({batch, nodes, nodes}, parents.options().dtype(at::kBool));
  at::Tensor depth = at::empty({batch, nodes}, parents.options());
  at::Tensor paths = at::empty({batch, nodes, nodes}, parents.options());
  if (batch == 0 || nodes == 0) {
    return {mask, depth, paths};
  }
  at::Tensor invalid_tree = at::zeros({}, parents.options().dtype(at::kInt));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  build_tree_mask_kernel<<<static_cast<unsigned int>(batch), kThreadsPerBlock, 0, stream>>>(
      contiguous.const_data_ptr<int64_t>(), nodes, mask.mutable_data_ptr<bool>(), depth.mutable_data_ptr<int64_t>(),
      paths.mutable_data_ptr<int64_t>(), invalid_tree.mutable_data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (invalid_tree.item<int>() != 0) {
    check_tree_parents(contiguous.cpu());
  }
  return {mask, depth, paths};
}

}  // namespace csd_engine
