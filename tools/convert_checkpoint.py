"""Convert a trained checkpoint to another TP x PP layout with its optimizer state (a universal checkpoint).

    python tools/convert_checkpoint.py --load checkpoints --save checkpoints_tp1_pp1 \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1

--load: a save folder holding `latest`, or an iter_XXXXXXX folder, written by training with its optimizer state
(any TP, PP, DP, ZeRO stage and precision), or by this tool. --save: a save folder (iter_XXXXXXX/ + `latest` are
written in it), or an iter_XXXXXXX folder itself. `pretrain_bloom.py --load <save>` then resumes on TP x PP with
any DP size and ZeRO stage (or on any other layout) with the fp32 master weights, Adam's moments and step, the LR
schedule, the step counters, the loss scale and the data position (megatron/checkpoint/universal.py describes the
files). It streams: one parameter's state and one output file at a time.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import universal  # noqa: E402
from megatron.checkpoint.convert import DTYPE_NAMES  # noqa: E402
from megatron.checkpoint.format import saved_layout_text  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", required=True,
                        help="the checkpoint to convert: an iter_XXXXXXX folder or the save folder holding `latest`")
    parser.add_argument("--save", required=True,
                        help="the output: a save folder (gets iter_XXXXXXX/ and `latest`) or an iter_XXXXXXX folder")
    parser.add_argument("--target-tensor-parallel-size", type=int, required=True)
    parser.add_argument("--target-pipeline-parallel-size", type=int, required=True)
    parser.add_argument("--force", action="store_true", help="replace an existing --save")
    parser.add_argument("--no-verify", action="store_true", help="skip the manifest checksum check of --load")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    try:
        reader, meta, out, count = universal.convert_checkpoint(args.load, args.save, tp, pp, force=args.force,
                                                                verify=not args.no_verify)
    except (ValueError, RuntimeError) as err:  # CheckpointError is a RuntimeError
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"converted {reader.folder} ({saved_layout_text(meta)}) into {out} (TP {tp} x PP {pp}, iteration "
          f"{reader.iteration}, {DTYPE_NAMES[reader.dtype]} weights, optimizer state of {count} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
