"""Convert a trained checkpoint to another TP x PP layout with its optimizer state (a universal checkpoint).

    python tools/convert_checkpoint.py --load checkpoints --save checkpoints_tp1_pp1 \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1

--load: a save folder holding `latest`, or an iter_XXXXXXX folder, written by training with its optimizer state
(any TP, PP, DP, ZeRO stage and precision), or by this tool. --save: a save folder (iter_XXXXXXX/ + `latest` are
written in it), or an iter_XXXXXXX folder itself. `pretrain_bloom.py --load <save>` then resumes on TP x PP with
any DP size and ZeRO stage (or on any other layout) with the fp32 master weights, Adam's moments and step, the LR
schedule, the step counters, the loss scale and the data position (megatron/checkpoint/universal.py describes the
files). It streams: one parameter's state and one output file at a time.

--load may also name an upstream Megatron-DeepSpeed checkpoint (BigScience's BLOOM runs, Microsoft's fork): a
folder holding `latest` and global_stepN/ (layer_XX-model_YY-model_states.pt, mp_rank_XX_model_states.pt, ZeRO's
[bf16_]zero_pp_rank_*_optim_states.pt), a global_stepN folder, or a universal checkpoint (latest_universal); its
weights, and its optimizer state where the ZeRO files name it per parameter, are written in this project's format
(megatron/checkpoint/upstream.py describes the layout read).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint import universal, upstream  # noqa: E402
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
    parser.add_argument("--no-optimizer-state", action="store_true",
                        help="an upstream checkpoint: convert the weights alone (the optimizer restarts on resume)")
    parser.add_argument("--universal-checkpoint", action="store_true",
                        help="an upstream folder: convert its universal checkpoint (latest_universal)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    try:
        kind, _ = upstream.classify_load(args.load, args.universal_checkpoint)
        if kind == "upstream":
            checkpoint, out, count = universal.convert_upstream_checkpoint(
                upstream.locate(args.load, args.universal_checkpoint), args.save, tp, pp, force=args.force,
                with_optimizer=not args.no_optimizer_state)
            print(f"converted upstream Megatron-DeepSpeed checkpoint {checkpoint.folder} (TP "
                  f"{checkpoint.tensor_model_parallel_size}, PP {checkpoint.pipeline_model_parallel_size}) into {out} "
                  f"(TP {tp} x PP {pp}, iteration {checkpoint.iteration}, {DTYPE_NAMES[checkpoint.dtype]} weights, "
                  f"optimizer state of {count} parameters)")
            return 0
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
