"""Before a run: what a layout costs in memory and time, which layouts fit, and whether the machine is ready.

    memory.py       per-GPU bytes of a layout: model states by DeepSpeed wrapper, activations op by op, the peak
    speed.py        predicted step time: FLOPs at an efficiency, 1F1B bubble, TP/PP/DP traffic over bandwidths
    planner.py      every valid (TP, PP, DP, ZeRO, micro batch, checkpointing, offload), sorted, recommended
    plan_cli.py     tools/plan_layout.py's command line and table
    advice.py       pretrain_bloom.py's predicted-peak line, its warning and the out-of-memory suggestion
    environment.py  versions, GPUs, /dev/shm, --save, fused kernels, gloo (tools/check_environment.py)
    collectives.py  nccl-tests-style bandwidths with checked values (tools/check_environment.py --collectives)
    check_cli.py    tools/check_environment.py's command line
"""
