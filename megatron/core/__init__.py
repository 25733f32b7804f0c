"""megatron.core: parallel state and tensor-parallel building blocks; imports nothing else from megatron."""
