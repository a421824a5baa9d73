"""Triton kernels, one per file with its launcher and PyTorch reference."""
import os


def use_kernels(tensor) -> bool:
    """Whether the engine runs a Triton kernel for work on `tensor` rather than its PyTorch
    reference: on a GPU; on the CPU only under CSD_CPU_KERNELS=1 with Triton's interpreter (slow:
    for the tests that run the GPU path's kernels through whole generations)."""
    return tensor.is_cuda or os.environ.get("CSD_CPU_KERNELS") == "1"
