"""Make the Megatron-LM checkpoints the interop tests load: tiny GPT models built and saved by megatron-core
itself (its local layer spec, `dist_checkpointing.save` in the `torch_dist` format, in Megatron-LM's folder
layout), with the logits megatron-core computes for fixed token ids.

megatron-core's package is also named `megatron`, so this runs in an environment of its own, from a folder
outside this repository:

    python -m venv /tmp/mcore && /tmp/mcore/bin/pip install torch==2.13.0 megatron-core==0.16.1 numpy
    cd /tmp && /tmp/mcore/bin/torchrun --nproc-per-node 1 REPO/tests/assets/megatron/make_assets.py \
        --out REPO/tests/assets/megatron --case dense
    # the same model saved by TP=2 / PP=2 layouts (megatron-core reshards the one-process save):
    # --nproc-per-node 2 with --tensor-model-parallel-size 2 or --pipeline-model-parallel-size 2 (the MoE case
    # with --expert-model-parallel-size 2)
    # Megatron-LM's legacy torch format (per-rank model_optim_rng.pt) of the same weights, any layout:
    # --ckpt-format torch [--tensor-model-parallel-size 2 | --pipeline-model-parallel-size 2 |
    # --expert-model-parallel-size 2]
    # each layer under its own keys (megatron-core's non_homogeneous_layers, as newer Megatron-LM runs save):
    # --per-layer-keys, into <case>_per_layer; with its singleton_local_shards metadata (each expert and SwiGLU
    # half its own key): --singleton-local-shards, into <case>_singleton
    # megatron-core loads a checkpoint tools/weights_conversion/to_megatron.py wrote (the case's architecture)
    # and writes the logits it computes to DIR/megatron_core_logits.pt:
    cd /tmp && /tmp/mcore/bin/torchrun --nproc-per-node 1 REPO/tests/assets/megatron/make_assets.py \
        --case dense --check-export DIR

(Beside this file: make_legacy_gpt.py, Megatron-LM's older GPT model before megatron-core, and
make_megatron_lm_save.py, a checkpoint written by Megatron-LM's own training save_checkpoint with a real run's args.)

It runs on CPU (gloo): two CUDA-only calls of megatron-core are replaced (the device a buffer moves to and a
stream synchronisation), and its model-parallel RNG tracker is bypassed (dropout is 0). Each case writes
`<case>/` (`latest_checkpointed_iteration.txt`, `iter_0000001/` with `common.pt`, `metadata.json`, `.metadata`
and the shards) and `<case>/logits.pt` ({"tokens", "logits"} for one process, full vocabulary).
The version of megatron-core that made them is recorded in `<case>/made_by.txt`. (0.16.1: the newest on the
package index this project can reach.)
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

torch.cuda.current_device = lambda: "cpu"  # megatron-core moves some buffers to the current CUDA device
torch.cuda.synchronize = lambda *args, **kwargs: None  # and waits for CUDA copies when it saves

CASES = {
    # GQA, QK-norm, SwiGLU, RMSNorm, RoPE, untied output layer, no biases (the Llama/Qwen3 style)
    "dense": dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  normalization="RMSNorm", swiglu=True, qk_layernorm=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, position_embedding_type="rope"),
    # Megatron's GPT defaults (LayerNorm, GELU, biases, tied embeddings, multi-head attention) with RoPE
    "dense_gpt": dict(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                      normalization="LayerNorm", swiglu=False, qk_layernorm=False, add_bias_linear=True,
                      untie_embeddings_and_output_weights=False, position_embedding_type="rope"),
    # Megatron's GPT defaults entirely: the same with its learned absolute position table
    "dense_gpt_learned": dict(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                              num_query_groups=4, normalization="LayerNorm", swiglu=False, qk_layernorm=False,
                              add_bias_linear=True, untie_embeddings_and_output_weights=False,
                              position_embedding_type="learned_absolute"),
    # the first with a mixture of experts in every layer: 4 experts of width 16, top-2 (SequentialMLP, the local
    # spec's experts; dropless, the allgather dispatcher), Megatron's default softmax router after the top-k
    "moe": dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                normalization="RMSNorm", swiglu=True, qk_layernorm=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=True, position_embedding_type="rope", num_experts=4,
                moe_ffn_hidden_size=16, moe_router_topk=2),
    # a dense first layer, then MoE (Megatron's --moe-layer-freq [0,1]) with a shared expert of width 24 beside
    # the routed ones (ungated, megatron-core's SharedExpertMLP)
    "moe_mixed_shared": dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                             num_query_groups=2, normalization="RMSNorm", swiglu=True, qk_layernorm=True,
                             add_bias_linear=False, untie_embeddings_and_output_weights=True,
                             position_embedding_type="rope", num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                             moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=24),
}
MOE_ARGS = {"moe_router_pre_softmax": False, "moe_router_score_function": "softmax",  # Megatron-LM's defaults
            "moe_router_topk_scaling_factor": None, "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
            "moe_router_enable_expert_bias": False, "moe_grouped_gemm": False, "moe_token_dispatcher_type": "allgather"}
MOE_EXTRAS = ("moe_layer_freq", "moe_shared_expert_intermediate_size")  # a case's own, beside MOE_ARGS
VOCAB, SEQ, ITERATION = 64, 32, 1


def megatron_lm_args(case: dict, tp: int, pp: int, ep: int = 1) -> argparse.Namespace:
    """The subset of Megatron-LM's flags its checkpoints record in common.pt that shape a GPT model, and two
    of its enum members, as Megatron-LM's pretrain() leaves them in args (its own classes in the pickle)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    moe = {} if "num_experts" not in case else {**MOE_ARGS, "moe_ffn_hidden_size": case["moe_ffn_hidden_size"],
                                                "moe_router_topk": case["moe_router_topk"],
                                                "expert_model_parallel_size": ep,
                                                **{key: case[key] for key in MOE_EXTRAS if key in case}}
    return argparse.Namespace(**moe, model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
        num_layers=case["num_layers"], hidden_size=case["hidden_size"], ffn_hidden_size=case["ffn_hidden_size"],
        num_attention_heads=case["num_attention_heads"],
        group_query_attention=case["num_query_groups"] < case["num_attention_heads"],
        num_query_groups=case["num_query_groups"], kv_channels=case["hidden_size"] // case["num_attention_heads"],
        normalization=case["normalization"], norm_epsilon=1e-5, swiglu=case["swiglu"],
        qk_layernorm=case["qk_layernorm"], add_bias_linear=case["add_bias_linear"],
        add_qkv_bias=case["add_bias_linear"],
        untie_embeddings_and_output_weights=case["untie_embeddings_and_output_weights"],
        position_embedding_type=case["position_embedding_type"], rotary_base=10000, rotary_percent=1.0,
        max_position_embeddings=SEQ, seq_length=SEQ, padded_vocab_size=VOCAB, vocab_size=VOCAB,
        make_vocab_size_divisible_by=1, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        num_experts=case.get("num_experts"), transformer_impl="local", ckpt_format="torch_dist", iteration=ITERATION,
        hidden_dropout=0.0, attention_dropout=0.0, apply_query_key_layer_scaling=False, bf16=False, fp16=False,
        params_dtype=torch.float32)


