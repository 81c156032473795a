"""Shared fixtures: tiny Llama checkpoints with sparse, RL-like task vectors.

Everything is built locally (no model hub): `HF_HUB_OFFLINE=1` is set before
anything imports transformers. `model_family` is a session-scoped factory; a
family is a base model plus task models whose task vectors have controlled
supports, written as safetensors checkpoints with a word-level tokenizer.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# tests/faults.py's fixtures (the publishing tests' OUT with a previous merge).
pytest_plugins = ["faults"]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
LAYER_WEIGHTS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.up_proj",
    "mlp.gate_proj",
    "mlp.down_proj",
)
VOCAB_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TaskSpec:
    """One task model: the base plus a sparse delta.

    density: fraction of each tensor's elements changed, varied per tensor by
    a random factor in [1 - skew, 1 + skew] (different for every task, so
    per-tensor and whole-model overlap ratios differ).
    subset_of: change only (about `share` of) the elements that task changes,
    so this task has no unique element, unless `plus` > 0: then it also
    changes about that fraction of each tensor's elements at random.
    identical: a byte copy of the base checkpoint.
    words: the task's own vocabulary (default: the base's).
    """

    name: str
    density: float = 0.1
    skew: float = 0.9
    subset_of: str | None = None
    share: float = 0.5
    plus: float = 0.0
    identical: bool = False
    words: tuple[str, ...] | None = None


@dataclass
class Family:
    root: Path
    paths: dict[str, str]
    dtype: torch.dtype
    words: dict[str, tuple[str, ...]]
    tie: bool
    # Per task and tensor: the flat indices its delta was written to.
    supports: dict[str, dict[str, torch.Tensor]] = field(repr=False)

    @property
    def base(self) -> str:
        return self.paths["base"]

    @property
    def tasks(self) -> list[str]:
        return [name for name in self.paths if name != "base"]

    def state(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(os.path.join(self.paths[name], "model.safetensors"))

    def task_states(self, names: Sequence[str] | None = None):
        return [self.state(n) for n in (names or self.tasks)]

    def config_dict(
        self,
        method: str = "ramplus",
        parameters: dict | None = None,
        tasks: Sequence[str] | None = None,
        model_parameters: dict[str, dict] | None = None,
        **extra,
    ) -> dict:
        models = []
        for name in tasks or self.tasks:
            entry: dict = {"model": self.paths[name]}
            if model_parameters and name in model_parameters:
                entry["parameters"] = model_parameters[name]
            models.append(entry)
        config: dict = {
            "merge_method": method,
            "base_model": self.base,
            "models": models,
        }
        if parameters:
            config["parameters"] = parameters
        config.update(extra)
        return config

    def yaml(self, *args, **kwargs) -> str:
        return yaml.safe_dump(self.config_dict(*args, **kwargs), sort_keys=False)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cuda",
        action="store_true",
        help="also run the tests that take `on_device` (the kernels' parity with "
        "the reference and stock mergekit, and output safety) on CUDA; they skip, "
        "saying why, where torch sees no CUDA device",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`on_device`: "cpu", and with --cuda also "cuda"."""
    if "on_device" not in metafunc.fixturenames:
        return
    devices = [pytest.param("cpu", id="cpu")]
    if metafunc.config.getoption("cuda"):
        devices.append(
            pytest.param(
                "cuda",
                id="cuda",
                marks=pytest.mark.skipif(
                    not torch.cuda.is_available(),
                    reason="--cuda given, but torch sees no CUDA device",
                ),
            )
        )
    metafunc.parametrize("on_device", devices)


def words_for(vocab: int) -> tuple[str, ...]:
    return SPECIAL_TOKENS + tuple(f"w{i}" for i in range(vocab - len(SPECIAL_TOKENS)))


