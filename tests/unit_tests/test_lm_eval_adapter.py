"""The lm-eval model `megadlms` (megatron/evaluation): lm-eval's own evaluator on bundled offline
tasks, our checkpoint against its Hugging Face export, the batched scorer against the
one-pair-at-a-time likelihood, AR scores against a plain forward and lm-eval's `hf` model, and
the CLI wrapper."""

import os
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")  # the only skip: lm-eval is an optional (dev) dependency
pytest.importorskip("transformers")  # the checkpoint helpers of the conversion tests

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from megatron.core.transformer.transformer_config import DLMConfig  # noqa: E402
from megatron.evaluation import lm_eval_adapter  # noqa: E402 (registers "megadlms")
from megatron.evaluation.scoring import pair_seed  # noqa: E402
from megatron.training.checkpointing import load_inference_model  # noqa: E402
from megatron.training.tokenizer import SentencePieceTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPM = str(ROOT / "examples" / "data" / "tokenizer" / "spm_8k.model")
TASKS = ROOT / "tests" / "assets" / "lm_eval"
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    """No hub: the tasks' data_files are relative to the repository root; datasets caches in tmp."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "datasets"))


def _checkpoint(tmp_path_factory, name: str, running_mode: str, **config):
    # Imported here, not at the top: the two-rank test's workers import this file and need no transformers.
    from tests.unit_tests.test_hf_conversion import export, save_checkpoint, tiny_config

    tokenizer = SentencePieceTokenizer(SPM)
    root = tmp_path_factory.mktemp(name)
    dlm = DLMConfig(model_running_mode=running_mode, mask_token_id=tokenizer.mask)
    save_checkpoint(root / "ckpt", tiny_config(vocab_size=8192, unpadded_vocab_size=8192, **config), dlm,
                    tokenizer=tokenizer.identity)
    export(root / "ckpt", root / "hf")
    return root / "ckpt", root / "hf", tokenizer


@pytest.fixture(scope="module")
def dlm(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "dlm", "difflm-noshift")


@pytest.fixture(scope="module")
def ar(tmp_path_factory):  # exported as a native LlamaForCausalLM
    return _checkpoint(tmp_path_factory, "ar", "vanilla", share_embeddings_and_output_weights=False, kv_channels=16)


def evaluate(model_args: str, tasks, model: str = "megadlms"):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), log_samples=True,
                                   task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))


def metrics(results) -> dict:
    return {task: {key: value for key, value in values.items() if "," in key}
            for task, values in results["results"].items()}


def responses(results, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda sample: sample["doc_id"])]


def choice_scores(results, task: str = "megadlms_tiny_mc") -> list:
    """Every choice's log-likelihood, question by question (lm-eval keeps [(ll, is_greedy)] per choice)."""
    return [choice[0][0] for sample in responses(results, task) for choice in sample]


def greedy_flags(results, task: str = "megadlms_tiny_mc") -> list:
    return [choice[0][1] for sample in responses(results, task) for choice in sample]


def test_dlm_checkpoint_and_hf_export_report_the_same_metrics(dlm):
    ckpt, hf, _ = dlm
    options = ",mc_num=4,batch_size=5,seed=3,device=cpu,gen_length=8,block_length=4,steps=4"
    ours = evaluate(f"load={ckpt}{options}", ["megadlms_tiny_mc", "megadlms_tiny_gen"])
    theirs = evaluate(f"pretrained={hf}{options}", ["megadlms_tiny_mc", "megadlms_tiny_gen"])
    assert metrics(ours) == metrics(theirs) and set(metrics(ours)) == {"megadlms_tiny_mc", "megadlms_tiny_gen"}
    assert responses(ours, "megadlms_tiny_gen") == responses(theirs, "megadlms_tiny_gen")
    assert len(choice_scores(ours)) == 13 and choice_scores(ours) == pytest.approx(choice_scores(theirs), abs=1e-4)
    assert not any(greedy_flags(ours))  # DLM: is_greedy is always False


