"""Upstream Megatron-DeepSpeed checkpoints (BigScience's BLOOM runs, Microsoft's fork): recognised and read lazily.

Layout (DeepSpeed's engine.save_checkpoint with a PipelineModule, what BLOOM was trained and published with and
what Hugging Face's BLOOM converter reads):

    <root>/latest                                  the tag, e.g. global_step95000
    <root>/global_step95000/
        layer_01-model_00-model_states.pt          the embedding layer of TP rank 00: word_embeddings.weight (its
                                                   vocabulary slice), word_embeddings.norm.{weight,bias} (BigScience's
                                                   embedding LayerNorm; word_embeddings_layernorm.* is accepted too)
        layer_03-model_00-model_states.pt ...      one transformer block per layer index 3 .. 3+L-1:
                                                   input_layernorm, self_attention.query_key_value, self_attention.dense,
                                                   post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h
        layer_{3+L+1}-model_00-model_states.pt     the final LayerNorm: weight, bias
        mp_rank_00_model_states.pt                 the engine state per model-parallel rank: Megatron's `args`
                                                   (the model shape, consumed_train_samples), `iteration`, DeepSpeed's
                                                   global_steps / global_samples, the LR scheduler's state
        [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt
                                                   ZeRO's flat fp32 partition and Adam's moments of DP rank dp, with
                                                   param_slice_mappings: where each named parameter's fragment lies
    <root>/latest_universal, <root>/global_stepN_universal/zero/<param name>/{fp32,exp_avg,exp_avg_sq}.pt
                                                   DeepSpeed's universal checkpoint (ds_to_universal): each
                                                   parameter whole (TP slices merged), {"param": tensor}

Tensor parallelism splits the same tensors as here (QKV, dense_h_to_4h and the embedding along dim 0, the two
row-parallel weights along dim 1, with BLOOM's per-head [q k v] rows); the other tensors are copies on every TP rank,
averaged when read (BLOOM's bf16 copies drifted apart; Hugging Face's converter averages them too).
UpstreamCheckpoint gives the reader interface of megatron/checkpoint/convert.py (shapes, dtype, read(name, rows,
cols)) under this project's canonical names, and UpstreamOptimizer the interface of saved_optimizer.SavedOptimizer
(entries, step, has_fp32, partition_dim, full), so resuming (load.py) and tools/convert_checkpoint.py use the code
paths they use for this project's own checkpoints. Files are mapped and read a tensor (or window) at a time.
"""
import os
import re

import torch

from megatron.checkpoint.format import CheckpointError, partition_dim
from megatron.checkpoint.streams import OpenFiles, narrow, owned, span_bytes, window, window_ranges
from megatron.config import ModelConfig

LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
MP_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
TAG_RE = re.compile(r"^global_step(\d+)(_universal)?$")
KINDS = ("exp_avg", "exp_avg_sq")
_BLOCK_KEYS = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.query_key_value.weight",
               "self_attention.query_key_value.bias", "self_attention.dense.weight", "self_attention.dense.bias",
               "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_h_to_4h.weight",
               "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias")
_EMBEDDING_KEYS = {"word_embeddings.weight": "embedding.word_embeddings.weight",
                   "word_embeddings.norm.weight": "embedding.word_embeddings_layernorm.weight",
                   "word_embeddings.norm.bias": "embedding.word_embeddings_layernorm.bias",
                   "word_embeddings_layernorm.weight": "embedding.word_embeddings_layernorm.weight",
                   "word_embeddings_layernorm.bias": "embedding.word_embeddings_layernorm.bias"}
_IGNORED = re.compile(r"(^|\.)(position_embeddings\.weight|masked_bias|attention\.bias|inv_freq)$")


def _load(path, mmap=True, weights_only=True):
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except Exception as err:  # a torn or foreign file: named in one line
        reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint file ({type(err).__name__}: {reason})") from None


def _holds_upstream_files(folder):
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(LAYER_RE.match(n) or MP_RE.match(n) for n in names) or os.path.isdir(os.path.join(folder, "zero"))


