"""megatron.model: the BLOOM network (plain torch + tensor-parallel layers); knows nothing of argparse or DeepSpeed."""
from megatron.model.bloom import BloomModel, InferenceCache
