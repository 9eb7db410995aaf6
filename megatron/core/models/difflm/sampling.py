"""GPTModel's sampling and scoring entry points: the trained attention pattern, the log-likelihood
(megatron.core.inference.likelihood) and generation (megatron.core.inference.generation), each over
the model's `inference_forward`; kept beside the model so gpt_model.py holds the forward paths."""

from __future__ import annotations

import contextlib

import torch

from megatron.core.inference import generation, likelihood
from megatron.core.inference.cuda_graphs import runner_for
from megatron.core.inference.generation_options import autoregressive_decoding

__all__ = ["SamplingMethods"]


class SamplingMethods:
    """Mixed into GPTModel: reads its dlm_config, config, running_mode, inference_forward and _graph_runner."""

    def trained_pattern(self) -> dict:
        """The attention pattern it was trained under (mask type, block size, window): what scoring and
        sampling use unless told otherwise."""
        pattern = dict(attention_mask_type=self.dlm_config.effective_mask_type,
                       attention_block_size=self.dlm_config.block_size, sliding_window=self.config.sliding_window)
        if self.dlm_config.causal_clean_half:  # a joint AR + DLM model's clean blocks are token-causal
            pattern["causal_clean"] = True
        return pattern

    @contextlib.contextmanager
    def sequence_parallel_off(self):
        """Run the model without sequence parallelism inside (no-op without it): the tensor-parallel layers
        all-reduce whole sequences instead of reduce-scattering slices, the weights being the same, so a model
        trained under --sequence-parallel samples and scores with `inference_forward` (which needs whole
        sequences). MoE layers under tensor parallelism split their tokens by sequence: refused."""
        switched = [module for module in self.modules() if getattr(module, "sequence_parallel", False) is True]
        if switched and self.config.moe is not None:
            raise ValueError("an MoE model under tensor and sequence parallelism routes sequence slices: it cannot "
                             "sample or score with inference_forward; use --sequence-parallel off or evaluate a "
                             "saved checkpoint")
        for module in switched:
            module.sequence_parallel = False
        try:
            yield
        finally:
            for module in switched:
                module.sequence_parallel = True

    def log_likelihood(self, prompt: torch.Tensor, answer: torch.Tensor, **options) -> float:
        """log p(answer | prompt) for 1-D id tensors: LLaDA's Monte Carlo ELBO in the diffusion
        modes, exact for AR; options (mc_num, batch_size, cfg_scale, generator) and the method
        in megatron.core.inference.likelihood. The attention pattern is the one trained."""
        with self.sequence_parallel_off():
            return likelihood.log_likelihood(self.inference_forward, prompt, answer, running_mode=self.running_mode,
                                             mask_token_id=self.dlm_config.mask_token_id,
                                             **(self.trained_pattern() | options))

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 cuda_graphs: bool = False, autoregressive: bool = False, **options) -> torch.Tensor:
        """Generate in this model's running mode; see megatron.core.inference.generation.generate
        for the options (LLaDA and MegaDLMs names). The attention pattern is the one trained.
        `autoregressive`: decode token by token with causal attention (a vanilla model's way), which a
        joint AR + DLM model (DLMConfig.ar_loss_weight) was trained for as well.

        `cuda_graphs`: replay a captured CUDA graph per forward shape (megatron.core.inference.
        cuda_graphs). The graphs stay with the model, so later calls of the same sizes reuse them
        (captured again once the weight tensors are replaced: `cuda_graphs.runner_for`)."""
        model_fn = self.inference_forward
        if cuda_graphs:
            model_fn = self._graph_runner = runner_for(self, self.inference_forward, self._graph_runner)
        running_mode, pattern = self.running_mode, self.trained_pattern()
        if autoregressive:
            running_mode, pattern = autoregressive_decoding(running_mode, pattern)
        with self.sequence_parallel_off():
            return generation.generate(model_fn, input_ids, attention_mask, running_mode=running_mode,
                                       mask_token_id=self.dlm_config.mask_token_id, **(pattern | options))
