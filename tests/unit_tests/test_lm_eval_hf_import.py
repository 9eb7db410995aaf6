"""An AR checkpoint imported from Hugging Face (tools/weights_conversion/hf_to_megatron.py) scores
lm-eval's bundled multiple-choice task like lm-eval's own `hf` model on the original weights:
the same per-choice log-likelihoods (fp32, 1e-4), greedy flags and metrics. The other
direction (our checkpoint against its export) is in test_lm_eval_adapter.py."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")  # the only skip: lm-eval is an optional (dev) dependency
transformers = pytest.importorskip("transformers")

from megatron.evaluation import lm_eval_adapter  # noqa: E402, F401 (registers "megadlms")
from tests.unit_tests.test_hf_conversion import perturb  # noqa: E402
from tests.unit_tests.test_lm_eval_adapter import choice_scores, evaluate, greedy_flags, metrics  # noqa: E402
from tests.unit_tests.test_lm_eval_adapter import offline  # noqa: E402, F401 (the autouse fixture: no hub)
from tools.weights_conversion import hf_to_megatron  # noqa: E402
from tools.weights_conversion.tokenizer_export import spm_to_tokenizers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPM = str(ROOT / "examples" / "data" / "tokenizer" / "spm_8k.model")


def native_llama(path: Path) -> None:
    """A randomly initialised transformers Llama (norms perturbed, untied head) saved with
    save_pretrained, beside the bundled SentencePiece vocabulary as a tokenizer.json."""
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=spm_to_tokenizers(SPM), eos_token="</s>",
                                                     bos_token="<s>", unk_token="<unk>")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, rope_theta=20000.0, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                                      bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    perturb(model)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def test_imported_ar_checkpoint_scores_like_lm_evals_hf_model_on_the_original(tmp_path):
    native_llama(tmp_path / "hf")
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                                "--no-progress"]) == 0
    ours = evaluate(f"load={tmp_path / 'ckpt'},batch_size=4,device=cpu", ["megadlms_tiny_mc"])
    reference = evaluate(f"pretrained={tmp_path / 'hf'},dtype=float32,device=cpu,add_bos_token=False",
                         ["megadlms_tiny_mc"], model="hf")
    scores = choice_scores(ours)
    assert len(scores) == 13 and len(set(scores)) == len(scores)  # every choice scored, none alike
    assert scores == pytest.approx(choice_scores(reference), abs=1e-4)
    assert greedy_flags(ours) == greedy_flags(reference)
    assert metrics(ours) == metrics(reference)
