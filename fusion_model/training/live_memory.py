"""The peak of live tensor bytes of a stretch of training on any device: `LivePeak`, a TorchDispatchMode that counts
every storage an op returns until it is freed, and `storage_bytes` of given tensors. torch keeps no allocator
statistics on CPU and tracemalloc does not see tensor memory; this is what `bench/bench_memory.py` checks the memory
plan (`train.py plan`) against and what `experiment sft` reports per arm. It counts tensors' storages, not the
allocator's rounding, kernels' private scratch or the interpreter."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LivePeak(TorchDispatchMode):
    """The peak of live tensor bytes: every storage an op returns is counted until it is freed (a weak reference's
    callback); `register` adds tensors that exist before (parameters, gradients, optimizer states)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}  # id of a storage -> the storage
        self.peak = 0

    def register(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage (once) while it lives."""
        if type(tensor) not in (torch.Tensor, nn.Parameter):  # a DTensor: its local shard holds the bytes
            local = getattr(tensor, "_local_tensor", None)
            if local is not None:
                self.register(local)
            return
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if id(storage) not in self.live:
            self.live[id(storage)] = weakref.ref(storage, lambda _, key=id(storage): self.live.pop(key, None))

    def measure(self) -> None:
        """Add up the live storages' current sizes (FSDP2 frees and refills its unsharded weights by resizing their
        storages in place, so a size is read each time, not remembered)."""
        current = sum(storage.nbytes() for ref in list(self.live.values()) if (storage := ref()) is not None)
        self.peak = max(self.peak, current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.register(tensor)
        self.measure()
        return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        tensor = getattr(tensor, "_local_tensor", tensor)
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
