"""Tensor-parallel layers, communication mappings, vocab-parallel cross entropy and the model-parallel RNG.

Every entry point takes the tensor-parallel group explicitly (`tp_group=` for modules, `group` for functions):
a torch.distributed ProcessGroup, or None for no tensor parallelism. None of them reads parallel_state's global.
"""
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.grad_accumulation import (embedding_with_grad_accumulation,
                                                              linear_with_grad_accumulation)
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    get_group_size_and_rank,
                                                    reduce_from_tensor_model_parallel_region,
                                                    scatter_to_tensor_model_parallel_region)
from megatron.core.tensor_parallel.random import (checkpoint, get_cuda_rng_tracker, get_rng_tracker,
                                                  model_parallel_manual_seed, model_parallel_cuda_manual_seed)
