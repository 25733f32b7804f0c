"""torch.save's file format written tensor by tensor: a file torch.load reads, with each tensor made only when written.

torch.save needs every tensor in memory at once; an output optimizer file of a conversion (megatron/checkpoint/
universal.py) is a whole TP x PP shard's state. save(obj, stream) writes the same zip archive from an object whose
tensors may be Deferred (shape, dtype and a function making the tensor): the pickle names every storage first (its
dtype and size are known), then each Deferred is made, written and dropped in turn, so one tensor is in memory at a
time. Real tensors in obj are written as torch.save writes them. The records are torch.save's (data.pkl,
.format_version, .storage_alignment, byteorder, data/0, data/1, ... aligned for mmap), through the same writer
(torch._C.PyTorchFileWriter, what torch.save uses).
"""
import collections
import io
import pickle
import sys

import torch
from torch.serialization import _get_storage_alignment, get_crc32_options


class Deferred:
    """A tensor of `shape` and `dtype`, made by make() (a contiguous CPU tensor) when save() writes it."""

    def __init__(self, shape, dtype, make):
        self.shape, self.dtype, self.make = torch.Size(shape), dtype, make

    def __reduce_ex__(self, protocol):
        strides = torch.empty(self.shape, device="meta").stride()
        return torch._utils._rebuild_tensor_v2, (_Storage(self), 0, self.shape, strides, False,
                                                 collections.OrderedDict())


class _Storage:
    def __init__(self, deferred):
        self.deferred = deferred


def _storage_type(dtype):
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def save(obj, stream):
    """Writes obj (Deferred tensors made one at a time) to the binary stream in torch.save's format."""
    storages, keys = [], {}  # in key order: a Deferred, or a real tensor's untyped storage

    class Pickler(pickle.Pickler):
        def persistent_id(self, item):
            if isinstance(item, _Storage):
                storages.append(item.deferred)
                return "storage", _storage_type(item.deferred.dtype), str(len(storages) - 1), "cpu", \
                    item.deferred.shape.numel()
            if isinstance(item, torch.storage.TypedStorage):
                untyped = item._untyped_storage
                if untyped._cdata not in keys:
                    keys[untyped._cdata] = str(len(storages))
                    storages.append(untyped.cpu())
                return "storage", getattr(torch, item._pickle_storage_type()), keys[untyped._cdata], "cpu", \
                    item._size()
            return None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump(obj)
    writer = torch._C.PyTorchFileWriter(stream, get_crc32_options(), _get_storage_alignment())
    for name, value in (("data.pkl", data.getvalue()), (".format_version", "1"),
                        (".storage_alignment", str(_get_storage_alignment())), ("byteorder", sys.byteorder)):
        writer.write_record(name, value, len(value))
    for key in range(len(storages)):
        storage = _made(storages[key]) if isinstance(storages[key], Deferred) else storages[key]
        storages[key] = None  # written: nothing of it stays alive here
        writer.write_record(f"data/{key}", storage, storage.nbytes())
        del storage
    writer.write_end_of_file()


def _made(deferred):
    """The untyped storage of deferred's tensor, made now (exactly its bytes)."""
    tensor = deferred.make()
    assert tensor.shape == deferred.shape and tensor.dtype == deferred.dtype, (tensor.shape, deferred.shape,
                                                                               tensor.dtype, deferred.dtype)
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor.untyped_storage()
