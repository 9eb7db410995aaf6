"""lm-evaluation-harness (0.4.x) model ``megadlms``: our checkpoints and their Hugging Face exports.

    import megatron.evaluation.lm_eval_adapter  # registers the model
    lm_eval.simple_evaluate(model="megadlms", model_args="load=CKPT_DIR,mc_num=128,batch_size=32", tasks=[...])
    python tools/lm_eval_harness.py --model megadlms --model_args load=CKPT_DIR --tasks arc_easy

model_args (``key=value``, comma-separated):

* ``load=CKPT_DIR``: a ``--save`` directory of ours, any parallel layout
  (`load_inference_model`); its tokenizer is rebuilt from the identity the checkpoint records
  (``tokenizer=FILE`` when the recorded files are not on this machine). Or ``pretrained=HF_DIR``:
  an export of tools/weights_conversion/megatron_to_hf.py, loaded with transformers
  (``trust_remote_code`` for the DLM export; native Llama/Qwen folders for AR checkpoints), with
  the tokenizer saved beside it.
* ``mc_num`` (128): Monte Carlo samples per continuation (DLMs; LLaDA uses 1 for one-token
  answers); ``cfg`` (0): classifier-free guidance of the likelihood and the sampler (DLMs);
  ``batch_size`` (32; lm-eval's own ``--batch_size`` when model_args has none, and ``auto``
  means 32): rows per forward, which for DLMs counts masked copies, not questions.
* ``gen_length`` (256), ``steps`` (= gen_length), ``block_length`` (= gen_length),
  ``remasking`` (low_confidence), ``threshold``, ``cache`` (none|prefix|dual): the sampler of
  megatron.core.inference.generation for ``generate_until`` (DLMs; AR checkpoints decode token
  by token). A task's ``max_gen_toks`` caps gen_length (the block length and steps shrink with it).
* ``seed`` (0), ``device`` (cuda when available, cuda:LOCAL_RANK under torch.distributed, else
  cpu; bf16 weights on CUDA, fp32 on CPU as load_inference_model), ``max_length`` (the model's
  max_position_embeddings): contexts are cut from the left to fit it.

The three request types: ``loglikelihood`` is megatron.evaluation.scoring (batched across all
questions and choices; exact with exact ``is_greedy`` for AR; LLaDA's Monte Carlo ELBO with
``is_greedy`` False for DLMs, common random numbers across the choices of a question: the mask
draws are seeded by the seed and the context). ``loglikelihood_rolling`` (perplexity tasks)
scores the text in lm-eval's disjoint windows of ``max_length`` tokens, each conditioned on
the token before it: exact for AR; for DLMs the sum of the windows' ELBOs, a lower bound on
the log-likelihood (each window's tokens are scored only given their predecessor token, not
the full left context). ``generate_until`` batches prompts with the same generation settings
(left-padded), stops at EOS and cuts the text at the first of the task's ``until`` strings.

Our checkpoint and its export give the same numbers for the same seed: both backends feed the
same model callable contract (generation.py's ``model_fn``) to the same scorer and sampler.
Under torch.distributed each rank evaluates the requests lm-eval gives it and ``all_gather`` /
``gather_object`` / ``barrier`` are the process group's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import lm_eval.models  # noqa: F401 (lm-eval fills its registry lazily only while it is empty: keep "hf" & co.)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.core.inference import generation
from megatron.evaluation.scoring import Scorer, pair_seed
from megatron.training.checkpoint_files import inference_metadata
from megatron.training.checkpointing import load_inference_model
from megatron.training.tokenizer.identity import rebuild_training_tokenizer

__all__ = ["MegaDLMsLM", "Backend", "load_backend"]

DEFAULTS = dict(mc_num=128, batch_size=32, cfg=0.0, gen_length=256, steps=None, block_length=None,
                remasking="low_confidence", threshold=None, cache=None, seed=0, max_length=None)


@dataclass
class Backend:
    """What the adapter needs of a model, whichever way it was loaded."""

    model_fn: Callable[..., torch.Tensor]
    running_mode: str
    mask_token_id: Optional[int]
    pattern: dict  # the trained attention: attention_mask_type, attention_block_size, sliding_window
    max_length: int
    eos_token_id: Optional[int]
    encode: Callable[[str], List[int]]
    decode: Callable[[Sequence[int]], str]
    kv_cache: bool  # whether model_fn takes generation.py's KVCache
    select: bool = False  # whether model_fn takes select= (logits at those positions only: scoring.py)


def _checkpoint_backend(load: str, device: torch.device, tokenizer: Optional[str]) -> Backend:
    identity = inference_metadata(load).get("tokenizer") or {"type": "NullTokenizer"}
    text_tokenizer = rebuild_training_tokenizer(identity, tokenizer_model=tokenizer)  # checked before the weights
    if text_tokenizer is None:
        raise ValueError(f"load={load} was trained with the NullTokenizer: lm-eval's tasks are text; evaluate a "
                         "checkpoint trained with a text tokenizer")
    model, _ = load_inference_model(load, device)
    return Backend(model.inference_forward, model.running_mode, model.dlm_config.mask_token_id,
                   model.trained_pattern(), model.config.max_position_embeddings, text_tokenizer.eod,
                   text_tokenizer.tokenize, text_tokenizer.detokenize, kv_cache=True, select=True)


def _hf_backend(pretrained: str, device: torch.device, tokenizer: Optional[str]) -> Backend:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(pretrained, trust_remote_code=True, dtype=dtype).to(device).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer or pretrained, trust_remote_code=True)
    config = model.config
    eos = getattr(config, "eos_token_id", None)
    eos = eos if eos is not None else hf_tokenizer.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos

    def encode(text: str) -> List[int]:
        return hf_tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(ids: Sequence[int]) -> str:
        return hf_tokenizer.decode(list(ids), skip_special_tokens=True)

    if hasattr(model, "dlm_forward"):  # the remote-code export of ours (every DLM, some AR models)
        return Backend(model.dlm_forward, config.model_running_mode, config.mask_token_id, model.trained_pattern(),
                       config.max_position_embeddings, eos, encode, decode, kv_cache=True,
                       select="select" in inspect.signature(model.dlm_forward).parameters)
    pattern = {}
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        pattern = dict(attention_mask_type="sliding_window", sliding_window=config.sliding_window)
    return Backend(_native_model_fn(model), "vanilla", None, pattern, config.max_position_embeddings, eos,
                   encode, decode, kv_cache=False)


def _native_model_fn(model) -> Callable[..., torch.Tensor]:
    """generation.py's model_fn over a native transformers causal LM: the [B, q, K] mask goes in as
    transformers' 4-D boolean mask; no KV cache (the adapter decodes AR exports without one)."""
    @torch.no_grad()
    def model_fn(input_ids, position_ids, attention_mask, kv_cache=None, cache_start=0):
        if kv_cache is not None:
            raise ValueError("a native transformers export runs without generation.py's KVCache")
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask[:, None],
                     use_cache=False).logits
    return model_fn