def save_word_tokenizer(path: str, words: Sequence[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def llama_shapes(
    *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int
) -> dict[str, tuple[int, ...]]:
    """Shapes of the non-vocabulary Llama weights."""
    head_dim = hidden // heads
    per_layer = {
        "input_layernorm": (hidden,),
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "post_attention_layernorm": (hidden,),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    shapes = {}
    for layer in range(layers):
        for suffix in LAYER_WEIGHTS:
            shapes[f"model.layers.{layer}.{suffix}.weight"] = per_layer[suffix]
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def _with_delta(tensor, support, generator) -> torch.Tensor:
    """tensor + δ at the flat indices `support`, |δ| in [0.01, 0.03) with a
    random sign: always above ε, also after rounding to bf16."""
    count = support.numel()
    magnitude = 0.01 + 0.02 * torch.rand(count, generator=generator)
    sign = torch.rand(count, generator=generator) < 0.5
    out = tensor.clone()
    out.view(-1)[support] += torch.where(sign, -magnitude, magnitude).to(out.dtype)
    return out


def _random_support(numel: int, density: float, generator) -> torch.Tensor:
    """About density·numel distinct flat indices (cheap for big tensors)."""
    draws = int(round(min(1.0, density) * numel))
    return torch.randint(numel, (draws,), generator=generator).unique()


def build_family(
    root: Path,
    tasks: Sequence[TaskSpec],
    *,
    layers: int = 2,
    hidden: int = 32,
    intermediate: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 48,
    tie: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer: bool = True,
) -> Family:
    """Write a base and task models under `root` (absolute paths)."""
    from transformers import LlamaConfig

    root = Path(root).resolve()
    generator = torch.Generator().manual_seed(seed)
    shapes = llama_shapes(
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=kv_heads,
    )
    base_words = words_for(vocab)
    all_words = list(base_words)
    for spec in tasks:
        all_words += [w for w in spec.words or () if w not in all_words]
    # One embedding (and output) row per word, whichever model has the word.
    vocab_rows = {
        name: {w: torch.randn(hidden, generator=generator) * 0.02 for w in all_words}
        for name in VOCAB_WEIGHTS
        if not (tie and name == "lm_head.weight")
    }

    def base_value(name, shape):
        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * torch.randn(shape, generator=generator)
        return 0.02 * torch.randn(shape, generator=generator)

    base32 = {name: base_value(name, shape) for name, shape in shapes.items()}

    def vocab_tensors(words):
        return {
            name: torch.stack([rows[w] for w in words])
            for name, rows in vocab_rows.items()
        }

    def store(name: str, state: dict, words: Sequence[str]) -> str:
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.to(dtype).contiguous() for k, v in state.items()},
            str(path / "model.safetensors"),
            metadata={"format": "pt"},
        )
        LlamaConfig(
            vocab_size=len(words),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=64,
            tie_word_embeddings=tie,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(str(path))
        if tokenizer:
            save_word_tokenizer(str(path), words)
        return str(path)

    # Everything in the checkpoint dtype from here on.
    base32 = {k: v.to(dtype) for k, v in base32.items()}
    base_state = {
        **base32,
        **{k: v.to(dtype) for k, v in vocab_tensors(base_words).items()},
    }
    paths = {"base": store("base", base_state, base_words)}
    words = {"base": tuple(base_words)}
    supports: dict[str, dict[str, torch.Tensor]] = {}
    for spec in tasks:
        if spec.identical:
            path = root / spec.name
            shutil.copytree(paths["base"], path)
            paths[spec.name] = str(path)
            words[spec.name] = tuple(base_words)
            supports[spec.name] = {
                k: torch.zeros(0, dtype=torch.long) for k in base_state
            }
            continue
        task_words = tuple(spec.words or base_words)
        start = {
            **base32,
            **{k: v.to(dtype) for k, v in vocab_tensors(task_words).items()},
        }
        state, support = {}, {}
        for name in sorted(start):
            tensor = start[name]
            if spec.subset_of is not None:
                other = supports[spec.subset_of][name]
                keep = other[
                    torch.rand(other.numel(), generator=generator) < spec.share
                ]
                if spec.plus:
                    extra = _random_support(tensor.numel(), spec.plus, generator)
                    keep = torch.cat([keep, extra]).unique()
            else:
                factor = 1.0 + spec.skew * (
                    2 * float(torch.rand(1, generator=generator)) - 1
                )
                keep = _random_support(tensor.numel(), spec.density * factor, generator)
            support[name] = keep
            state[name] = _with_delta(tensor, keep, generator)
        paths[spec.name] = store(spec.name, state, task_words)
        words[spec.name] = task_words
        supports[spec.name] = support
    return Family(
        root=root,
        paths=paths,
        dtype=dtype,
        words=words,
        tie=tie,
        supports=supports,
    )


THREE_TASKS = (
    TaskSpec("alpha", density=0.08),
    TaskSpec("beta", density=0.15),
    TaskSpec("gamma", density=0.25),
)


@pytest.fixture(scope="session")
def model_family(tmp_path_factory):
    """Factory: model_family(key, tasks=THREE_TASKS, **build_family options).

    Families are cached per key for the whole session.
    """
    cache: dict[str, Family] = {}

    def make(key: str, tasks: Sequence[TaskSpec] = THREE_TASKS, **options) -> Family:
        if key not in cache:
            root = tmp_path_factory.mktemp(f"family-{key}")
            cache[key] = build_family(root, tasks, **options)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def family_f32(model_family) -> Family:
    return model_family("f32", dtype=torch.float32)


@pytest.fixture(scope="session")
def family_bf16(model_family) -> Family:
    return model_family("bf16", dtype=torch.bfloat16, seed=1)


def merge(config: dict, out: Path, **options) -> Path:
    """Merge a configuration dict with mergekit_ram.run_merge (quiet)."""
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    import mergekit_ram

    mergekit_ram.run_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        MergeOptions(quiet=True, **options),
    )
    return out


def merge_yaml(text: str, out: Path) -> dict[str, torch.Tensor]:
    """Merge a YAML config with mergekit_ram.run_merge; the written tensors."""
    merge(yaml.safe_load(text), out)
    return load_file(str(Path(out) / "model.safetensors"))


def read_json(path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
