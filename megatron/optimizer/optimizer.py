"""Optimizer construction: torch AdamW (fused on CUDA) or SGD, or DeepSpeed's CPU Adam when offloading on GPU."""
import logging

import torch

logger = logging.getLogger(__name__)


def get_param_groups(module, weight_decay):
    """Two groups: matrices decay; biases and LayerNorm parameters (every 1-D tensor) do not."""
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            (no_decay if param.dim() == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(param_groups, config, cpu_offload=False):
    """config: OptimizerConfig. On CUDA, Adam is torch's fused AdamW; with --cpu-offload, DeepSpeedCPUAdam."""
    on_cuda = torch.cuda.is_available()
    if config.optimizer == "sgd":
        return torch.optim.SGD(param_groups, lr=config.lr, momentum=config.sgd_momentum)
    betas = (config.adam_beta1, config.adam_beta2)
    if cpu_offload and on_cuda:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(param_groups, lr=config.lr, betas=betas, eps=config.adam_eps, adamw_mode=True)
    return torch.optim.AdamW(param_groups, lr=config.lr, betas=betas, eps=config.adam_eps,
                             fused=on_cuda and not cpu_offload)
