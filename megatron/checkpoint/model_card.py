"""What an exported Hugging Face folder says about the model: the tokenizer's model_max_length and a model card.

    set_model_max_length(folder, seq_length)   tokenizer_config.json's model_max_length = the trained length
    write_model_card(folder, config, dtype, source)   README.md: architecture, data, flags, metrics

The card is written from the checkpoint alone: its config.json (the resolved run: model, layout, optimizer,
data), meta.json (iteration, consumed samples) and the run's metrics.jsonl beside the save folder (the last
training and validation lines at or before the checkpoint's iteration), when it is there.
"""
import json
import os

# transformers' "no limit" value, which a tokenizer folder without a recorded length carries
UNSET_MODEL_MAX_LENGTH = 1000000000000000019884624838656


def set_model_max_length(folder, seq_length):
    """Sets model_max_length in folder/tokenizer_config.json (written for a bare tokenizer.json) to seq_length,
    so AutoTokenizer truncates and warns at the length the model was trained on. Returns whether it was set."""
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    elif os.path.isfile(os.path.join(folder, "tokenizer.json")):
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        return False
    config["model_max_length"] = int(seq_length)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return True


def metrics_file_of(folder, run_config):
    """The metrics.jsonl of the run that saved checkpoint `folder`: beside its save root, else the one config.json
    names (if it exists)."""
    candidates = [os.path.join(os.path.dirname(os.path.abspath(folder)), "metrics.jsonl")]
    named = ((run_config or {}).get("logging") or {}).get("metrics_file")
    if named:
        candidates.append(named)
    return next((path for path in candidates if os.path.isfile(path)), None)


def last_metrics(path, iteration):
    """{"train": record, "valid": record}: the last of each kind in the metrics file at or before `iteration`
    (lines that do not parse are passed over)."""
    found = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("kind") in ("train", "valid") and \
                    isinstance(record.get("iteration"), int) and record["iteration"] <= iteration:
                found[record["kind"]] = record
    return found


def _row(name, value):
    return f"| {name} | {value} |"


def _section(title, rows):
    return [f"## {title}", "", "| | |", "|---|---|", *rows, ""]


def model_card(config, dtype_name, run_config=None, iteration=None, consumed_samples=None, metrics=None,
               source=None):
    """README.md text for a BLOOM model of ModelConfig `config` exported in dtype_name."""
    run = run_config or {}
    parallel, training, optimizer = run.get("parallel", {}), run.get("training", {}), run.get("optimizer", {})
    precision, data = run.get("precision", {}), run.get("data", {})
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- bloom",
             "- megatron-deepspeed", "---", "", "# BLOOM-architecture causal language model", "",
             f"Exported{f' from `{source}`' if source else ''} by megatron-bloom (tools/merge_mp_partitions.py); "
             "`BloomForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load this folder.", ""]
    parameters = config.num_parameters()
    lines += _section("Architecture", [
        _row("parameters", f"{parameters:,} ({parameters / 1e6:.1f}M, LM head tied to the embedding)"),
        _row("layers", config.num_layers), _row("hidden size", config.hidden_size),
        _row("attention heads", config.num_attention_heads), _row("FFN size", config.ffn_dim),
        _row("vocabulary (padded)", config.vocab_size), _row("positions", "ALiBi"),
        _row("trained sequence length", f"{config.seq_length} (the tokenizer's model_max_length)"),
        _row("embedding LayerNorm", "yes" if config.embed_layernorm else "no"),
        _row("weights dtype", dtype_name)])
    tokenizer = data.get("tokenizer_name_or_path") or data.get("vocab_file")
    data_path = data.get("data_path")
    lines += _section("Data", [
        _row("--data-path", " ".join(f"`{p}`" for p in data_path) if data_path else "(not recorded)"),
        _row("--split", data.get("split", "(not recorded)")),
        _row("tokenizer", f"`{tokenizer}`" if tokenizer else "(not recorded)"),
        _row("consumed samples", f"{consumed_samples:,}" if consumed_samples is not None else "(not recorded)"),
        _row("consumed tokens", f"{consumed_samples * config.seq_length:,}" if consumed_samples is not None
             else "(not recorded)")])
    flag_rows = [_row("iteration", iteration if iteration is not None else "(not recorded)")]
    for section, keys in ((training, ("train_iters", "global_batch_size", "micro_batch_size", "zero_stage")),
                          (optimizer, ("lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "weight_decay",
                                       "clip_grad", "adam_beta1", "adam_beta2")),
                          (parallel, ("tensor_model_parallel_size", "pipeline_model_parallel_size"))):
        flag_rows += [_row(f"--{key.replace('_', '-')}", section[key]) for key in keys if key in section]
    if "world_size" in parallel:
        flag_rows.append(_row("processes", parallel["world_size"]))
    name = "bf16" if precision.get("bf16") else "fp16" if precision.get("fp16") else "fp32" if precision else None
    if name:
        flag_rows.append(_row("precision", name))
    lines += _section("Training flags", flag_rows)
    metrics = metrics or {}
    train, valid = metrics.get("train"), metrics.get("valid")
    metric_rows = []
    if train:
        metric_rows.append(_row(f"training LM loss (iteration {train['iteration']})", f"{train['lm_loss']:.4f}"))
    if valid:
        metric_rows.append(_row(f"validation LM loss (iteration {valid['iteration']})", f"{valid['lm_loss']:.4f}"))
        metric_rows.append(_row(f"validation perplexity (iteration {valid['iteration']})", f"{valid['ppl']:.2f}"))
    if not metric_rows:
        metric_rows.append(_row("metrics", "no metrics.jsonl was found beside the checkpoint"))
    lines += _section("Metrics", metric_rows)
    return "\n".join(lines)


def write_model_card(folder, config, dtype_name, source=None):
    """folder/README.md for ModelConfig `config`; source: the checkpoint reader (run_config, iteration,
    consumed_samples, folder), or None for a card from the config alone."""
    run_config = getattr(source, "run_config", None)
    checkpoint = getattr(source, "folder", None)
    iteration = getattr(source, "iteration", None)
    metrics_path = metrics_file_of(checkpoint, run_config) if checkpoint else None
    metrics = last_metrics(metrics_path, iteration) if metrics_path and iteration is not None else None
    text = model_card(config, dtype_name, run_config, iteration, getattr(source, "consumed_samples", None),
                      metrics, checkpoint)
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)
