"""ZeRO-3 checkpoints shard by shard (megatron/checkpoint/zero3.py): on DP 2, save and load gather no parameter, each
rank holds only its own parts of the weights, and a resumed engine continues exactly.

Two gloo processes, real engines (tests/checkpoint_engines.py, fp32 and bf16 ZeRO-3). Measured on each rank: the
largest set of full parameters materialized at once (every deepspeed.zero.GatheredParameters entered, the bytes of
its parameters whole), during the save and during the load, and the bytes of weights the save's snapshot holds on the
CPU. Before this layout every rank gathered the whole model on save and on load (measured: 7712 of 7712 bytes in fp32,
3856 of 3856 in bf16, on both ranks), and DP rank 0's snapshot held all of it; now nothing is gathered and each
rank's snapshot holds its half (3856 and 1928 bytes).
"""
import os

import pytest
import torch

DP = 2


class GatherCounter:
    """Wraps deepspeed.zero.GatheredParameters: the peak bytes of parameters held whole at once."""

    def __init__(self, monkeypatch_target):
        self.live = self.peak = 0
        original = monkeypatch_target.GatheredParameters
        counter = self

        class Counted(original):
            def __enter__(self):
                self.counted = sum(p.ds_numel * p.element_size() for p in getattr(self, "params", []) or [])
                counter.live += self.counted
                counter.peak = max(counter.peak, counter.live)
                return super().__enter__()

            def __exit__(self, *args):
                counter.live -= self.counted
                return super().__exit__(*args)

        monkeypatch_target.GatheredParameters = Counted


def _tensor_bytes(obj):
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    return 0


def _save_and_resume(rank, world_size, root):
    import deepspeed
    from megatron.checkpoint import load, save
    from megatron.core import parallel_state
    from tests.checkpoint_engines import build_engine, configure, train, weights
    state = parallel_state.initialize_model_parallel(1, 1)
    counter = GatherCounter(deepspeed.zero)
    results = {}
    for case, flags in (("fp32-zero3", ["--zero-stage", "3"]), ("bf16-zero3", ["--bf16", "--zero-stage", "3"])):
        folder = os.path.join(root, case)
        config, ds_config = configure(folder, flags)
        trained = build_engine(case, config, ds_config, state)
        train(trained, 3)
        full = sum(p.ds_numel * p.element_size() for p in trained.module.parameters())
        counter.peak = 0
        objects = save.snapshot(trained, config, state)
        held = sum(_tensor_bytes(obj) for name, obj in objects.items() if name.startswith("model_"))
        save.write_and_publish(objects, config, state, 3, 6 * world_size)
        saved_gather = counter.peak
        saved_weights = weights(trained)  # gathered by the test, outside what is measured
        load_config, _ = configure(folder, flags, load=folder)
        resumed = build_engine(case, load_config, ds_config, state)
        counter.peak = 0
        load.load_checkpoint(resumed, load_config, state)
        loaded_gather = counter.peak
        zero1_config, zero1_ds = configure(os.path.join(root, case + "-on-zero1"),
                                           [f for f in flags if f != "3"] + ["1"], load=folder)
        on_zero1 = build_engine(case.replace("zero3", "zero1"), zero1_config, zero1_ds, state)
        load.load_checkpoint(on_zero1, zero1_config, state)  # another layout: the parts assembled per tensor
        train(trained, 1, first=3)
        train(resumed, 1, first=3)
        results[case] = {"full": full, "held": held, "save gathered": saved_gather,
                         "load gathered": loaded_gather, "expected": weights(trained), "got": weights(resumed),
                         "saved": saved_weights, "on zero1": weights(on_zero1), "folder": folder,
                         "files": sorted(os.listdir(os.path.join(folder, "iter_0000003")))}
    torch.save(results, os.path.join(root, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    from tests.distributed import run_distributed
    root = str(tmp_path_factory.mktemp("zero3"))
    run_distributed(_save_and_resume, DP, root)
    return [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False) for r in range(DP)]


@pytest.mark.parametrize("case", ["fp32-zero3", "bf16-zero3"])
def test_zero3_saves_and_loads_shard_by_shard_and_resumes_exactly(zero3_runs, case):
    for rank, results in enumerate(zero3_runs):
        result = results[case]
        assert result["save gathered"] == 0 and result["load gathered"] == 0, (rank, result["save gathered"],
                                                                             result["load gathered"])
        assert 0 < result["held"] < result["full"], (rank, result["held"], result["full"])  # before: all of it
        assert sorted(result["expected"]) == sorted(result["got"])
        for name, tensor in result["expected"].items():
            assert torch.equal(tensor, result["got"][name]), (rank, name)
    assert sum(results[case]["held"] for results in zero3_runs) == zero3_runs[0][case]["full"]  # each element once
    saved = zero3_runs[0][case]["saved"]
    assert sorted(zero3_runs[0][case]["on zero1"]) == sorted(saved)
    for name, tensor in saved.items():  # resumed on ZeRO 1 (load.load_model_weights through zero3.read_weights)
        assert torch.equal(zero3_runs[0][case]["on zero1"][name], tensor), name
    files = zero3_runs[0][case]["files"]
    assert [f for f in files if f.startswith("model_")] == ["model_tp00_pp000_dp00000.pt",
                                                             "model_tp00_pp000_dp00001.pt"]


def test_the_merge_tool_and_the_readers_assemble_the_parts(zero3_runs, tmp_path):
    """tools/merge_mp_partitions.py (CheckpointReader) on the DP 2 ZeRO-3 checkpoint: the merged weights equal the
    saved ones (gathered by the test at the save); so does its megatron output, one model_tp00_pp000.pt."""
    from megatron.checkpoint import convert
    from tests.unit.test_streaming_convert import load_tool
    result = zero3_runs[0]["bf16-zero3"]
    folder = os.path.join(result["folder"], "iter_0000003")
    merged = convert.load_merged_checkpoint(folder)
    assert merged.dtype == torch.bfloat16 and sorted(merged.weights) == sorted(result["saved"])
    for name, tensor in result["saved"].items():
        assert torch.equal(merged.weights[name], tensor), name
    out = tmp_path / "merged"
    assert load_tool("merge_mp_partitions").main(["--model-path", folder, "--output-path", str(out),
                                                  "--output-format", "megatron"]) == 0
    shard = torch.load(out / "iter_0000003" / "model_tp00_pp000.pt", weights_only=True)
    for name, tensor in result["saved"].items():
        assert torch.equal(shard["weights"][name], tensor), name
