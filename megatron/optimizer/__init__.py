"""Parameter groups (no weight decay on biases and norms), the optimizer, and the LR schedule."""
from megatron.optimizer.optimizer import build_optimizer, get_param_groups
from megatron.optimizer.lr_schedule import AnnealingLR
