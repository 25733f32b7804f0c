"""Which layout (TP x PP x DP, ZeRO stage, micro batch, activation checkpointing, CPU offload) fits these GPUs, and
which is fastest: predicted per-GPU peak memory and tokens/s for every valid one, and a recommendation.

    python tools/plan_layout.py --num-gpus 4 --gpu-memory-gib 24 --gpu rtx3090 \
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
        --pad-vocab-size-to 250880 --global-batch-size 256 --micro-batch-size 1 --bf16
    # any pretrain_bloom.py launch line works: its flags and --deepspeed_config JSON are read the same way

The model is megatron/planning (memory.py, speed.py, planner.py); layouts are validated by pretrain_bloom.py's
own resolve(), so a refused layout gets the same message.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from megatron.planning.plan_cli import main
    main()
