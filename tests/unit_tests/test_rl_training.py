"""posttrain_rl.py end to end on CPU: the mean reward of a tiny model rises under grpo (AR) and diffu_grpo
(DLM); a run resumed from its checkpoint goes on bit for bit; left-padded rollouts score as unpadded ones;
bad RL flags are one line before anything is built."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posttrain_rl
from megatron.rl import rollouts
from megatron.rl.step import RLConfig, RolloutBatch, rl_forward_step
from megatron.rl.estimators import completion_logprobs
from megatron.rl.tasks import TaskRecord
from tests.unit_tests.test_gpt_model import MASK_ID, build, dlm_config, tiny_config

ROOT = Path(__file__).resolve().parents[2]
SPM = str(ROOT / "examples" / "data" / "tokenizer" / "spm_8k.model")
# Reward: the share of the letter e among the completion's characters (about 0.12 at random init).
CHECKER = '''def reward(completion, answer, prompt):
    text = "".join(completion.split())
    return sum(c == "e" for c in text) / max(len(text), 1)
'''
# The same rewards on rank 0 (the first tensor-parallel rank of the first stage: the one that scores, as one
# process does), the opposite on other ranks: a model-parallel peer scoring for itself would train on others.
RANK_CHECKER = """import os


def reward(completion, answer, prompt):
    text = "".join(completion.split())
    share = sum(c == "e" for c in text) / max(len(text), 1)
    return share if os.environ.get("RANK", "0") == "0" else 1.0 - share
"""
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "48", "--micro-batch-size", "16", "--global-batch-size", "32", "--lr-decay-style", "constant",
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", SPM, "--attention-dropout", "0",
         "--hidden-dropout", "0", "--log-interval", "1", "--rl-group-size", "8", "--rl-gen-length", "8",
         "--rl-reward-workers", "1"]


# MODEL is Megatron's default configuration (linear biases, LayerNorm, GeLU, tied); this the Llama style
LLAMA_STYLE = ["--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu",
               "--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights"]


def task_file(folder: Path, checker: str = CHECKER) -> str:
    (folder / "letter.py").write_text(checker)
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say something {i}", "answer": "", "reward": "python",
                                        "checker": "letter.py"}) + "\n" for i in range(16)))
    return str(path)


def run(argv):
    return posttrain_rl.main(argv)


@pytest.mark.parametrize("mode, algorithm, lr, iterations", [("vanilla", "grpo", "3e-2", 20),
                                                           ("difflm-noshift", "diffu_grpo", "3e-2", 16),
                                                           ("difflm-noshift", "spg", "5e-2", 16)])
def test_the_mean_reward_rises(runtime, tmp_path, mode, algorithm, lr, iterations):
    steps = [] if mode == "vanilla" else ["--rl-sampling-steps", "4"]  # the DLM commits 2 tokens a step
    steps += ["--rl-block-length", "4"] if algorithm == "spg" else []  # SPG's masks: blocks of 4 of the 8
    trainer = run(MODEL + ["--rl-task", task_file(tmp_path), "--model-running-mode", mode, "--rl-algorithm", algorithm,
                           "--lr", lr, "--train-iters", str(iterations)] + steps)
    rewards = trainer.rollout_rewards
    assert len(rewards) == iterations
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.08, rewards
    entropy = trainer.rollout_entropy  # the policy sharpens as it learns
    assert sum(entropy[-4:]) / 4 < sum(entropy[:4]) / 4 - 0.1, entropy
    assert len(trainer.update_throughput) == iterations and min(trainer.update_throughput) > 0  # SPG's too


def test_resume_goes_on_bit_for_bit(runtime, tmp_path):
    """4 iterations straight equal 2, a checkpoint, then 2 more, with two inner PPO steps per rollout."""
    base = MODEL + ["--rl-task", task_file(tmp_path), "--model-running-mode", "vanilla", "--rl-algorithm", "grpo",
                    "--lr", "1e-2", "--rl-inner-steps", "2"]
    straight = run(base + ["--train-iters", "4"])
    run(base + ["--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"])
    resumed = run(base + ["--train-iters", "4", "--load", str(tmp_path / "ckpt")])
    assert [r.loss for r in resumed.history] == [r.loss for r in straight.history[2:]]
    assert [r.grad_norm for r in resumed.history] == [r.grad_norm for r in straight.history[2:]]
    assert resumed.rollout_rewards == straight.rollout_rewards[1:]
    first, second = straight.update_statistics[:2]  # on-policy, then against the stored sampling log-probs
    assert (first["ratio"], first["clip fraction"]) == (1.0, 0.0) and second["ratio"] != 1.0
    assert resumed.update_statistics == straight.update_statistics[2:]


@pytest.mark.parametrize("estimator", ["ar", "diffu_grpo", "ar_order", "coupled"])
def test_a_left_padded_row_scores_as_the_row_alone(estimator):
    """The update's forward reads padding apart (document ids, positions from the first real token), and
    d1's random prompt masks fall on the same prompt tokens whatever the padding."""
    dlm = (dlm_config(model_running_mode="vanilla", attention_mask_type="causal") if estimator == "ar" else
           dlm_config(block_diffusion=True, block_size=4) if estimator == "ar_order" else dlm_config())
    model = build(config=tiny_config(), dlm=dlm)
    config = RLConfig(estimator=estimator, mask_token_id=MASK_ID, prompt_mask_prob=0.5)  # d1's prompt masks too
    prompt, completion, pad = torch.arange(5, 10), torch.arange(20, 26), 3

    def logp(sequence, prompt_length, real=None):
        layout = rollouts.row_layout(real) if real is not None else (None, None)
        batch = RolloutBatch(sequence, prompt_length, torch.ones(1, 6, dtype=torch.bool), torch.ones(1), None,
                             torch.tensor([7]), document_ids=layout[0], position_ids=layout[1])
        output, loss_func = rl_forward_step(batch, model, config)
        return completion_logprobs(loss_func.args[1], output[0])

    alone = logp(torch.cat([prompt, completion])[None], 5)
    padded = torch.cat([torch.full((3,), pad), prompt, completion])[None]
    real = torch.cat([torch.zeros(3, dtype=torch.bool), torch.ones(11, dtype=torch.bool)])[None]
    torch.testing.assert_close(logp(padded, 8, real), alone)
    assert not torch.allclose(logp(padded, 8), alone)  # without the layout the padding would be read


