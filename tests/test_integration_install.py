"""mergekit_ram.integration.install: the one transformers warning mergekit's
own code triggers is dropped while mergekit builds the output config, and
nothing else is (issue 30, item 4)."""

from __future__ import annotations

import logging
import types

import pytest
from mergekit import merge as mergekit_merge
from mergekit.architecture import get_architecture_info
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from transformers.utils import logging as transformers_logging

from mergekit_ram.integration.install import (
    IncompatibleMergekit,
    install,
    patch_out_config,
)

LOGGER = "transformers.configuration_utils"
DEPRECATED = "`torch_dtype` is deprecated"


@pytest.fixture
def records():
    """What transformers' configuration logger lets through, from a clean
    once-only cache (transformers says each message once per process)."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    transformers_logging.warning_once.cache_clear()
    yield seen
    logger.removeHandler(handler)
    transformers_logging.warning_once.cache_clear()


def out_config(build, family):
    config = MergeConfiguration.model_validate(
        family.config_dict("ramplus", dtype="bfloat16")
    )
    options = MergeOptions(quiet=True)
    return build(config, get_architecture_info(config, options), False)


def test_output_config_builds_without_the_torch_dtype_warning(records, family_f32):
    install()
    built = out_config(mergekit_merge._model_out_config, family_f32)
    assert str(built.dtype).removeprefix("torch.") == "bfloat16"
    assert not [r for r in records if DEPRECATED in r.getMessage()]
    assert not logging.getLogger(LOGGER).filters  # only for the call
    # mergekit's own function does warn: the test above could fail.
    transformers_logging.warning_once.cache_clear()
    out_config(mergekit_merge._model_out_config.__mergekit_ram__, family_f32)
    assert [r for r in records if DEPRECATED in r.getMessage()]


def test_other_warnings_pass_during_the_call(records):
    """The filter drops that message only."""
    logger = logging.getLogger(LOGGER)

    def build():
        logger.warning("`torch_dtype` is deprecated! Use `dtype` instead!")
        logger.warning("something else")
        return "built"

    module = types.ModuleType("fake_merge")
    module._model_out_config = build
    patch_out_config(module)
    assert module._model_out_config() == "built"
    assert [r.getMessage() for r in records] == ["something else"]
    wrapped = module._model_out_config
    patch_out_config(module)  # idempotent
    assert module._model_out_config is wrapped and wrapped.__mergekit_ram__ is build


def test_missing_out_config_builder():
    with pytest.raises(IncompatibleMergekit, match="_model_out_config"):
        patch_out_config(types.ModuleType("fake_merge"))
