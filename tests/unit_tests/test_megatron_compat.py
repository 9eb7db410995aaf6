"""Megatron-LM's and MegaDLMs' flags: accepted with their meaning, or with one note saying why
they change nothing, or refused in one line (megatron/training/compat_args.py)."""

import re
from pathlib import Path

import pytest
import torch

import pretrain_difflm
import pretrain_gpt
from custom_args.difflm import add_difflm_args
from megatron.core.transformer.attention_backends import core_attention
from megatron.core.transformer.attention_mask import AttentionMask
from megatron.core.transformer.norms import LayerNorm, RMSNorm
from megatron.training.arguments import build_parser, parse_args
from megatron.training.compat_args import ALIASES, NO_EFFECT, REMOVED
from megatron.training.run_config import parse_run_config
from tests.unit_tests.test_bad_inputs_training import TINY, parse_error, write_corpus

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "megatron_compatibility.md"


def notes(capsys) -> list:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]


def typed(flag: str) -> list:
    """The command-line words that give `flag` a value other than its default."""
    action = PARSER._option_string_actions[flag]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(c for c in action.choices if c != action.default)]
    return [flag, "3" if action.type is int else "v2"]


def configs(args) -> tuple:
    return args.transformer_config, args.dlm_config, args.training_config, args.checkpoint_config


PARSER = build_parser(add_difflm_args)
SPM = str(ROOT / "examples" / "data" / "tokenizer" / "spm_8k.model")
NEEDS = {"--use-on-the-fly-eval": [a for a in TINY if a not in ("--tokenizer-type", "NullTokenizer", "--vocab-size",
                                                                 "64")]
         + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", SPM, "--lm-eval-tasks", "arc_easy"],
         "--eval-only": TINY + ["--eval-iters", "1"]}
"""Flags that act only beside another one: the command line they are tried on instead of TINY."""


def documented_statuses() -> dict:
    """{flag: status} of the table of every flag we accept."""
    text = DOC.read_text().split("## Every flag we accept", 1)[1]
    return {m.group(1): m.group(2) for line in text.splitlines()
            if (m := re.match(r"\| `(--[a-z0-9_-]+)` \| ([a-z ]+) \| ", line))}


STATUSES = documented_statuses()


def labelled(status: str) -> list:
    return sorted(flag for flag, label in STATUSES.items() if label == status)


def test_every_status_is_one_the_doc_defines():
    assert set(STATUSES.values()) == {"implemented", "alias", "no effect", "refused"}, set(STATUSES.values())


@pytest.mark.parametrize("flag", labelled("no effect"))
def test_a_flag_labelled_no_effect_changes_nothing_and_says_why_in_one_line(flag, capsys):
    base = NEEDS.get(flag, TINY)
    baseline = configs(parse_args(base, add_difflm_args, world_size=1))
    capsys.readouterr()
    args = parse_args(base + typed(flag), add_difflm_args, world_size=1)
    assert configs(args) == baseline
    lines = notes(capsys)
    primary = PARSER._option_string_actions[flag].option_strings[0]  # the note names a spelling's flag
    assert len(lines) == 1 and primary in lines[0] and "has no effect here: " in lines[0], lines


@pytest.mark.parametrize("flag", labelled("refused"))
def test_a_flag_labelled_refused_stops_in_one_line_naming_it(flag, capsys):
    assert flag in parse_error(TINY + typed(flag), capsys)


@pytest.mark.parametrize("flag", labelled("alias"))
def test_a_flag_labelled_alias_sets_our_flag_and_says_so(flag, capsys):
    alias = next(alias for alias in ALIASES if alias.flag == flag)
    base = [a for a in NEEDS.get(flag, TINY) if a not in ("--attention-backend", "math")]
    args = parse_args(base + typed(flag), add_difflm_args, world_size=1)
    assert getattr(args, alias.dest) == (alias.values[typed(flag)[1]] if alias.values else alias.target)
    assert any(line.startswith(f"note: {flag}") and " is read as " in line for line in notes(capsys))


def _code() -> str:
    files = [ROOT / "pretrain_difflm.py", ROOT / "pretrain_gpt.py"]
    files += [path for folder in ("megatron", "custom_args") for path in (ROOT / folder).rglob("*.py")]
    return "\n".join(path.read_text() for path in files)


