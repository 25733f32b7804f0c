"""megatron: a Megatron-DeepSpeed fork that trains BLOOM-architecture models with TP, PP and DP."""
__version__ = "0.1.0"
