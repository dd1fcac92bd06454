"""vLLM's KV cache tensors as byte pages: the one byte view both connectors use.

:class:`PagedCaches` views vLLM's per-layer, blocks-first tensors as ``uint8`` arrays
``[num_blocks, heads, block_size, row]`` sharing their memory: the store connector moves
whole blocks (one pool object per page), the transfer connector page slices.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.config.kv_transfer import STORE_CONNECTOR as STORE
from kvpool.config.kv_transfer import TRANSFER_CONNECTOR as TRANSFER
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["CacheSet", "PagedCaches", "block_pages", "byte_pages", "page_view"]


class PagedCaches:
    """vLLM's per-layer KV caches as ``uint8`` arrays ``[num_blocks, heads, block_size, row]``.

    A page slice (``[block, h0:h1]``) and a whole block (``[block]``) are contiguous in this
    layout, which is what lets both connectors copy without reshaping anything.  On CPU
    the layout is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (MLA's
    ``[num_blocks, block_size, latent]`` is one replicated head).

    - the store connector moves *whole blocks*: :meth:`gather` and :meth:`scatter` copy
      one block of every layer (a *page*: one pool object) to and from a staging array
      made by :meth:`new_pages`, or a pool moves them in place as :meth:`block_parts`
      (one row per layer).  Pages move opaque: the CPU kernel does not keep a block's
      tokens in position order, so nothing looks inside;
    - the transfer connector sends and receives *page slices*, on CPU in place:
      :meth:`page` is the contiguous bytes of heads ``h0:h0+n`` of one block of one
      layer, which a socket reads into or writes from directly.  Senders and receivers
      go through :meth:`sending` and :meth:`receiving` (one layer's pages of a pull at a
      time), so that staged device caches can serve the same callers.
    """

    #: False: the views are the KV cache itself; True: pages are copied through host
    #: staging (:class:`~kvpool.connectors.device_pages.StagedCaches`)
    staged = False

    def __init__(
        self,
        layers: Mapping[str, np.ndarray],
        *,
        connector: str = "kvpool",
        tensors: Mapping[str, Any] | None = None,
    ) -> None:
        for name, arr in layers.items():
            if arr.ndim != 4 or arr.dtype != np.uint8 or not _blocks_contiguous(arr):
                raise ConfigError(
                    f"{connector}: layer {name} is not a [num_blocks, heads, block_size, row]"
                    " byte view with contiguous blocks"
                )
        self._geometry({name: arr.shape for name, arr in layers.items()}, connector)
        self._layers = dict(layers)
        # [num_blocks, layer_page_bytes] views of the same memory, for whole-block copies
        # (a block may be followed by padding: a hybrid model's state blocks are padded
        # to the attention page, so the rows keep the block stride)
        self._blocks = [_rows(arr) for arr in self._layers.values()]
        # the same rows as the CPU tensors the arrays view (``tensors``, same order), so
        # that an engine can find the tensor a row lies in (Mooncake registers it in place)
        self._block_tensors = (
            None if tensors is None else [_tensor_rows(t) for t in tensors.values()]
        )

    @property
    def groups(self) -> tuple[PagedCaches, ...]:
        """The KV cache groups' pages: this one (see :class:`CacheSet`)."""
        return (self,)

    def of(self, layers: Sequence[str]) -> PagedCaches:
        """The pages that hold ``layers`` (all of one group): these, if they have them."""
        known = set(self.names)
        unknown = [name for name in layers if name not in known]
        if unknown or not layers:
            raise ConfigError(f"unknown layers {unknown[:3]} (different models on P and D?)")
        return self

    @property
    def block_stride(self) -> int:
        """Bytes from one block of a layer to the next: the page, or more when each block
        is padded (a hybrid model's state blocks are padded to the attention page)."""
        blocks = getattr(self, "_blocks", None)  # staged caches move pages, never in place
        return int(blocks[0].strides[0]) if blocks else self.layer_page_bytes

    def _geometry(self, shapes: Mapping[str, tuple[int, ...]], connector: str) -> None:
        """Sizes from the layers' ``[num_blocks, heads, block_size, row]`` byte shapes."""
        if not shapes:
            raise ConfigError(f"{connector}: vLLM registered no KV cache layers")
        distinct = {tuple(shape) for shape in shapes.values()}
        if len(distinct) != 1:
            raise ConfigError(f"{connector}: KV cache layers differ in shape: {sorted(distinct)}")
        self.names: list[str] = list(shapes)
        self.num_blocks, self.num_heads, self.block_size, row = next(iter(distinct))
        self.head_bytes = self.block_size * row
        #: bytes of one block of one layer, and of one page (one block of every layer)
        self.layer_page_bytes = self.num_heads * self.head_bytes
        self.page_bytes = self.layer_page_bytes * len(self.names)

    # ------------------------------------------------------------ page slices (transfer)

    def page(self, layer: str, block: int, head_start: int, head_count: int) -> memoryview:
        """Heads ``head_start:head_start+head_count`` of one block of one layer, in place."""
        page = self._layers[layer][block, head_start : head_start + head_count]
        return page.data.cast("B")

    def sending(
        self, layer: str, blocks: Sequence[int], head_start: int, head_count: int
    ) -> list[memoryview]:
        """The page slices of ``blocks`` of one layer, to send in this order.

        Here they are the KV cache itself; staged caches copy them to host memory first
        (valid until the caller drops them)."""
        return [self.page(layer, block, head_start, head_count) for block in blocks]

    @contextmanager
    def receiving(
        self, layer: str, blocks: Sequence[int], head_start: int, head_count: int
    ) -> Iterator[list[memoryview]]:
        """Writable page slices of ``blocks`` of one layer, to receive into.

        Here they are the KV cache itself; staged caches hand out host staging and copy
        it into the cache when the block ends without an exception (so a pull that fails
        half-way writes nothing of that layer)."""
        yield [self.page(layer, block, head_start, head_count) for block in blocks]

    # ------------------------------------------------------------ whole blocks (store)

    def block_parts(self, block: int) -> list[Any]:
        """One block of every layer in place: the *parts* of its page, one per layer, in
        layer order (what a pool reads into or writes from with no staging copy).  CPU
        tensor rows when the caches came from tensors, else NumPy rows."""
        rows = self._blocks if self._block_tensors is None else self._block_tensors
        return [kv[block] for kv in rows]

    def head_parts(self, block: int, head_start: int, head_count: int) -> list[Any]:
        """Heads ``head_start:head_start+head_count`` of one block of every layer, in place:
        the parts of one KV-head group's object (contiguous in each layer's row)."""
        rows = self._blocks if self._block_tensors is None else self._block_tensors
        lo, hi = head_start * self.head_bytes, (head_start + head_count) * self.head_bytes
        return [kv[block][lo:hi] for kv in rows]

    def new_pages(self, n: int) -> np.ndarray[Any, Any]:
        """Staging for ``n`` pages: ``[n, layers, layer_page_bytes]`` bytes."""
        return np.empty((n, len(self._blocks), self.layer_page_bytes), dtype=np.uint8)

    # CPU caches copy through NumPy byte views: a plain single-threaded memcpy per layer
    # page.  Torch's copy_ on CPU would open an OpenMP parallel region per page, and on a
    # loaded host (vLLM pins its OpenMP threads to cores) each region can wait a
    # scheduler tick.  (Device caches need torch's copies: kernels and DMA, not OpenMP.)
    def gather(self, block_ids: Iterable[int], out: np.ndarray[Any, Any]) -> None:
        for j, block in enumerate(block_ids):
            for layer, kv in enumerate(self._blocks):
                np.copyto(out[j, layer], kv[block])

    def scatter(
        self, block_ids: Iterable[int], pages: np.ndarray[Any, Any], layer: int | None = None
    ) -> None:
        """Staged pages into the cache: every layer, or only ``layer`` (a layer-wise load)."""
        for j, block in enumerate(block_ids):
            for i, kv in enumerate(self._blocks):
                if layer is None or i == layer:
                    np.copyto(kv[block], pages[j, i])


