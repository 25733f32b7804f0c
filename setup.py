"""Installs the `megatron` package of this Megatron-DeepSpeed fork for BLOOM models.

`pip install -e .` installs the Python package and builds the C++ data helpers
(csrc/data/helpers.cpp, a pybind11 module imported as megatron.data.helpers_cpp).
CUDA kernels in csrc/ are not built here: megatron/fused_kernels compiles them
with ninja at first use on a CUDA machine and caches the build.
"""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def read_requirements(name):
    lines = (ROOT / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ext_modules():
    from pybind11.setup_helpers import Pybind11Extension

    return [
        Pybind11Extension(
            "megatron.data.helpers_cpp",
            ["csrc/data/helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ]


setup(
    name="megatron-bloom",
    version="0.1.0",
    description="Megatron-DeepSpeed fork that trains BLOOM-architecture models with TP, PP and DP",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(include=["megatron", "megatron.*"]),
    install_requires=read_requirements("requirements.txt"),
    extras_require={"test": read_requirements("requirements-test.txt")},
    ext_modules=ext_modules() if (ROOT / "csrc/data/helpers.cpp").exists() else [],
    setup_requires=["pybind11>=2.11"],
)
