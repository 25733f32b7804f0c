"""The environment check before a run (tools/check_environment.py without --collectives): versions, GPUs and
peer access, /dev/shm, the --save folder's free space and measured write speed, the fused kernels against their
torch references on CUDA, and a two-process gloo all-reduce (the CPU path). Each check gives rows
(name, status, detail) with status "ok", "warn" or "FAIL"; any FAIL makes the tool exit non-zero.
"""
import importlib
import os
import platform
import shutil
import time

import torch

OK, WARN, FAIL = "ok", "warn", "FAIL"
SHM_WARN_BYTES = 1 << 30  # DataLoader workers and NCCL's shared-memory transport need more than Docker's 64 MiB


def check_versions():
    rows = [("python", OK, platform.python_version()), ("torch", OK, torch.__version__)]
    if torch.cuda.is_available():
        rows.append(("CUDA (torch build)", OK, str(torch.version.cuda)))
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        rows.append(("NCCL", OK if nccl else FAIL, ".".join(map(str, nccl)) if nccl else "not in this torch build"))
    else:
        rows.append(("CUDA", WARN, f"not available (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
                                   "the CPU path (gloo) is checked instead"))
    for module, why in (("deepspeed", "the training engine"), ("transformers", "Hugging Face export and parity")):
        try:
            rows.append((module, OK, importlib.import_module(module).__version__))
        except Exception as err:  # a broken install raises anything at import time
            rows.append((module, FAIL, f"cannot import ({type(err).__name__}: {err}); needed for {why}: "
                                       "pip install -r requirements.txt"))
    return rows


