"""Build of what pyproject.toml cannot declare: the C++/CUDA extension `csd_engine._C` and the
Triton kernels' folder `kernels/` installed as `csd_engine.kernels`. Metadata, dependencies,
extras and the version live in pyproject.toml.

    pip install --no-build-isolation -e .        # against the torch already installed
    CSD_SKIP_CUDA=1 pip install ...               # C++ CPU sources only, even with CUDA torch
    CSD_NO_EXTENSION=1 pip install ...            # no extension: ops fall back to PyTorch
    CSD_FORCE_CUDA=1 pip install ...              # CUDA sources without a visible GPU (build hosts)
"""
import glob
import os

from setuptools import setup

def extension_modules():
    if os.environ.get("CSD_NO_EXTENSION") == "1":
        return []
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cpp = sorted(glob.glob("csrc/*.cpp"))
    cuda = sorted(glob.glob("csrc/*.cu"))
    with_cuda = torch.cuda.is_available() or os.environ.get("CSD_FORCE_CUDA") == "1"
    with_cuda = with_cuda and torch.version.cuda is not None and os.environ.get("CSD_SKIP_CUDA") != "1"
    # -fno-trapping-math: no code here reads floating-point exception flags, and without it GCC
    # keeps branches around compares in csrc/decode_cpu_kernels.inc's loops (no AVX2 vectorisation)
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-fno-trapping-math"]
    if with_cuda:
        return [CUDAExtension("csd_engine._C", cpp + cuda, define_macros=[("CSD_WITH_CUDA", None)],
                              extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++20"]},
                              extra_link_args=["-fopenmp"])]
    return [CppExtension("csd_engine._C", cpp, extra_compile_args=cxx, extra_link_args=["-fopenmp"])]


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension
    return BuildExtension.with_options(use_ninja=True)


setup(
    packages=["csd_engine", "csd_engine.models", "csd_engine.strategies", "csd_engine.drafters", "csd_engine.serving",
              "csd_engine.kernels"],
    package_dir={"csd_engine": "csd_engine", "csd_engine.kernels": "kernels"},
    ext_modules=extension_modules(),
    cmdclass={"build_ext": build_ext_class()},
)