def test_completion_mask_and_prompt_order():
    completions = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]])
    assert rollouts.completion_mask(completions, eos=2).tolist() == [[True, True, False, False], [True] * 4]
    order = rollouts.PromptOrder(5, seed=3)
    first = [order(k) for k in range(10)]
    assert sorted(first[:5]) == list(range(5)) and sorted(first[5:]) == list(range(5))
    assert first[:5] != first[5:] and first == [rollouts.PromptOrder(5, seed=3)(k) for k in range(10)]


class Letters:
    """A prompt encoder (every prompt: ids 3 4) with a tokenizer whose every id is a letter, id 0 included;
    EOS (and padding) is id 2."""
    eod, bos = 2, None

    def __init__(self):
        self.tokenizer = self

    def __call__(self, text):
        return [3, 4]

    def detokenize(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


class Scripted(torch.nn.Module):
    """A policy whose generate writes the same completion after each prompt."""
    running_mode = "vanilla"

    def __init__(self, completion):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.completion = torch.tensor(completion)

    def generate(self, ids, **kwargs):
        return torch.cat([ids, self.completion.expand(ids.shape[0], -1)], dim=1)


def test_the_reward_reads_the_completion_to_its_eos_and_nothing_after():
    """The text scored (and logged) is the completion's tokens before its first EOS: not EOS, not the
    canvas after it, whatever token id 0 reads as."""
    seen = []

    def score(pairs):
        seen.extend(text for _, text in pairs)
        return [1.0] * len(pairs)

    config = rollouts.RolloutConfig(group_size=2, gen_length=6)
    result = rollouts.sample_rollouts(Scripted([5, 0, 7, 2, 0, 8]), Letters(), [TaskRecord(prompt="p", answer="x")],
                                      [0], config, score)
    assert seen == ["fah", "fah"] and result.texts == seen  # ids 5 0 7, then EOS: the rest unread
    assert result.completion_mask[0].tolist() == [True, True, True, True, False, False]


def test_sequence_parallel_moe_rollouts_are_one_line(tmp_path, capsys, monkeypatch):
    """Rollouts run the model with sequence parallelism off, which MoE layers under TP cannot do."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = MODEL + ["--lr", "1e-3", "--train-iters", "2", "--rl-task", task_file(tmp_path), "--num-experts", "4",
                    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "16"]
    with pytest.raises(SystemExit) as exit_info:
        posttrain_rl.main(argv)
    error = capsys.readouterr().err
    assert exit_info.value.code in (1, 2) and error.count("\n") == 1 and "drop --sequence-parallel" in error, error


@pytest.mark.parametrize("extra, message", [
    ([], "--rl-task is required"),
    (["--rl-task", "TASKS", "--model-running-mode", "difflm-noshift", "--rl-algorithm", "grpo"],
     "--rl-algorithm grpo: the ar estimator reads a causal forward"),
    (["--rl-task", "TASKS", "--rl-group-size", "5"], "must split into whole groups of --rl-group-size 5"),
    (["--rl-task", "TASKS", "--rl-inner-steps", "3", "--train-iters", "4"], "a multiple of --rl-inner-steps 3"),
    (["--rl-task", "MISSING"], "MISSING"),
    (["--rl-task", "TASKS", "--rl-kl-beta", "0.1"], "--rl-kl-beta 0.1 needs --rl-reference"),
    (["--rl-task", "TASKS", "--rl-log-completions", "-1"], "--rl-log-completions >= 0"),
    (["--rl-task", "TASKS", "--rl-prompt-mask-prob", "1.5"], "--rl-prompt-mask-prob 1.5 is a probability"),
    (["--rl-task", "TASKS", "--rl-algorithm", "spg", "--rl-kl-beta", "0.1", "--rl-reference", "x"],
     "the spg estimator takes no KL term"),
    (["--rl-task", "TASKS", "--rl-gen-length", "44"], "--rl-gen-length 44 need"),  # past --seq-length 48
    (["--rl-task", "TASKS", "--model-running-mode", "vanilla", "--rl-algorithm", "grpo", "--rl-cache", "dual"],
     "--rl-cache dual is a DLM sampler's cache"),
    (["--rl-task", "TASKS", "--difflm-block-diffusion", "--difflm-block-size", "4"],
     "--rl-algorithm diffu_grpo: the diffu_grpo estimator would score a block-diffusion policy"),
])
def test_bad_rl_flags_are_one_line(tmp_path, capsys, extra, message):
    tasks = task_file(tmp_path)
    argv = MODEL + ["--lr", "1e-3", "--train-iters", "2"] + [tasks if a == "TASKS" else str(tmp_path / a) if
                                                            a == "MISSING" else a for a in extra]
    with pytest.raises(SystemExit) as exit_info:
        posttrain_rl.main(argv)
    error = capsys.readouterr().err
    assert exit_info.value.code in (1, 2) and error.count("\n") == 1 and message in error, error


INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
PIPELINE_AR = ["--num-layers", "4", "--model-running-mode", "vanilla", "--rl-algorithm", "grpo"]
BLOCK_DIFFUSION = ["--difflm-block-diffusion", "--difflm-block-size", "4", "--rl-algorithm", "ar_order_grpo"]
EVALUATION = ["--rl-eval-prompts", "6", "--eval-interval", "3", "--eval-iters", "1"]


def two_processes(argv, tmp_path):
    """posttrain_rl.py under torchrun with 2 gloo processes: its rollout rewards and entropies, validation
    rewards, losses and gradient norms as the log prints them."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "posttrain_rl.py"), *argv]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr[-2000:]
    return logged_values(result.stdout)


def logged_values(stdout: str) -> dict:
    def values(pattern):
        return [float(match) for match in re.findall(pattern, stdout)]
    return dict(rewards=values(r"rollouts before iteration \d+ \| reward: ([0-9.]+)"),
                entropy=values(r"\| entropy: ([0-9.]+) \|"),
                validation=values(r"validation reward at [^|]*\| reward: ([0-9.]+)"),
                losses=values(r"\| lm loss: ([-0-9.E+]+) \|"), grad_norms=values(r"\| grad norm: ([0-9.]+) \|"))


@pytest.mark.parametrize("layout, model", [
    (["--tensor-model-parallel-size", "2"], []), ([], []),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], []),
    (["--data-parallel-sharding-strategy", "optim_grads_params"], []),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], LLAMA_STYLE),
    (["--pipeline-model-parallel-size", "2"], ["--rl-cache", "dual"] + EVALUATION),
    (INTERLEAVED, PIPELINE_AR + LLAMA_STYLE),
    (["--pipeline-model-parallel-size", "2"], BLOCK_DIFFUSION + EVALUATION)],
    ids=["tp2", "dp2", "tp2_sp", "fsdp2", "tp2_sp_llama", "pp2_dual_cache", "pp2_vp2_ar_llama", "pp2_block_diffusion"])
