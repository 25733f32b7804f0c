"""What generation and serving load: a checkpoint of any layout (merged in memory) or an HF folder, and its tokenizer."""
from megatron import checkpoint_tools
from megatron.tokenizer import build_tokenizer


def load_checkpoint_and_tokenizer(path, num_partitions=None, tokenizer_dir=None):
    """(MergedCheckpoint, tokenizer) for --load path; tokenizer_dir overrides the checkpoint's own tokenizer.
    Raises ValueError naming the flag when there is no tokenizer or it does not fit the model's vocabulary."""
    merged = checkpoint_tools.load_any(path, num_partitions)
    tokenizer_dir = tokenizer_dir or merged.tokenizer_dir
    if tokenizer_dir is None:
        raise ValueError(f"--load {path} has no tokenizer; pass --tokenizer-name-or-path FOLDER")
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=tokenizer_dir)
    if tokenizer.vocab_size > merged.config.vocab_size:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {tokenizer.vocab_size} tokens but the model's "
                         f"vocabulary holds {merged.config.vocab_size}; pass the tokenizer it was trained with")
    return merged, tokenizer