def test_a_flag_labelled_implemented_is_read_by_the_code_and_prints_no_note():
    """Its destination is read somewhere besides its own add_argument (an attribute, a config field of
    that name, a string naming it other than `dest=`), and it is neither a no-effect flag nor an alias."""
    code, compat = _code(), {entry.flag for entry in NO_EFFECT} | {alias.flag for alias in ALIASES}
    unread = []
    for flag in labelled("implemented"):
        action = PARSER._option_string_actions[flag]
        assert flag not in compat and not (action.help or "").startswith(("Accepted", "Refused")), flag
        reads = re.findall(rf"\.{action.dest}\b|(?<!dest=)[\"']{action.dest}[\"']|^\s+{action.dest}:", code, re.M)
        if not reads:
            unread.append(flag)
    assert not unread, f"labelled implemented, but nothing reads them: {unread}"


def test_no_note_without_compat_flags(capsys):
    parse_args(TINY, add_difflm_args, world_size=1)
    assert notes(capsys) == []


@pytest.mark.parametrize("flag,expected", [("--use-mcor-models", "did you mean --use-mcore-models?"),
                                           ("--log-param-norm", "did you mean --log-params-norm?"),
                                           ("--totally-unknown-thing", "docs/megatron_compatibility.md")])
def test_an_unknown_flag_is_one_line_with_the_closest_known_flag(flag, expected, capsys):
    line = parse_error(TINY + [flag, "3"], capsys)
    assert f"unrecognized argument {flag}" in line and expected in line


@pytest.mark.parametrize("flag,reason", [("--multi-latent-attention", "multi-latent attention"),
                                         ("--mtp-num-layers", "multi-token prediction"), ("--mamba-state-dim", "Mamba"),
                                         ("--rl-use-sequence-packing", "reinforcement")])
def test_a_megatron_feature_we_do_not_have_is_refused_with_its_reason(flag, reason, capsys):
    line = parse_error(TINY + [flag], capsys)
    assert f"{flag} is a Megatron-LM flag this framework refuses" in line and reason in line


@pytest.mark.parametrize("argv,dest,value", [
    (["--attention-backend", "flash"], "attention_backend", "sdpa_flash"),
    (["--attention-backend", "fused"], "attention_backend", "sdpa"),
    (["--attention-backend", "unfused"], "attention_backend", "math"),
    (["--attention-backend", "local"], "attention_backend", "math"),
    (["--core-attn-implementation", "FlexAttention"], "attention_backend", "flex"),
    (["--core-attn-implementation", "TEDotProductAttention"], "attention_backend", "sdpa"),
    (["--use-flash-attn"], "attention_backend", "sdpa_flash"),
    (["--recompute-activations"], "recompute_granularity", "selective"),
])
def test_aliases_set_our_flag_and_say_so(argv, dest, value, capsys):
    args = parse_args([a for a in TINY if a not in ("--attention-backend", "math")] + argv, add_difflm_args,
                      world_size=1)
    assert getattr(args, dest) == value
    if dest == "attention_backend":
        assert args.transformer_config.attention_backend == value
    assert any(argv[0] in line and value in line for line in notes(capsys))


def test_fsdp2_aliases_choose_the_sharding_strategy():
    base = TINY + ["--use-distributed-optimizer"]
    full = parse_args(base + ["--use-torch-fsdp2"], add_difflm_args, world_size=1)
    assert full.data_parallel_sharding_strategy == "optim_grads_params"
    grads = parse_args(base + ["--torch-fsdp2-no-reshard-after-forward"], add_difflm_args, world_size=1)
    assert grads.data_parallel_sharding_strategy == "optim_grads"
    assert parse_args(base, add_difflm_args, world_size=1).data_parallel_sharding_strategy == "optim"


def test_an_alias_contradicting_its_flag_is_one_error(capsys):
    argv = [a for a in TINY if a not in ("--attention-backend", "math")]
    line = parse_error(argv + ["--attention-backend", "math", "--core-attn-implementation", "FlexAttention"], capsys)
    assert "--core-attn-implementation FlexAttention means --attention-backend flex" in line


def test_every_removed_lever_is_in_the_doc_and_refused_in_one_line(capsys):
    text = DOC.read_text()
    known = build_parser(add_difflm_args)._option_string_actions
    for entry in REMOVED:
        assert f"| {entry.shown} |" in text, entry.shown
        assert entry.value is not None or entry.flag not in known, entry.flag  # a removed flag has left the parser
        assert f"{entry.shown} was removed: " in parse_error(TINY + entry.shown.split(), capsys)


def test_every_alias_and_no_effect_flag_is_in_the_parser():
    known = build_parser(add_difflm_args)._option_string_actions
    for flag in [e.flag for e in NO_EFFECT] + [a.flag for a in ALIASES]:
        assert flag in known