def test_parallel_rollouts_and_updates_equal_one_process(runtime, tmp_path, capsys, layout, model):
    """TP=2, DP=2, TP=2 with sequence parallelism, DP=2 under FSDP2 or PP=2 (interleaved too; 2 gloo processes):
    the same completions (rewards) and losses as one process, step by step (under DP each replica samples half
    the prompts: per-row sampling seeds make them the same draws; under SP the sampler runs the model with
    sequence parallelism off; under FSDP2 with the weights gathered once, so replicas may sample to different
    lengths; under PP every stage runs the sampler, the last one deciding, inference/pipelined.py, and keeps
    the KV cache of its own layers: Fast-dLLM's dual cache in one case). Under TP and PP one rank scores the
    completions for both: the checker would give the other rank other rewards."""
    model_parallel = "--tensor-model-parallel-size" in layout or "--pipeline-model-parallel-size" in layout
    tasks = task_file(tmp_path, RANK_CHECKER if model_parallel else CHECKER)  # rank 1 is a peer, or a replica
    argv = MODEL + model + ["--rl-task", tasks, "--lr", "2e-2", "--train-iters", "3", "--rl-sampling-steps", "4"]
    argv += ["--rl-valid-task", argv[argv.index("--rl-task") + 1]] if model[-len(EVALUATION):] == EVALUATION else []
    alone = run(argv)
    validation = logged_values(capsys.readouterr().out)["validation"]
    logged = two_processes(argv + layout, tmp_path)
    assert logged["rewards"] == [round(value, 4) for value in alone.rollout_rewards]
    assert logged["entropy"] == pytest.approx(alone.rollout_entropy, abs=2e-4) and len(logged["entropy"]) == 3
    # a young policy is near uniform: below log of the padded vocabulary (8192 tokens and the mask, padded)
    assert 8.5 < min(logged["entropy"]) and max(logged["entropy"]) < math.log(8320)
    assert logged["losses"] == pytest.approx([step.loss for step in alone.history], rel=1e-4, abs=1e-7)
    assert logged["grad_norms"] == pytest.approx([step.grad_norm for step in alone.history], abs=1e-3)
    if "--eval-interval" in model:  # the held-out reward (greedy) after the last step
        assert len(validation) == 1 and logged["validation"] == validation


