"""Pretrain a BLOOM-architecture model: parse flags -> validate everything -> build -> train.

    deepspeed --num_gpus 2 pretrain_bloom.py --tensor-model-parallel-size 2 ... --deepspeed --deepspeed_config ds.json
"""
import logging

from megatron.arguments import build_config, parse_args, world_size_from_env
from megatron.core.parallel_state import validate_parallel_sizes
from megatron.deepspeed_config import apply_flag_keys, build_deepspeed_config, load_user_config, reconcile_args
from megatron.initialize import deepspeed_output, exit_before_distributed, setup_logging

logger = logging.getLogger("megatron")


def build_tokenizer_from_args(args):
    """The tokenizer named by the flags (GPT2BPETokenizer when --vocab-file and --merge-file are given)."""
    from megatron.tokenizer import build_tokenizer
    tokenizer_type = args.tokenizer_type
    if tokenizer_type is None:
        if args.vocab_file and args.merge_file:
            tokenizer_type = "GPT2BPETokenizer"
        elif args.tokenizer_name_or_path:
            tokenizer_type = "PretrainedFromHF"
        else:
            raise ValueError("no tokenizer: pass --vocab-file and --merge-file (GPT2BPETokenizer) or "
                             "--tokenizer-name-or-path (a local Hugging Face tokenizer folder)")
    return build_tokenizer(tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_name_or_path=args.tokenizer_name_or_path)


def resolve_config(argv=None):
    """Every check that can fail before any process group, model or data is built. Returns (config, ds, tok)."""
    args = parse_args(argv)
    user_ds = load_user_config(args.deepspeed_config)
    apply_flag_keys(args, user_ds, args.deepspeed_config)  # its keys naming flags (lr, micro_batch_size, ...)
    world_size = world_size_from_env()
    data_parallel_size = validate_parallel_sizes(world_size, args.tensor_model_parallel_size,
                                                 args.pipeline_model_parallel_size)
    reconcile_args(args, user_ds, data_parallel_size)
    tokenizer = None if args.mock_data and not (args.vocab_file or args.tokenizer_name_or_path) \
        else build_tokenizer_from_args(args)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else args.mock_vocab_size
    if args.load and args.pad_vocab_size_to is None:
        _keep_saved_vocab(args, vocab_size)
    config = build_config(args, world_size, vocab_size)
    return config, build_deepspeed_config(config, user_ds), tokenizer


def _keep_saved_vocab(args, tokenizer_vocab):
    """Resuming (or fine-tuning) keeps the checkpoint's padded vocabulary, which depends on the TP size it was
    trained with (128 x TP), instead of padding the tokenizer again for this run's TP size."""
    from megatron.checkpointing import saved_model_config
    saved = (saved_model_config(args.load) or {}).get("vocab_size")
    if not saved or saved < tokenizer_vocab:
        return
    if saved % args.tensor_model_parallel_size != 0:
        raise ValueError(f"--load {args.load}: its padded vocabulary ({saved}) is not divisible by "
                         f"--tensor-model-parallel-size {args.tensor_model_parallel_size}; pick a TP size that "
                         "divides it")
    args.pad_vocab_size_to = saved
    logger.info("keeping the checkpoint's padded vocabulary of %d (--pad-vocab-size-to overrides)", saved)


def build_datasets(config):
    training = config.training
    train_samples = training.train_iters * training.global_batch_size
    eval_samples = (training.train_iters // max(training.eval_interval, 1) + 1) * training.eval_iters * \
        training.global_batch_size
    if config.data.mock_data:
        from megatron.data.mock_dataset import MockGPTDataset
        vocab = config.data.mock_vocab_size
        return (MockGPTDataset(train_samples, config.model.seq_length, vocab, training.seed),
                MockGPTDataset(eval_samples, config.model.seq_length, vocab, training.seed + 1), None)
    from megatron.data.gpt_dataset import build_train_valid_test_datasets
    return build_train_valid_test_datasets(
        list(config.data.data_path), config.data.split,
        (train_samples, eval_samples, training.eval_iters * training.global_batch_size),
        config.model.seq_length, training.seed, config.data.data_cache_dir)


def main(argv=None, step_hook=None):
    setup_logging()
    from megatron import checkpointing
    try:
        config, ds_config, tokenizer = resolve_config(argv)
        if config.checkpoint.save:  # writable, with room for one more checkpoint
            checkpointing.check_save_dir(config.checkpoint.save, checkpointing.checkpoint_bytes(
                config.model.num_parameters(), config.precision.name, config.checkpoint.no_save_optim))
    except ValueError as err:
        exit_before_distributed(str(err), 2)  # printed once, not once per process
    setup_logging(log_level=config.logging.log_level)

    from megatron.initialize import (exit_after_error, initialize_distributed, load_kernels, set_random_seeds,
                                     shutdown_distributed)
    from megatron.data.indexed_dataset import IndexedDatasetError
    from megatron.training import FatalTrainingError, pretrain, setup_engine

    state = initialize_distributed(config.parallel)
    try:
        load_kernels(config.model)
    except RuntimeError as err:  # --abort-on-unmet-fused-kernel-constraints and the kernels cannot serve
        exit_after_error(err, 1)
    set_random_seeds(config.training.seed, state)
    with deepspeed_output():  # its prints (topology, memory dumps) only with --log-level debug
        engine, scheduler = setup_engine(config, ds_config, state)
    try:
        start = None
        if config.checkpoint.load:
            start = checkpointing.load_checkpoint(engine, config)
        datasets = build_datasets(config)
        result = pretrain(config, engine, scheduler, datasets, tokenizer, start, step_hook)
    except (checkpointing.CheckpointError, FatalTrainingError, IndexedDatasetError) as err:  # one line, exit 1
        exit_after_error(err, 1)
    shutdown_distributed()
    return result


if __name__ == "__main__":
    main()
