"""megatron.training.engine's additions to the DeepSpeed JSON, read back through DeepSpeed's own config parser."""
import os

import torch
from deepspeed.utils.config import get_timers_config

from megatron.training.engine import _throughput_timer_unsynchronized


def test_throughput_timer_runs_without_device_syncs_unless_the_json_says():
    assert get_timers_config({}).synchronized is True  # DeepSpeed's default: a device sync per micro batch
    base = {"train_batch_size": 8, "timers": {"throughput": {"enabled": True}}, "bf16": {"enabled": True}}
    got = _throughput_timer_unsynchronized(base)
    timers = get_timers_config(got)
    assert (timers.enabled, timers.synchronized) == (True, False)
    assert get_timers_config(_throughput_timer_unsynchronized({})).synchronized is False
    assert got["bf16"] == {"enabled": True} and base["timers"] == {"throughput": {"enabled": True}}  # not mutated
    for chosen in (True, False):
        given = {"timers": {"throughput": {"synchronized": chosen}}}
        assert get_timers_config(_throughput_timer_unsynchronized(given)).synchronized is chosen


def _identity_allreduce_runs(rank, world_size, root, results):
    """One process: each case's engine with the all-reduce skipped where skip_identity_allreduce decides, and the
    same engine with DeepSpeed's all-reduce forced on; the calls into DeepSpeed's bucket all-reduce and the weights
    after 3 steps."""
    import deepspeed.runtime.engine as ds_engine
    from megatron.core import parallel_state
    from tests.checkpoint_engines import build_engine, configure, train, weights
    state = parallel_state.initialize_model_parallel(1, 1)
    calls = []
    original = ds_engine.DeepSpeedEngine.allreduce_bucket

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    ds_engine.DeepSpeedEngine.allreduce_bucket = counted
    out = {}
    for case, flags in (("fp32-zero0", []), ("bf16-zero0", ["--bf16"]), ("fp32-zero1", ["--zero-stage", "1"])):
        got = {}
        for forced in (False, True):
            config, ds_config = configure(os.path.join(root, case), flags)
            engine = build_engine(case, config, ds_config, state)
            got.setdefault("enabled", engine.enable_backward_allreduce)
            engine.enable_backward_allreduce = engine.enable_backward_allreduce or forced
            calls.clear()
            train(engine, 3)
            got[forced] = (len(calls), weights(engine))
        out[case] = got
    torch.save(out, results)


def test_one_data_parallel_rank_skips_deepspeeds_identity_allreduce(tmp_path):
    """At one data-parallel rank and ZeRO 0 the engine leaves out DeepSpeed's gradient all-reduce (no bucket is
    flattened or reduced) and trains to the same weights, bit for bit, as with it; ZeRO 1 keeps DeepSpeed's own
    reduction. (At two ranks the reduction runs: tests/integration/test_timers.py times it.)"""
    from tests.distributed import run_distributed
    results = tmp_path / "results.pt"
    run_distributed(_identity_allreduce_runs, 1, str(tmp_path), str(results))
    out = torch.load(results)
    for case in ("fp32-zero0", "bf16-zero0"):
        assert out[case]["enabled"] is False, case
        skipped, forced = out[case][False], out[case][True]
        assert skipped[0] == 0 and forced[0] > 0, case
        assert skipped[1].keys() == forced[1].keys()
        for name in skipped[1]:
            assert torch.equal(skipped[1][name], forced[1][name]), (case, name)
    assert out["fp32-zero1"]["enabled"] is True