def test_the_reference_policy_under_pipeline_parallelism(runtime, tmp_path):
    """--rl-kl-beta under PP=2 interleaved: each stage holds its part of the frozen reference and runs it in
    pipeline order; the KL term moves the losses as in one process."""
    base = MODEL + PIPELINE_AR + ["--rl-task", task_file(tmp_path), "--lr", "3e-2"]
    init = str(tmp_path / "init")
    run(base + ["--train-iters", "2", "--save", init, "--save-interval", "2"])
    argv = base + ["--load", init, "--finetune", "--rl-kl-beta", "0.5", "--rl-reference", init, "--train-iters", "3"]
    alone = run(argv)
    logged = two_processes(argv + INTERLEAVED, tmp_path)
    assert alone.update_statistics[0]["kl"] == 0.0 < alone.update_statistics[2]["kl"]
    assert logged["losses"] == pytest.approx([step.loss for step in alone.history], rel=1e-4, abs=1e-7)
    assert logged["grad_norms"] == pytest.approx([step.grad_norm for step in alone.history], abs=1e-3)


def test_cuda_graph_rollouts_need_cuda_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        posttrain_rl.main(MODEL + ["--rl-task", task_file(tmp_path), "--lr", "1e-3", "--train-iters", "2",
                                   "--rl-cuda-graphs"])
    error = capsys.readouterr().err
    assert exit_info.value.code in (1, 2) and error.count("\n") == 1 and "--rl-cuda-graphs needs a CUDA" in error


@pytest.mark.gpu
def test_rollouts_replayed_from_cuda_graphs_equal_eager_ones(runtime, tmp_path):
    """--rl-cuda-graphs on CUDA: the rollouts replay captured graphs, which read the weights the optimizer
    updates in place between steps, and sample what eager forwards sample; so the updates are the same."""
    argv = MODEL + ["--rl-task", task_file(tmp_path), "--lr", "2e-2", "--train-iters", "3", "--rl-sampling-steps",
                    "4", "--rl-cache", "dual"]
    eager = run(argv)
    graphs = run(argv + ["--rl-cuda-graphs"])
    from megatron.core.distributed.data_parallel import unwrap
    assert unwrap(graphs.model)._graph_runner.replays > 0
    assert graphs.rollout_rewards == eager.rollout_rewards and len(eager.rollout_rewards) == 3
    assert [step.loss for step in graphs.history] == pytest.approx([step.loss for step in eager.history], abs=1e-6)
    assert [step.grad_norm for step in graphs.history] == pytest.approx([s.grad_norm for s in eager.history],
                                                                        rel=1e-4)