def test_sdpa_flash_backend_computes_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    for mask in (AttentionMask("no_mask"), AttentionMask("causal")):
        expected = core_attention(q, k, v, mask, backend="math")
        torch.testing.assert_close(core_attention(q, k, v, mask, backend="sdpa_flash"), expected, atol=1e-5, rtol=0)


def test_megatron_scripts_pass_split_and_cache_with_mock_data_and_sp_at_tp1(capsys):
    args = parse_args(TINY + ["--split", "99,1,0", "--data-cache-path", "/tmp/unused-cache", "--sequence-parallel"],
                      add_difflm_args, world_size=1)
    assert args.sequence_parallel is False and args.transformer_config.sequence_parallel is False
    lines = notes(capsys)
    for flag in ("--split", "--data-cache-path", "--sequence-parallel"):
        assert any(line.startswith(f"note: {flag} has no effect") for line in lines), lines


def test_vocab_size_with_a_file_tokenizer_must_match_it(tmp_path, capsys):
    from tests.unit_tests.test_tokenizers import save_hf

    folder = save_hf(tmp_path / "hf", ("<|endoftext|>", "<|mdm_mask|>"))
    base = [a for a in TINY if a not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "64")]
    base += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder)]
    size = parse_args(base, add_difflm_args, world_size=1).tokenizer.vocab_size
    assert parse_args(base + ["--vocab-size", str(size)], add_difflm_args, world_size=1).tokenizer.vocab_size == size
    line = parse_error(base + ["--vocab-size", str(size + 5)], capsys)
    assert f"--vocab-size {size + 5} is not the size of --tokenizer-type HuggingFaceTokenizer" in line


def test_llama2_tokenizer_is_read_by_the_sentencepiece_tokenizer(capsys):
    spm = str(ROOT / "examples/data/tokenizer/spm_8k.model")
    argv = [a for a in TINY if a not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "64")]
    args = parse_args(argv + ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", spm], add_difflm_args,
                      world_size=1)
    assert args.tokenizer_type == "SentencePieceTokenizer" and type(args.tokenizer).__name__ == "SentencePieceTokenizer"
    assert any("Llama2Tokenizer is read as --tokenizer-type SentencePieceTokenizer" in line for line in notes(capsys))


@pytest.mark.parametrize("norm_cls", [RMSNorm, LayerNorm])
def test_zero_centred_norm_multiplies_by_one_plus_its_weight(norm_cls):
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    plain, centred = norm_cls(8), norm_cls(8, zero_centered_gamma=True)
    assert torch.equal(centred.weight, torch.zeros(8)), "initialised at 0 (a scale of 1)"
    torch.testing.assert_close(centred(x), plain(x), atol=0, rtol=0)
    with torch.no_grad():
        centred.weight.uniform_(-0.5, 0.5)
        plain.weight.copy_(centred.weight + 1)
    torch.testing.assert_close(centred(x), plain(x))


def test_apply_layernorm_1p_reaches_every_norm_and_exports_as_one_plus_w():
    from tools.weights_conversion import mapping

    argv = TINY + ["--qk-layernorm", "--apply-layernorm-1p"]
    run = parse_run_config(argv, add_difflm_args, world_size=1)
    config = run.model
    assert config.layernorm_zero_centered_gamma
    model = pretrain_difflm.model_provider(run)
    norms = {name: p for name, p in model.named_parameters() if "layernorm.weight" in name}
    assert len(norms) == 4 * config.num_layers + 1 and all(torch.equal(p, torch.zeros_like(p)) for p in norms.values())
    layer = {name: torch.full(mapping.our_shape(config, name), 0.25) for name in mapping.layer_names(config, 0)}
    hf = mapping.layer_to_hf(config, 0, layer)
    assert torch.equal(hf["model.layers.0.input_layernorm.weight"], torch.full((16,), 1.25))
    assert torch.equal(hf["model.layers.0.self_attn.q_norm.weight"], torch.full((8,), 1.25))
    assert torch.equal(hf["model.layers.0.self_attn.o_proj.weight"], torch.full((16, 16), 0.25))


