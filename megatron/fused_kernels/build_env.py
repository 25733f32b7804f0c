"""What C++ extension builds run with, so each is built once per environment, and the one DeepSpeed makes at start-up
announces itself.

torch.utils.cpp_extension runs `ninja` from PATH. Ninja keeps what it built in .ninja_log, whose format differs
between ninja versions (v5 up to ninja 1.11, v7 from 1.12): a build directory last built by another ninja is
built again from scratch. With the system's ninja (/usr/bin) first on PATH in one shell and the virtual
environment's (pip's `ninja` package) in another (an activated .venv, or not), DeepSpeed's CPU communication op
(deepspeed_shm_comm, 35-100 s) was recompiled at every switch. pin_ninja() puts the environment's own ninja first
on this process's PATH, so every build of an environment uses one ninja.

Where builds go: TORCH_EXTENSIONS_DIR when set, else this clone's .cache/torch_extensions (what
examples/quickstart.sh and scripts/test.sh use), rather than torch's ~/.cache/torch_extensions/py311_cpu that every
environment of the user shares (and rebuilds in turn: the build commands name each environment's paths).
"""
import contextlib
import logging
import os
import shutil
import time

logger = logging.getLogger("megatron")

REPO_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".cache",
                          "torch_extensions")
SHM_OP_NAME = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder extension (deepspeed/ops/op_builder/cpu)


def environment_ninja_dir():
    """The folder of the ninja that pip's `ninja` package installed in this environment, or None."""
    try:
        import ninja
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and os.access(os.path.join(folder, "ninja"), os.X_OK):
        return folder
    return None


def pin_ninja():
    """Puts this environment's ninja first on os.environ["PATH"] (idempotent); returns the ninja that builds run."""
    folder = environment_ninja_dir()
    if folder is not None:
        entries = os.environ.get("PATH", "").split(os.pathsep)
        if not entries or os.path.abspath(entries[0]) != os.path.abspath(folder):
            os.environ["PATH"] = os.pathsep.join([folder] + [e for e in entries if e])
    return shutil.which("ninja")


def pin_extensions_dir():
    """Sets TORCH_EXTENSIONS_DIR to this clone's .cache/torch_extensions when it is unset (and the clone is
    writable); returns the folder builds go to (None: torch's default)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    try:
        os.makedirs(REPO_CACHE, exist_ok=True)
    except OSError:
        return None
    if not os.access(REPO_CACHE, os.W_OK):
        return None
    os.environ["TORCH_EXTENSIONS_DIR"] = REPO_CACHE
    return REPO_CACHE


def shm_op_library():
    """Path of the deepspeed_shm_comm library DeepSpeed's init_distributed loads (or builds), or None when it
    builds none (a GPU accelerator, or the op is not compatible here)."""
    try:
        from deepspeed.accelerator import get_accelerator
        import deepspeed.ops
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            return None
        from torch.utils.cpp_extension import _get_build_directory  # the folder torch's load() builds in
        return os.path.join(_get_build_directory(SHM_OP_NAME, verbose=False), SHM_OP_NAME + ".so")
    except Exception as err:  # noqa: BLE001  (an announcement only: never stop a run over it)
        logger.debug("cannot tell where DeepSpeed's shm comm op is built: %s", err)
        return None


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


@contextlib.contextmanager
def announce_shm_op_build():
    """Around deepspeed.init_distributed: pins ninja, says before a first build that it will take a while and
    after any build how long it took and where the library is."""
    ninja_path = pin_ninja()
    pin_extensions_dir()
    library = shm_op_library()
    before = _mtime(library) if library else None
    if library and before is None:
        logger.info("building DeepSpeed's CPU communication op %s into %s with %s (once per environment; about a "
                    "minute)", SHM_OP_NAME, os.path.dirname(library), ninja_path)
    start = time.perf_counter()
    yield
    if library and _mtime(library) != before:
        logger.info("built DeepSpeed's CPU communication op %s in %.0f s: %s", SHM_OP_NAME,
                    time.perf_counter() - start, library)
