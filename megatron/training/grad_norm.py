"""The true gradient norm under DeepSpeed's unfused fp16/bf16 wrapper (FP16_UnfusedOptimizer).

DeepSpeed picks FP16_UnfusedOptimizer for fp16 with a non-fused optimizer and for bf16 at ZeRO 0 without a
pipeline. Its step() takes the norm of `p.grad.to(p.dtype)` tensors, which carry none of the parameter's
attributes, and hands them to `get_weight_norm`, which decides what to count from exactly those attributes:

- `tensor_model_parallel`: on TP ranks > 0 every gradient looks replicated and is left out, so the reported norm
  (and the norm clipping divides by) misses those ranks' slices of every partitioned weight (measured: bf16 TP 2
  reported 0.564 where DP 2, PP 2 and one process report 0.572);
- `ds_pipe_replicated`: the tied embedding held by the first and the last stage is counted on both (fp16 PP 2
  reported 1.083 where the true norm is 0.769).

`use_true_grad_norm(engine)` gives that wrapper the per-parameter view: the gradients it measures carry their
parameter's attributes, so `get_weight_norm` counts a partitioned gradient on every TP rank, a replicated one on
TP rank 0 and a pipeline-replicated one on its owning stage only; clipping then uses the true norm too.
Tested with DeepSpeed 0.19.8 (tests/integration/test_training_parity.py compares the reported norms of every
layout in fp32, bf16 and fp16 with one process's).
"""
import logging

logger = logging.getLogger("megatron.training")

# The attributes DeepSpeed's get_weight_norm and is_moe_param read from what they are given.
_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "model_parallel", "ds_pipe_replicated", "allreduce")


def grads_with_parallel_attributes(group):
    """(shared, expert) gradients of `group`'s parameters in the parameters' dtype, each carrying its parameter's
    parallel attributes: DeepSpeed's split_params_grads_into_shared_and_expert_params with the attributes kept."""
    from deepspeed.moe.utils import is_moe_param

    shared, expert = [], []
    for param in group:
        if param.grad is None:
            continue
        grad = param.grad.to(param.dtype)
        for name in _PARALLEL_ATTRIBUTES:
            if hasattr(param, name):
                setattr(grad, name, getattr(param, name))
        (expert if is_moe_param(param) else shared).append(grad)
    return shared, expert


def use_true_grad_norm(engine):
    """Makes `engine`'s FP16_UnfusedOptimizer (if that is its wrapper) measure and clip by the true norm."""
    from deepspeed.runtime.fp16 import unfused_optimizer

    if not isinstance(engine.optimizer, unfused_optimizer.FP16_UnfusedOptimizer):
        return False
    name = "split_params_grads_into_shared_and_expert_params"
    if not hasattr(unfused_optimizer, name):
        raise RuntimeError(f"deepspeed.runtime.fp16.unfused_optimizer has no {name} in this DeepSpeed version: "
                           "the gradient-norm correction for TP/PP (megatron/training/grad_norm.py) needs updating")
    setattr(unfused_optimizer, name, grads_with_parallel_attributes)
    return True
