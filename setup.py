"""MegaDLMs: Megatron-style pretraining of masked diffusion and autoregressive language models."""

import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "([^"]+)"', (Path(__file__).parent / "megatron" / "__init__.py").read_text())[1]

setup(
    name="megadlms",
    version=VERSION,
    description="Megatron-style pretraining of masked diffusion language models and AR LMs on PyTorch",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*", "custom_args", "custom_args.*"]),
    py_modules=["pretrain_difflm", "pretrain_gpt"],
    install_requires=[
        "torch>=2.11",
        "numpy",
        "sentencepiece",
        "tokenizers",
        "safetensors",
        "tensorboard",
        "tqdm",
    ],
    extras_require={
        # lm-eval's [hf] extra brings accelerate, which lm-eval's own `hf` model (a test reference) needs.
        # triton: the Triton kernels' tests (fused loss, SwiGLU) run them under Triton's interpreter on CPU.
        "dev": ["pytest", "pytest-timeout", "triton>=3.5; platform_system == 'Linux'", "transformers>=4.56", "gguf",
                "ruff", "lm-eval[hf]>=0.4.5,<0.5"],
        "hf": ["transformers", "gguf"],  # gguf: tools/weights_conversion/gguf_to_hf.py
        "wandb": ["wandb"],
    },
)