def _read_tag(path):
    try:
        with open(path) as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def locate(path, universal=False):
    """The upstream checkpoint folder that --load `path` names, or None when it is not one: the folder itself (a
    global_stepN folder), or the one its `latest` (`latest_universal` first with universal=True, and when `latest`
    names none) names, or else its newest global_step* folder."""
    if not path or not os.path.isdir(path):
        return None
    if _holds_upstream_files(path) and not os.path.isfile(os.path.join(path, "meta.json")):
        return path
    order = ("latest_universal", "latest") if universal else ("latest", "latest_universal")
    for name in order:
        tag = _read_tag(os.path.join(path, name))
        if tag and TAG_RE.match(tag) and _holds_upstream_files(os.path.join(path, tag)):
            return os.path.join(path, tag)
    tags = sorted((n for n in os.listdir(path) if TAG_RE.match(n) and _holds_upstream_files(os.path.join(path, n))),
                  key=lambda n: (int(TAG_RE.match(n).group(1)), bool(TAG_RE.match(n).group(2)) == universal))
    return os.path.join(path, tags[-1]) if tags else None


def is_universal(folder):
    return os.path.isdir(os.path.join(folder, "zero")) and not any(LAYER_RE.match(n) for n in os.listdir(folder))


# ---------------------------------------------------------------- names


def canonical_from_layers(layer_keys):
    """{layer index: {upstream key: canonical name}} from each layer file's keys (TP rank 0's): the embedding layer
    (word_embeddings.weight), the blocks in layer order (layers.0 ...), the final LayerNorm (weight, bias) after them.
    Raises CheckpointError naming a layer whose keys fit none of these."""
    mapping, block = {}, 0
    for index in sorted(layer_keys):
        keys = [k for k in layer_keys[index] if not _IGNORED.search(k)]
        if "word_embeddings.weight" in keys:
            unknown = [k for k in keys if k not in _EMBEDDING_KEYS]
            names = {k: _EMBEDDING_KEYS[k] for k in keys if k in _EMBEDDING_KEYS}
        elif "input_layernorm.weight" in keys:
            unknown = [k for k in keys if k not in _BLOCK_KEYS]
            names = {k: f"layers.{block}.{k}" for k in keys if k in _BLOCK_KEYS}
            block += 1
        elif set(keys) == {"weight", "bias"}:
            unknown, names = [], {k: f"final_layernorm.{k}" for k in keys}
        else:
            unknown, names = keys, {}
        if unknown:
            raise CheckpointError(f"layer_{index:02d}: keys {unknown[:4]} are not those of a BLOOM layer in the "
                                  "upstream Megatron-DeepSpeed layout (embedding, transformer block, final LayerNorm)")
        mapping[index] = names
    return mapping


_MODULE_RE = re.compile(r"^(?:module\.)?(?:language_model\.)?(?:(embedding)\.(word_embeddings\.weight|"
                        r"word_embeddings\.norm\.(?:weight|bias)|word_embeddings_layernorm\.(?:weight|bias))|"
                        r"(?:encoder|transformer)\.(?:layers\.(\d+)\.(.+)|final_layernorm\.(weight|bias)))$")


def module_canonical(key):
    """A non-pipeline GPTModel's state-dict key (language_model.embedding.word_embeddings.weight,
    language_model.encoder.layers.0.input_layernorm.weight, ...encoder.final_layernorm.bias) -> canonical name."""
    match = _MODULE_RE.match(key)
    if match is None:
        return None
    embedding, embedding_key, layer, layer_key, final_key = match.groups()
    if embedding:
        return _EMBEDDING_KEYS[embedding_key]
    if layer is not None:
        return f"layers.{layer}.{layer_key}" if layer_key in _BLOCK_KEYS else None
    return f"final_layernorm.{final_key}"