def _blocks_contiguous(arr: np.ndarray[Any, Any]) -> bool:
    """Whether each block's bytes are contiguous (blocks may be spaced further apart)."""
    if arr.flags.c_contiguous:
        return True
    return len(arr) > 0 and arr[0].flags.c_contiguous and arr.strides[0] >= arr[0].nbytes


def _rows(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``[num_blocks, block_bytes]`` over the same memory (never a copy)."""
    if arr.flags.c_contiguous:
        return arr.reshape(len(arr), -1)
    return np.lib.stride_tricks.as_strided(
        arr, shape=(len(arr), arr[0].nbytes), strides=(arr.strides[0], 1)
    )


def _tensor_rows(t: Any) -> Any:
    """A byte tensor's ``[num_blocks, block_bytes]`` rows over the same memory."""
    if t.is_contiguous():
        return t.reshape(t.shape[0], -1)
    return t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1))


class CacheSet:
    """A hybrid model's KV caches: one :class:`PagedCaches` per KV cache group (its layers
    share a shape, other groups' do not), found by layer name.  A P→D pull names the layers
    of one group, whose geometry (heads, page bytes, block stride) it then uses."""

    def __init__(self, groups: Sequence[PagedCaches]) -> None:
        if not groups:
            raise ConfigError("a cache set needs at least one KV cache group")
        self.groups: tuple[PagedCaches, ...] = tuple(groups)
        self._group_of = {name: g for g in self.groups for name in g.names}
        self.names: list[str] = [name for g in self.groups for name in g.names]
        self.staged = any(g.staged for g in self.groups)

    def of(self, layers: Sequence[str]) -> PagedCaches:
        """The group that holds every one of ``layers``."""
        groups = {id(self._group_of[n]) for n in layers if n in self._group_of}
        unknown = [name for name in layers if name not in self._group_of]
        if unknown or not layers:
            raise ConfigError(f"unknown layers {unknown[:3]} (different models on P and D?)")
        if len(groups) != 1:
            raise ConfigError(f"layers {list(layers)[:3]}... lie in {len(groups)} KV cache groups")
        return self._group_of[layers[0]]


