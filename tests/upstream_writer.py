"""Test-only: trains a BLOOM PipelineModule laid out as upstream Megatron-DeepSpeed lays it out, and saves it with
DeepSpeed's own engine.save_checkpoint (what BigScience's BLOOM checkpoints are).

    deepspeed --num_gpus 2 tests/upstream_writer.py <pretrain_bloom.py flags> --upstream-save DIR --upstream-at K \
        --upstream-out OUT

The layer list is upstream GPTModelPipe's for BLOOM: 0 a function (fp16 cast), 1 the tied embedding (its keys
word_embeddings.weight and word_embeddings.norm.{weight,bias}, BigScience's embedding LayerNorm), 2 a function
(transpose), 3 .. 3+L-1 the transformer blocks (upstream's key names), 3+L a function, 3+L+1 the final LayerNorm
(weight, bias), 3+L+2 the tied LM head. The math is this project's layers', so that a run resumed here from the
checkpoint continues this one. The run trains with the same data, schedule and optimizer as pretrain_bloom.py
with the same flags (its Trainer, on DeepSpeed's pipeline engine); at iteration K it saves DIR/global_stepK with
Megatron's client state (args, iteration) and writes OUT/logits.pt (the full-vocabulary logits of a fixed input at
that point, with one pipeline stage); at the end OUT/losses.json (iteration -> loss of every iteration).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402


# What Microsoft's Megatron-DeepSpeed records for DeepSpeed's ds_to_universal (its GPTModelPipe's patterns for BLOOM).
_REPLICATED = [r"tied_modules.embed.word_embeddings.norm.weight", r"tied_modules.embed.word_embeddings.norm.bias",
               r"\d+.input_layernorm.weight", r"\d+.input_layernorm.bias", r"\d+.post_attention_layernorm.weight",
               r"\d+.post_attention_layernorm.bias", r"\d+.self_attention.dense.bias", r"\d+.mlp.dense_4h_to_h.bias",
               r"\d+.weight", r"\d+.bias"]
UNIVERSAL_INFO = {
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": _REPLICATED,
    "parameter_to_average_patterns": _REPLICATED,
    "parameter_with_row_parallelism_patterns": [r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight"],
    "vocabulary_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight"],
    "pipeline_replicated_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight",
                                               r"tied_modules.embed.word_embeddings.norm.weight",
                                               r"tied_modules.embed.word_embeddings.norm.bias"],
}


def _cast(x):
    return x  # upstream: _to_float16 (a no-op in fp32)


def _transpose(x):
    return x  # upstream: [b s h] <-> [s b h]; this project's layers take [b s h]


def build_upstream_model(config, topology, tp_group, partition_method="type:BloomBlockPipe"):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from megatron.core import tensor_parallel
    from megatron.model.bloom import make_layernorm, normal_init
    from megatron.model.pipeline import BloomBlockPipe, _LossFn, _lm_head

    class EmbeddingPipe(nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, init_method=normal_init(config.init_method_std),
                tp_group=tp_group)
            self.word_embeddings.norm = make_layernorm(config, config.hidden_size)

        @property
        def word_embeddings_weight(self):
            return self.word_embeddings.weight

        def forward(self, input_ids):
            return self.word_embeddings.norm(self.word_embeddings(input_ids))

    specs = [_cast, TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr="word_embeddings_weight"), _transpose]
    specs += [LayerSpec(BloomBlockPipe, config, i, tp_group) for i in range(config.num_layers)]
    specs += [_transpose, LayerSpec(nn.LayerNorm, config.hidden_size, eps=config.layernorm_epsilon)]
    specs += [TiedLayerSpec("embed", EmbeddingPipe, forward_fn=_lm_head, tied_weight_attr="word_embeddings_weight")]
    return PipelineModule(layers=specs, loss_fn=_LossFn(tp_group), topology=topology,
                          partition_method=partition_method)


def main():
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--upstream-save", required=True)
    extra.add_argument("--upstream-at", type=int, required=True)
    extra.add_argument("--upstream-out", required=True)
    ours, argv = extra.parse_known_args()

    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from megatron.arguments import load_and_resolve
    from megatron.data.datasets import build_datasets
    from megatron.initialize import initialize_distributed, set_random_seeds, setup_logging
    from megatron.optimizer import AnnealingLR, build_optimizer, get_param_groups
    from megatron.training import Trainer
    from megatron.training.callbacks import Callback
    from megatron.upstream_compat import schedule_lengths

    setup_logging()
    config, ds_config, tokenizer = load_and_resolve(argv)
    state = initialize_distributed(config.parallel)
    set_random_seeds(config.model.seed, state)
    topology = PipeModelDataParallelTopology(num_pp=state.pipeline_model_parallel_size,
                                             num_mp=state.tensor_model_parallel_size, num_dp=state.data_parallel_size)
    with torch.no_grad():
        module = build_upstream_model(config.model, topology, state.tp_group)
    opt = config.optimizer
    optimizer = build_optimizer(get_param_groups(module, opt.weight_decay), opt)
    warmup, decay, _ = schedule_lengths(config.upstream, opt, config.training)
    scheduler = AnnealingLR(optimizer, opt.lr, opt.min_lr, warmup, decay, opt.lr_decay_style)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    os.makedirs(ours.upstream_out, exist_ok=True)

    class SaveUpstream(Callback):
        def on_iteration_end(self, trainer, iteration, loss):
            if iteration != ours.upstream_at:
                return
            model = config.model
            megatron_args = argparse.Namespace(
                num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_dim,
                num_attention_heads=model.num_attention_heads, seq_length=model.seq_length,
                max_position_embeddings=model.max_position_embeddings, padded_vocab_size=model.vocab_size,
                layernorm_epsilon=model.layernorm_epsilon, embed_layernorm=True,
                tensor_model_parallel_size=state.tensor_model_parallel_size,
                pipeline_model_parallel_size=state.pipeline_model_parallel_size,
                consumed_train_samples=trainer.progress.consumed_samples, iteration=iteration)
            engine.save_checkpoint(ours.upstream_save, tag=f"global_step{iteration}", client_state={
                "args": megatron_args, "iteration": iteration, "checkpoint_version": 3.0,
                "tokens": trainer.progress.consumed_samples * model.seq_length,
                "universal_checkpoint_info": {**UNIVERSAL_INFO, "original_vocab_size": tokenizer.vocab_size}})
            if state.pipeline_model_parallel_size > 1:
                return  # the logits need the whole model on one stage
            engine.module.eval()
            with torch.no_grad():
                ids = (torch.arange(2 * model.seq_length).view(2, -1) * 7 + 3) % 200
                local = engine.module(ids)  # (B, S, V / TP): this rank's vocabulary slice
                pieces = [torch.empty_like(local) for _ in range(state.tensor_model_parallel_size)]
                dist.all_gather(pieces, local.contiguous(), group=state.tp_group)
            engine.module.train()
            if state.rank == 0:
                torch.save({"input_ids": ids, "logits": torch.cat(pieces, -1)},
                           os.path.join(ours.upstream_out, "logits.pt"))

    trainer = Trainer(config, state, engine, scheduler, build_datasets(config), tokenizer, None, [SaveUpstream()])
    trainer.pipelined = True  # DeepSpeed's pipeline engine (train_batch), also with one stage
    trainer.data_iter = trainer._batches(trainer.train_ds, 0, 0)
    summary = trainer.train()
    if state.rank == 0:
        with open(os.path.join(ours.upstream_out, "losses.json"), "w") as f:
            json.dump({str(k): v for k, v in summary["losses"].items()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