def test_the_kl_to_a_frozen_reference_policy_and_its_resume(runtime, tmp_path):
    """--rl-kl-beta with --rl-reference: nothing at the first step (the policy is the reference: k3 and its
    gradient vanish), a different update later; a resumed run reloads the reference, not its own weights."""
    base = MODEL + ["--rl-task", task_file(tmp_path), "--model-running-mode", "vanilla", "--rl-algorithm", "grpo",
                    "--lr", "3e-2"]
    init = str(tmp_path / "init")
    run(base + ["--train-iters", "2", "--save", init, "--save-interval", "2"])
    start = ["--load", init, "--finetune"]
    kl = ["--rl-kl-beta", "0.5", "--rl-reference", init]
    plain = run(base + start + ["--train-iters", "4"])
    straight = run(base + start + kl + ["--train-iters", "4"])
    assert (straight.history[0].loss, straight.history[0].grad_norm) == (plain.history[0].loss,
                                                                         plain.history[0].grad_norm)
    assert straight.history[3].loss != plain.history[3].loss
    assert straight.update_statistics[0]["kl"] == 0.0 < straight.update_statistics[3]["kl"]
    run(base + start + kl + ["--train-iters", "2", "--save", str(tmp_path / "rl"), "--save-interval", "2"])
    resumed = run(base + kl + ["--train-iters", "4", "--load", str(tmp_path / "rl")])
    assert [r.loss for r in resumed.history] == [r.loss for r in straight.history[2:]]


def test_step_throughput_is_off_with_a_note(tmp_path, capsys):
    """--log-throughput counts --seq-length tokens a row, which RL rows are not: off, and said so."""
    from custom_args.rl import add_rl_args
    from megatron.training.arguments import parse_args

    args = parse_args(MODEL + ["--rl-task", task_file(tmp_path), "--lr", "1e-3", "--train-iters", "2",
                               "--log-throughput"], add_rl_args, world_size=1)
    posttrain_rl.without_step_throughput(args)
    assert not args.logging_config.log_throughput
    assert "note: --log-throughput is off for RL" in capsys.readouterr().out


def test_the_validation_reward_scores_the_held_out_tasks_greedily(runtime, tmp_path, capsys):
    """--rl-valid-task: every --eval-interval, one greedy completion of each of --rl-eval-prompts tasks; greedy,
    so a second evaluation of the same weights gives the same reward. --rl-log-completions prints the first
    ones with the rewards they scored."""
    tasks = task_file(tmp_path)
    trainer = run(MODEL + ["--rl-task", tasks, "--rl-valid-task", tasks, "--rl-eval-prompts", "5",
                           "--rl-log-completions", "2", "--eval-interval", "2", "--eval-iters", "1",
                           "--model-running-mode", "vanilla", "--rl-algorithm", "grpo", "--lr", "1e-3",
                           "--train-iters", "2"])
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if "validation reward at iteration 2" in line]
    assert len(lines) == 1 and "prompts: 5 |" in lines[0]
    shown = [re.search(r"validation completion (\d+) \| reward: ([0-9.]+) \| answer: \"\" \| completion: (.*) \|$",
                       line) for line in out if "validation completion" in line]
    assert [int(match.group(1)) for match in shown] == [0, 1]  # the held-out tasks in order, 2 of the 5
    for match in shown:  # the reward the checker gives the printed text
        text = "".join(json.loads(match.group(3)).split())
        assert text and float(match.group(2)) == pytest.approx(text.count("e") / len(text), abs=1e-4)
    with RewardWorkersFor(trainer):
        again = trainer.evaluate_and_log()
    assert f"reward: {again:.4f}" in lines[0] and 0.0 < again < 1.0


class RewardWorkersFor:
    """The reward processes a finished RLTrainer needs to evaluate again."""

    def __init__(self, trainer) -> None:
        from megatron.rl.rewards import RewardWorkers

        self.trainer, self.workers = trainer, RewardWorkers(1)

    def __enter__(self):
        self.trainer.workers = self.workers

    def __exit__(self, *exc_info):
        self.trainer.workers = None
        self.workers.close()
