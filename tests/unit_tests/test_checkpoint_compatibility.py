"""What --load accepts from a checkpoint's metadata, and the message when it does not."""

import dataclasses

import pytest

from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig
from megatron.training.checkpoint_files import FORMAT_VERSION
from megatron.training.checkpointing import _check_compatible
from megatron.training.configs import RunRecord


def config(**changes) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=640,
                unpadded_vocab_size=513)
    return TransformerConfig(**(base | changes))


DLM = DLMConfig(mask_token_id=512)


def check(saved: TransformerConfig, run: TransformerConfig, finetune=False, saved_sha="a", run_sha="a",
          saved_dlm=DLM, run_dlm=DLM, saved_tokenizer=None, run_tokenizer=None, saved_extra=None):
    metadata = {"format_version": FORMAT_VERSION, "transformer_config": dataclasses.asdict(saved) | (saved_extra or {}),
                "dlm_config": dataclasses.asdict(saved_dlm),
                "tokenizer": {"sha256": saved_sha, **(saved_tokenizer or {})}}
    record = RunRecord(transformer_config=run, dlm_config=run_dlm, seq_length=16,
                       tokenizer={"sha256": run_sha, **(run_tokenizer or {})})
    _check_compatible(record, finetune, metadata, "ckpt/iter_0000010")


def test_same_architecture_and_tokenizer_load():
    check(config(), config(vocab_size=768))  # the padding may differ (another tp)


def test_an_architecture_difference_names_the_field():
    expected = "ckpt/iter_0000010: the checkpoint has hidden_size=32 but this run has 48 \\(--hidden-size\\)"
    with pytest.raises(ValueError, match=expected):
        check(config(), config(hidden_size=48))


def test_another_tokenizer_is_refused():
    with pytest.raises(ValueError, match="another tokenizer"):
        check(config(), config(), saved_sha="a", run_sha="b")


def test_extra_stored_vocabulary_rows_load_as_padding():
    # A converted Qwen: 151,936 embedding rows for a 151,665-token tokenizer.
    check(config(vocab_size=151936, unpadded_vocab_size=151936), config(vocab_size=151680, unpadded_vocab_size=151665))


def test_a_grown_vocabulary_needs_finetune():
    grown = config(unpadded_vocab_size=520)
    expected = "513 vocabulary rows but this run's tokenizer has 520 tokens; pass --finetune"
    with pytest.raises(ValueError, match=expected):
        check(config(), grown)
    check(config(), grown, finetune=True)


FUNCTION_CHANGES = [  # (what differs, the flag the message names)
    (dict(run=config(rotary_base=500000.0)), "--rotary-base"),
    (dict(run=config(rotary_percent=0.5)), "--rotary-percent"),
    (dict(run=config(layernorm_epsilon=1e-5)), "--norm-epsilon"),
    (dict(run=config(activation="gelu")), "--swiglu"),
    (dict(run_dlm=DLMConfig(mask_token_id=511)), "--mask-token"),
    (dict(run_dlm=DLMConfig(model_running_mode="difflm-shift", mask_token_id=512)), "--model-running-mode"),
    (dict(run_dlm=DLMConfig(model_running_mode="vanilla")), "--model-running-mode"),
    (dict(run_dlm=DLMConfig(mask_token_id=512, attention_mask_type="block_causal", block_size=4)),
     "--attention-mask-type"),
    (dict(saved_tokenizer={"vocab_size": 513}, run_tokenizer={"vocab_size": 500}), "--vocab-size"),
    # a joint AR + DLM checkpoint's clean half is token-causal: plain block diffusion reads it otherwise
    (dict(saved_dlm=DLMConfig(mask_token_id=512, block_diffusion=True, block_size=4, ar_loss_weight=1.0),
          run_dlm=DLMConfig(mask_token_id=512, block_diffusion=True, block_size=4)), "--difflm-ar-loss-weight"),
]


@pytest.mark.parametrize("changes,flag", FUNCTION_CHANGES, ids=[flag for _, flag in FUNCTION_CHANGES])
def test_a_network_computing_another_function_is_refused_unless_finetuning(changes, flag):
    base = dict(saved=config(), run=config())
    with pytest.raises(ValueError, match=f"\\({flag}\\); use the checkpoint|\\({flag}\\); pass the checkpoint"):
        check(**{**base, **changes})
    check(**{**base, **changes}, finetune=True)


