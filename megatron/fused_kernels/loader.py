"""Builds and loads the CUDA fused kernels of csrc/fused_kernels once per machine, and decides per call
whether a kernel may run or the torch fallback is used (with --abort-on-unmet-fused-kernel-constraints)."""
import hashlib
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

ABORT_FLAG = "--abort-on-unmet-fused-kernel-constraints"
SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc" / "fused_kernels"
SOURCES = ("fused_kernels.cpp", "alibi_softmax.cu", "layer_norm.cu", "cross_entropy.cu",
           "gemm_epilogue.cpp")
HEADERS = ("fused_kernels.h", "common.cuh")


class _State:
    """Process-wide loader state: one build attempt per process, one log line per fallback reason."""

    def __init__(self):
        self.attempted = False
        self.module = None
        self.failure: Optional[str] = None
        self.abort_on_unmet_constraints = False
        self.logged_reasons: set = set()


_state = _State()


def _reset_for_tests() -> None:
    """Forgets the build attempt and the logged reasons (tests only)."""
    global _state
    _state = _State()


def unmet_constraint_error(reason: str) -> RuntimeError:
    """The error raised under the abort flag; `reason` says which constraint was not met."""
    return RuntimeError(
        f"fused kernel unavailable: {reason}; {ABORT_FLAG} is set, so the torch fallback is not used. "
        f"Fix the constraint or drop {ABORT_FLAG} to fall back to torch."
    )


def source_hash() -> str:
    """sha256 over the kernel sources, the torch/CUDA versions and the device arch (the build cache key)."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(str(torch.version.cuda).encode())
    if torch.cuda.is_available():
        digest.update(str(torch.cuda.get_device_capability()).encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """TORCH_EXTENSIONS_DIR if set, else ~/.cache/megatron_fused_kernels."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "megatron_fused_kernels"


def arch_flags() -> list:
    """nvcc -gencode flags for the current device (e.g. sm_90 -> compute_90/sm_90 SASS + PTX)."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-gencode=arch=compute_{arch},code=compute_{arch}"]


def _unavailable_reason() -> Optional[str]:
    """Why the kernels cannot be built on this machine at all, or None if they can be tried."""
    if not torch.cuda.is_available():
        return "CUDA is not available (no GPU or a CPU-only torch build)"
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    major, _ = torch.cuda.get_device_capability()
    if major < 7:
        return f"GPU compute capability {torch.cuda.get_device_capability()} < (7, 0)"
    for name in SOURCES + HEADERS:
        if not (SOURCE_DIR / name).is_file():
            return f"kernel source {SOURCE_DIR / name} is missing"
    return None


def _build():
    """Compiles (or loads from the cache) the extension; returns the module. Raises on failure."""
    from torch.utils import cpp_extension

    from megatron.fused_kernels.build_env import pin_ninja
    pin_ninja()  # one ninja per environment: another one's .ninja_log format rebuilds everything
    name = f"megatron_fused_kernels_{source_hash()}"
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=name,
        sources=[str(SOURCE_DIR / s) for s in SOURCES],
        build_directory=str(build_dir),
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"] + arch_flags(),
        extra_ldflags=["-lcublasLt"],
        verbose=False,
    )


def _is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def load_fused_kernels(abort_on_unmet_constraints: bool = False):
    """Builds the fused kernels once per machine and returns the extension module, or None.

    The build is cached under cache_root()/megatron_fused_kernels_<hash of sources, torch, arch>.
    With torch.distributed initialised, global rank 0 builds first, all ranks meet at a barrier,
    then the other ranks load from the cache (ninja finds nothing to do; ranks of other machines
    build their own copy, serialised per machine by the build folder's lock).

    With abort_on_unmet_constraints (the --abort-on-unmet-fused-kernel-constraints flag) a failed
    build, and later any call whose kernel constraints are unmet, raises RuntimeError; otherwise
    the torch fallbacks are used and the reason is logged once.
    """
    _state.abort_on_unmet_constraints = abort_on_unmet_constraints
    if not _state.attempted:
        _state.attempted = True
        _state.module, _state.failure = _attempt_build()
    if _state.module is None and abort_on_unmet_constraints:
        raise unmet_constraint_error(_state.failure)
    return _state.module


def _attempt_build():
    """Returns (module, None) or (None, reason); logs one line either way."""
    reason = _unavailable_reason()
    if reason is not None:
        logger.warning("fused kernels not built: %s; using torch fallbacks", reason)
        return None, reason

    distributed = _is_distributed()
    rank = torch.distributed.get_rank() if distributed else 0
    start = time.perf_counter()
    module, failure = None, None
    if rank == 0:
        module, failure = _try_build()
    if distributed:
        torch.distributed.barrier()
    if rank != 0:
        module, failure = _try_build()
    if module is None:
        logger.warning("fused kernels build failed on rank %d: %s; using torch fallbacks", rank, failure)
    else:
        major, minor = torch.cuda.get_device_capability()
        logger.info(
            "fused kernels ready on rank %d (sm_%d%d, %.1f s, cache %s)",
            rank, major, minor, time.perf_counter() - start, cache_root(),
        )
    return module, failure


def _try_build():
    try:
        return _build(), None
    except (RuntimeError, OSError, ImportError, ValueError, subprocess.CalledProcessError) as exc:
        return None, _summarise_build_error(exc)


def _summarise_build_error(exc: BaseException) -> str:
    """First line of a build error plus its first compiler 'error' line (the full text goes to DEBUG)."""
    text = str(exc).strip()
    logger.debug("fused kernels build output:\n%s", text)
    lines = text.splitlines() or [type(exc).__name__]
    summary = f"{type(exc).__name__}: {lines[0][:200]}"
    detail = next((line.strip() for line in lines[1:] if "error" in line.lower()), None)
    if detail:
        summary += f" ({detail[:300]})"
    return summary


def kernel_module_or_fallback(reason: Optional[str]):
    """The module to run a kernel with, or None to use the torch fallback.

    reason: why this call cannot use a kernel (None if its inputs meet every constraint).
    Loads the kernels on first use. Raises RuntimeError under the abort flag when the kernel
    cannot run; otherwise logs each distinct reason once.
    """
    if reason is None:
        if not _state.attempted:
            load_fused_kernels(_state.abort_on_unmet_constraints)
        if _state.module is not None:
            return _state.module
        reason = f"fused kernels not built ({_state.failure})"
    if _state.abort_on_unmet_constraints:
        raise unmet_constraint_error(reason)
    if reason not in _state.logged_reasons:
        _state.logged_reasons.add(reason)
        logger.warning("fused kernel not used: %s; using the torch fallback", reason)
    return None
