"""megatron/inference/scoring.py on a random tiny BloomModel: log-probs equal log_softmax of the model's own full
logits over the real vocabulary (padding rows never enter the softmax, even when they would win), the shared-prefix
path equals the flat path, top-n alternatives are the largest log-probs."""
import pytest
import torch

from megatron.config import ModelConfig
from megatron.inference.scoring import Scorer
from megatron.model import BloomModel

REAL, PADDED = 100, 128  # tokenizer vocabulary, the embedding's (padded) rows


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=PADDED, seq_length=32,
                         attention_impl="torch", hidden_dropout=0.0, attention_dropout=0.0, seed=7)
    model = BloomModel(config, parallel_output=False).eval()
    with torch.no_grad():  # padding rows that would dominate any softmax that let them in: logit = sum(h) = 32
        model.final_layernorm.bias.fill_(1.0)
        model.embedding.word_embeddings.weight[REAL:] = 1.0
    return model


def reference(model, prefix, continuation):
    """log p(continuation | prefix) per token from the model's full logits, softmax over the first REAL ids."""
    ids = torch.tensor([prefix + continuation[:-1]])
    with torch.no_grad():
        logp = model(ids)[0, len(prefix) - 1:].float()[:, :REAL].log_softmax(-1)
    target = torch.tensor(continuation)
    return logp.gather(1, target[:, None])[:, 0].tolist(), (logp.argmax(-1) == target).tolist(), logp


def test_padding_rows_never_enter_the_softmax(model):
    with torch.no_grad():
        unmasked = model(torch.tensor([[5, 6, 7]]))[0]
    assert int(unmasked.argmax(-1)[-1]) >= REAL  # without the mask a padding row would win
    scorer = Scorer.for_bloom_model(model, vocab_limit=REAL)
    prefix, continuation = [5, 6, 7], [9, 10, 11, 3]
    expected, greedy, logp = reference(model, prefix, continuation)
    flat = scorer.score([prefix + continuation[:-1]], [(len(prefix) - 1, continuation)], top_n=3)[0]
    torch.testing.assert_close(flat.logprobs, expected, rtol=0, atol=1e-5)
    assert flat.greedy == greedy
    values, indices = logp.topk(3, dim=-1)
    assert flat.top_ids == indices.tolist()
    torch.testing.assert_close(flat.top_logprobs, values.double().tolist(), rtol=0, atol=1e-6)
    assert all(i < REAL for row in flat.top_ids for i in row)
    argmax = logp.argmax(-1).tolist()  # a continuation of the argmax tokens is greedy
    assert scorer.score([prefix + argmax[:1]], [(len(prefix) - 1, argmax[:1] + [0])])[0].greedy[0]


def test_shared_prefixes_equal_the_flat_path(model):
    scorer = Scorer.for_bloom_model(model, vocab_limit=REAL)
    groups = [([5, 6, 7, 8, 9], [[10], [11, 12], [13, 14, 15]]), ([20, 21], [[22, 23]]), ([30], [[31] * 6])]
    shared = scorer.score_continuations(groups, top_n=2)
    flat = Scorer(model.hidden_states, model.embedding.word_embeddings.weight, vocab_limit=REAL,
                  hidden_size=32).score_continuations(groups, top_n=2)  # no model: each request in full
    for (prefix, conts), got, want in zip(groups, shared, flat):
        for cont, a, b in zip(conts, got, want):
            expected, greedy, _ = reference(model, prefix, cont)
            torch.testing.assert_close(a.logprobs, expected, rtol=0, atol=1e-5)
            torch.testing.assert_close(b.logprobs, expected, rtol=0, atol=1e-5)
            assert a.greedy == b.greedy == greedy
            assert a.top_ids == b.top_ids


def test_out_of_range_span_names_the_row(model):
    scorer = Scorer.for_bloom_model(model)
    with pytest.raises(ValueError, match=r"row 0: positions 2\.\.4 lie outside its 3 tokens"):
        scorer.score([[1, 2, 3]], [(2, [4, 5, 6])])
