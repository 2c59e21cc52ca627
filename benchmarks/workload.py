"""The benchmark's workload and its physical baselines.

The state is shaped like a transformer's training state: an embedding, per layer QKV/output/MLP
matrices, biases and layer norms, and AdamW's two moments for every parameter, all fp32, sized to a
target number of bytes. The baselines move the same bytes with nothing in the way: a copy into warm
buffers, a plain write (tmpfs, or disk with fsync), a plain read back.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

HIDDEN = 1024
VOCAB = 32_000


def layer_shapes(hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter shapes of one transformer block."""
    return [
        ("attn.qkv.weight", (3 * hidden, hidden)),
        ("attn.qkv.bias", (3 * hidden,)),
        ("attn.out.weight", (hidden, hidden)),
        ("attn.out.bias", (hidden,)),
        ("mlp.up.weight", (4 * hidden, hidden)),
        ("mlp.up.bias", (4 * hidden,)),
        ("mlp.down.weight", (hidden, 4 * hidden)),
        ("mlp.down.bias", (hidden,)),
        ("ln1.weight", (hidden,)),
        ("ln1.bias", (hidden,)),
        ("ln2.weight", (hidden,)),
        ("ln2.bias", (hidden,)),
    ]


def model_state(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A training state of about ``total_bytes``: parameters plus AdamW moments (3 x params)."""
    params_wanted = max(total_bytes // 12, 1)
    per_layer = sum(_numel(s) for _, s in layer_shapes(HIDDEN))
    vocab = min(VOCAB, max(256, params_wanted // (4 * HIDDEN)))
    layers = max(1, (params_wanted - vocab * HIDDEN) // per_layer)
    shapes = [("embed.weight", (vocab, HIDDEN))]
    for index in range(layers):
        shapes += [(f"layers.{index}.{name}", shape) for name, shape in layer_shapes(HIDDEN)]
    leftover = params_wanted - sum(_numel(s) for _, s in shapes)
    if leftover > HIDDEN:
        shapes.append(("head.weight", (leftover // HIDDEN, HIDDEN)))
    generator = torch.Generator().manual_seed(seed)
    model = {name: torch.randn(shape, generator=generator) for name, shape in shapes}
    moments = {
        name: {"exp_avg": torch.randn_like(t) * 1e-3, "exp_avg_sq": torch.rand_like(t) * 1e-6}
        for name, t in model.items()
    }
    return {"model": model, "optim": {"state": moments, "lr": 3e-4}, "step": 1000}


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def tensors_of(state: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state, in order."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors_of(value)


def state_bytes(state: Any) -> int:
    """Total tensor bytes."""
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def zeros_like_state(state: Any) -> Any:
    """A same-shaped state of zeros (a restore target)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    return state


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (no copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


@dataclass
class Samples:
    """Repeated timings of one measurement (seconds), and the bytes each moved."""

    seconds: list[float] = field(default_factory=list)
    nbytes: int = 0

    @property
    def median(self) -> float:
        ordered = sorted(self.seconds)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    @property
    def gib_s(self) -> float:
        return self.nbytes / 2**30 / self.median if self.median else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "median_s": self.median,
            "min_s": min(self.seconds),
            "max_s": max(self.seconds),
            "samples_s": self.seconds,
            "bytes": self.nbytes,
            "gib_per_s": self.gib_s,
        }


def repeat(
    reps: int, nbytes: int, run: Callable[[], object], setup: Callable[[], object] | None = None
) -> Samples:
    """Time ``run`` ``reps`` times (wall clock); ``setup`` runs untimed before each, then a sync.

    Deleting the previous output and syncing outside the timed part matters on disk: with ext4's
    ``discard`` option the blocks freed by a deletion are trimmed at the next journal commit, that
    is, inside whichever fsync comes next, measurement or not.
    """
    samples = Samples(nbytes=nbytes)
    for _ in range(reps):
        if setup is not None:
            setup()
        os.sync()
        started = time.perf_counter()
        run()
        samples.seconds.append(time.perf_counter() - started)
    return samples


def warm_copy(state: Any) -> Callable[[], None]:
    """The physical floor of staging: copy every tensor into buffers allocated (and touched) before."""
    sources = list(tensors_of(state))
    targets = [torch.empty_like(t) for t in sources]
    for source, target in zip(sources, targets, strict=True):
        target.copy_(source)

    def run() -> None:
        for source, target in zip(sources, targets, strict=True):
            target.copy_(source)

    return run


def plain_write(state: Any, directory: str, *, fsync: bool) -> Callable[[], None]:
    """Write every tensor's bytes, in order, into one new file (then fsync); the file is kept.

    Pair it with :func:`remove_plain` as the untimed setup.
    """
    path = os.path.join(directory, "plain.bin")

    def run() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for tensor in tensors_of(state):
                view = byte_view(tensor)
                while view:
                    view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    return run


def remove_plain(directory: str) -> Callable[[], None]:
    """Untimed setup for :func:`plain_write`: remove the previous file."""
    path = os.path.join(directory, "plain.bin")

    def run() -> None:
        if os.path.exists(path):
            os.unlink(path)

    return run


def plain_read(state: Any, directory: str) -> Callable[[], None]:
    """Read the plain file back into preallocated tensors (``readinto``, no intermediate copy)."""
    path = os.path.join(directory, "plain.bin")
    targets = [torch.empty_like(t) for t in tensors_of(state)]

    def run() -> None:
        with open(path, "rb", buffering=0) as f:
            for target in targets:
                view = byte_view(target)
                while view:
                    view = view[f.readinto(view) :]

    return run


@contextmanager
def quiet_warnings() -> Iterator[None]:
    """Silence torch's single-process notices during timed sections."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
