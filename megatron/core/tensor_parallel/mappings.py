"""Autograd-aware communication into and out of the tensor-parallel region.

    copy_to_tensor_model_parallel_region      forward: identity         backward: all-reduce (sum)
    reduce_from_tensor_model_parallel_region  forward: all-reduce (sum) backward: identity
    scatter_to_tensor_model_parallel_region   forward: split last dim   backward: all-gather last dim
    gather_from_tensor_model_parallel_region  forward: all-gather last  backward: split last dim

Convention (the whole model follows it): the tensor-parallel group is passed explicitly as `group` / `tp_group`,
a torch.distributed ProcessGroup, or None meaning no tensor parallelism (one rank). Nothing here reads
megatron.core.parallel_state or torch.distributed's default group: the size and rank come from the group object
itself (ProcessGroup.size() / .rank()), which modules resolve once in __init__ with get_group_size_and_rank. With
one rank every mapping is the identity.
"""
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import comm_timing


def get_group_size_and_rank(group):
    """(size, this process's rank in group); (1, 0) for None (no tensor parallelism)."""
    if group is None:
        return 1, 0
    return group.size(), group.rank()


def _all_reduce(x, group):
    x = x.contiguous()
    token = comm_timing.begin()
    dist.all_reduce(x, group=group)
    comm_timing.end(token)
    return x


def _split_last_dim(x, group):
    world, rank = get_group_size_and_rank(group)
    if x.shape[-1] % world != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[rank].contiguous()


def _gather_last_dim(x, group):
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size())]
    token = comm_timing.begin()
    dist.all_gather(parts, x, group=group)
    comm_timing.end(token)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def _single(group):
    return group is None or group.size() == 1


def copy_to_tensor_model_parallel_region(x, group):
    """Identity forward; the gradient is all-reduced over group in backward."""
    return x if _single(group) else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group):
    """Sum over group in forward (all-reduce); identity backward."""
    return x if _single(group) else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group):
    """This rank's slice of the last dimension; backward all-gathers the gradient."""
    return x if _single(group) else _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group):
    """All-gather along the last dimension; backward keeps this rank's slice of the gradient."""
    return x if _single(group) else _GatherFromRegion.apply(x, group)
