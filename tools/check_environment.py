"""Is this machine ready to train? Versions, GPUs and peer access, /dev/shm, the --save folder's free space and
write speed, the fused kernels against torch, the CPU path (gloo); exits non-zero when something is broken.

    python tools/check_environment.py --save checkpoints
    torchrun --nproc_per_node 4 tools/check_environment.py --collectives --json collectives.json
    deepspeed --num_gpus 4 tools/check_environment.py --collectives

--collectives measures all-reduce, all-gather, reduce-scatter and point-to-point from --min-bytes to --max-bytes
and prints algorithm and bus bandwidth as nccl-tests defines them, each result's values checked; the JSON feeds
tools/plan_layout.py --collectives-json. The checks live in megatron/planning (environment.py, collectives.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from megatron.planning.check_cli import main
    main()
