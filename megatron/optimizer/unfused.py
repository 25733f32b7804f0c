"""What we change in DeepSpeed's FP16_UnfusedOptimizer, the wrapper of bf16 and fp16 runs without ZeRO (the
document's run): its gradient norm, its loss scaling and the host synchronizations of its step.

- The norm: the wrapper measures the gradient norm on gradients stripped of their parameters' parallel attributes,
  so it misses TP ranks' slices and counts the pipeline's tied embedding twice (measured: bf16 TP 2 reported 0.564
  where one process reports 0.572; fp16 PP 2 1.083 where the true norm is 0.769). Its step gets gradients that
  carry them (tests/integration/test_training_parity.py).
- The loss scale: DeepSpeed 0.19.8's engine.backward scales the loss by the fp16 loss scale for ZeRO's optimizers
  only, while this wrapper's step divides the gradients by that scale: in fp16 its gradients reached Adam divided
  by the loss scale and clipping never acted. The engine scales the loss for it too (fp16 only; bf16 has no loss
  scale), so that fp16 ZeRO 0 steps as ZeRO 1-3 do (tests/unit/test_checkpointing.py).
- The synchronizations: the step tested each gradient for inf/NaN with a host synchronization per parameter (293
  for the document's model), then measured the norm with three kernels per parameter and two more syncs: the
  device sat idle ~120 ms of a 1.4 s step on an H200 (tools/benchmark_training.py --gaps). The norm is now one
  multi-tensor reduction per parameter group and one sync for all groups, and it is the overflow test: a gradient with an inf or a NaN makes the norm
  non-finite, which the step already treats as an overflow (the same skip, the same loss-scale update, on every
  rank: the norm is summed over the model-parallel group as the test was). The unscale of the fp32 gradients is one
  multi-tensor multiply, and none when the scale is 1 (bf16 without clipping). The step's two per-parameter copies
  (gradients to fp32, masters back to the bf16/fp16 weights) are one multi-tensor copy each (multi_tensor_step).

install() applies each change once; tested with DeepSpeed 0.19.8 (requirements.txt pins the range).
"""
import math

import torch

TESTED_DEEPSPEED = ">=0.19.8,<0.20"

# The attributes DeepSpeed's get_weight_norm and is_moe_param read from the gradients they are given.
_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "model_parallel", "ds_pipe_replicated", "allreduce")


def install():
    from deepspeed.runtime.fp16 import unfused_optimizer
    for name, ours in (("split_params_grads_into_shared_and_expert_params", grads_with_parallel_attributes),
                       ("get_weight_norm", gradient_norm)):
        if getattr(unfused_optimizer, name, None) is not ours:
            if not hasattr(unfused_optimizer, name):
                raise RuntimeError(f"deepspeed.runtime.fp16.unfused_optimizer has no {name} in this DeepSpeed "
                                   f"version: install deepspeed{TESTED_DEEPSPEED} (requirements.txt), or update "
                                   "megatron/optimizer/unfused.py")
            setattr(unfused_optimizer, name, ours)
    _patch_step()


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


def gradient_norm(grads, norm_type=2, mpu=None):
    """DeepSpeed's get_weight_norm (the 2-norm of `grads` over the model-parallel group, -1 when not finite; a
    replicated gradient counts on TP rank 0 only, the pipeline's replicated copy not at all) with one
    multi-tensor reduction and one host synchronization instead of three kernels per gradient and two syncs."""
    from deepspeed.runtime.utils import get_weight_norm
    if norm_type != 2 or isinstance(grads, torch.Tensor):
        return get_weight_norm(grads, norm_type, mpu)
    return group_norms([grads], mpu)[0]


