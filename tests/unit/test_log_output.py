"""Default output is our own log lines: DeepSpeed's logger, its stdout prints and known warnings only at debug."""
import json
import subprocess
import sys

from tests.distributed import free_port
from tests.launch import ROOT, env

# Runs in a fresh interpreter: setup_logging reconfigures logging and warnings process-wide.
PROBE = r"""
import json, sys, warnings
import torch, torch.distributed as dist
from megatron.initialize import deepspeed_output, setup_logging
from deepspeed.utils import logger as ds_logger
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
seen = {}
for level in ("info", "debug", "info"):
    setup_logging(rank=0, log_level=level)
    print(f"== {level}", flush=True)
    ds_logger.warning("ds-warning-at-%s", level)
    with deepspeed_output():
        print(f"ds-print-at-{level}")
    with warnings.catch_warnings(record=True) as caught:
        dist.all_gather_into_tensor(torch.zeros(1), torch.ones(1))  # torch warns inside this call, as in ZeRO
    seen.setdefault(level, []).append([str(w.message) for w in caught])
try:
    with deepspeed_output():
        print("held-then-shown")
        raise RuntimeError("inside")
except RuntimeError:
    pass
dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_deepspeed_output_hidden_by_default_shown_at_debug():
    probe = PROBE.replace("PORT", str(free_port()))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    seen = json.loads(lines[-1])
    info_out = lines[lines.index("== info"):lines.index("== debug")]
    debug_out = lines[lines.index("== debug"):lines.index("== info", lines.index("== debug"))]
    assert not [line for line in info_out[1:] if "ds-" in line]
    assert [line for line in debug_out if "ds-" in line][-1] == "ds-print-at-debug"
    assert any(line.endswith("ds-warning-at-debug") for line in debug_out)
    assert "ds-warning-at-info" not in proc.stdout and "ds-print-at-info" not in proc.stdout  # nor after debug
    deprecated = "`torch.distributed.all_gather_into_tensor` is deprecated"
    assert seen["info"] == [[], []]
    assert len(seen["debug"][0]) == 1 and seen["debug"][0][0].startswith(deprecated)
    assert "held-then-shown" in proc.stderr and "held-then-shown" not in proc.stdout
