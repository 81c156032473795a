"""Global RAM+ on MoE checkpoints saved one expert per tensor.

mergekit plans the experts fused (`mlp.experts.gate_up_proj`, ...) and builds
each fused tensor from the stored ones as it reads; the statistics pass reads
them through mergekit's own load, as the merge does. Its counts must be the
fused tensors': the same ram_statistics.json and output bytes as the same
weights saved fused (which mergekit reads by name).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import merge, read_json
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, Qwen3MoeConfig

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration import statistics

HIDDEN, INTER, EXPERTS, LAYERS, HEADS, KV, VOCAB = 16, 24, 4, 2, 4, 2, 64
HEAD = HIDDEN // HEADS
# Fraction of each stored tensor's elements an agent changes (some change
# nothing in a tensor: unchanged experts).
DENSITIES = (0.05, 0.3, 0.6)

# model type: ((config class, architecture), the stored names of expert e's
# gate, up and down projections and of the router, "|"-separated, and the
# layer's other tensors of that type)
MIXTRAL = "|".join(f"block_sparse_moe.experts.{{e}}.w{i}" for i in (1, 3, 2))
QWEN = "|".join(f"mlp.experts.{{e}}.{p}_proj" for p in ("gate", "up", "down"))
NORMS = {"self_attn.q_norm": (HEAD,), "self_attn.k_norm": (HEAD,)}
KINDS = {
    "mixtral": (
        (MixtralConfig, "MixtralForCausalLM"),
        MIXTRAL + "|block_sparse_moe.gate",
        {},
    )
}
KINDS["qwen3_moe"] = (
    (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
    QWEN + "|mlp.gate",
    NORMS,
)


def stored_state(kind: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The base's tensors, one per expert (the checkpoint layout)."""
    _config, names, extra = KINDS[kind]
    gate, up, down, router = names.split("|")
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    layer_shapes = {"input_layernorm": (HIDDEN,), "post_attention_layernorm": (HIDDEN,)}
    rows = {"q": HIDDEN, "k": KV * HEAD, "v": KV * HEAD, "o": HIDDEN}
    layer_shapes |= {f"self_attn.{x}_proj": (n, HIDDEN) for x, n in rows.items()}
    layer_shapes |= {router: (EXPERTS, HIDDEN), **extra}
    for e in range(EXPERTS):
        layer_shapes |= {
            gate.format(e=e): (INTER, HIDDEN),
            up.format(e=e): (INTER, HIDDEN),
        }
        layer_shapes[down.format(e=e)] = (HIDDEN, INTER)
    for layer in range(LAYERS):
        shapes |= {
            f"model.layers.{layer}.{k}.weight": v for k, v in layer_shapes.items()
        }
    shapes.update({"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    return {k: torch.randn(v, generator=generator) * 0.02 for k, v in shapes.items()}


def fused(kind: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights in transformers' model layout: each layer's experts
    stacked (gate and up concatenated), the router under `mlp.gate`."""
    _config, names, _extra = KINDS[kind]
    gate, up, down, router = names.split("|")
    out = dict(state)
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        gates, ups, downs = (
            torch.stack([out.pop(f"{p}{n.format(e=e)}.weight") for e in range(EXPERTS)])
            for n in (gate, up, down)
        )
        out[f"{p}mlp.experts.gate_up_proj"] = torch.cat([gates, ups], dim=1)
        out[f"{p}mlp.experts.down_proj"] = downs
        out[f"{p}mlp.gate.weight"] = out.pop(f"{p}{router}.weight")
    return out


def run(config: dict, out: Path) -> Path:
    return merge(config, out, copy_tokenizer=False)


def build(root: Path, kind: str, layout: str, nan: str | None = None) -> dict:
    """Base and three agents (sparse deltas: unique, shared and unchanged
    elements) in `layout` ("stored" or "fused"); `nan`: a stored tensor of
    the last agent that gets one NaN. Returns a global RAM+ config."""
    (config_class, architecture), _names, _extra = KINDS[kind]
    generator = torch.Generator().manual_seed(7)
    base = stored_state(kind, generator)
    states = {"base": base}
    for index, density in enumerate(DENSITIES):
        agent = {}
        for name, tensor in base.items():
            # Each agent leaves some tensors alone, whole experts included.
            keep = torch.rand(tensor.shape, generator=generator) < density
            if torch.rand(1, generator=generator) < 0.2:
                keep[:] = False
            agent[name] = (
                tensor + 0.01 * torch.randn(tensor.shape, generator=generator) * keep
            )
        states[f"agent{index}"] = agent
    if nan:
        states["agent2"][nan].view(-1)[3] = float("nan")
    paths = {}
    for model, state in states.items():
        path = root / model
        path.mkdir(parents=True)
        if layout == "fused":
            state = fused(kind, state)
        state = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        sizes = dict(
            intermediate_size=INTER, moe_intermediate_size=INTER, head_dim=HEAD
        )
        sizes |= dict(
            num_local_experts=EXPERTS, num_experts=EXPERTS, hidden_size=HIDDEN
        )
        sizes |= dict(num_attention_heads=HEADS, num_key_value_heads=KV)
        config_class(
            vocab_size=VOCAB,
            num_hidden_layers=LAYERS,
            tie_word_embeddings=False,
            architectures=[architecture],
            **sizes,
        ).save_pretrained(str(path))
        paths[model] = str(path)
    return {
        "merge_method": "ramplus",
        "base_model": paths["base"],
        "models": [{"model": paths[m]} for m in states if m != "base"],
        "dtype": "bfloat16",
        "parameters": {"r": 0.3, "alpha": 1.0},
    }


def outcome(out: Path) -> tuple[dict, bytes]:
    """ram_statistics.json without `seconds`, and the output's weight bytes."""
    document = read_json(out / statistics.STATISTICS_FILE)
    del document["seconds"]
    for row in document["tasks"]:
        row["model"] = Path(row["model"]).name  # the same models, other folders
    return document, (out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_per_expert_checkpoint_counts_as_fused(kind, tmp_path):
    fused_config = build(tmp_path / "fused", kind, "fused")
    stored_config = build(tmp_path / "stored", kind, "stored")
    expected = outcome(run(fused_config, tmp_path / "out-fused"))
    document, weights = outcome(run(stored_config, tmp_path / "out-stored"))
    assert document == expected[0]
    assert weights == expected[1]
    # Each fused tensor counted once, with all its elements.
    written = load_file(str(tmp_path / "out-stored" / "model.safetensors"))
    assert document["num_tensors"] == len(written)
    assert document["num_elements"] == sum(t.numel() for t in written.values())
    rows = document["tasks"]
    assert all(row["unique"] and row["shared"] for row in rows)
    assert len({row["scale"] for row in rows}) > 1  # λ follows the counts


def test_nan_in_one_stored_expert_is_refused_naming_the_fused_tensor(tmp_path):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    config = build(tmp_path, "qwen3_moe", "stored", nan=name)
    fused_name = "model.layers.1.mlp.experts.gate_up_proj"
    with pytest.raises(
        RAMInputError, match=rf"Tensor {fused_name} of model .*agent2 has 1 NaN"
    ):
        run(config, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_ignored_nan_in_one_stored_expert_counts_as_fused(tmp_path):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    found = []
    for layout in ("fused", "stored"):
        config = build(tmp_path / layout, "qwen3_moe", layout, nan=name)
        config["parameters"]["nonfinite"] = "ignore"
        found.append(outcome(run(config, tmp_path / f"out-{layout}")))
    assert found[0] == found[1]
    written = load_file(str(tmp_path / "out-stored" / "model.safetensors"))
    assert not written["model.layers.1.mlp.experts.gate_up_proj"].isnan().any()
