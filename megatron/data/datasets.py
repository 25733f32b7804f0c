"""The train/valid/test datasets a run's config asks for: mock tokens (--mock-data) or the indexed corpus."""


def build_datasets(config):
    """(train, valid, test) datasets sized for config.training's iterations, global batch and eval schedule."""
    training = config.training
    train_samples = training.train_iters * training.global_batch_size
    eval_samples = (training.train_iters // max(training.eval_interval, 1) + 1) * training.eval_iters * \
        training.global_batch_size
    if config.data.mock_data:
        from megatron.data.mock_dataset import MockGPTDataset
        vocab = config.data.mock_vocab_size
        return (MockGPTDataset(train_samples, config.model.seq_length, vocab, config.model.seed),
                MockGPTDataset(eval_samples, config.model.seq_length, vocab, config.model.seed + 1), None)
    from megatron.data.gpt_dataset import build_train_valid_test_datasets
    return build_train_valid_test_datasets(
        list(config.data.data_path), config.data.split,
        (train_samples, eval_samples, training.eval_iters * training.global_batch_size),
        config.model.seq_length, config.model.seed, config.data.data_cache_dir)
