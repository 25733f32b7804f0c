"""megatron.model: the BLOOM network (plain torch + tensor-parallel layers); knows nothing of argparse or DeepSpeed.

BloomModel and InferenceCache are imported on first use, so the pure modules here (spec.py, alibi.py) load
without torch."""


def __getattr__(name):
    if name in ("BloomModel", "InferenceCache"):
        from megatron.model import bloom
        return getattr(bloom, name)
    raise AttributeError(f"module 'megatron.model' has no attribute {name!r}")