def page_view(page: np.ndarray[Any, Any]) -> memoryview:
    """A writable byte view of one staged page (what a pool reads into or writes from)."""
    buffer: Any = page  # NumPy arrays export the buffer protocol; its stubs do not say so
    return memoryview(buffer).cast("B")


# The builders import torch only when called, so code and tests that use NumPy arrays
# stay torch-free; their errors name the connector that registered the caches.
def block_pages(
    kv_caches: Mapping[str, torch.Tensor], *, staged: bool | None = None
) -> PagedCaches:
    """The store connector's view: whole blocks of any layout with blocks first.

    Layers must agree in shape and dtype (one page is one block of every layer), and each
    block's bytes be contiguous (blocks may lie further apart than their size).  A layout
    other than the two of :class:`PagedCaches` is one head of one row per block:
    whole-block copies need nothing more.  ``staged``: see :func:`_staged`.
    """
    import torch

    if not kv_caches:
        raise ConfigError(f"{STORE}: vLLM registered no KV cache tensors")
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):  # a device Mamba layer: [conv, ssm] tensors
            raise ConfigError(
                f"{STORE}: layer {name}'s KV cache is {len(t)} separate tensors; the store"
                " connector moves one tensor per layer (vLLM's CPU layout)"
            )
    first = next(iter(kv_caches.values()))
    layers = {}
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ConfigError(
                f"{STORE}: layer {name} has KV shape {tuple(t.shape)} {t.dtype}, unlike"
                f" {tuple(first.shape)} {first.dtype}; mixed layouts are unsupported"
            )
        if not t.is_contiguous() and not (
            t.dim() > 1 and t[0].is_contiguous() and t.stride(0) >= t[0].numel()
        ):
            raise ConfigError(f"{STORE}: layer {name}'s KV cache blocks are not contiguous")
        if t.dim() == 3:
            t = t.unsqueeze(1)
        elif t.dim() != 4:
            t = t.as_strided((t.shape[0], 1, 1, t[0].numel()), (t.stride(0), 0, 0, 1))
        layers[name] = t.detach().view(torch.uint8)
    return _build(layers, STORE, staged)


def byte_pages(
    kv_caches: Mapping[str, torch.Tensor],
    block_size: int,
    *,
    staged: bool | None = None,
    state: bool = False,
) -> PagedCaches:
    """The transfer connector's view: page slices per head range.

    On CPU the arrays share memory with vLLM's tensors: pulls write straight into the KV
    cache.  ``staged``: see :func:`_staged`.  ``state``: the layers keep a recurrent state
    (one row per block, maybe padded), not ``block_size`` tokens of attention.
    """
    import torch

    layers = {}
    for name, tensor in kv_caches.items():
        if tensor.dim() == 3:
            tensor = tensor.unsqueeze(1)
        blocks_contiguous = tensor.dim() > 1 and (
            tensor.is_contiguous()
            or (tensor[0].is_contiguous() and tensor.stride(0) >= tensor[0].numel())
        )
        if tensor.dim() != 4 or not blocks_contiguous:
            raise ConfigError(
                f"{TRANSFER}: layer {name} has an unsupported KV cache layout "
                f"{tuple(tensor.shape)} (expected [blocks, heads, block_size, row] with"
                " contiguous blocks)"
            )
        if tensor.shape[2] != block_size and not state:
            raise ConfigError(
                f"{TRANSFER}: layer {name} stores {tensor.shape[2]} tokens per kernel "
                f"block but the scheduler's block size is {block_size}; use a --block-size "
                "the attention kernel supports natively"
            )
        layers[name] = tensor.detach().view(torch.uint8)
    return _build(layers, TRANSFER, staged)


def _staged(layers: Mapping[str, torch.Tensor], connector: str, staged: bool | None) -> bool:
    """Whether the caches go through host staging: ``None`` decides from the device (CPU:
    NumPy views in place; anything else: staged), ``True`` stages even CPU tensors (tests
    and ``bench/device_pages.py --device cpu`` take the device path this way), ``False``
    insists on in-place views and fails on device memory."""
    devices = {str(t.device) for t in layers.values()}
    if len(devices) > 1:
        raise ConfigError(f"{connector}: KV cache layers are on several devices: {sorted(devices)}")
    on_cpu = devices <= {"cpu"}
    if staged is False and not on_cpu:
        raise ConfigError(
            f"{connector}: KV caches on {devices.pop()} cannot be viewed in place; "
            "leave staged unset to copy them through host memory"
        )
    return bool(staged) or not on_cpu


def _build(layers: Mapping[str, torch.Tensor], connector: str, staged: bool | None) -> PagedCaches:
    if not _staged(layers, connector, staged):
        return PagedCaches(
            {n: t.numpy() for n, t in layers.items()}, connector=connector, tensors=layers
        )
    from kvpool.connectors.device_pages import StagedCaches

    return StagedCaches(layers, connector=connector)
