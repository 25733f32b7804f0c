"""megatron.core: parallel state and tensor-parallel building blocks; imports nothing else from megatron except the
pure megatron.config (validate_parallel_sizes: the one check of TP x PP against the world size)."""