@pytest.mark.parametrize("cfg", [0.0, 0.5])
def test_batched_elbo_equals_one_pair_at_a_time_likelihood(dlm, cfg):
    """Batching across pairs, padding and the batch size change nothing: each pair's score is
    likelihood.log_likelihood's with mc_num draws seeded by (seed, context)."""
    ckpt, _, tokenizer = dlm
    model, _ = load_inference_model(str(ckpt), CPU)
    pairs = [(tokenizer.tokenize("Congress shall have power"), tokenizer.tokenize(" to lay and collect taxes")),
             (tokenizer.tokenize("Congress shall have power"), tokenizer.tokenize(" songs")),
             (tokenizer.tokenize("We the People"), tokenizer.tokenize(" of the United States"))]
    scores = {}
    for batch_size in (3, 64):
        lm = lm_eval_adapter.MegaDLMsLM(load=str(ckpt), mc_num=8, batch_size=batch_size, cfg=cfg, seed=5,
                                        device="cpu")
        scores[batch_size] = lm._score(pairs)
    for (context, answer), (score, greedy) in zip(pairs, scores[3]):
        expected = model.log_likelihood(torch.tensor(context), torch.tensor(answer), mc_num=8, batch_size=8,
                                        cfg_scale=cfg, generator=torch.Generator().manual_seed(pair_seed(5, context)))
        assert score == pytest.approx(expected, rel=1e-5) and greedy is False
    assert [score for score, _ in scores[3]] == pytest.approx([score for score, _ in scores[64]], rel=1e-5)
    assert pair_seed(5, pairs[0][0]) == pair_seed(5, pairs[1][0]) != pair_seed(5, pairs[2][0])  # common numbers


@pytest.mark.parametrize("cfg, ar_loss_weight", [(0.0, 0.0), (0.5, 0.0), (0.5, 1.0)])
def test_block_diffusion_pairs_score_block_by_block_as_the_one_pair_likelihood(cfg, ar_loss_weight):
    """A BD3 model: the batched scorer (left padding, select, deduped masks) gives each pair the
    block-wise ELBO of likelihood.log_likelihood with the same draws; a pair whose continuation
    spans blocks runs rows for each block. A joint AR + DLM model's clean blocks are token-causal in both."""
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.evaluation.scoring import Scorer
    from tests.unit_tests.test_hf_conversion import perturb, tiny_config

    torch.manual_seed(0)
    dlm = DLMConfig(model_running_mode="difflm-noshift", mask_token_id=89, block_diffusion=True, block_size=4,
                    ar_loss_weight=ar_loss_weight)
    model = GPTModel(tiny_config(), dlm).eval()
    perturb(model)
    pairs = [([3, 4, 5], [7, 8, 9, 10, 11]), ([3, 4, 5], [9]), ([10, 11, 12, 13, 14, 15], [12, 13])]
    seeds = [pair_seed(2, context) for context, _ in pairs]
    scores = Scorer(model.inference_forward, "difflm-noshift", 89, CPU, batch_size=7, mc_num=8, cfg=cfg,
                    pattern=model.trained_pattern(), select=True).score(pairs, seeds)
    for (context, answer), seed, (score, greedy) in zip(pairs, seeds, scores):
        expected = model.log_likelihood(torch.tensor(context), torch.tensor(answer), mc_num=8, batch_size=8,
                                        cfg_scale=cfg, generator=torch.Generator().manual_seed(seed))
        assert score == pytest.approx(expected, rel=1e-5) and greedy is False
    joint = Scorer(model.inference_forward, "difflm-noshift", 89, CPU, batch_size=7, mc_num=8, cfg=cfg,
                   pattern=dict(model.trained_pattern(), attention_mask_type="block_causal", causal_clean=False)
                   ).score(pairs, seeds)
    assert abs(joint[0][0] - scores[0][0]) > 1e-3  # one span over the whole answer is another estimate
    if ar_loss_weight:  # block-causal clean blocks would be another model's reading
        plain = dict(model.trained_pattern(), causal_clean=False)
        other = Scorer(model.inference_forward, "difflm-noshift", 89, CPU, batch_size=7, mc_num=8, cfg=cfg,
                       pattern=plain).score(pairs, seeds)
        assert abs(other[0][0] - scores[0][0]) > 1e-4


