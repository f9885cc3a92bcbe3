"""KV cache groups: layers grouped by attention type, one block table per group. No torch.

A model whose layers all attend to their whole context has one group, and a KV *page* holds one
block of tokens for every layer (the classic layout). A model with sliding-window layers (Gemma 2/3,
Mistral v0.1, windowed Qwen2) keeps full KV only where a layer needs it: its layers are grouped by
attention type (full, or a window size) into groups of ``layers_per_page`` layers each, and a page
holds one block of tokens for the layers of one group. Every group has its own block table per
request, all over one pool of pages; a windowed group's pages that fall wholly before its window are
returned to the pool while the request runs (vLLM's hybrid KV cache manager)::

    Gemma 3 shape: 26 layers, 4 global, 22 sliding (window 512), layers_per_page = 4
    group 0 (full)     layers  5 11 17 23          pages for every block of the context
    group 1 (window)   layers  0  1  2  3          pages for the last ~512 tokens only
    ...
    group 6 (window)   layers 24 25  -  -          (two slots unused)

Full-attention groups come first, then windowed ones by window size. Each attention type has its
manager (kv/managers.py): the full groups' cached pages live in the radix index, a window's in a
map by block hash; ``window_start`` says which blocks a windowed group still needs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupPlan:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, or None (full attention)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot in a page (axis 0 of the KV cache)
    layers_per_page: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def hybrid(self) -> bool:
        """Whether some group frees pages outside its window."""
        return any(w is not None for w in self.windows)

    def pages_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Pages a sequence of ``num_tokens`` tokens holds at most while computed in chunks of up to
        ``chunk`` tokens: every block in a full group, a window plus a chunk in a windowed one."""
        blocks = -(-num_tokens // block_size)
        total = 0
        for w in self.windows:
            total += blocks if w is None else min(blocks, -(-(w + chunk) // block_size) + 1)
        return total


def window_start(window: int, num_computed: int, block_size: int) -> int:
    """First block a windowed group still needs once ``num_computed`` tokens are computed: the next
    query, at position ``num_computed``, sees keys from ``num_computed - window + 1`` on."""
    return max(0, num_computed - window + 1) // block_size


def plan_kv_groups(layer_windows: tuple[int | None, ...], hybrid: bool = True) -> KVGroupPlan:
    """Group layers by their window (``None``: full attention). ``hybrid=False``, or a model without
    windowed layers, gives one group of every layer that keeps every block (the classic layout)."""
    n = len(layer_windows)
    if not hybrid or all(w is None for w in layer_windows):
        return KVGroupPlan((None,), (0,) * n, tuple(range(n)), max(n, 1))
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    # full attention first (the anchor), then windows in ascending size
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    lpg = min(len(kinds[w]) for w in order)
    windows: list[int | None] = []
    layer_group, layer_slot = [0] * n, [0] * n
    for w in order:
        layers = kinds[w]
        for start in range(0, len(layers), lpg):
            g = len(windows)
            windows.append(w)
            for slot, layer in enumerate(layers[start:start + lpg]):
                layer_group[layer], layer_slot[layer] = g, slot
    return KVGroupPlan(tuple(windows), tuple(layer_group), tuple(layer_slot), lpg)
