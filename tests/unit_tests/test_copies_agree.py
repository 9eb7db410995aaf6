"""The torch-only copies that Hugging Face exports carry agree with the library.

`generation.py` and `hf_dlm/*.py` ship inside exported folders and import torch only, so they
restate the running modes, the mask types and the mask rules. The reference rule is
`AttentionMask.dense`; FlexAttention's mask_mods, the sampler's canvas mask and the exported
model's pattern must allow exactly the same (query, key) pairs.
"""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron.core.inference import generation
from megatron.core.transformer import attention_backends, transformer_config
from megatron.core.transformer.attention_mask import AttentionMask

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 12
MASKS = {"no_mask": {}, "causal": {}, "block_causal": {"block_size": 4}, "sliding_window": {"window": 3},
         "sliding_window_two_sided": {"window": 3}}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_running_modes_and_mask_types_are_listed_alike():
    pytest.importorskip("transformers")
    exported = _load(ROOT / "tools/weights_conversion/hf_dlm/configuration_dlm.py")
    modes, masks = transformer_config.RUNNING_MODES, transformer_config.ATTENTION_MASK_TYPES
    assert generation.RUNNING_MODES == exported.RUNNING_MODES == modes
    assert generation.MASK_TYPES == exported.ATTENTION_MASK_TYPES == masks == tuple(MASKS)
    assert generation.SAMPLER_MASK_TYPES == exported.SAMPLER_MASK_TYPES == masks + ("block_diffusion",)


def _reference(mask_type: str) -> torch.Tensor:
    return AttentionMask(mask_type, **MASKS[mask_type]).dense(LENGTH)[0, 0]


@pytest.mark.parametrize("mask_type", list(MASKS))
def test_flex_mask_mods_allow_what_the_reference_allows(mask_type):
    mod = attention_backends._structure_mask_mod(AttentionMask(mask_type, **MASKS[mask_type]))
    query, key = torch.arange(LENGTH)[:, None], torch.arange(LENGTH)[None, :]
    allowed = torch.ones(LENGTH, LENGTH, dtype=torch.bool) if mod is None else mod(0, 0, query, key)
    assert torch.equal(allowed, _reference(mask_type))


@pytest.mark.parametrize("mask_type", list(MASKS))
def test_the_samplers_canvas_mask_allows_what_the_reference_allows(mask_type):
    options = generation.GenerationOptions(attention_mask_type=mask_type,
                                           attention_block_size=MASKS[mask_type].get("block_size"),
                                           sliding_window=MASKS[mask_type].get("window"))
    layout = generation.CanvasLayout(torch.ones(1, LENGTH, dtype=torch.bool), torch.arange(LENGTH)[None], options)
    assert torch.equal(layout.attention_mask(0, LENGTH, LENGTH)[0], _reference(mask_type))
    # A slice of the queries against every key (a cached block) keeps the same rule.
    assert torch.equal(layout.attention_mask(4, 9, LENGTH)[0], _reference(mask_type)[4:9])


@pytest.mark.parametrize("mask_type", list(MASKS))
def test_the_exported_models_pattern_allows_what_the_reference_allows(mask_type, tmp_path):
    pytest.importorskip("transformers")
    modeling = _load_modeling(tmp_path)
    config = SimpleNamespace(attention_mask_type=mask_type, attention_block_size=MASKS[mask_type].get("block_size"),
                             sliding_window=MASKS[mask_type].get("window"))
    pattern = modeling.pattern_mask(config, LENGTH, "cpu")
    allowed = torch.ones(LENGTH, LENGTH, dtype=torch.bool) if pattern is None else pattern
    assert torch.equal(allowed, _reference(mask_type))


def _load_modeling(folder: Path):
    """modeling_dlm.py as an export holds it: the remote-code files the exporter copies, loaded
    as one package (they import each other relatively)."""
    import sys
    import types

    from tools.weights_conversion.megatron_to_hf import _write_remote_code

    _write_remote_code(str(folder))
    package = f"exported_{abs(hash(str(folder)))}"
    module = types.ModuleType(package)
    module.__path__ = [str(folder)]
    sys.modules[package] = module
    return importlib.import_module(f"{package}.modeling_dlm")
