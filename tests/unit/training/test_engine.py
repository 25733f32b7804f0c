"""megatron.training.engine's additions to the DeepSpeed JSON, read back through DeepSpeed's own config parser."""
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