def _flatten(tree, prefix=""):
    """{"a": {"b": t}} -> {"a.b": t} (Megatron's nested module state dicts)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[prefix + key] = value
    return flat


def _open_weights(path):
    """The tensors of a weight file: a layer file's state dict, or an mp_rank file's `module`, flattened."""
    if MP_RE.match(os.path.basename(path)):
        return _flatten(_load(path, weights_only=False)["module"])
    return _load(path)


def canonical_param_name(name, by_layer):
    """A PipelineModule parameter name in an upstream ZeRO file or universal folder (tied_modules.embed.word_embeddings
    .weight, 3.input_layernorm.weight, 7.weight) -> canonical name, or None for a name that is no model weight; also
    a non-pipeline GPTModel's names (module_canonical)."""
    if not re.match(r"^\d+\.", name) and not name.startswith("tied_modules.") and module_canonical(name):
        return module_canonical(name)
    if name.startswith("tied_modules."):
        rest = name.split(".", 2)[2]
        return _EMBEDDING_KEYS.get(rest)
    match = re.match(r"^(\d+)\.(.*)$", name)
    if match is None:
        return None
    return by_layer.get(int(match.group(1)), {}).get(match.group(2))


# ---------------------------------------------------------------- the run's record (mp_rank files)


def _model_config(args, shapes, source):
    """ModelConfig from Megatron's saved args (the shapes fill what older args lack)."""
    def arg(name, default=None):
        value = getattr(args, name, None)
        return default if value is None else value
    heads = arg("num_attention_heads")
    if heads is None:
        raise CheckpointError(f"{source}: holds no Megatron `args` with num_attention_heads; the checkpoint was not "
                              "written by Megatron-DeepSpeed's training script")
    vocab, hidden = shapes["embedding.word_embeddings.weight"]
    layers = sum(1 for n in shapes if n.endswith(".input_layernorm.weight"))
    seq = arg("seq_length", 2048)
    try:
        return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                           seq_length=seq, max_position_embeddings=max(arg("max_position_embeddings", seq), seq),
                           ffn_hidden_size=shapes["layers.0.mlp.dense_h_to_4h.weight"][0],
                           layernorm_epsilon=arg("layernorm_epsilon", 1e-5),
                           embed_layernorm="embedding.word_embeddings_layernorm.weight" in shapes,
                           apply_residual_connection_post_layernorm=bool(
                               arg("apply_residual_connection_post_layernorm", False)),
                           init_method_std=arg("init_method_std", 0.02))
    except ValueError as err:
        raise CheckpointError(f"{source}: its model shape is not a valid BLOOM model here ({err})") from None