def test_architecture_differences_stay_refused_with_finetune():
    base = config()
    other_norm = "LayerNorm" if base.normalization == "RMSNorm" else "RMSNorm"
    for changed in (config(normalization=other_norm), config(add_bias_linear=not base.add_bias_linear),
                    config(num_layers=3)):
        with pytest.raises(ValueError, match="use the checkpoint's architecture"):
            check(config(), changed, finetune=True)


def test_a_block_size_matters_only_for_block_causal_attention():
    block = DLMConfig(mask_token_id=512, attention_mask_type="block_causal", block_size=4)
    with pytest.raises(ValueError, match="--difflm-block-size"):
        check(config(), config(), saved_dlm=block, run_dlm=DLMConfig(mask_token_id=512, attention_mask_type=
                                                                      "block_causal", block_size=8))
    check(config(), config(), saved_dlm=DLMConfig(mask_token_id=512, block_size=4), run_dlm=DLM)


def test_moe_shapes_and_routing_are_checked():
    """The experts' shapes can never change; the routing (top-k, scores) only with --finetune; the
    expert-parallel layout is free (experts are stored as global [E, ...] tensors)."""
    from megatron.core.transformer.moe.config import MoEConfig

    def moe(**changes):
        return config(moe=MoEConfig(num_experts=4, router_topk=2, **changes))

    # Earlier releases stored the parallel sizes in the transformer config: another layout still loads.
    check(moe(), moe(), saved_extra=dict(expert_model_parallel_size=2, tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match=r"moe.num_experts=4 but this run has None \(--num-experts\)"):
        check(moe(), config())
    with pytest.raises(ValueError, match=r"moe.ffn_hidden_size=None but this run has 16 \(--moe-ffn-hidden-size\)"):
        check(moe(), moe(ffn_hidden_size=16), finetune=True)
    with pytest.raises(ValueError, match=r"moe.layer_flags=\[1, 1\] but this run has \[0, 1\] \(--moe-layer-freq\)"):
        check(moe(), moe(layer_freq="[0,1]"))
    with pytest.raises(ValueError, match=r"moe.router_score_function='softmax'.*--finetune to change it"):
        check(moe(), moe(router_score_function="sigmoid"))
    check(moe(), moe(router_score_function="sigmoid"), finetune=True)


def test_use_checkpoint_args_rebuilds_the_moe_config():
    import argparse

    from megatron.core.transformer.moe.config import MoEConfig
    from megatron.training.checkpoint_args import _apply_moe
    from megatron.training.moe_args import add_moe_args, moe_config_from_args

    saved = MoEConfig(num_experts=8, router_topk=3, ffn_hidden_size=24, shared_expert_intermediate_size=16,
                      layer_freq="[0,1,1]", router_score_function="sigmoid", router_enable_expert_bias=True).resolve(3)
    parser = argparse.ArgumentParser()
    add_moe_args(parser)
    args = parser.parse_args([])
    _apply_moe(args, dataclasses.asdict(saved))
    rebuilt = moe_config_from_args(args).resolve(3)
    for field in ("num_experts", "router_topk", "ffn_hidden_size", "shared_expert_intermediate_size", "layer_flags",
                  "router_score_function", "router_enable_expert_bias"):
        assert getattr(rebuilt, field) == getattr(saved, field), field


def test_a_checkpoints_configs_rebuild_for_one_process_from_an_earlier_releases_metadata():
    """What generation, evaluation and the converters load (checkpoint_files.configs_from_metadata): an MoE
    config stored as a dict, and fields the configs no longer have (the parallel sizes of earlier
    releases), rebuild the single-process fp32 model's configs."""
    from megatron.core.transformer.moe.config import MoEConfig
    from megatron.training.checkpoint_files import configs_from_metadata

    saved = config(moe=MoEConfig(num_experts=4, router_topk=2, layer_freq="[0]+[1]"), bf16=True,
                   sequence_parallel=True)
    stored = {key: str(value) if key == "params_dtype" else value for key, value in dataclasses.asdict(saved).items()}
    metadata = {"transformer_config": stored | {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2},
                "dlm_config": dataclasses.asdict(DLM) | {"a_removed_lever": True}}
    model, dlm = configs_from_metadata(metadata)
    assert isinstance(model.moe, MoEConfig) and model.moe.layer_flags == [0, 1] and model.moe.num_experts == 4
    assert (model.bf16, model.sequence_parallel) == (False, False)
    assert (model.vocab_size, model.unpadded_vocab_size) == (513, 513)
    assert dlm == DLM
