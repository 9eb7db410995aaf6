"""Inference for MegaDLMs models: diffusion samplers and autoregressive decoding (generation.py),
answer log-likelihoods for evaluation (likelihood.py) and CUDA graphs for generation
(cuda_graphs.py).

These three files import only torch and each other, so the Hugging Face exporter ships them with
an exported model; `GPTModel.generate`, `GPTModel.log_likelihood` and `GPTModel.inference_forward`
are the model side.
"""

from megatron.core.inference.generation import GenerationOptions, generate, resolve_options
from megatron.core.inference.kv_cache import KVCache
from megatron.core.inference.likelihood import log_likelihood

__all__ = ["GenerationOptions", "KVCache", "generate", "log_likelihood", "resolve_options"]
