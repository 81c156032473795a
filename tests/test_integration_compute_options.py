"""dtype, out_dtype, --cuda and --device are checked before any weight is read
(issue 17 items 7 and 9): one Error paragraph naming the key or option."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from rejected_inputs import no_weight_reads

import mergekit_ram
from mergekit_ram.commands.cli import main
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.compute_options import check_device, check_dtypes


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA, also where the test runs on one."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def cli(family, tmp_path, command: str, *args: str):
    config = tmp_path / "ramplus.yml"
    config.write_text(family.yaml("ramplus"))
    argv = [command, str(config)]
    if command == "merge":
        argv.append(str(tmp_path / "out"))
    with no_weight_reads():
        return CliRunner().invoke(main, [*argv, "--quiet", *args])


@pytest.mark.parametrize("command", ["merge", "analyze"])
def test_cuda_without_cuda_is_one_error(command, family_f32, tmp_path, no_cuda):
    result = cli(family_f32, tmp_path, command, "--cuda")
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: --cuda: this machine has no cuda device")
    assert "Traceback" not in result.output and "Leave --cuda out" in result.output
    assert not (tmp_path / "out").exists()


def test_python_run_merge_refuses_cuda_without_cuda(family_f32, tmp_path, no_cuda):
    """mergekit-yaml reaches the same check through the run_merge wrapper."""
    config = MergeConfiguration.model_validate(family_f32.config_dict("ramplus"))
    with no_weight_reads(), pytest.raises(RAMInputError, match="--cuda"):
        mergekit_ram.run_merge(
            config, str(tmp_path / "out"), MergeOptions(cuda=True, quiet=True)
        )


def test_device_index_beyond_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RAMInputError, match="has 2 cuda device.*0 to 1"):
        check_device(MergeOptions(device="cuda:3"))
    check_device(MergeOptions(device="cuda:1"))


def test_multi_gpu_needs_cuda(no_cuda):
    with pytest.raises(RAMInputError, match="--multi-gpu"):
        check_device(MergeOptions(multi_gpu=True))


@pytest.mark.parametrize("device", ["tpu9", "meta", "cuda:x"])
def test_devices_mergekit_cannot_use(device):
    with pytest.raises(RAMInputError, match=f"--device {device}: '{device}' is not"):
        check_device(MergeOptions(device=device))


def test_cpu_and_no_options_pass():
    check_device(None)
    check_device(MergeOptions())
    check_device(MergeOptions(device="cpu"))


def dtypes_config(family, **keys) -> MergeConfiguration:
    return MergeConfiguration.model_validate(family.config_dict("ramplus", **keys))


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("dtype", "bf16", "did you mean bfloat16?"),
        ("dtype", "fp16", "did you mean float16?"),
        ("out_dtype", "bool", "not a floating-point dtype"),
        ("dtype", "int64", "not a floating-point dtype"),
    ],
)
def test_dtypes_refused(key, value, says, family_f32):
    with pytest.raises(RAMInputError, match=f"{key}: '{value}' is {'.*' + says}"):
        check_dtypes(dtypes_config(family_f32, **{key: value}))


@pytest.mark.parametrize("value", ["bfloat16", "float16", "float32", "torch.float64"])
def test_float_dtypes_pass(value, family_f32):
    check_dtypes(dtypes_config(family_f32, dtype=value, out_dtype=value))
