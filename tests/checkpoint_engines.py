"""Tiny real DeepSpeed engines for checkpoint tests (one process, CPU): each optimizer wrapper, trained a few steps.

The engines are the training's own (megatron.training.engine.setup_engine: BloomModel, parameter groups, AdamW,
AnnealingLR) on a one-layer model of hidden size 8. raw_state reads what the wrapper steps with straight from
DeepSpeed's structures, independently of megatron/checkpoint/adapters.py, so that a test compares the adapters'
round trip against DeepSpeed itself. Only APIs that main had before the adapters are used here:
tests/fixtures/format2/generate.py writes checkpoints with an older checkout through this module.
"""
import os

import torch

# case: (flags, the wrapper DeepSpeed picks on one process); "fp32-accumulation": bf16 gradients accumulated in
# fp32, for which DeepSpeed picks BF16_Optimizer at ZeRO 1 (as it does for bf16 with PP > 1)
CASES = {
    "fp32-zero0": ([], "AdamW"),
    "fp16-zero0": (["--fp16"], "FP16_UnfusedOptimizer"),
    "bf16-zero0": (["--bf16"], "FP16_UnfusedOptimizer"),
    "bf16-zero1-fp32-accumulation": (["--bf16", "--zero-stage", "1"], "BF16_Optimizer"),
    "fp32-zero1": (["--zero-stage", "1"], "DeepSpeedZeroOptimizer"),
    "fp16-zero2": (["--fp16", "--zero-stage", "2"], "DeepSpeedZeroOptimizer"),
    "bf16-zero3": (["--bf16", "--zero-stage", "3"], "DeepSpeedZeroOptimizer_Stage3"),
    "fp32-zero3": (["--zero-stage", "3"], "DeepSpeedZeroOptimizer_Stage3"),
}
FP16_FLAGS = ["--initial-loss-scale", "1024", "--loss-scale-window", "2"]  # the scaler moves across the save


def configure(root, flags, load=None):
    """(Config, DeepSpeed dict) of a one-layer run saving to root (and loading from `load`), on $WORLD_SIZE
    data-parallel processes."""
    from megatron.arguments import load_and_resolve
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", str(2 * world_size),
            "--train-iters", "10", "--lr", "1e-2", "--min-lr", "1e-3", "--clip-grad", "1.0", "--mock-data",
            "--mock-vocab-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0", "--save", str(root),
            "--deepspeed", *flags, *(FP16_FLAGS if "--fp16" in flags else [])]
    if load is not None:
        args += ["--load", str(load)]
    return load_and_resolve(args, world_size=world_size)[:2]


def build_engine(case, config, ds_config, state):
    """The training's engine for CASES[case]."""
    from deepspeed.accelerator import get_accelerator
    from megatron.training.engine import setup_engine
    get_accelerator().is_fp16_supported = lambda: True  # DeepSpeed asks oneDNN; torch runs fp16 on any CPU
    if case.endswith("fp32-accumulation"):
        ds_config = {**ds_config, "data_types": {"grad_accum_dtype": "fp32"}}
    return setup_engine(config, ds_config, state)[0]


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 64, (2, 9), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train(engine, steps, first=0):
    for step in range(first, first + steps):
        inputs, labels = batch(step)
        loss = engine(inputs, labels=labels).mean()
        engine.backward(loss)
        engine.step()


def raw_state(engine):
    """{label: tensor or number}: the tensors the wrapper's torch optimizer steps (fp32 master partitions or copies,
    or the weights themselves in fp32 without ZeRO) with their state, the loss scaler and the step counters, read
    from DeepSpeed's structures directly."""
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):  # ZeRO 3: the inner groups are filled only during step
        tensors = list(wrapper.fp32_partitioned_groups_flat)
    else:
        tensors = [t for group in inner.param_groups for t in group["params"]]
    out = {}
    for i, tensor in enumerate(tensors):
        out[f"tensor {i}"] = tensor.detach().clone()
        for key, value in inner.state[tensor].items():
            out[f"tensor {i} {key}"] = value.clone() if torch.is_tensor(value) else value
    scaler = getattr(wrapper, "loss_scaler", None) or getattr(wrapper, "loss_scale_config", None)
    for field in ("cur_scale", "cur_iter", "last_overflow_iter"):
        if scaler is not None and hasattr(scaler, field):
            out[f"scaler {field}"] = getattr(scaler, field)
    for field in ("global_steps", "global_samples", "skipped_steps"):
        out[field] = getattr(engine, field)
    out["lr"] = inner.param_groups[0]["lr"]
    return out


def weights(engine):
    """The module's weights (gathered under ZeRO 3), by name."""
    import contextlib
    import deepspeed
    params = list(engine.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if hasattr(params[0], "ds_id") else \
        contextlib.nullcontext()
    with gathered:
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}
