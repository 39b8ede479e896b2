"""Hugging Face transformers adapter: store a ``DynamicCache`` after prefill, rebuild one later.

transformers has no paged cache, so :class:`HFCacheConnector` keeps a paged
block pool in the vLLM flash layout (``[layers, 2, blocks, block_size,
kv_heads, head_dim]``) as the engine's blocks and moves chunks through
:class:`~kvpool.gpu.PagedKVConnector`, the same path a paged engine uses:

- ``store(tokens, cache)``: copies the cache's K/V of the full chunks of
  ``tokens`` into the pool and stores the chunks the pool lacks. Call it
  after prefill; decoding appends to the cache in place, which is harmless
  (only the first ``len(tokens)`` positions are read) but storing must
  happen before the cache is cropped or reused.
- ``load(tokens)``: loads the longest cached prefix (at most ``len(tokens) - 1``
  tokens, so the model still computes the last prompt token's logits) and
  returns a fresh ``DynamicCache`` holding it, built from the model config so
  every layer has its type; sliding-window layers get the full prefix through
  ``update``, which keeps their window and restores their true sequence
  length. Run the model on ``tokens[n:]`` with it.

Batch size 1; sliding-window layers that have already dropped tokens cannot
be stored (their K/V is gone) and raise :class:`LayoutError`.

transformers 5.x: the forward keyword is ``cache`` (``past_key_values`` is
deprecated), and ``DynamicCache(ddp_cache_data=...)`` / ``DynamicCache(config=...)``
build caches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpool.client import Client
from kvpool.gpu.connector import DEFAULT_STAGING_SLOTS, PagedKVConnector, tokens_list
from kvpool.gpu.layout import KVLayout
from kvpool.placement.keys import DEFAULT_CHUNK_TOKENS
from kvpool.protocol.errors import LayoutError

__all__ = ["Generation", "HFCacheConnector", "generate_greedy", "layout_for"]


def layout_for(config: Any, *, dtype: torch.dtype = torch.float32,
               block_size: int = 16) -> KVLayout:
    """The flash-layout :class:`KVLayout` of a transformers model config."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return KVLayout(text.num_hidden_layers, kv_heads, head_dim, dtype, block_size)


class HFCacheConnector:
    """Stores and rebuilds transformers ``DynamicCache`` objects through kvpool."""

    def __init__(self, client: Client, config: Any, *, model_id: str | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_tokens: int = 8192, block_size: int = 16,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 staging_slots: int = DEFAULT_STAGING_SLOTS) -> None:
        self.config = config
        self.layout = layout_for(config, dtype=dtype, block_size=block_size)
        num_blocks = -(-max_tokens // block_size)
        self.max_tokens = num_blocks * block_size
        lay = self.layout
        self.pool = torch.zeros((lay.num_layers, *lay.layer_shape(num_blocks)), dtype=dtype,
                                device=device)
        self.block_ids = list(range(num_blocks))
        # the same default as the vLLM connector's: the two engines share chunks
        self.model_id = model_id or str(getattr(config, "kvpool_model_id", None)
                                        or getattr(config, "name_or_path", ""))
        if not self.model_id:
            raise LayoutError("give model_id: the config names no model")
        self.namespace = lay.namespace(self.model_id, chunk_tokens=chunk_tokens)
        self.connector = PagedKVConnector(client, lay, self.pool, self.namespace,
                                          staging_slots=staging_slots)

    def close(self) -> None:
        self.connector.close()

    def __enter__(self) -> HFCacheConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def store(self, tokens: Sequence[int] | torch.Tensor, cache: Any) -> int:
        """Store the full chunks of ``tokens`` from ``cache``; tokens newly stored."""
        tokens = tokens_list(tokens)
        t = self.connector.chunk_tokens
        n = min(len(tokens), self.max_tokens) // t * t
        if n == 0:
            return 0
        b = self.layout.block_size
        for i, layer in enumerate(cache.layers):
            keys, values = layer.keys, layer.values
            if keys.shape[0] != 1:
                raise LayoutError(f"only batch size 1 is supported, got {keys.shape[0]}")
            if keys.shape[-2] < n:
                raise LayoutError(f"layer {i} holds {keys.shape[-2]} positions, fewer than the "
                                  f"{n} tokens to store (a sliding-window layer drops old K/V)")
            for kv, src in ((0, keys), (1, values)):
                # [1, H, S, D] -> [S, H, D] -> blocks [S/B, B, H, D]
                blocks = src[0, :, :n].permute(1, 0, 2).reshape(n // b, b, src.shape[1],
                                                                 src.shape[-1])
                self.pool[i, kv, : n // b].copy_(blocks)
        return self.connector.store(tokens[:n], self.block_ids)

    def load(self, tokens: Sequence[int] | torch.Tensor) -> tuple[Any, int]:
        """A new ``DynamicCache`` with the longest cached prefix of ``tokens``, and its length."""
        from transformers import DynamicCache

        tokens = tokens_list(tokens)
        n = self.connector.load(tokens, self.block_ids, max_tokens=len(tokens) - 1)
        cache: Any = DynamicCache(config=self.config)
        if n:
            lay = self.layout
            for i, layer in enumerate(cache.layers):
                k, v = (self.pool[i, kv, : n // lay.block_size]
                        .reshape(n, lay.num_kv_heads, lay.head_dim).permute(1, 0, 2)
                        .unsqueeze(0).contiguous() for kv in (0, 1))
                layer.update(k, v)
        return cache, n


@dataclass
class Generation:
    tokens: list[int]  #: the greedily decoded tokens
    logits: torch.Tensor  #: [steps, vocab]: the logits each token was picked from
    ttft_s: float  #: seconds from the start of prefill to the first token


@torch.inference_mode()
def generate_greedy(model: Any, tokens: Sequence[int], cache: Any, steps: int, *,
                    start: int = 0) -> Generation:
    """Prefill ``tokens[start:]`` on top of ``cache`` (which holds ``tokens[:start]``),
    then decode ``steps`` tokens greedily. One sequence, no sampling."""
    t0 = time.perf_counter()
    ids = torch.tensor([list(tokens[start:])], dtype=torch.long)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    logits = [out.logits[0, -1].float()]
    ttft = time.perf_counter() - t0
    picked = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        out = model(input_ids=torch.tensor([[picked[-1]]]), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
        picked.append(int(logits[-1].argmax()))
    return Generation(picked, torch.stack(logits), ttft)