def load_backend(load: Optional[str], pretrained: Optional[str], device: torch.device,
                 tokenizer: Optional[str] = None) -> Backend:
    """The model of ``load=`` (our checkpoint) or ``pretrained=`` (an HF export): exactly one."""
    if bool(load) == bool(pretrained):
        raise ValueError("megadlms needs exactly one of model_args load=CKPT_DIR (our checkpoint) or "
                         "pretrained=HF_DIR (its Hugging Face export)")
    if load:
        return _checkpoint_backend(load, device, tokenizer)
    return _hf_backend(pretrained, device, tokenizer)


def _none(value):
    return None if value in (None, "", "none", "None") else value


def _default_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.device("cuda", torch.distributed.get_rank() % torch.cuda.device_count())
    return torch.device("cuda")


@register_model("megadlms")
class MegaDLMsLM(LM):
    """lm-eval's LM over a `Backend`; the module docstring lists the model_args and the estimates."""

    def __init__(self, load: Optional[str] = None, pretrained: Optional[str] = None, tokenizer: Optional[str] = None,
                 device: Optional[str] = None, backend: Optional[Backend] = None, max_batch_size=None, **options):
        super().__init__()
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"megadlms: unknown model_args {unknown}; known: load, pretrained, tokenizer, device, "
                             f"{', '.join(DEFAULTS)}")
        settings = {**DEFAULTS, **{key: _none(value) for key, value in options.items()}}
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self._rank = torch.distributed.get_rank() if distributed else 0
        self._world_size = torch.distributed.get_world_size() if distributed else 1
        if settings["cache"] not in generation.CACHE_MODES:  # checked before any weight is loaded
            raise ValueError(f"megadlms: cache={settings['cache']!r} must be none, prefix or dual")
        self._device = torch.device(device) if _none(device) else _default_device()
        self.backend = backend or load_backend(_none(load), _none(pretrained), self._device, _none(tokenizer))
        batch = settings["batch_size"]
        self.batch_size = 32 if batch is None or str(batch).startswith("auto") else int(batch)
        self.seed, self.cfg = int(settings["seed"]), float(settings["cfg"])
        self.max_length = min(int(settings["max_length"] or self.backend.max_length), self.backend.max_length)
        self.generation = {key: settings[key] for key in ("gen_length", "steps", "block_length", "remasking",
                                                          "threshold", "cache")}
        self.scorer = Scorer(self.backend.model_fn, self.backend.running_mode, self.backend.mask_token_id,
                             self._device, batch_size=self.batch_size, mc_num=int(settings["mc_num"]), cfg=self.cfg,
                             pattern=self.backend.pattern, select=self.backend.select)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "MegaDLMsLM":
        """model_args win over lm-eval's own --batch_size / --device (which it always passes)."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "MegaDLMsLM":
        extra = {key: value for key, value in (additional_config or {}).items() if value is not None}
        return cls(**{**extra, **arg_dict})

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.backend.eos_token_id

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        """lm-eval's split (TemplateLM): trailing spaces of the context join the continuation, the
        continuation's tokens are the whole text's after the context's; an empty context is EOT."""
        encode = self.backend.encode
        if not context:
            tokens = encode(continuation)
            if tokens and tokens[0] == self.eot_token_id:
                return tokens[:1], tokens[1:]
            return [self.eot_token_id], tokens
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        head = encode(context)
        return head, encode(context + continuation)[len(head):]

    def _fit(self, context: List[int], continuation: List[int]) -> Tuple[List[int], List[int]]:
        """Cut the context from the left so that the model's input fits max_length (AR models do not
        read the last token, so their pair may be one longer: lm-eval's own windows)."""
        keep = self.max_length + (self.backend.running_mode == "vanilla") - len(continuation)
        if keep < (0 if self.backend.running_mode == "difflm-noshift" else 1):
            raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length="
                             f"{self.max_length} with its context; raise max_length or shorten the task's targets")
        return (context[-keep:] if keep else []), continuation

    def _score(self, pairs: List[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        pairs = [self._fit(context, continuation) for context, continuation in pairs]
        return self.scorer.score(pairs, [pair_seed(self.seed, context) for context, _ in pairs])

    def _window(self) -> int:
        """Tokens predicted per rolling window: lm-eval's max_length for AR (the input is one shorter
        than the window plus its context token), one less for DLMs (which read every token)."""
        return self.max_length - (self.backend.running_mode != "vanilla")

    # ------------------------------------------------------------------ requests
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        results = self._score([self._encode_pair(*request.args) for request in requests])
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        owners, windows = [], []
        for index, request in enumerate(requests):
            tokens = self.backend.encode(request.args[0])
            for window in get_rolling_token_windows(token_list=tokens, prefix_token=self.eot_token_id,
                                                    max_seq_len=self._window(), context_len=1):
                owners.append(index)
                windows.append(make_disjoint_window(window))
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._score(windows)):
            totals[owner] += score
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Requests grouped by their generation settings, longest prompts first, ``batch_size`` a forward."""
        results: List[Optional[str]] = [None] * len(requests)
        groups: dict = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        for members in groups.values():
            gen_kwargs = requests[members[0]].args[1]
            options, until = self._generation_options(gen_kwargs), gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            keep = self.max_length - options["gen_length"]
            if keep < 1:
                raise ValueError(f"megadlms: generating {options['gen_length']} tokens leaves no room for a prompt "
                                 f"in max_length={self.max_length}; lower gen_length")
            prompts = {index: self.backend.encode(requests[index].args[0])[-keep:] for index in members}
            order = sorted(members, key=lambda index: -len(prompts[index]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                texts = self._generate([prompts[index] for index in chunk], options, self.seed + start)
                for index, text in zip(chunk, texts):
                    results[index] = _cut(text, until)
                    self.cache_hook.add_partial("generate_until", requests[index].args, results[index])
        return results

    def _generation_options(self, gen_kwargs: dict) -> dict:
        """generation.py options for one request group: max_gen_toks caps gen_length."""
        wanted = self.generation["gen_length"]
        cap = int(gen_kwargs.get("max_gen_toks") or wanted or 256)
        length = min(int(wanted), cap) if wanted else cap
        temperature = float(gen_kwargs.get("temperature") or 0.0)
        if gen_kwargs.get("do_sample") is False:
            temperature = 0.0
        options = dict(gen_length=length, temperature=temperature)
        options.update({key: gen_kwargs[key] for key in ("top_k", "top_p") if gen_kwargs.get(key) is not None})
        if self.backend.running_mode == "vanilla":
            return {**options, "use_cache": self.backend.kv_cache}
        threshold = self.generation["threshold"]
        common = {"cfg_scale": self.cfg, "remasking": self.generation["remasking"], "cache": self.generation["cache"],
                  "threshold": None if threshold is None else float(threshold)}
        if self.backend.pattern.get("attention_mask_type") == "block_diffusion":  # the model's blocks, any length
            steps = self.generation["steps"]
            return {**options, **common, "block_length": self.generation["block_length"],
                    "steps": length if steps is None else max(1, round(int(steps) * length / int(wanted or length)))}
        block = min(int(self.generation["block_length"] or length), length)
        length -= length % block
        blocks = length // block
        steps = self.generation["steps"]
        steps = length if steps is None else max(1, round(int(steps) * length / int(wanted or length)))
        steps = max(blocks, steps // blocks * blocks)
        return {**options, **common, "gen_length": length, "block_length": block, "steps": steps}

    def _generate(self, prompts: List[List[int]], options: dict, seed: int) -> List[str]:
        """Left-padded batch through generation.generate; each text ends before its first EOS."""
        width = max(len(prompt) for prompt in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        real = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            real[row, width - len(prompt):] = 1
        backend, eos = self.backend, self.eot_token_id
        output = generation.generate(backend.model_fn, ids.to(self._device), real.to(self._device),
                                     running_mode=backend.running_mode, mask_token_id=backend.mask_token_id,
                                     eos_token_id=eos, pad_token_id=eos,
                                     generator=torch.Generator(self._device).manual_seed(seed),
                                     **backend.pattern, **options)
        texts = []
        for row in output[:, width:].tolist():
            texts.append(backend.decode(row[:row.index(eos)] if eos in row else row))
        return texts

    # ------------------------------------------------------------------ ranks
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor, stacked (0-d) or concatenated along dim 0, as accelerate's gather."""
        if self._world_size == 1:
            return tensor
        pieces = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        torch.distributed.all_gather(pieces, tensor.contiguous())
        return torch.stack(pieces) if tensor.dim() == 0 else torch.cat(pieces)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        gathered = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self._world_size > 1:
            torch.distributed.barrier()


def _cut(text: str, until: Sequence[str]) -> str:
    """The text before the first of the stop strings (lm-eval's `until`)."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