@pytest.mark.parametrize("running_mode, cfg", [("difflm-noshift", 0.5), ("difflm-shift", 0.5), ("vanilla", 0.0)])
def test_output_layer_at_the_scored_slots_only_equals_the_full_logits(running_mode, cfg):
    """Scorer(select=True) asks the model for the scored slots' logits only (2-D, never [B, L, V]),
    and every score and greedy flag equals the full-logits path's."""
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.evaluation.scoring import Scorer
    from tests.unit_tests.test_hf_conversion import perturb, tiny_config

    torch.manual_seed(0)
    model = GPTModel(tiny_config(), DLMConfig(model_running_mode=running_mode, mask_token_id=89)).eval()
    perturb(model)
    shapes = []

    def model_fn(*args, **kwargs):
        logits = model.inference_forward(*args, **kwargs)
        shapes.append(tuple(logits.shape))
        return logits

    pairs = [([3, 4, 5, 6], [7, 8]), ([3, 4, 5, 6], [9]), ([10, 11], [12, 13, 14, 15, 16])]
    seeds = [pair_seed(1, context) for context, _ in pairs]
    results = {select: Scorer(model_fn, running_mode, 89, CPU, batch_size=5, mc_num=4, cfg=cfg,
                              pattern=model.trained_pattern(), select=select).score(pairs, seeds)
               for select in (False, True)}
    selected = shapes[len(shapes) // 2:]
    assert all(len(shape) == 3 for shape in shapes[:len(shapes) // 2]) and all(len(shape) == 2 for shape in selected)
    assert sum(shape[0] for shape in selected) < sum(len(c) + len(a) for c, a in pairs) * (1 if running_mode ==
                                                                                            "vanilla" else 4)
    assert [score for score, _ in results[True]] == pytest.approx([score for score, _ in results[False]], rel=1e-5)
    assert [greedy for _, greedy in results[True]] == [greedy for _, greedy in results[False]]
    assert len({score for score, _ in results[True]}) == len(pairs)


@pytest.mark.parametrize("cfg", [0.0, 0.5])
def test_equal_masked_copies_run_once_and_give_the_same_scores(cfg):
    """A mask drawn k times runs as one row weighted k: the scores equal running every copy, and a
    one-token continuation costs one row instead of mc_num (two-token ones at most 3)."""
    from megatron.core.models.difflm.gpt_model import GPTModel
    from megatron.evaluation.scoring import Scorer
    from tests.unit_tests.test_hf_conversion import perturb, tiny_config

    torch.manual_seed(0)
    model = GPTModel(tiny_config(), DLMConfig(model_running_mode="difflm-noshift", mask_token_id=89)).eval()
    perturb(model)
    pairs = [([3, 4, 5, 6], [7]), ([3, 4, 5, 6], [9, 10]), ([10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20])]
    seeds = [pair_seed(1, context) for context, _ in pairs]
    rows, results = {}, {}
    for dedupe in (False, True):
        def model_fn(ids, *args, **kwargs):
            rows[dedupe] = rows.get(dedupe, 0) + ids.shape[0] // (2 if cfg else 1)
            return model.inference_forward(ids, *args, **kwargs)
        scorer = Scorer(model_fn, "difflm-noshift", 89, CPU, batch_size=7, mc_num=16, cfg=cfg,
                        pattern=model.trained_pattern(), select=True, dedupe=dedupe)
        results[dedupe] = [score for score, _ in scorer.score(pairs, seeds)]
    assert results[True] == pytest.approx(results[False], rel=1e-6)
    assert rows[False] == 16 * len(pairs)
    assert 1 + 2 + 3 <= rows[True] <= 1 + 3 + 16 and rows[True] > 1 + 3  # the long one's copies mostly differ


def test_the_exports_dlm_forward_selects_the_same_logits(dlm):
    """The remote-code export's dlm_forward(select=) equals its full logits at those slots."""
    from tests.unit_tests.test_hf_conversion import load_hf

    model = load_hf(dlm[1])
    ids = torch.randint(0, 8000, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9).expand(2, 9)
    mask = torch.ones(2, 9, 9, dtype=torch.bool)
    read = (torch.tensor([0, 0, 1]), torch.tensor([2, 8, 5]))
    selected = model.dlm_forward(ids, positions, mask, select=read)
    assert selected.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(selected, model.dlm_forward(ids, positions, mask)[read], rtol=1e-5, atol=1e-5)


def _exact(model, context, continuation):
    """log p(continuation | context) and greedy-ness from one causal forward of the unpadded sequence."""
    sequence = torch.tensor([context + continuation])
    length = sequence.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
    logits = model.inference_forward(sequence, torch.arange(length)[None], causal)[0, len(context) - 1:-1]
    logprobs = logits.float().log_softmax(-1)
    target = torch.tensor(continuation)
    return logprobs.gather(1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())


def test_ar_loglikelihood_is_exact_with_exact_greedy(ar):
    ckpt, _, tokenizer = ar
    model, _ = load_inference_model(str(ckpt), CPU)
    lm = lm_eval_adapter.MegaDLMsLM(load=str(ckpt), batch_size=2, device="cpu")
    requests = [Instance("loglikelihood", {}, (context, continuation), index) for index, (context, continuation)
                in enumerate([("Fellow-Citizens of the Senate and House of", " Representatives"),
                              ("Congress shall have", " power to lay and collect taxes"), ("", "We the People")])]
    results = lm.loglikelihood(requests)
    for request, (score, greedy) in zip(requests, results):
        context, continuation = lm._encode_pair(*request.args)
        assert (score, greedy) == pytest.approx(_exact(model, context, continuation), rel=1e-5)
    assert lm._encode_pair("", "We the People")[0] == [tokenizer.eod]  # lm-eval's empty-context rule
    context = tokenizer.tokenize("Congress shall have power")
    greedy_tokens = model.generate(torch.tensor([context]), gen_length=3)[0, len(context):].tolist()
    other = greedy_tokens[:2] + [(greedy_tokens[2] + 1) % 8000]
    (greedy_score, is_greedy), (other_score, other_greedy) = lm._score([(context, greedy_tokens), (context, other)])
    assert is_greedy and not other_greedy and _exact(model, context, greedy_tokens)[1]
    assert [greedy_score, other_score] == pytest.approx([_exact(model, context, greedy_tokens)[0],
                                                         _exact(model, context, other)[0]], rel=1e-5)


def test_ar_scores_match_lm_evals_own_hf_model_on_the_export(ar):
    """lm-eval's `hf` model on the native Llama export: the same per-choice log-likelihoods, greedy
    flags and rolling (windowed) perplexity as ours on the checkpoint, and as ours on the export."""
    ckpt, hf, tokenizer = ar
    ours = evaluate(f"load={ckpt},batch_size=4,device=cpu", ["megadlms_tiny_mc"])
    native = evaluate(f"pretrained={hf},batch_size=4,device=cpu", ["megadlms_tiny_mc"])
    reference = evaluate(f"pretrained={hf},dtype=float32,device=cpu,add_bos_token=False", ["megadlms_tiny_mc"],
                         model="hf")
    for other in (native, reference):
        assert choice_scores(ours) == pytest.approx(choice_scores(other), abs=1e-4)
        assert greedy_flags(ours) == greedy_flags(other)
    assert metrics(ours) == metrics(reference) == metrics(native)
    long_text = ("Fellow-Citizens of the Senate and House of Representatives: among the vicissitudes incident to "
                 "life no event could have filled me with greater anxieties")
    request = [Instance("loglikelihood_rolling", {}, (long_text,), 0)]
    rolling = lm_eval_adapter.MegaDLMsLM(load=str(ckpt), max_length=16, device="cpu").loglikelihood_rolling(request)
    from lm_eval.models.huggingface import HFLM

    # Our documents start after an EOD (pretraining's separator): the prefix of the first window.
    expected = HFLM(pretrained=str(hf), dtype="float32", device="cpu", max_length=16, add_bos_token=False,
                    prefix_token_id=tokenizer.eod).loglikelihood_rolling(request)
    assert rolling == pytest.approx(expected, rel=1e-5)


def test_generate_until_caps_at_max_gen_toks_and_cuts_at_stop_strings(ar, dlm):
    ckpt, _, tokenizer = ar
    model, _ = load_inference_model(str(ckpt), CPU)
    lm = lm_eval_adapter.MegaDLMsLM(load=str(ckpt), gen_length=64, device="cpu")
    prompt = "Congress shall have power"
    ids = tokenizer.tokenize(prompt)
    full = tokenizer.detokenize(model.generate(torch.tensor([ids]), gen_length=5)[0, len(ids):].tolist())
    stop = full.split()[1] if len(full.split()) > 1 else full[1:]
    assert lm.generate_until([Instance("generate_until", {}, (prompt, {"max_gen_toks": 5}), 0)]) == [full]
    cut = lm.generate_until([Instance("generate_until", {}, (prompt, {"max_gen_toks": 5, "until": [stop]}), 0)])
    assert cut == [full.split(stop, 1)[0]] and len(cut[0]) < len(full)
    dlm_lm = lm_eval_adapter.MegaDLMsLM(load=str(dlm[0]), gen_length=64, block_length=16, steps=32, device="cpu")
    options = dlm_lm._generation_options({"max_gen_toks": 8})
    assert (options["gen_length"], options["block_length"], options["steps"]) == (8, 8, 4)  # steps/token kept
    options = dlm_lm._generation_options({"max_gen_toks": 40})  # a whole number of blocks
    assert (options["gen_length"], options["block_length"], options["steps"]) == (32, 16, 16)


def test_cli_wrapper_runs_a_task_and_prints_its_table(dlm, monkeypatch, capsys):
    import functools

    import lm_eval.tasks

    sys.path.insert(0, str(ROOT / "tools"))
    import lm_eval_harness

    # Indexing lm-eval's thousands of built-in task YAMLs takes ~30 s on two cores; this task is in --include_path.
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))

    lm_eval_harness.main(["--model", "megadlms", "--model_args", f"load={dlm[0]},mc_num=2,device=cpu",
                          "--batch_size", "4", "--tasks", "megadlms_tiny_mc", "--include_path", str(TASKS)])
    table = capsys.readouterr().out
    assert "megadlms_tiny_mc" in table and "acc" in table and "|" in table

def test_dlm_rolling_is_the_sum_of_the_window_elbos(dlm):
    """Perplexity tasks on a DLM: lm-eval's disjoint windows, each fitting max_length, each scored
    by the Monte Carlo ELBO given its context token."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ckpt, _, tokenizer = dlm
    model, _ = load_inference_model(str(ckpt), CPU)
    text = "We the People of the United States, in Order to form a more perfect Union, establish Justice"
    tokens = tokenizer.tokenize(text)
    windows = [make_disjoint_window(window) for window in get_rolling_token_windows(tokens, tokenizer.eod, 15, 1)]
    assert len(windows) > 1 and all(len(context) + len(piece) <= 16 for context, piece in windows)
    expected = sum(model.log_likelihood(torch.tensor(context), torch.tensor(piece), mc_num=4, batch_size=4,
                                        generator=torch.Generator().manual_seed(pair_seed(0, context)))
                   for context, piece in windows)
    lm = lm_eval_adapter.MegaDLMsLM(load=str(ckpt), max_length=16, mc_num=4, batch_size=3, device="cpu")
    assert lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)]) == pytest.approx(
        [expected], rel=1e-5)


def test_generation_stops_at_eos_with_an_injected_backend():
    """A Backend built in-process (the in-training hook's way in): a stub AR model whose greedy
    tokens are 5 until position 4, then EOS (9); the text ends there, not at gen_length."""
    def model_fn(input_ids, position_ids, attention_mask, kv_cache=None, cache_start=0):
        best = torch.where(position_ids < 4, 5, 9)
        return torch.nn.functional.one_hot(best, 10).float()

    backend = lm_eval_adapter.Backend(model_fn, "vanilla", None, {}, 32, 9, lambda text: [1] * len(text),
                                      lambda ids: "".join(chr(ord("a") + token) for token in ids), kv_cache=False)
    lm = lm_eval_adapter.MegaDLMsLM(backend=backend, gen_length=8, device="cpu")
    assert lm.generate_until([Instance("generate_until", {}, ("abc", {"until": ["zz"]}), 0),
                              Instance("generate_until", {}, ("a", {"until": ["ff"]}), 1)]) == ["ff", ""]



@pytest.mark.parametrize("arguments, message", [
    ({}, "exactly one of model_args load=CKPT_DIR"),
    ({"load": "a", "pretrained": "b"}, "exactly one of model_args load=CKPT_DIR"),
    ({"load": "x", "mcnum": 4}, "unknown model_args ['mcnum']"),
    ({"load": "x", "cache": "full"}, "cache='full' must be none, prefix or dual"),
])
def test_bad_model_args_are_one_clear_error(arguments, message):
    with pytest.raises(ValueError) as error:
        lm_eval_adapter.MegaDLMsLM(device="cpu", **arguments)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_package_imports_without_lm_eval(monkeypatch):
    """megatron.evaluation and its scorer run again with lm_eval unimportable (None in sys.modules)."""
    import importlib

    import megatron.evaluation
    import megatron.evaluation.scoring

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ImportError):
        import lm_eval.api  # noqa: F401 (proves the block works)
    importlib.reload(megatron.evaluation)
    importlib.reload(megatron.evaluation.scoring)


def _rank_worker(rank: int, port: int, ckpt: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=f"{out}.datasets-{rank}")
    os.chdir(ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = evaluate(f"load={ckpt},mc_num=4,batch_size=5,seed=3,device=cpu", ["megadlms_tiny_mc"])
    if rank == 0:
        torch.save({"metrics": metrics(results), "scores": choice_scores(results)}, out)
    else:
        assert results is None  # lm-eval reports on rank 0 only


@pytest.mark.distributed
def test_two_ranks_split_the_requests_and_report_the_single_process_numbers(dlm, tmp_path):
    """Each rank scores half the questions and lm-eval gathers them through the adapter's
    all_gather / gather_object / barrier; the masks are seeded per context, so the numbers do not
    depend on which rank (or batch) scored a question."""
    from tests.distributed.parity import free_port, start_workers

    ckpt = str(dlm[0])
    start_workers(_rank_worker, (free_port(), ckpt, str(tmp_path / "rank0.pt")), 2)
    gathered = torch.load(tmp_path / "rank0.pt")
    alone = evaluate(f"load={ckpt},mc_num=4,batch_size=5,seed=3,device=cpu", ["megadlms_tiny_mc"])
    assert gathered["metrics"] == metrics(alone)
    assert sorted(gathered["scores"]) == pytest.approx(sorted(choice_scores(alone)), abs=1e-5)
