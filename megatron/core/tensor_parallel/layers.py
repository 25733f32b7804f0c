"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding.

Weights are initialised as the full (unsplit) matrix on the CPU with the caller's `init_method`, which
draws from torch's global CPU RNG, and each rank keeps its slice. The same seed therefore gives the same
full weights whatever the tensor-parallel size. Every parameter carries `tensor_model_parallel` (True when split
over p > 1 ranks), `partition_dim` (the dim it is split along at any TP size; None for RowParallelLinear's bias,
which every rank holds whole) and `partition_stride`, which the checkpoint tools and DeepSpeed's gradient-norm
code read; they agree with the parameter spec (megatron/model/spec.py, tests/unit/model/test_spec.py).

Every layer takes its tensor-parallel group as `tp_group` (a ProcessGroup, or None for no tensor parallelism) and
resolves tp_size / tp_rank once in __init__; forward reads only those attributes, never global state.

gradient_accumulation_fusion=True: each micro batch's weight gradient is summed into `.grad` by the weight-gradient
GEMM (or, for the embedding, an index_put_) itself instead of by autograd's separate add (grad_accumulation.py).
"""
import torch
from torch import nn

from megatron.core.tensor_parallel.grad_accumulation import (embedding_with_grad_accumulation,
                                                              linear_with_grad_accumulation)
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    get_group_size_and_rank,
                                                    reduce_from_tensor_model_parallel_region,
                                                    scatter_to_tensor_model_parallel_region)


def set_tensor_model_parallel_attributes(param, is_parallel, partition_dim, stride=1):
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = stride


def _divide(numerator, denominator, what):
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}); "
                         f"choose --tensor-model-parallel-size that divides {numerator}")
    return numerator // denominator


def _init_split_weight(full_shape, partition_dim, world, rank, init_method, dtype):
    """Initialises the full weight in fp32 with init_method and returns this rank's slice as a Parameter."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    # a copy: a chunk along dim 0 is a view that would keep the whole master weight alive on every TP rank
    local = master.chunk(world, dim=partition_dim)[rank].to(dtype, copy=True).contiguous()
    weight = nn.Parameter(local)
    set_tensor_model_parallel_attributes(weight, world > 1, partition_dim)
    return weight


def _zero_bias(size, dtype, is_parallel, partition_dim):
    bias = nn.Parameter(torch.zeros(size, dtype=dtype))
    set_tensor_model_parallel_attributes(bias, is_parallel, partition_dim)
    return bias


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split along its columns, A = [A_1 ... A_p]; rank i computes Y_i = X A_i + b_i.

    Forward: the input is copied into the TP region (backward all-reduces its gradient); with
    gather_output the partial outputs are all-gathered along the last dimension, otherwise each rank
    returns its (..., output_size / p) slice. The weight is stored as (output_size / p, input_size).
    """

    def __init__(self, input_size, output_size, *, bias=True, gather_output=False, init_method=None,
                 params_dtype=torch.float32, tp_group=None, gradient_accumulation_fusion=False):
        super().__init__()
        self.tp_group = tp_group
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.tp_size, self.tp_rank = world, rank = get_group_size_and_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, world, "output size")
        self.gather_output = gather_output
        init_method = init_method or nn.init.xavier_normal_
        self.weight = _init_split_weight((output_size, input_size), 0, world, rank, init_method, params_dtype)
        self.bias = _zero_bias(self.output_size_per_partition, params_dtype, world > 1, 0) if bias else None

    def forward(self, x, add_bias=True):
        """add_bias=False: X A_i without b_i (Megatron's skip_bias_add), for a caller that adds self.bias inside a
        fused elementwise region; needs gather_output=False."""
        bias = self.bias if add_bias else None
        assert add_bias or not self.gather_output, "add_bias=False needs gather_output=False"
        if self.tp_size > 1:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        y = linear_with_grad_accumulation(x, self.weight, bias, self.gradient_accumulation_fusion)  # (..., output / p)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split along its rows and X along its columns:

        A = [A_1; ...; A_p],  X = [X_1 ... X_p],  Y = sum_i X_i A_i + b

    Forward: unless input_is_parallel the input is split along its last dimension; partial products are
    all-reduced (backward: identity), then the full bias is added once. Weight: (output_size, input_size / p).
    """

    def __init__(self, input_size, output_size, *, bias=True, input_is_parallel=False, init_method=None,
                 params_dtype=torch.float32, tp_group=None, gradient_accumulation_fusion=False):
        super().__init__()
        self.tp_group = tp_group
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.tp_size, self.tp_rank = world, rank = get_group_size_and_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, world, "input size")
        self.input_is_parallel = input_is_parallel
        init_method = init_method or nn.init.xavier_normal_
        self.weight = _init_split_weight((output_size, input_size), 1, world, rank, init_method, params_dtype)
        self.bias = _zero_bias(output_size, params_dtype, False, None) if bias else None  # whole on every rank

    def forward(self, x, add_bias=True):
        """add_bias=False: sum_i X_i A_i without b (Megatron's skip_bias_add), for a caller that adds self.bias
        inside a fused elementwise region."""
        if self.tp_size > 1 and not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        # (..., output_size): this rank's partial product
        y = linear_with_grad_accumulation(x, self.weight, None, self.gradient_accumulation_fusion)
        if self.tp_size > 1:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        return y + self.bias if self.bias is not None and add_bias else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across TP ranks: rank i holds rows [i*V/p, (i+1)*V/p).

    Forward: ids outside this rank's range look up zeros, then the partial embeddings are all-reduced
    (backward: identity), so every rank ends with the full (..., hidden) embedding.
    """

    def __init__(self, num_embeddings, embedding_dim, *, init_method=None, params_dtype=torch.float32,
                 tp_group=None, gradient_accumulation_fusion=False):
        super().__init__()
        self.tp_group = tp_group
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.tp_size, self.tp_rank = world, rank = get_group_size_and_rank(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_partition = _divide(num_embeddings, world, "padded vocabulary size")
        self.vocab_start_index = rank * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        init_method = init_method or nn.init.normal_
        self.weight = _init_split_weight((num_embeddings, embedding_dim), 0, world, rank, init_method,
                                         params_dtype)

    def forward(self, input_ids):
        if self.tp_size == 1:
            return embedding_with_grad_accumulation(input_ids, self.weight, self.gradient_accumulation_fusion)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = embedding_with_grad_accumulation(local_ids, self.weight, self.gradient_accumulation_fusion)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)
