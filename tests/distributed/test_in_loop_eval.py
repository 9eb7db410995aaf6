"""--lm-eval-tasks under data and tensor parallelism (with sequence parallelism too) and FSDP2: every rank
scores every request with the live model (the tensor-parallel and FSDP2 forwards are collectives; under
sequence parallelism it is switched off for scoring), and the metrics rank 0 logs are the single-process run's."""

import os

import pytest
import torch

import pretrain_difflm
from custom_args.difflm import add_difflm_args
from megatron.evaluation.in_loop import inference_ready
from megatron.training.initialize import initialize_distributed
from megatron.training.run_config import parse_run_config
from megatron.training.training import build_trainer
from tests.distributed.parity import free_port, start_workers
from tests.unit_tests.test_in_loop_eval import TEXT_MODEL, lm_eval_flags, task_folder

pytestmark = pytest.mark.distributed

# (context, continuation) pairs scored after training, besides the tasks' metrics: numbers, not just accuracies.
PAIRS = [("Fellow-Citizens of the Senate and House of", " Representatives"),
         ("Congress shall have power to lay and collect", " taxes"), ("We the People", " of the United States")]
LAYOUTS = {"dp2": ["--micro-batch-size", "1"], "tp2": ["--tensor-model-parallel-size", "2"],
           "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "fsdp2": ["--data-parallel-sharding-strategy", "optim_grads_params"]}


def _train_and_score(argv: list, runtime) -> dict:
    from lm_eval.api.instance import Instance

    trainer = build_trainer(parse_run_config(argv, add_difflm_args), runtime,
                            pretrain_difflm.train_valid_test_datasets_provider, pretrain_difflm.model_provider,
                            pretrain_difflm.forward_step)
    trainer.train()
    trainer.logger.close()
    trainer.model.eval()
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(PAIRS)]
    with inference_ready(trainer.model):  # every rank: the forward is a collective (TP, FSDP2)
        scores = [score for score, _ in trainer.lm_eval.lm.loglikelihood(requests)]
    return {"history": trainer.lm_eval.history, "scores": scores, "losses": [r.loss for r in trainer.history]}


def _worker(rank: int, port: int, argvs: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                      HF_DATASETS_CACHE=f"{out}.datasets-{rank}")
    torch.set_num_threads(1)
    runtime = initialize_distributed("gloo")
    results = [_train_and_score(argv, runtime) for argv in argvs]  # one process group serves every layout
    if rank == 0:
        torch.save(results, out)
    else:  # lm-eval reports on LOCAL_RANK 0 only; this rank scored the same requests
        assert all(result["history"] and not any(result["history"].values()) for result in results)


def test_dp2_tp2_sp_and_fsdp2_log_the_single_process_metrics(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")  # an optional (dev) dependency, like the adapter's own tests
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    base = TEXT_MODEL + ["--train-iters", "1", "--lm-eval-limit", "2"] + lm_eval_flags(task_folder(tmp_path))
    out = str(tmp_path / "layouts.pt")
    start_workers(_worker, (free_port(), [base + flags for flags in LAYOUTS.values()], out), 2)
    alone = _train_and_score(base, initialize_distributed("gloo"))
    assert sorted(alone["history"]) == [1] and alone["history"][1]  # after the last iteration
    for name, result in zip(LAYOUTS, torch.load(out)):
        assert result["losses"] == pytest.approx(alone["losses"], rel=1e-5), name
        assert result["scores"] == pytest.approx(alone["scores"], rel=1e-4), name
        assert result["history"] == alone["history"], name
