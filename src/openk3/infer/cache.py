"""Paged hybrid cache of the inference engine, and the prefix cache.

Layouts (``Lk`` = number of KDA layers, ``Lm`` = number of MLA layers, ``S`` = ``max_seqs``, ``P`` = ``num_pages``):

* ``kv``    ``[Lm, P + 1, page_size, dc + dr]`` (cache dtype): per MLA layer, fixed-size pages of the 576-value latent
  (SPEC.md §2.5): the normed ``c_hat`` (``kv_lora_rank`` values) then the shared unrotated key ``k_r``
  (``qk_rope_head_dim`` values). Token ``t`` of a sequence lives in page ``block_table[t // page_size]`` at offset
  ``t % page_size``. Page ``P`` is a scratch page for padded batch rows.
* ``state`` ``[Lk, S + 1, H, K, V]`` fp32: per KDA layer and sequence slot, the recurrent state (row = key channel).
* ``conv``  ``[Lk, S + 1, 3, H*K, W-1]`` fp32: the q/k/v short-conv history (last ``W-1`` pre-activation
  projections, oldest first). Slot ``S`` is a scratch slot for padded batch rows.

Pages are reference counted (a page can be held by several sequences and by prefix-cache snapshots); a sequence
slot is owned by one sequence. :class:`PrefixCache` keeps snapshots of the KDA state and conv history at every
``interval``-th prompt position, keyed by a chained hash of the token prefix, together with references to the MLA
pages that cover the prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from openk3.config import K3Config


def device_tensor(data, dtype: torch.dtype, device) -> torch.Tensor:
    """``data`` (a number, a list, or a tensor) as a ``dtype`` tensor on ``device``, copied to a CUDA device without
    waiting for the work queued there: a blocking host-to-device copy synchronises the stream first, which would
    keep the engine's decode steps from running ahead of the GPU (a non-blocking copy from pageable memory has taken
    the bytes when it returns)."""
    if isinstance(data, torch.Tensor):
        return data.to(device=device, dtype=dtype, non_blocking=True)
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)


__all__ = ["CacheLayout", "PoolPlan", "plan_pool", "PagedHybridCache", "PrefixCache", "Snapshot"]


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheLayout:
    """What one sequence keeps per layer, derived from a :class:`K3Config`."""

    kda_layers: tuple[int, ...]  # 0-based model layer ids
    mla_layers: tuple[int, ...]
    kda_heads: int
    kda_head_dim: int
    conv_hist: int  # short_conv_kernel_size - 1
    kv_lora_rank: int
    rope_dim: int

    @classmethod
    def from_config(cls, config: K3Config) -> CacheLayout:
        t = config.layer_types
        return cls(
            kda_layers=tuple(i for i, x in enumerate(t) if x == "kda"),
            mla_layers=tuple(i for i, x in enumerate(t) if x == "mla"),
            kda_heads=config.kda_num_heads,
            kda_head_dim=config.kda_head_dim,
            conv_hist=config.short_conv_kernel_size - 1,
            kv_lora_rank=config.kv_lora_rank,
            rope_dim=config.qk_rope_head_dim,
        )

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def conv_channels(self) -> int:
        return self.kda_heads * self.kda_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """MLA latent bytes per token over all MLA layers (27,648 B for K3 in bf16, SPEC.md §2.5)."""
        return len(self.mla_layers) * self.latent_dim * _dtype_size(dtype)

    def bytes_per_sequence(self) -> int:
        """Fixed per-sequence bytes: fp32 KDA state plus fp32 q/k/v conv history over all KDA layers."""
        H, K = self.kda_heads, self.kda_head_dim
        return len(self.kda_layers) * 4 * (H * K * K + 3 * H * K * self.conv_hist)


@dataclass
class PoolPlan:
    num_pages: int
    page_size: int
    max_seqs: int
    bytes_per_token: int
    bytes_per_sequence: int
    source: str  # how the size was chosen

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.max_tokens * self.bytes_per_token + (self.max_seqs + 1) * self.bytes_per_sequence


def plan_pool(
    config: K3Config,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 16,
    max_seqs: int = 64,
    max_tokens: int | None = None,
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: int = 0,
) -> PoolPlan:
    """Choose the number of pages.

    ``max_tokens`` given: that many cached tokens (rounded up to whole pages). Otherwise on CUDA: the free memory
    (``torch.cuda.mem_get_info``) times ``gpu_memory_utilization``, minus ``reserve_bytes`` (activations, prefix
    snapshots) and the per-sequence state of ``max_seqs`` sequences, divided by the bytes per page. On CPU without
    ``max_tokens``: 32768 tokens.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    lay = CacheLayout.from_config(config)
    bpt, bps = lay.bytes_per_token(dtype), lay.bytes_per_sequence()
    dev = torch.device(device)
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens (cache size) must be >= 1, got {max_tokens}")
        pages, src = -(-max_tokens // page_size), f"--max-total-tokens {max_tokens}"
    elif dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        budget = int(free * gpu_memory_utilization) - reserve_bytes - (max_seqs + 1) * bps
        if budget <= 0:
            raise RuntimeError(
                f"not enough free GPU memory for the state of {max_seqs} sequences "
                f"({(max_seqs + 1) * bps / 2**30:.2f} GiB); lower --max-seqs"
            )
        per_page = max(1, bpt * page_size)
        pages = budget // per_page
        src = f"{free / 2**30:.1f} GiB free x {gpu_memory_utilization}"
    else:
        pages, src = -(-32768 // page_size), "CPU default (32768 tokens)"
    if lay.mla_layers and pages < 1:
        raise RuntimeError("the cache pool would have no pages; lower --max-seqs or raise the memory budget")
    return PoolPlan(max(1, int(pages)), page_size, max_seqs, bpt, bps, src)


class PagedHybridCache:
    """The engine's cache pool (layouts in the module docstring) with page and slot allocators."""

    def __init__(
        self,
        config: K3Config,
        *,
        num_pages: int,
        page_size: int,
        max_seqs: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.layout = lay = CacheLayout.from_config(config)
        self.page_size, self.num_pages, self.max_seqs = page_size, num_pages, max_seqs
        self.dtype, self.device = dtype, torch.device(device)
        self.dummy_page, self.dummy_slot = num_pages, max_seqs
        H, K = lay.kda_heads, lay.kda_head_dim
        self.kv = torch.zeros(
            len(lay.mla_layers), num_pages + 1, page_size, lay.latent_dim, dtype=dtype, device=device
        )
        self.state = torch.zeros(
            len(lay.kda_layers), max_seqs + 1, H, K, K, dtype=torch.float32, device=device
        )
        self.conv = torch.zeros(
            len(lay.kda_layers), max_seqs + 1, 3, H * K, lay.conv_hist, dtype=torch.float32, device=device
        )
        self.pool_index = {li: j for j, li in enumerate(lay.kda_layers)} | {
            li: j for j, li in enumerate(lay.mla_layers)
        }
        self._free_pages: deque[int] = deque(range(num_pages))
        self._seq_refs = [0] * num_pages
        self._snap_refs = [0] * num_pages
        self._snap_only = 0  # pages held only by snapshots (reclaimable by evicting them)
        self._free_slots: list[int] = list(range(max_seqs - 1, -1, -1))

    # ------------------------------------------------------------------ accounting
    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token(self.dtype)

    @property
    def bytes_per_sequence(self) -> int:
        return self.layout.bytes_per_sequence()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.state, self.conv))

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_reclaimable_pages(self) -> int:
        """Free pages plus pages only prefix snapshots hold."""
        return len(self._free_pages) + self._snap_only

    @property
    def num_seq_pages(self) -> int:
        """Pages held by at least one live sequence."""
        return self.num_pages - len(self._free_pages) - self._snap_only

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def report(self) -> dict:
        return {
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "max_tokens": self.num_pages * self.page_size,
            "max_seqs": self.max_seqs,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_sequence": self.bytes_per_sequence,
            "pool_bytes": self.nbytes(),
            "dtype": str(self.dtype).replace("torch.", ""),
        }

    # ------------------------------------------------------------------ pages
    def _change(self, page: int, dseq: int, dsnap: int) -> None:
        s0, n0 = self._seq_refs[page], self._snap_refs[page]
        s1, n1 = s0 + dseq, n0 + dsnap
        if s1 < 0 or n1 < 0:
            raise RuntimeError(f"page {page} released more often than it was taken")
        self._seq_refs[page], self._snap_refs[page] = s1, n1
        self._snap_only += int(s1 == 0 and n1 > 0) - int(s0 == 0 and n0 > 0)
        if s1 == 0 and n1 == 0 and (s0 or n0):
            self._free_pages.append(page)

    def alloc_page(self) -> int | None:
        """A fresh page held by one sequence, or None when no page is free."""
        if not self._free_pages:
            return None
        p = self._free_pages.popleft()
        self._seq_refs[p] = 1
        return p

    def share_page(self, page: int) -> None:
        self._change(page, 1, 0)

    def release_pages(self, pages: list[int]) -> None:
        for p in pages:
            self._change(p, -1, 0)

    def snap_ref(self, pages: list[int]) -> None:
        for p in pages:
            self._change(p, 0, 1)

    def snap_unref(self, pages: list[int]) -> None:
        for p in pages:
            self._change(p, 0, -1)

    def copy_page(self, src: int, dst: int) -> None:
        self.kv[:, dst].copy_(self.kv[:, src])

    # ------------------------------------------------------------------ slots
    def alloc_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def free_slot(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.max_seqs:
            raise RuntimeError(f"slot {slot} freed twice or out of range")
        self._free_slots.append(slot)

    def reset_slot(self, slot: int) -> None:
        self.state[:, slot].zero_()
        self.conv[:, slot].zero_()

    def save_slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.state[:, slot].clone(), self.conv[:, slot].clone()

    def load_slot(self, slot: int, state: torch.Tensor, conv: torch.Tensor) -> None:
        self.state[:, slot].copy_(state)
        self.conv[:, slot].copy_(conv)

    # ------------------------------------------------------------------ latent
    def slot_mapping(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Flat row index (page * page_size + offset) of positions [start, end) of a sequence: [end - start]."""
        ps = self.page_size
        return device_tensor(
            [pages[t // ps] * ps + t % ps for t in range(start, end)], torch.long, self.device
        )

    def write_latent(self, j: int, rows: torch.Tensor, latent: torch.Tensor) -> None:
        """Write ``latent [N, dc + dr]`` of MLA pool layer ``j`` at flat rows ``rows [N]``."""
        self.kv[j].view(-1, self.layout.latent_dim).index_copy_(0, rows, latent.to(self.dtype))

    def gather_latent(self, j: int, pages: list[int], length: int) -> torch.Tensor:
        """Contiguous latent [length, dc + dr] of the first ``length`` tokens of a sequence (MLA pool layer ``j``)."""
        n = self.pages_for(length)
        idx = device_tensor(pages[:n], torch.long, self.device)
        return self.kv[j].index_select(0, idx).reshape(-1, self.layout.latent_dim)[:length]


# ======================================================================================================= prefix cache
@dataclass
class Snapshot:
    key: bytes
    length: int
    tokens: array
    pages: list[int]  # pages covering [0, length), held by the snapshot
    state: torch.Tensor  # [Lk, H, K, V] fp32
    conv: torch.Tensor  # [Lk, 3, HK, W-1] fp32

    @property
    def nbytes(self) -> int:
        return self.state.numel() * 4 + self.conv.numel() * 4 + len(self.tokens) * 4


class PrefixCache:
    """Snapshots of a sequence's cache at prompt positions that are multiples of ``interval``.

    A snapshot holds the KDA states and conv histories of all KDA layers after exactly ``length`` tokens (never a
    state from another position) and references to the MLA pages that cover those tokens. Lookup returns the longest
    snapshot whose tokens equal the request's prefix (hash match, then verified token by token). Least recently
    used snapshots are evicted past ``max_bytes`` or when the pool needs pages.
    """

    def __init__(self, pool: PagedHybridCache, interval: int = 64, max_bytes: int = 64 << 20):
        if interval < 1:
            raise ValueError(f"prefix cache interval must be >= 1, got {interval}")
        self.pool, self.interval, self.max_bytes = pool, interval, max_bytes
        self.entries: OrderedDict[bytes, Snapshot] = OrderedDict()
        self.nbytes = 0
        self.queries = self.hits = self.hit_tokens = self.inserts = self.evictions = 0

    def block_keys(self, ids: list[int], upto: int) -> list[tuple[int, bytes]]:
        """[(length, key)] for every multiple of ``interval`` up to ``upto``; keys are chained hashes."""
        out, h = [], b""
        n = self.interval
        for end in range(n, upto + 1, n):
            h = hashlib.blake2b(h + array("q", ids[end - n : end]).tobytes(), digest_size=20).digest()
            out.append((end, h))
        return out

    def lookup(self, ids: list[int], max_len: int, record: bool = True) -> Snapshot | None:
        """Longest snapshot of a prefix of ``ids`` no longer than ``max_len`` (``record``: count it in the stats)."""
        found = None
        for length, key in reversed(self.block_keys(ids, max_len)):
            snap = self.entries.get(key)
            if snap is not None and snap.length == length and snap.tokens == array("q", ids[:length]):
                self.entries.move_to_end(key)
                found = snap
                break
        if record:
            self.record(found.length if found else 0)
        return found

    def record(self, hit_length: int) -> None:
        self.queries += 1
        if hit_length:
            self.hits += 1
            self.hit_tokens += hit_length

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def insert(
        self,
        key: bytes,
        ids: list[int],
        length: int,
        pages: list[int],
        slot: int,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Snapshot the first ``length`` tokens of a sequence: its KDA states and conv histories as the pool's
        ``slot`` holds them now, or ``state`` = (states, conv histories) in ``save_slot``'s layout when the slot has
        moved past ``length`` already (a snapshot inside a prefill chunk)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if self.max_bytes <= 0:
            return
        held = pages[: self.pool.pages_for(length)]
        state, conv = state if state is not None else self.pool.save_slot(slot)
        snap = Snapshot(key, length, array("q", ids[:length]), list(held), state, conv)
        if snap.nbytes > self.max_bytes:
            return
        self.pool.snap_ref(snap.pages)
        self.entries[key] = snap
        self.nbytes += snap.nbytes
        self.inserts += 1
        while self.nbytes > self.max_bytes and self.evict_lru():
            pass

    def evict_lru(self) -> bool:
        if not self.entries:
            return False
        _, snap = self.entries.popitem(last=False)
        self.pool.snap_unref(snap.pages)
        self.nbytes -= snap.nbytes
        self.evictions += 1
        return True

    def clear(self) -> None:
        while self.evict_lru():
            pass
