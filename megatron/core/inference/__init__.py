"""Generation for MegaDLMs models: diffusion samplers and autoregressive decoding.

`generation.py` is self-contained (torch only) so the Hugging Face exporter can ship it with an
exported model; `GPTModel.generate` and `GPTModel.inference_forward` are the model side.
"""

from megatron.core.inference.generation import GenerationOptions, KVCache, generate, resolve_options

__all__ = ["GenerationOptions", "KVCache", "generate", "resolve_options"]