def build(case: dict, tp: int, pp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    mc_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()  # no CUDA RNG
    moe = {}
    if "num_experts" in case:  # the router's gating GEMM is Transformer Engine's: a plain linear on CPU
        from megatron.core.transformer.moe import router

        router.router_gating_linear = lambda x, weight, bias, dtype: torch.nn.functional.linear(
            x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        moe = dict(num_moe_experts=case["num_experts"], moe_ffn_hidden_size=case["moe_ffn_hidden_size"],
                   moe_router_topk=case["moe_router_topk"], moe_token_dispatcher_type="allgather",
                   moe_aux_loss_coeff=0.0, **{key: case[key] for key in MOE_EXTRAS if key in case})
    config = TransformerConfig(**moe,
        num_layers=case["num_layers"], hidden_size=case["hidden_size"], ffn_hidden_size=case["ffn_hidden_size"],
        num_attention_heads=case["num_attention_heads"], num_query_groups=case["num_query_groups"],
        normalization=case["normalization"], gated_linear_unit=case["swiglu"],
        activation_func=torch.nn.functional.silu if case["swiglu"] else torch.nn.functional.gelu,
        add_bias_linear=case["add_bias_linear"], qk_layernorm=case["qk_layernorm"], layernorm_epsilon=1e-5,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, init_method_std=0.2,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32 if pp > 1 else None)
    spec = get_gpt_layer_local_spec(num_experts=case.get("num_experts"), moe_grouped_gemm=False,
                                    qk_layernorm=case["qk_layernorm"], normalization=case["normalization"])
    if "moe_layer_freq" in case:  # a spec per layer: dense and MoE ones
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=case["normalization"])
    from megatron.core import parallel_state

    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not case["untie_embeddings_and_output_weights"],
                     position_embedding_type=case["position_embedding_type"], parallel_output=False)
    with torch.no_grad():  # visible biases and norms: zeros and ones would hide a misplaced tensor
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def save(model, args: argparse.Namespace, folder: str, metadata=None) -> None:
    from megatron.core import dist_checkpointing

    iteration_dir = os.path.join(folder, f"iter_{ITERATION:07d}")
    os.makedirs(iteration_dir, exist_ok=True)
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": args, "checkpoint_version": 3.0,
             "iteration": ITERATION}
    dist_checkpointing.save(state, iteration_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(ITERATION))


