"""Checkpoints: the on-disk format, durable writes, the collective save and load, and conversions to and from HF.

    format.py           names, `latest`, the manifest check, choosing a folder, saved meta/config, the model's
                        names, shapes and partition dims (pure: files and JSON, no process group, no DeepSpeed)
    io.py               fsynced and atomic writes, checksummed torch.save, the manifest, atomic output folders
    saved_optimizer.py  the per-parameter optimizer index (index_*.json) and its reader (pure)
    streams.py          windows of tensors read from mapped files, safetensors written a block at a time
    adapters.py         one adapter per DeepSpeed optimizer wrapper: each parameter's state region, read and
                        written (the only module that reads DeepSpeed's optimizer internals)
    optimizer_state.py  each rank's optimizer state per parameter and region, LR schedule and step counters
    save.py             the collective save (atomic iter_* folders, pruning, --save checks)
    load.py             resuming from --load (same or another layout, weights alone), the schedule warning
    convert.py          merged and resharded checkpoints, written in our layout (tools, one process, CPU)
    hf.py               Hugging Face folders: export, lazy import, load_any
    universal.py        any checkpoint with optimizer state rewritten for another TP x PP, its optimizer state per
                        parameter (tools/convert_checkpoint.py; resumes on any DP size and ZeRO stage)

Dependencies point one way: format <- io <- save/load (with saved_optimizer, adapters <- optimizer_state
below them),
and format <- streams/io <- convert <- hf, universal. Nothing here imports megatron.training; import the modules
themselves (this package re-exports nothing).
"""