class UpstreamCheckpoint:
    """An upstream global_stepN folder (or a universal one), read lazily under canonical names.

    Attributes: folder, config (ModelConfig, TP 1), shapes, dtype, iteration, consumed_samples, global_steps,
    lr_scheduler (the saved scheduler state or None), tensor_model_parallel_size, pipeline_model_parallel_size,
    universal, run_config (config.json's sections for this project), tokenizer_dir (None)."""

    def __init__(self, folder):
        self.folder, self.universal, self.tokenizer_dir = folder, is_universal(folder), None
        names = os.listdir(folder)
        mp_files = sorted((n for n in names if MP_RE.match(n)), key=lambda n: int(MP_RE.match(n).group(1)))
        if not mp_files:
            raise CheckpointError(f"{folder} holds no mp_rank_XX_model_states.pt; the upstream checkpoint is "
                                  "incomplete (the save did not finish?)")
        record = _load(os.path.join(folder, mp_files[0]), weights_only=False)  # Megatron's args: a Namespace
        self.args = record.get("args")
        self.iteration = int(record.get("iteration") or record.get("global_steps") or 0)
        self.global_steps = int(record.get("global_steps") or self.iteration)
        consumed = getattr(self.args, "consumed_train_samples", None)
        self.consumed_samples = int(consumed if consumed is not None else record.get("global_samples") or 0)
        self.lr_scheduler = record.get("lr_scheduler")
        self.skipped_steps = int(record.get("skipped_steps") or 0)
        self._files = OpenFiles(_open_weights)
        self._where = {}  # canonical name -> (files by TP rank, upstream key, partition dim or None)
        if self.universal:
            self._scan_universal()
        else:
            self._scan_layers(names, record)
        self.shapes = {name: where[3] for name, where in self._where.items()}
        self.config = _model_config(self.args, self.shapes, os.path.join(folder, mp_files[0]))
        self.tensor_model_parallel_size = int(getattr(self.args, "tensor_model_parallel_size", None) or self.tp)
        self.pipeline_model_parallel_size = int(getattr(self.args, "pipeline_model_parallel_size", None) or 1)
        self.run_config = {"model": {k: v for k, v in vars(self.config).items()}, "converted_from_upstream": folder}

    def _scan_layers(self, names, record):
        layers = {}
        for name in names:
            match = LAYER_RE.match(name)
            if match:
                layers.setdefault(int(match.group(1)), {})[int(match.group(2))] = os.path.join(self.folder, name)
        if not layers:
            if isinstance(record.get("module"), dict):
                return self._scan_module(names)
            raise CheckpointError(f"{self.folder} holds no layer_XX-model_YY-model_states.pt files; the upstream "
                                  "checkpoint is incomplete")
        self.tp = len(layers[min(layers)])
        for index, by_rank in layers.items():
            if sorted(by_rank) != list(range(self.tp)):
                raise CheckpointError(f"{self.folder}: layer_{index:02d} has files for TP ranks {sorted(by_rank)}, "
                                      f"expected 0..{self.tp - 1}; the checkpoint is incomplete")
        keys = {index: list(_load(by_rank[0]).keys()) for index, by_rank in layers.items()}
        self.by_layer = canonical_from_layers(keys)
        for index, names_of in self.by_layer.items():
            paths = [layers[index][t] for t in range(self.tp)]
            first = self._files.get(paths[0])
            for key, canonical in names_of.items():
                dim = partition_dim(canonical) if self.tp > 1 else None
                shape = list(first[key].shape)
                if dim is not None:
                    shape[dim] *= self.tp
                self._where[canonical] = (paths, key, dim, tuple(shape))
                if canonical == "embedding.word_embeddings.weight":
                    self.dtype = first[key].dtype
        self._files.close()

    def _scan_module(self, names):
        """A run without a PipelineModule (--no-pipeline-parallel): each mp_rank_XX file's `module` holds TP rank XX's
        whole model under GPTModel's names (language_model.embedding..., language_model.encoder.layers.N...)."""
        paths = [os.path.join(self.folder, n) for n in sorted((n for n in names if MP_RE.match(n)),
                                                              key=lambda n: int(MP_RE.match(n).group(1)))]
        self.tp, self.by_layer = len(paths), {}
        first = self._files.get(paths[0])
        unknown = [k for k in first if module_canonical(k) is None and not _IGNORED.search(k)]
        if unknown:
            raise CheckpointError(f"{paths[0]}: `module` keys {unknown[:4]} are not those of a BLOOM GPTModel in the "
                                  "upstream Megatron-DeepSpeed layout")
        for key, tensor in first.items():
            canonical = module_canonical(key)
            if canonical is None:
                continue
            dim = partition_dim(canonical) if self.tp > 1 else None
            shape = list(tensor.shape)
            if dim is not None:
                shape[dim] *= self.tp
            self._where[canonical] = (paths, key, dim, tuple(shape))
            if canonical == "embedding.word_embeddings.weight":
                self.dtype = tensor.dtype
        self._files.close()

    def _scan_universal(self):
        zero = os.path.join(self.folder, "zero")
        self.tp, self.by_layer = 1, {}
        params = [n for n in os.listdir(zero) if os.path.isfile(os.path.join(zero, n, "fp32.pt"))]
        blocks = sorted({int(m.group(1)) for n in params if (m := re.match(r"^(\d+)\.input_layernorm\.", n))})
        numbered = sorted({int(m.group(1)) for n in params if (m := re.match(r"^(\d+)\.", n))})
        self.by_layer = {index: {k: f"layers.{i}.{k}" for k in _BLOCK_KEYS} for i, index in enumerate(blocks)}
        after = [i for i in numbered if blocks and i > blocks[-1]]
        if after:
            self.by_layer[after[0]] = {"weight": "final_layernorm.weight", "bias": "final_layernorm.bias"}
        self.universal_paths = {}
        for name in params:
            canonical = canonical_param_name(name, self.by_layer)
            if canonical is None:
                continue
            path = os.path.join(zero, name, "fp32.pt")
            shape = tuple(self._files.get(path)["param"].shape)
            padded = getattr(self.args, "padded_vocab_size", None)
            if canonical == "embedding.word_embeddings.weight" and padded and padded > shape[0]:
                shape = (padded,) + shape[1:]  # ds_to_universal strips the vocabulary padding: zeros again here
            self._where[canonical] = ([path], "param", None, shape)
            self.universal_paths[canonical] = os.path.join(zero, name)
        self.dtype = torch.float32
        self._files.close()

    def read(self, name, rows=None, cols=None, dtype=None):
        """Tensor `name` (canonical) merged over the TP ranks, or its window rows x cols, as a new tensor in dtype
        (None keeps the stored one); copies on several TP ranks are averaged (in fp32)."""
        paths, key, dim, shape = self._where[name]
        pieces = [self._files.get(path)[key] for path in paths]
        ranges = window_ranges(shape, rows, cols)
        if self.universal and pieces[0].shape[0] < shape[0]:  # a universal checkpoint's unpadded vocabulary: padding rows are zeros
            return pad_rows(pieces[0], shape[0], ranges, dtype)
        if dim is None:
            views = [narrow(piece, ranges) for piece in pieces]
            self._files.charge(sum(span_bytes(v) for v in views))
            if len(views) == 1:
                return owned(views, None, dtype)
            mean = torch.stack([v.float() for v in views]).mean(0)
            return mean.to(dtype or views[0].dtype)
        views = window(pieces, dim, ranges)
        self._files.charge(sum(span_bytes(v) for v in views))
        return owned(views, dim, dtype)

    def tp_slice_shape(self, name):
        _, _, dim, shape = self._where[name]
        shape = list(shape)
        if dim is not None:
            shape[dim] //= self.tp
        return tuple(shape)

    def close(self):
        self._files.close()

    def optimizer(self):
        """The per-parameter optimizer state (UpstreamOptimizer), or None when the folder holds none that is named
        per parameter (ZeRO files without param_slice_mappings, or a run without ZeRO)."""
        if self.universal:
            return UniversalOptimizer(self)
        files = [n for n in os.listdir(self.folder) if ZERO_RE.match(n)]
        return UpstreamOptimizer(self, files) if files else None


