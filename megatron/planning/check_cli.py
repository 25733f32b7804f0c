"""tools/check_environment.py's command line: one table of environment checks, or (--collectives, under a
launcher) the collective bandwidths; exits non-zero when something is broken."""
import argparse
import json
import os
import sys
import time

from megatron.planning import collectives, environment


def build_parser():
    from megatron.arguments import ArgumentParser  # raises ConfigError with one line; main() prints it once
    p = ArgumentParser(description="Is this machine ready to train? Versions, GPUs, /dev/shm, the --save "
                                "folder, fused kernels, gloo; with --collectives (under torchrun or deepspeed) "
                                "NCCL/gloo bandwidths.", allow_abbrev=False)
    p.add_argument("--save", default=None, help="checkpoint folder of the run: free space and write speed")
    p.add_argument("--write-test-mib", type=int, default=256, help="bytes written to measure --save's speed")
    p.add_argument("--collectives", action="store_true",
                   help="measure all-reduce, all-gather, reduce-scatter and p2p (run under torchrun/deepspeed)")
    p.add_argument("--min-bytes", type=_size, default=None, help="smallest message (default 1M; K/M/G suffixes)")
    p.add_argument("--max-bytes", type=_size, default=None,
                   help="largest message (default 1G with CUDA, 16M with gloo on the CPU)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per size")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds one size of one collective may take")
    p.add_argument("--json", default=None, help="write the figures as JSON here (tools/plan_layout.py "
                   "--collectives-json reads it)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1M, 256K, 1G)") from None


def print_table(rows):
    width = max(len(name) for name, _, _ in rows)
    for name, status, detail in rows:
        print(f"{name:{width}s}  {status:4s}  {detail}")


def environment_main(args):
    start = time.perf_counter()
    rows = environment.check_versions() + environment.check_gpus() + environment.check_shm()
    if args.save:
        rows += environment.check_save_folder(args.save, args.write_test_mib << 20)
    rows += environment.check_fused_kernels()
    if not __import__("torch").cuda.is_available():
        rows += environment.check_gloo()
    print_table(rows)
    failed = [name for name, status, _ in rows if status == environment.FAIL]
    print(f"{'BROKEN: ' + ', '.join(failed) if failed else 'ready'} ({time.perf_counter() - start:.1f} s); "
          "next: torchrun --nproc_per_node <GPUs> tools/check_environment.py --collectives")
    return 1 if failed else 0


def collectives_main(args):
    import torch
    import torch.distributed as dist
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("--collectives runs one process per GPU: torchrun --nproc_per_node N tools/check_environment.py "
              "--collectives (or deepspeed --num_gpus N ...)")
        return 2
    backend = collectives.init_from_launcher(args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = backend == "nccl"
    low = args.min_bytes or (1 << 20)
    high = args.max_bytes or ((1 << 30) if cuda else (16 << 20))
    if low > high:
        if rank == 0:
            print(f"--min-bytes {low} is larger than --max-bytes {high}; swap them")
        return 2
    if rank == 0:
        device = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"{world} ranks, backend {backend}, {device}, messages {low >> 10} KiB .. {high >> 10} KiB")
        if world == 1:
            print("one rank: nothing travels between GPUs, so these figures are the GPU's own copy speed; all-reduce, "
                  "all-gather, reduce-scatter and p2p bandwidth between GPUs (NVLink/PCIe, NCCL) cannot be measured "
                  "with one GPU: run under torchrun --nproc_per_node N with N >= 2")
    rows = collectives.measure(low, high, args.iters, args.warmup, args.timeout)
    if rank == 0:
        print(f"all {len(rows)} results have the expected values")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "backend": backend, "results": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None):
    from megatron.config import ConfigError
    from megatron.initialize import exit_before_distributed
    try:
        args = build_parser().parse_args(argv)
    except ConfigError as err:  # a bad command line: one line, once per host, exit 2
        exit_before_distributed(str(err), 2)
    sys.exit(collectives_main(args) if args.collectives else environment_main(args))