def check_gpus():
    if not torch.cuda.is_available():
        return [("GPUs", WARN, "none visible (CUDA_VISIBLE_DEVICES="
                               f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); training runs on the CPU")]
    rows = []
    count = torch.cuda.device_count()
    for i in range(count):
        prop = torch.cuda.get_device_properties(i)
        bf16 = prop.major >= 8
        rows.append((f"GPU {i}", OK if bf16 else WARN,
                     f"{prop.name}, {prop.total_memory / 2 ** 30:.1f} GiB, compute capability {prop.major}.{prop.minor}"
                     f", bf16 {'yes' if bf16 else 'no (use --fp16)'}"))
    if count > 1:
        pairs = [(i, j) for i in range(count) for j in range(count) if i != j]
        missing = [f"{i}->{j}" for i, j in pairs if not torch.cuda.can_device_access_peer(i, j)]
        rows.append(("peer access", OK if not missing else WARN,
                     f"all {len(pairs)} GPU pairs" if not missing else
                     f"none between {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}: NCCL goes through "
                     "host memory (slower all-reduce; measure it with --collectives)"))
    return rows


def check_shm(path="/dev/shm"):
    if not os.path.isdir(path):
        return [("/dev/shm", WARN, f"{path} does not exist")]
    usage = shutil.disk_usage(path)
    status = OK if usage.total >= SHM_WARN_BYTES else WARN
    detail = f"{usage.total / 2 ** 30:.1f} GiB, {usage.free / 2 ** 30:.1f} GiB free"
    if status != OK:
        detail += " (below 1 GiB: DataLoader workers and NCCL may fail; docker run --shm-size=8g or --ipc=host)"
    return [("/dev/shm", status, detail)]


def check_save_folder(folder, test_bytes=256 << 20):
    """Free space and a measured write speed (test_bytes written with fsync to a temporary file, then removed)
    in --save's folder, or in its nearest existing parent when it does not exist yet."""
    target = os.path.abspath(folder)
    probe_dir = target
    while not os.path.isdir(probe_dir):
        if os.path.exists(probe_dir):
            return [("--save", FAIL, f"{folder}: {probe_dir} is a file, so the folder cannot be created; pick "
                                     "another --save")]
        probe_dir = os.path.dirname(probe_dir)
    where = target if probe_dir == target else f"{probe_dir} (nearest existing parent of {target})"
    if not os.access(probe_dir, os.W_OK):
        return [("--save", FAIL, f"{where} is not writable; pick another folder or fix its permissions")]
    usage = shutil.disk_usage(probe_dir)
    rows = [("--save free space", OK if usage.free > 2 * test_bytes else FAIL,
             f"{usage.free / 2 ** 30:.1f} GiB free of {usage.total / 2 ** 30:.1f} GiB in {where}")]
    if usage.free <= 2 * test_bytes:
        return rows
    path = os.path.join(probe_dir, f".check_environment_write_test_{os.getpid()}")
    block = os.urandom(1 << 20) * 4  # 4 MiB of incompressible bytes
    try:
        start = time.perf_counter()
        with open(path, "wb") as f:
            written = 0
            while written < test_bytes:
                f.write(block)
                written += len(block)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
    except OSError as err:
        return rows + [("--save write", FAIL, f"writing {path} failed: {err}")]
    finally:
        if os.path.exists(path):
            os.remove(path)
    rows.append(("--save write speed", OK, f"{written / seconds / 1e6:,.0f} MB/s ({written >> 20} MiB with fsync)"))
    return rows


def check_fused_kernels():
    """On CUDA: build (or load) the csrc kernels and compare each with its torch reference."""
    if not torch.cuda.is_available():
        return [("fused kernels", WARN, "CUDA-only: not built here; the torch fallbacks serve every op")]
    from megatron import fused_kernels
    from megatron.fused_kernels.cross_entropy import cross_entropy_reference, sliced_cross_entropy
    from megatron.fused_kernels.loader import kernel_module_or_fallback
    module = fused_kernels.load_fused_kernels()
    if module is None:
        from megatron.fused_kernels.loader import _state
        return [("fused kernels", FAIL, f"build failed: {_state.failure}")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def compare(name, got, want, tol):
        """max |kernel - torch| relative to max(1, max |torch|): bf16 outputs differ by output rounding only."""
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1.0)).item()
        rows.append((f"kernel {name}", OK if err <= tol else FAIL,
                     f"max |kernel - torch| / max(1, |torch|) = {err:.1e} (tolerance {tol:g})"))

    scores = torch.randn(2, 4, 256, 256, device="cuda", generator=gen).bfloat16()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    x = torch.randn(512, 1024, device="cuda", generator=gen).bfloat16()
    weight, bias = torch.randn(1024, device="cuda", generator=gen), torch.randn(1024, device="cuda", generator=gen)
    logits = torch.randn(512, 4096, device="cuda", generator=gen).bfloat16()
    target = torch.randint(0, 4096, (512,), device="cuda", generator=gen)
    cases = [
        ("ALiBi causal softmax", lambda: fused_kernels.alibi_causal_softmax(scores, slopes, 0.125),
         lambda: fused_kernels.alibi_causal_softmax_reference(scores, slopes, 0.125), 1.6e-2),
        ("LayerNorm", lambda: fused_kernels.mixed_layer_norm(x, (1024,), weight, bias),
         lambda: fused_kernels.mixed_layer_norm_reference(x, (1024,), weight, bias), 1.6e-2),
        ("cross entropy", lambda: sliced_cross_entropy(logits, target, ops=kernel_module_or_fallback(None)),
         lambda: cross_entropy_reference(logits, target), 1e-4),
    ]
    for name, kernel, reference, tol in cases:
        try:
            compare(name, kernel(), reference(), tol)
        except RuntimeError as err:  # a kernel that launches but fails (wrong arch, ...)
            rows.append((f"kernel {name}", FAIL, f"raised {str(err).splitlines()[0][:200]}"))
    return rows


def _gloo_worker(rank, world, port, queue):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=20))
    x = torch.full((1 << 16,), float(rank + 1))
    dist.all_reduce(x)
    if rank == 0:
        queue.put(x[0].item() == world * (world + 1) / 2 and bool((x == x[0]).all()))
    dist.destroy_process_group()


def check_gloo(world=2, timeout=30):
    """Two processes, a gloo all-reduce of 64 Ki floats, its values checked."""
    import multiprocessing
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, queue)) for r in range(world)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    if alive or any(p.exitcode != 0 for p in procs) or queue.empty():
        return [("gloo (CPU path)", FAIL, f"{world}-process all-reduce did not complete (exit codes "
                                          f"{[p.exitcode for p in procs]}); check localhost networking")]
    right = queue.get()
    return [("gloo (CPU path)", OK if right else FAIL,
             f"{world}-process all-reduce {'correct' if right else 'WRONG VALUES'} ({time.perf_counter() - start:.1f} s "
             "including start-up)")]