# ---------------------------------------------------------------- optimizer state per parameter


class UpstreamOptimizer:
    """The ZeRO files' state per canonical parameter, with SavedOptimizer's interface (saved_optimizer.py).

    Each file is one (model-parallel rank, DP rank)'s flat fp32 partition per parameter group, Adam's moments over
    it, and param_slice_mappings: {parameter name: (start, numel)} in that partition. A parameter's fragments,
    taken in DP-rank order, are its flattened TP slice (what DeepSpeed's ds_to_universal reassembles too)."""

    def __init__(self, checkpoint, files):
        self.checkpoint, self.folder = checkpoint, checkpoint.folder
        self.step, self.entries, self._fragments = None, {}, {}
        self._files = OpenFiles(lambda path: _load(path, weights_only=False)["optimizer_state_dict"])
        tp = checkpoint.tp
        for name in sorted(files, key=lambda n: (int(ZERO_RE.match(n).group(3)), int(ZERO_RE.match(n).group(2)))):
            match = ZERO_RE.match(name)
            dp, mp = int(match.group(2)), int(match.group(3))
            path = os.path.join(self.folder, name)
            state = self._files.get(path)
            mappings = state.get("param_slice_mappings")
            if mappings is None:
                raise CheckpointError(f"{path} has no param_slice_mappings (written by a DeepSpeed older than 0.7): "
                                      "its optimizer state cannot be placed per parameter; resume with --no-load-optim "
                                      "or convert with tools/convert_checkpoint.py --no-optimizer-state")
            base = state["base_optimizer_state"]
            groups = base["state"] if isinstance(base, dict) else dict(enumerate(base))
            for group, mapping in enumerate(mappings):
                if self.step is None and "step" in groups.get(group, {}):
                    self.step = float(groups[group]["step"])
                for param, fragment in mapping.items():
                    canonical = canonical_param_name(param, checkpoint.by_layer)
                    if canonical is None:
                        continue
                    places = self._fragments.setdefault(canonical, {}).setdefault(mp % tp, {})
                    if mp // tp > 0 and canonical.startswith("embedding.") and places and dp in places:
                        continue  # the tied embedding's copy on the last stage: the first stage's serves
                    places[dp] = (path, group, int(fragment.start), int(fragment.numel))
            self._files.close()
        for canonical in self._fragments:
            self.entries[canonical] = {t: {"partition_dim": checkpoint._where[canonical][2]} for t in range(tp)}

    def names(self):
        return sorted(self.entries)

    def has_fp32(self, name=None):
        return True  # ZeRO keeps an fp32 partition in every precision

    def partition_dim(self, name):
        return self.checkpoint._where[name][2] if self.checkpoint.tp > 1 else partition_dim(name)

    def tp_slice(self, name, key, tp_rank):
        parts = []
        for dp in sorted(self._fragments[name][tp_rank]):
            path, group, start, numel = self._fragments[name][tp_rank][dp]
            state = self._files.get(path)
            if key == "fp32":
                flat = state["single_partition_of_fp32_groups"][group]
            else:
                base = state["base_optimizer_state"]
                flat = (base["state"] if isinstance(base, dict) else dict(enumerate(base)))[group][key]
            parts.append(flat.reshape(-1)[start:start + numel].float().clone())
            self._files.charge(numel * flat.element_size())
        shape = self.checkpoint.tp_slice_shape(name)
        whole = torch.cat(parts)
        if whole.numel() != torch.Size(shape).numel():
            raise CheckpointError(f"{self.folder}: the ZeRO files hold {whole.numel()} elements of {name}'s {key} "
                                  f"for TP rank {tp_rank}, its shape {shape} needs {torch.Size(shape).numel()}")
        return whole.view(shape)

    def full(self, name, key, dim=None):
        dim = self.checkpoint._where[name][2]
        slices = [self.tp_slice(name, key, t) for t in range(self.checkpoint.tp)]
        return torch.cat(slices, dim) if dim is not None and len(slices) > 1 else slices[0]


