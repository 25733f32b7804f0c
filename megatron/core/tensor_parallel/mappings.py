"""Autograd-aware communication into and out of the tensor-parallel region.

    copy_to_tensor_model_parallel_region      forward: identity         backward: all-reduce
    reduce_from_tensor_model_parallel_region  forward: all-reduce       backward: identity
    scatter_to_tensor_model_parallel_region   forward: split last dim   backward: all-gather last dim
    gather_from_tensor_model_parallel_region  forward: all-gather last  backward: split last dim

Each takes the TP group explicitly (layers resolve it once in __init__); with one rank they are identities.
"""
import torch
import torch.distributed as dist


def _world(group):
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce(x, group):
    if _world(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x, group):
    world = _world(group)
    if world == 1:
        return x
    if x.shape[-1] % world != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last_dim(x, group):
    world = _world(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
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


def copy_to_tensor_model_parallel_region(x, group):
    return x if _world(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group):
    return x if _world(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group):
    return x if _world(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group):
    return x if _world(group) == 1 else _GatherFromRegion.apply(x, group)
