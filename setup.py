"""MegaDLMs: Megatron-style pretraining of masked diffusion and autoregressive language models."""

from setuptools import find_packages, setup

setup(
    name="megadlms",
    version="0.1.0",
    description="Megatron-style pretraining of masked diffusion language models and AR LMs on PyTorch",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*", "custom_args", "custom_args.*"]),
    py_modules=["pretrain_difflm"],
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
        "dev": ["pytest", "pytest-timeout", "transformers>=4.56"],
        "hf": ["transformers"],
        # Optional kernels; the package imports and runs without them.
        "kernels": ["liger-kernel", "torchao"],
        "wandb": ["wandb"],
    },
)
