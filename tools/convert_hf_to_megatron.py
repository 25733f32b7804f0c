"""Convert a local Hugging Face BLOOM folder into this project's checkpoint layout for a chosen TP x PP.

    python tools/convert_hf_to_megatron.py --hf-model-path bloom-560m --output-path ckpt_bloom560m \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    deepspeed --num_gpus 4 pretrain_bloom.py --load ckpt_bloom560m --finetune ...

Writes <output>/iter_0000000/ (weight shards, config.json, meta.json, the tokenizer if the HF folder has one,
manifest.json) and <output>/latest. The training run must use the same padded vocabulary
(the HF vocab_size; pass --pad-vocab-size-to <vocab_size> when the tokenizer pads differently).
The conversion streams: the HF files are read a tensor slice at a time and one output shard is in memory at once.
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import convert, hf  # noqa: E402
from megatron.checkpoint.io import check_output_path  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-model-path", "--load", dest="hf_model_path", required=True,
                        help="local folder written by save_pretrained (config.json + safetensors or .bin)")
    parser.add_argument("--output-path", required=True)
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="auto keeps the stored dtype")
    parser.add_argument("--force", action="store_true", help="replace an existing --output-path")
    return parser.parse_args(argv)


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        for flag, value in (("--target-tensor-parallel-size", args.target_tensor_parallel_size),
                            ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be at least 1")
        check_output_path(args.output_path, args.force, [args.hf_model_path])
        reader = hf.HFReader(args.hf_model_path)
        dtype = convert.resolve_dtype(args.dtype, reader.dtype)
        out = convert.write_megatron_checkpoint(
            args.output_path, reader, reader.config, args.target_tensor_parallel_size,
            args.target_pipeline_parallel_size, iteration=0, run_config=reader.run_config,
            tokenizer_dir=reader.tokenizer_dir, precision=convert.DTYPE_NAMES[dtype],
            source=os.path.abspath(args.hf_model_path), force=args.force, dtype=dtype)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"converted {args.hf_model_path} into {out} (TP {args.target_tensor_parallel_size} x PP "
          f"{args.target_pipeline_parallel_size}, {convert.DTYPE_NAMES[dtype]}, vocab "
          f"{reader.config.vocab_size}{', with tokenizer' if reader.tokenizer_dir else ', no tokenizer'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