def test_a_1p_checkpoint_never_loads_into_a_plain_model_even_with_finetune():
    import dataclasses

    from megatron.core.errors import InputError
    from megatron.training.checkpoint_args import check_compatible

    plain = parse_args(TINY, add_difflm_args, world_size=1).run_record
    centred = parse_args(TINY + ["--apply-layernorm-1p"], add_difflm_args, world_size=1).run_record
    metadata = {"transformer_config": dataclasses.asdict(centred.transformer_config),
                "dlm_config": dataclasses.asdict(centred.dlm_config), "tokenizer": centred.tokenizer}
    for finetune in (False, True):
        with pytest.raises(InputError, match="layernorm_zero_centered_gamma.*--apply-layernorm-1p"):
            check_compatible(plain, finetune, metadata, "ckpt")
    old = dict(metadata, transformer_config={k: v for k, v in metadata["transformer_config"].items()
                                             if k != "layernorm_zero_centered_gamma"})
    check_compatible(plain, False, old, "ckpt")  # written before the field existed: plain norms


def test_no_mmap_bin_files_reads_through_a_file_handle(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", num_documents=20, length=40)
    argv = [a for a in TINY if a != "--mock-data"] + ["--data-path", prefix, "--split", "1,0,0"]
    samples = {}
    for flags in ([], ["--no-mmap-bin-files"]):
        config = parse_run_config(argv + flags, add_difflm_args, world_size=1)
        train, _, _ = pretrain_difflm.train_valid_test_datasets_provider(config, [8, 0, 0])
        assert train.indexed.mmap is (not flags)
        samples[bool(flags)] = [train[i]["tokens"] for i in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(samples[False], samples[True]))


def test_deterministic_mode_turns_on_deterministic_algorithms():
    from megatron.training.initialize import set_deterministic_mode

    assert not torch.are_deterministic_algorithms_enabled()
    try:
        set_deterministic_mode(True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def documented_flags() -> set:
    return {m.group(1) for line in DOC.read_text().splitlines() if (m := re.match(r"\| `(--[a-z0-9_-]+)`", line))}


def test_the_compatibility_table_lists_every_flag_we_accept():
    known = {flag for flag in build_parser(add_difflm_args)._option_string_actions if flag.startswith("--")}
    missing = sorted(known - {"--help"} - documented_flags())
    assert not missing, f"add these to {DOC.name}: {missing}"
    for entry in NO_EFFECT:
        for flag in (entry.flag, *entry.spellings):
            assert STATUSES[flag] == "no effect", flag
    for alias in ALIASES:
        assert STATUSES[alias.flag] == "alias", alias.flag


def test_override_opt_param_scheduler_keeps_the_flags_schedule_and_the_position():
    from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler

    def scheduler(max_lr):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        return OptimizerParamScheduler(optimizer, max_lr=max_lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                                       lr_decay_style="linear")

    saved = scheduler(1.0)
    saved.step(4)
    resumed, overridden = scheduler(2.0), scheduler(2.0)
    resumed.load_state_dict(saved.state_dict())
    overridden.load_state_dict(saved.state_dict(), override=True)
    assert resumed.max_lr == 1.0 and resumed.get_lr() == pytest.approx(0.6)
    assert overridden.max_lr == 2.0 and overridden.num_steps == 4 and overridden.get_lr() == pytest.approx(1.2)
    assert overridden.optimizer.param_groups[0]["lr"] == pytest.approx(1.2)
    args = parse_args(TINY + ["--override-opt_param-scheduler"], add_difflm_args, world_size=1)
    assert args.checkpoint_config.override_opt_param_scheduler


def test_loss_scale_follows_megatrons_hysteresis_window_floor_and_static_rules():
    from megatron.core.precision.loss_scale import LossScale

    def scales(overflows, **kwargs):
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        rule, seen = LossScale(scaler, **kwargs), []
        for overflow in overflows:
            rule.update(overflow)
            seen.append(scaler.get_scale())
        return seen, rule

    seen, _ = scales([True, True, True, False, False, True], min_scale=2.0, window=2, hysteresis=2)
    # 1st overflow: one hysteresis left; 2nd: halves; 3rd: halves to the floor 2; two clean steps
    # double it and refill the hysteresis, so the next overflow keeps it.
    assert seen == [8.0, 4.0, 2.0, 2.0, 4.0, 4.0]
    assert scales([True, False, True], static=16.0)[0] == [16.0, 16.0, 16.0]
    _, rule = scales([True, False], window=5, hysteresis=3)
    restored = LossScale(torch.amp.GradScaler("cpu", init_scale=1.0), window=5, hysteresis=3)
    restored.load_state_dict(rule.state_dict())
    assert restored.scaler.get_scale() == 8.0 and restored.state == rule.state


def test_loss_scale_flags_reach_the_trainer_and_notes_without_fp16(capsys):
    from megatron.core.precision.loss_scale import LossScale
    from megatron.training.precision_args import precision_config

    args = parse_args(TINY + ["--fp16", "--loss-scale", "128", "--hysteresis", "3"], add_difflm_args, world_size=1)
    rule = LossScale.build(precision_config(args).loss_scale, torch.device("cpu"))  # as the Trainer builds it
    assert rule.scaler.is_enabled() and rule.scaler.get_scale() == 128.0 and rule.static == 128.0
    assert rule.state.hysteresis_tracker == 3
    capsys.readouterr()
    args = parse_args(TINY + ["--bf16", "--loss-scale", "128"], add_difflm_args, world_size=1)
    assert precision_config(args).loss_scale is None
    assert not LossScale.build(None, torch.device("cpu")).scaler.is_enabled()
    assert any(line.startswith("note: --loss-scale has no effect without --fp16") for line in notes(capsys))


def test_fp16_trains_at_the_initial_scale_and_follows_fp32():
    """The loss sum is backpropagated as S x sum / tokens: at Megatron's scales no step overflows."""
    argv = TINY + ["--train-iters", "3", "--log-interval", "100", "--hidden-size", "32", "--seq-length", "32"]
    fp32 = pretrain_gpt.main(argv)
    fp16 = pretrain_gpt.main(argv + ["--fp16"])
    assert not any(result.skipped for result in fp16.history)
    assert fp16.grad_scaler.get_scale() == 2.0 ** 16
    for a, b in zip(fp32.history, fp16.history):
        assert b.loss == pytest.approx(a.loss, rel=2e-3) and b.grad_norm == pytest.approx(a.grad_norm, rel=2e-2)


def test_the_tokenizer_type_is_inferred_from_the_files_when_not_given(tmp_path, capsys):
    from tests.unit_tests.test_tokenizers import save_gpt2

    vocab, merges = save_gpt2(tmp_path / "gpt2", ("<|endoftext|>", "<|mdm_mask|>"))
    argv = [a for a in TINY if a not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "64")]
    args = parse_args(argv + ["--vocab-file", vocab, "--merge-file", merges], add_difflm_args, world_size=1)
    assert args.tokenizer_type == "GPT2BPETokenizer" and type(args.tokenizer).__name__ == "GPT2BPETokenizer"
    assert any("read by --tokenizer-type GPT2BPETokenizer" in line for line in notes(capsys))
    spm = str(ROOT / "examples/data/tokenizer/spm_8k.model")
    assert parse_args(argv + ["--tokenizer-model", spm], add_difflm_args, world_size=1).tokenizer_type == \
        "SentencePieceTokenizer"


def test_eval_only_is_skip_train():
    argv = [a for a in TINY if a not in ("--eval-iters", "0")] + ["--eval-iters", "1", "--eval-only"]
    assert parse_args(argv, add_difflm_args, world_size=1).skip_train


def test_per_token_loss_contradicting_a_per_sequence_normalizer_is_one_error(capsys):
    line = parse_error(TINY + ["--calculate-per-token-loss", "--difflm-loss-normalizer", "sequence"], capsys)
    assert "--calculate-per-token-loss contradicts --difflm-loss-normalizer sequence" in line


def test_data_paths_can_come_from_files(tmp_path, capsys):
    import json

    prefix = write_corpus(tmp_path / "corpus", num_documents=12, length=40)
    base = [a for a in TINY if a != "--mock-data"]
    words = tmp_path / "data_args.txt"
    words.write_text(f"0.5 {prefix}\n0.5 {prefix}\n")
    args = parse_args(base + ["--data-args-path", str(words), "--split", "1,0,0"], add_difflm_args, world_size=1)
    assert args.data_path == ["0.5", prefix, "0.5", prefix]
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": f"1.0 {prefix}", "valid": [prefix], "test": None}))
    args = parse_args(base + ["--per-split-data-args-path", str(splits)], add_difflm_args, world_size=1)
    assert args.train_data_path == ["1.0", prefix] and args.valid_data_path == [prefix]
    assert args.test_data_path is None
    splits.write_text("{not json")
    assert "is not JSON" in parse_error(base + ["--per-split-data-args-path", str(splits)], capsys)
    both = base + ["--data-args-path", str(words), "--data-path", prefix]
    assert "give --data-path or --data-args-path, not both" in parse_error(both, capsys)


def test_exit_signal_chooses_the_signal_the_handler_waits_for():
    import os
    import signal

    from megatron.training.training import ExitSignalHandler

    args = parse_args(TINY + ["--exit-signal-handler", "--exit-signal", "SIGUSR1"], add_difflm_args, world_size=1)
    assert args.training_config.exit_signal == "SIGUSR1"
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        handler = ExitSignalHandler(getattr(signal, args.training_config.exit_signal))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_pretrain_gpt_takes_megatron_lms_gpt_defaults_for_what_a_script_leaves_out(monkeypatch):
    monkeypatch.setattr(pretrain_difflm, "main", lambda argv: argv)
    assert pretrain_gpt.main(["--num-layers", "2"]) == ["--model-running-mode", "vanilla", "--position-embedding-type",
                                                        "learned_absolute", "--num-layers", "2"]
    given = ["--position-embedding-type", "rope", "--model-running-mode=difflm-noshift"]
    assert pretrain_gpt.main(given) == given


def _profiling(args):
    from megatron.training.configs import ProfilingConfig

    return ProfilingConfig.from_args(args)


def _loss_scale(args):
    from megatron.training.precision_args import precision_config

    return precision_config(args).loss_scale


# (flags on top of TINY, where their value lands, the value): flags whose behaviour other tests cover by
# field; this table pins that the command-line spelling reaches that field.
FLAG_FIELDS = [
    (["--check-for-large-grads"], lambda a: a.rerun_config.check_for_large_grads, True),
    (["--no-check-for-nan-in-loss-and-grad"], lambda a: a.rerun_config.check_for_nan_in_loss_and_grad, False),
    (["--ckpt-assume-constant-structure", "--save", "SAVE"],
     lambda a: a.checkpoint_config.ckpt_assume_constant_structure, True),
    (["--override-opt-param-scheduler"], lambda a: a.checkpoint_config.override_opt_param_scheduler, True),
    (["--no-log-loss-scale-to-tensorboard"], lambda a: a.logging_config.log_loss_scale_to_tensorboard, False),
    (["--no-log-learning-rate-to-tensorboard"], lambda a: a.logging_config.log_learning_rate_to_tensorboard, False),
    (["--manual-gc", "--no-manual-gc-eval"], lambda a: a.training_config.manual_gc_eval, False),
    (["--profile", "--profile-ranks", "0", "1", "--pytorch-profiler-collect-callstack"],
     lambda a: (tuple(_profiling(a).profile_ranks), _profiling(a).pytorch_profiler_collect_callstack), ((0, 1), True)),
    (["--fp16", "--loss-scale-window", "7", "--min-loss-scale", "4", "--initial-loss-scale", "64"],
     lambda a: (_loss_scale(a).loss_scale_window, _loss_scale(a).min_loss_scale, _loss_scale(a).initial_loss_scale),
     (7, 4.0, 64.0)),
    (["--use-rope-scaling", "--rope-scaling-low-freq-factor", "2", "--rope-scaling-high-freq-factor", "8"],
     lambda a: (a.transformer_config.rope_scaling_low_freq_factor, a.transformer_config.rope_scaling_high_freq_factor),
     (2.0, 8.0)),
    (["--position-embedding-type", "yarn", "--yarn-beta-slow", "2", "--no-yarn-correction-range-round-to-int"],
     lambda a: (a.transformer_config.yarn_beta_slow, a.transformer_config.yarn_correction_range_round_to_int),
     (2.0, False)),
    (["--deterministic-mode"], lambda a: a.deterministic_mode, True),
    (["--difflm-masked-only-loss", "--difflm-compile-loss", "--difflm-loss-kernel", "inductor"],
     lambda a: a.dlm_config.loss_kernel, "inductor"),
]


@pytest.mark.parametrize("argv,field,value", FLAG_FIELDS, ids=[" ".join(f[0][:2]) for f in FLAG_FIELDS])
def test_the_flag_reaches_its_config_field(argv, field, value, tmp_path):
    argv = [str(tmp_path / "save") if word == "SAVE" else word for word in argv]
    assert field(parse_args(TINY + argv, add_difflm_args, world_size=1)) == value


def test_wsd_decay_in_samples_reaches_the_scheduler():
    at = TINY.index("--train-iters")
    base = TINY[:at] + TINY[at + 2:]
    args = parse_args(base + ["--train-samples", "40", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "10"],
                      add_difflm_args, world_size=1)
    from megatron.training.arguments import schedule_kwargs

    kwargs = schedule_kwargs(args)
    assert kwargs["wsd_decay_steps"] == 10 and kwargs["unit"] == "samples"
