"""What generation and serving load: a checkpoint of any layout (merged in memory) or an HF folder, and its tokenizer;
the command-line flags tools/generate_text.py and tools/run_text_generation_server.py share to choose it."""
import os

from megatron.checkpoint.convert import DTYPES
from megatron.checkpoint.hf import load_any
from megatron.inference.checks import check_tokenizer_fits_model
from megatron.tokenizer import build_tokenizer


def add_model_flags(parser):
    """The flags naming the model and how it runs: --load, --tokenizer-name-or-path, --num-partitions, --dtype,
    --no-cuda-graphs."""
    parser.add_argument("--load", required=True,
                        help="checkpoint folder (iter_XXXXXXX), its --save root, or a Hugging Face BLOOM folder")
    parser.add_argument("--tokenizer-name-or-path", default=None,
                        help="tokenizer folder (default: the checkpoint's tokenizer/ or the HF folder)")
    parser.add_argument("--num-partitions", type=int, default=None, help="expected TP size of --load (checked)")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="auto: the stored dtype on GPU, fp32 on CPU")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on a GPU")


def device_and_dtype(merged, dtype_flag):
    """(device, dtype) to run merged on: the GPU if there is one; --dtype auto is the stored dtype there, fp32 on
    the CPU."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype_flag != "auto":
        return device, DTYPES[dtype_flag]
    return device, merged.dtype if device == "cuda" else torch.float32


def load_checkpoint_and_tokenizer(path, num_partitions=None, tokenizer_dir=None):
    """(MergedCheckpoint, tokenizer) for --load path; tokenizer_dir overrides the checkpoint's own tokenizer.
    Raises ValueError naming the flag when there is no tokenizer or it does not fit the model's vocabulary."""
    merged = load_any(path, num_partitions)
    own_dir = merged.tokenizer_dir
    tokenizer_dir = tokenizer_dir or own_dir
    if tokenizer_dir is None:
        raise ValueError(f"--load {path} has no tokenizer; pass --tokenizer-name-or-path FOLDER")
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=tokenizer_dir)
    overridden = own_dir is not None and os.path.realpath(own_dir) != os.path.realpath(tokenizer_dir)
    own = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=own_dir) if overridden else None
    check_tokenizer_fits_model(tokenizer, tokenizer_dir, merged.config.vocab_size, merged.run_config, own, own_dir)
    return merged, tokenizer