class UniversalOptimizer:
    """A universal checkpoint's zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt (whole tensors), SavedOptimizer's
    interface."""

    def __init__(self, checkpoint):
        self.checkpoint, self.folder = checkpoint, checkpoint.folder
        self.entries = {name: {0: {}} for name, path in checkpoint.universal_paths.items()
                        if os.path.isfile(os.path.join(path, "exp_avg.pt"))}
        step_path = next((os.path.join(p, "step.pt") for p in checkpoint.universal_paths.values()
                          if os.path.isfile(os.path.join(p, "step.pt"))), None)
        step = _load(step_path, mmap=False) if step_path else None  # a tensor, or {"param": tensor}
        step = step["param"] if isinstance(step, dict) else step
        self.step = float(step) if step is not None else (float(checkpoint.global_steps) if self.entries else None)

    def names(self):
        return sorted(self.entries)

    def has_fp32(self, name=None):
        return True

    def partition_dim(self, name):
        return partition_dim(name)

    def full(self, name, key, dim=None):
        tensor = _load(os.path.join(self.checkpoint.universal_paths[name], f"{key}.pt"))["param"]
        shape = self.checkpoint.shapes[name]
        if tensor.shape[0] < shape[0]:
            return pad_rows(tensor, shape[0], [None] * len(shape), torch.float32)
        return tensor.float().clone().view(shape)


def pad_rows(tensor, rows, ranges, dtype):
    """The window `ranges` of `tensor` grown to `rows` rows with zeros (the vocabulary padding ds_to_universal
    strips), as a new tensor in dtype (None keeps the tensor's)."""
    start, stop = ranges[0] if ranges[0] is not None else (0, rows)
    cols = ranges[1] if len(ranges) > 1 else None
    tail = narrow(tensor, [None, cols] if len(ranges) > 1 else [None])
    out = torch.zeros((stop - start,) + tuple(tail.shape[1:]), dtype=dtype or tensor.dtype)
    have = max(0, min(stop, tensor.shape[0]) - start)
    if have:
        out[:have] = tail[start:start + have]
    return out


