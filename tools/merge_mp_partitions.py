"""Merge a TP x PP checkpoint into a Hugging Face BLOOM folder, or reshard it into another TP x PP layout.

    python tools/merge_mp_partitions.py --model-type bloom --model-path checkpoints/iter_0100000 \
        --num-partitions 4 --output-path bloom_final
    python tools/merge_mp_partitions.py --model-path checkpoints --output-format megatron \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --output-path checkpoints_tp1

--output-format hf writes config.json, model.safetensors (sharded past --max-shard-size), generation_config.json
and the tokenizer, for BloomForCausalLM / AutoTokenizer.from_pretrained(output). --output-format megatron
writes a save root (<output>/iter_XXXXXXX + <output>/latest; or just the folder when --output-path is itself
named iter_XXXXXXX) with weights only, which `pretrain_bloom.py --load <output>` resumes from (the optimizer
restarts; iteration and consumed samples carry over).

Both stream: the shards are mapped and read a tensor (or a block of rows) at a time, so the tool holds one block
of the HF output, or one output shard of a reshard, never the whole model.
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
    parser.add_argument("--model-type", default="bloom", choices=["bloom"])
    parser.add_argument("--model-path", required=True,
                        help="a checkpoint folder (iter_XXXXXXX) or the --save folder holding `latest`")
    parser.add_argument("--num-partitions", type=int, default=None,
                        help="tensor-parallel size of the checkpoint (checked; inferred from meta.json if omitted)")
    parser.add_argument("--output-path", required=True)
    parser.add_argument("--output-format", choices=["hf", "megatron"], default=None,
                        help="hf (default for --model-type bloom) or megatron (reshard)")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="auto keeps the checkpoint's dtype")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (hf output)")
    parser.add_argument("--force", action="store_true", help="replace an existing --output-path")
    parser.add_argument("--no-verify", action="store_true", help="skip the manifest checksum check")
    return parser.parse_args(argv)


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    output_format = args.output_format or "hf"
    try:
        if args.num_partitions is not None and args.num_partitions < 1:
            raise ValueError(f"--num-partitions {args.num_partitions} must be at least 1")
        for flag, value in (("--target-tensor-parallel-size", args.target_tensor_parallel_size),
                            ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be at least 1")
        max_shard = hf.parse_size(args.max_shard_size)
        check_output_path(args.output_path, args.force, [args.model_path])
        reader = convert.CheckpointReader(args.model_path, args.num_partitions, verify=not args.no_verify)
        dtype = convert.resolve_dtype(args.dtype, reader.dtype)
        if output_format == "hf":
            out = hf.write_hf_folder(args.output_path, reader, reader.config, dtype, reader.tokenizer_dir, max_shard,
                                     args.force, source=reader)
            what = "Hugging Face BLOOM folder"
        else:
            out = convert.write_megatron_checkpoint(
                args.output_path, reader, reader.config, args.target_tensor_parallel_size,
                args.target_pipeline_parallel_size, iteration=reader.iteration,
                consumed_samples=reader.consumed_samples, run_config=reader.run_config,
                tokenizer_dir=reader.tokenizer_dir, precision=convert.DTYPE_NAMES[dtype],
                source=reader.folder, force=args.force, dtype=dtype)
            what = (f"checkpoint TP {args.target_tensor_parallel_size} x PP {args.target_pipeline_parallel_size} "
                    f"(iteration {reader.iteration})")
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"merged {reader.folder} (TP {reader.tensor_model_parallel_size} x PP "
          f"{reader.pipeline_model_parallel_size}, {convert.DTYPE_NAMES[reader.dtype]}) into {what} "
          f"{out} ({convert.DTYPE_NAMES[dtype]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
