"""MegatronLM with data parallelism (2 gloo processes): each replica scores every other batch and the results are
all-gathered, equal on both ranks to one process scoring everything."""
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.launch import TOKENIZER

REQUESTS = [(None, [5, 6, 7, 8], [9, 10]), (None, [5, 6, 7, 8], [11]), (None, [20, 21], [22, 23, 24]),
            (None, [30], [31]), (None, list(range(40, 70)), [71, 72]), (None, [3, 4], [5])]


def _worker(rank, world_size):
    from megatron.config import ModelConfig
    from megatron.core.parallel_state import ParallelState
    from megatron.evaluation.harness import MegatronLM
    from megatron.inference.scoring import Scorer
    from megatron.model import BloomModel
    from megatron.tokenizer import build_tokenizer

    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=8064, seq_length=32,
                         attention_impl="torch", hidden_dropout=0.0, attention_dropout=0.0, seed=3)
    model = BloomModel(config, parallel_output=False).eval()
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(TOKENIZER))
    scorer = Scorer.for_bloom_model(model, vocab_limit=tokenizer.vocab_size)
    single = MegatronLM(scorer, tokenizer, 32, batch_size=1)._loglikelihood_tokens(REQUESTS)
    state = ParallelState(world_size=2, rank=rank, data_parallel_size=2, dp_group=dist.new_group([0, 1]),
                          dp_ranks=(0, 1))
    calls = []
    inner = scorer.score_continuations
    scorer.score_continuations = lambda groups, top_n=0: calls.append(len(groups)) or inner(groups, top_n)
    parallel = MegatronLM(scorer, tokenizer, 32, batch_size=1, state=state)._loglikelihood_tokens(REQUESTS)
    assert parallel == single, (parallel, single)
    assert len(calls) == (3 if rank == 0 else 2), calls  # 5 batches (one context group each): 0, 2, 4 and 1, 3
    gathered = [None, None]
    dist.all_gather_object(gathered, parallel)
    assert gathered[0] == gathered[1]


def test_data_parallel_replicas_split_the_batches():
    run_distributed(_worker, 2)