def save_legacy(model, args: argparse.Namespace, folder: str) -> None:
    """Megatron-LM's legacy `torch` format, as its checkpointing.py writes it: per model-parallel rank
    iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt (the PPP part only with pipeline parallelism, EEE only with
    expert parallelism), a torch.save of args, version, iteration, `model.state_dict_for_save_checkpoint()`
    (an expert-parallel rank's routed experts numbered locally) and the RNG states (Python's, numpy's,
    torch's)."""
    import random

    import numpy as np
    from megatron.core import parallel_state

    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}" if args.pipeline_model_parallel_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    if getattr(args, "expert_model_parallel_size", 1) > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
    rank_dir = os.path.join(folder, f"iter_{ITERATION:07d}", name)
    os.makedirs(rank_dir, exist_ok=True)
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state()}]
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": model.state_dict_for_save_checkpoint(), "rng_state": rng},
               os.path.join(rank_dir, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as handle:
            handle.write(str(ITERATION))


def reference_logits(model) -> dict:
    """The whole model's logits (one process) for fixed token ids, causal."""
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(16).expand(2, 16)
    causal = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)  # True = masked out
    with torch.no_grad():
        return {"tokens": tokens, "logits": model(tokens, positions, causal).float()}


def check_export(model, folder: str) -> None:
    """megatron-core's own load (its default strictness) of the latest iteration under `folder`."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(folder, "latest_checkpointed_iteration.txt")) as handle:
        iteration_dir = os.path.join(folder, f"iter_{int(handle.read()):07d}")
    common = dist_checkpointing.load_common_state_dict(iteration_dir)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iteration_dir)
    model.load_state_dict(loaded["model"])
    torch.save(reference_logits(model), os.path.join(folder, "megatron_core_logits.pt"))
    print(f"megatron-core loaded {iteration_dir} (iteration {common['iteration']}, "
          f"checkpoint_version {common['checkpoint_version']})")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the assets folder (to make them)")
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--check-export", help="a to_megatron.py checkpoint to load and compute logits of")
    parser.add_argument("--per-layer-keys", action="store_true",
                        help="save with megatron-core's non_homogeneous_layers metadata: each layer under its own "
                             "keys (as newer Megatron-LM runs save), into <case>_per_layer")
    parser.add_argument("--singleton-local-shards", action="store_true",
                        help="save with megatron-core's singleton_local_shards metadata, into <case>_singleton")
    parser.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                        help="torch: Megatron-LM's legacy per-rank files (from the case's torch_dist save)")
    options = parser.parse_args()
    tp, pp = options.tensor_model_parallel_size, options.pipeline_model_parallel_size
    ep = options.expert_model_parallel_size
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    torch.manual_seed(1234)
    case = CASES[options.case]
    model = build(case, tp, pp)
    if options.check_export:
        return check_export(model, options.check_export)
    if tp * pp * ep > 1 or options.ckpt_format == "torch" or options.per_layer_keys or options.singleton_local_shards:
        from megatron.core import dist_checkpointing  # the one-process save's weights, for this layout

        source = os.path.join(options.out, options.case, f"iter_{ITERATION:07d}")
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, source)["model"])
    folder = os.path.join(options.out, options.case + ("" if tp * pp == 1 else f"_tp{tp}_pp{pp}")
                          + ("" if ep == 1 else f"_ep{ep}"))
    if options.ckpt_format == "torch":
        folder = os.path.join(options.out, f"legacy_{options.case}_tp{tp}_pp{pp}" + ("" if ep == 1 else f"_ep{ep}"))
        args = megatron_lm_args(case, tp, pp, ep)
        args.ckpt_format = "torch"
        save_legacy(model, args, folder)
    elif options.per_layer_keys or options.singleton_local_shards:
        folder += "_per_layer" if options.per_layer_keys else "_singleton"
        metadata = {"non_homogeneous_layers": True} if options.per_layer_keys else {"singleton_local_shards": True}
        save(model, megatron_lm_args(case, tp, pp, ep), folder, metadata=metadata)
    else:
        save(model, megatron_lm_args(case, tp, pp, ep), folder)
    if dist.get_world_size() == 1 and options.ckpt_format == "torch_dist" and not (options.per_layer_keys
                                                                                   or options.singleton_local_shards):
        torch.save(reference_logits(model), os.path.join(folder, "logits.pt"))
    if dist.get_rank() == 0:
        from importlib.metadata import version

        with open(os.path.join(folder, "made_by.txt"), "w") as handle:
            handle.write(f"megatron-core {version('megatron-core')}, torch {torch.__version__}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