def group_norms(groups, mpu=None):
    """gradient_norm of each list of gradients in `groups`, all read back in one host synchronization (and, with
    an mpu, one all-reduce): the step's parameter groups cost one sync, not one each."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.utils import bwc_tensor_model_parallel_rank, is_model_parallel_parameter

    if not groups:
        return []
    tp_rank = bwc_tensor_model_parallel_rank(mpu=mpu)
    totals = []
    for grads in groups:
        kept = [g for g in grads if not getattr(g, "ds_pipe_replicated", False)
                and (tp_rank == 0 or is_model_parallel_parameter(g))]
        if kept:
            totals.append(torch.stack(torch._foreach_norm(kept, 2, dtype=torch.float32)).square().sum())
        else:
            totals.append(torch.zeros((), dtype=torch.float32, device=get_accelerator().current_device_name()))
    total = torch.stack(totals)
    if mpu is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    norms = [value ** 0.5 for value in total.tolist()]
    return [norm if math.isfinite(norm) else -1 for norm in norms]


def _patch_step():
    """FP16_UnfusedOptimizer.step: the engine scales the loss for it in fp16; the reported norm is the unscaled
    one, as ZeRO's optimizers report it; the per-parameter overflow test is left to the norm (module docstring);
    the unscale is one multi-tensor multiply."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    if getattr(DeepSpeedEngine.backward, "scales_unfused_fp16", False):
        return
    backward, unscale = DeepSpeedEngine.backward, FP16_UnfusedOptimizer.unscale_and_clip_grads

    def scaling(optimizer):
        return isinstance(optimizer, FP16_UnfusedOptimizer) and optimizer.loss_scale_config.use_grad_scaling and \
            not optimizer.custom_loss_scaler and not optimizer.fused_lamb_legacy

    def scaled_backward(self, loss, *args, **kwargs):
        if not scaling(self.optimizer):
            return backward(self, loss, *args, **kwargs)
        scale = self.optimizer.loss_scale_config.cur_scale
        return backward(self, loss.float() * scale, *args, **kwargs) / scale

    def unscaled_norm_step(self, *args, **kwargs):
        if not self.fused_lamb_legacy:  # its norm tests for overflow (the step skips on a non-finite norm)
            self.overflow_checker.check = _no_overflow
        scale = self.loss_scale_config.cur_scale  # the scale of this step's gradients (the step may change it)
        overflow = multi_tensor_step(self, *args, **kwargs)
        if scaling(self) and not overflow:
            self._global_grad_norm = self._global_grad_norm / scale
        return overflow

    def multi_tensor_unscale(self, total_norm, apply_scale=True):
        combined_scale = unscale(self, total_norm, apply_scale=False)
        if apply_scale and combined_scale != 1.0:
            grads = [p.grad for group in self.fp32_groups for p in group if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / combined_scale)
        return combined_scale

    unscaled_norm_step.deepspeed_step = FP16_UnfusedOptimizer.step  # DeepSpeed's, for the tests
    scaled_backward.scales_unfused_fp16 = True
    DeepSpeedEngine.backward = scaled_backward
    FP16_UnfusedOptimizer.step = unscaled_norm_step
    FP16_UnfusedOptimizer.unscale_and_clip_grads = multi_tensor_unscale


def _no_overflow(param_groups=None):
    return False


def multi_tensor_step(self, closure=None):
    """FP16_UnfusedOptimizer.step (DeepSpeed 0.19.8) with its two per-parameter loops, the gradients' copy to fp32
    and the weights' copy back from the fp32 masters, each one multi-tensor copy: the same values, ~600 fewer
    launches per step (the device waited on them, tools/benchmark_training.py --gaps)."""
    from deepspeed.runtime.fp16 import unfused_optimizer as unfused
    if self.fused_lamb_legacy:
        return self.step_fused_lamb()
    self.overflow = self.overflow_checker.check()
    if self.overflow:
        return self._skip_invalid_grad_norm()
    grads_for_norms = []
    for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
        grads_for_norm, _ = unfused.split_params_grads_into_shared_and_expert_params(fp16_group)
        grads_for_norms.append(grads_for_norm)
        sources, targets = [], []
        for fp32_param, fp16_param in zip(fp32_group, fp16_group):
            if fp16_param.grad is None:
                fp32_param.grad = torch.zeros_like(fp32_param)
            else:
                fp32_param.grad = torch.empty_like(fp32_param)
                sources.append(fp16_param.grad)
                targets.append(fp32_param.grad)
        if targets:
            torch._foreach_copy_(targets, sources)
    measured = iter(group_norms([g for g in grads_for_norms if g], mpu=self.mpu))
    norm_groups = [next(measured) if g else 0.0 for g in grads_for_norms]
    self._global_grad_norm = unfused.get_global_norm(norm_list=norm_groups)
    if unfused.is_invalid_grad_norm(self._global_grad_norm):
        return self._skip_invalid_grad_norm()
    self._update_scale(False)
    self.unscale_and_clip_grads(self._global_grad_norm)
    self.optimizer.step()
    for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
        for fp32_param in fp32_group:
            fp32_param.grad = None
        if fp16_group:
            torch._foreach_copy_([p.data for p in fp16_group], [p.data for p in fp32_group])
    return self.overflow
