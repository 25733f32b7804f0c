"""What a run reports about itself outside the log line: GPU utilization from NVML, the torch profiler window
(--profile) and Weights & Biases (--wandb-project). Each heavy import (pynvml, torch.profiler's trace export,
wandb) happens only when its feature is on; none of them can stop a run: a failure is one warning."""
import logging
import os

import torch

from megatron.training.callbacks import Callback

logger = logging.getLogger("megatron.training")


class GpuUtilization:
    """NVML's GPU utilization of this process's device, averaged over a log window: the share of time in which at
    least one kernel was running (what nvidia-smi shows), from NVML's sample buffer (one sample every 1/6 to 1 s),
    else the last sample period's value. available is False without CUDA or NVML (then window_mean() is None)."""

    def __init__(self, warn=True):
        self.handle, self.pynvml, self.since = None, None, 0
        if not torch.cuda.is_available():
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self.pynvml, self.handle = pynvml, self._handle(pynvml)
        except Exception as err:  # noqa: BLE001 -- no driver library, no permission: report, run on
            if warn:
                logger.warning("GPU utilization is not reported: NVML is not usable here (%s: %s)",
                               type(err).__name__, err)
            self.handle = None

    @property
    def available(self):
        return self.handle is not None

    @staticmethod
    def _handle(pynvml):
        """The NVML handle of torch's current device (by UUID or PCI bus id, which CUDA_VISIBLE_DEVICES does not
        renumber)."""
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        uuid = str(getattr(props, "uuid", "") or "")
        if uuid:
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
            except pynvml.NVMLError:
                pass
        try:
            bus = f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except (AttributeError, pynvml.NVMLError):
            if os.environ.get("CUDA_VISIBLE_DEVICES"):
                raise
            return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

    def _samples(self, since):
        try:
            _, samples = self.pynvml.nvmlDeviceGetSamples(self.handle, self.pynvml.NVML_GPU_UTILIZATION_SAMPLES,
                                                          since)
        except self.pynvml.NVMLError:  # NOT_FOUND: no sample since `since`
            return []
        return [(s.timeStamp, s.sampleValue.uiVal) for s in samples if s.timeStamp > since]

    def start_window(self):
        if self.available:
            samples = self._samples(0)
            self.since = max((t for t, _ in samples), default=0)

    def window_mean(self):
        """Mean utilization (percent) since start_window(); None when not available."""
        if not self.available:
            return None
        samples = self._samples(self.since)
        if samples:
            self.since = max(t for t, _ in samples)
            return sum(v for _, v in samples) / len(samples)
        return float(self.pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)


def profiled_iterations(monitoring):
    """The iterations --profile traces: after --profile-step-start, up to and including --profile-step-end
    (Megatron-LM starts the profiler at step S and stops it at step E)."""
    return range(monitoring.profile_step_start + 1, monitoring.profile_step_end + 1)


class ProfilerWindow(Callback):
    """--profile: a torch profiler trace of profiled_iterations() on the ranks in --profile-ranks, each iteration
    named ProfilerStep#<iteration>, written to --profile-dir as rank<r>_iterations<a>-<b>.pt.trace.json (Chrome
    trace format: Perfetto, chrome://tracing and TensorBoard's profiler plugin open it)."""

    def __init__(self, monitoring, rank):
        self.iterations = profiled_iterations(monitoring)
        self.enabled = monitoring.profile and rank in monitoring.profile_ranks
        self.directory, self.rank = monitoring.profile_dir, rank
        self.profiler = self.step = None
        self.path = None

    def on_iteration_start(self, trainer, iteration):
        if not self.enabled or iteration not in self.iterations:
            return
        if self.profiler is None:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities, record_shapes=False, with_stack=False)
            self.profiler.start()
        self.step = torch.profiler.record_function(f"ProfilerStep#{iteration}")
        self.step.__enter__()

    def on_iteration_end(self, trainer, iteration, loss):
        if self.step is None:
            return
        self.step.__exit__(None, None, None)
        self.step = None
        if iteration == self.iterations[-1]:
            self._write()

    def on_train_end(self, trainer, summary):
        if self.profiler is not None:  # the run stopped inside the window: keep what was traced
            self._write()

    def _write(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.stop()
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, f"rank{self.rank}_iterations{self.iterations[0]}-"
                                                 f"{self.iterations[-1]}.pt.trace.json")
        self.profiler.export_chrome_trace(self.path)
        self.profiler = None
        logger.info("profiler trace of iterations %d-%d written to %s", self.iterations[0], self.iterations[-1],
                    self.path)


class WandbWriter:
    """Rank 0's Weights & Biases run: the scalars tensorboard gets, under the same names (train/lm_loss, ...).
    WANDB_MODE=offline keeps it in --wandb-save-dir for `wandb sync`. If wandb cannot start (not installed, no
    API key, no network) or stops accepting data, one warning and the run goes on without it."""

    def __init__(self, monitoring, run_config):
        self.run = None
        try:
            import wandb
            if monitoring.wandb_save_dir:
                os.makedirs(monitoring.wandb_save_dir, exist_ok=True)
            self.run = wandb.init(project=monitoring.wandb_project, name=monitoring.wandb_exp_name,
                                  dir=monitoring.wandb_save_dir, config=run_config)
        except Exception as err:  # noqa: BLE001 -- any failure of an optional logger must not stop training
            self._give_up("could not start", err)

    def _give_up(self, what, err):
        logger.warning("W&B %s (%s: %s); training goes on without W&B", what, type(err).__name__,
                       str(err).splitlines()[0] if str(err) else "")
        self.run = None

    def log(self, scalars, step):
        if self.run is None:
            return
        try:
            self.run.log(scalars, step=step)
        except Exception as err:  # noqa: BLE001
            self._give_up("stopped accepting data", err)

    def close(self):
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as err:  # noqa: BLE001
                self._give_up("could not finish", err)