# ---------------------------------------------------------------- what --load names


def _checkpoint_like(root, names):
    """The entries of root that look like a checkpoint of some format (for the 'neither format' message)."""
    found = []
    for name in sorted(names):
        path = os.path.join(root, name)
        if name in ("latest", "latest_universal", "config.json") or name.endswith((".pt", ".bin", ".safetensors",
                                                                                    ".pth", ".ckpt")):
            found.append(name)
        elif os.path.isdir(path) and not name.startswith("."):
            try:
                inner = os.listdir(path)
            except OSError:
                continue
            if any(n.endswith((".pt", ".bin", ".safetensors")) for n in inner):
                found.append(name + "/")
    return found


def classify_load(path, universal=False):
    """What --load `path` holds, read before anything is built: ("ours", None) for this project's save folder (or
    one with no checkpoint yet: training starts from scratch), ("upstream", the checkpoint's model section for
    the vocabulary padding) for an upstream one; ValueError in one line for a folder in neither format."""
    from megatron.checkpoint.format import TAG_RE as OUR_TAG, TMP_PREFIX
    if not os.path.isdir(path):
        return "ours", None
    folder = locate(path, universal)
    if folder is not None:
        if universal and not is_universal(folder):
            raise ValueError(f"--load {path}: --universal-checkpoint is set but {folder} is not a universal checkpoint "
                             "(no zero/ folder, no latest_universal); drop the flag to resume from it directly")
        layers = sorted(n for n in os.listdir(folder) if LAYER_RE.match(n) and n.endswith("-model_00-model_states.pt"))
        for name in layers:
            keys = _load(os.path.join(folder, name))
            if "word_embeddings.weight" in keys:
                return "upstream", {"vocab_size": int(keys["word_embeddings.weight"].shape[0]) * len(
                    [n for n in os.listdir(folder) if n.startswith(name.split("-")[0] + "-")])}
        mp_files = sorted(n for n in os.listdir(folder) if MP_RE.match(n))
        if not layers and mp_files and not is_universal(folder):  # a non-pipeline run: the weights in `module`
            weights = _open_weights(os.path.join(folder, mp_files[0]))
            rows = [t.shape[0] for k, t in weights.items() if module_canonical(k) == "embedding.word_embeddings.weight"]
            return "upstream", ({"vocab_size": rows[0] * len(mp_files)} if rows else None)
        return "upstream", None
    names = os.listdir(path)
    base = os.path.basename(os.path.normpath(path))
    latest = _read_tag(os.path.join(path, "latest"))
    if OUR_TAG.match(base) or os.path.isfile(os.path.join(path, "meta.json")) or (latest and OUR_TAG.match(latest)) \
            or any(OUR_TAG.match(n) or n.startswith(TMP_PREFIX) for n in names):
        return "ours", None
    found = _checkpoint_like(path, names)
    if not found:
        return "ours", None  # nothing saved yet (metrics, logs): training starts from scratch
    if os.path.isfile(os.path.join(path, "config.json")) and any(
            n.endswith((".safetensors", ".bin")) for n in names):
        raise ValueError(f"--load {path} is a Hugging Face model folder, not a training checkpoint; convert it first: "
                         f"python tools/convert_hf_to_megatron.py --hf-model-path {path} --output-path "
                         f"{os.path.normpath(path)}_megatron, then --load {os.path.normpath(path)}_megatron --finetune")
    raise ValueError(f"--load {path} is neither this project's checkpoint format (iter_XXXXXXX/ with meta.json, "
                     "named by `latest`) nor upstream Megatron-DeepSpeed's (global_stepN/ with "
                     f"mp_rank_XX_model_states.pt and layer_XX-model_YY-model_states.pt); it holds "
                     f"{', '.join(found[:5])}{' ...' if len(found) > 5 else ''}; pass the folder --save wrote")
