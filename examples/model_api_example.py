"""The model API without the trainer: build a tiny diffusion LM and watch it fit a fixed batch.

    python examples/model_api_example.py [--mode difflm-noshift|difflm-shift|vanilla] [--steps 200]

Runs on CPU in seconds. It shows the three pieces a training step is made of: the
corruption key (which samples of the stream these rows are), the corruption and loss
weights (megatron/core/models/difflm/diffusion.py) and the model's weighted loss.
"""

import argparse

import torch

from megatron.core.models.difflm import diffusion
from megatron.core.models.difflm.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import DLMConfig, TransformerConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="difflm-noshift", choices=["difflm-noshift", "difflm-shift", "vanilla"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    vocab, mask_token = 128, 127
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128, vocab_size=vocab, max_position_embeddings=args.seq_length,
                               qk_layernorm=True)
    dlm = DLMConfig(model_running_mode=args.mode, mask_token_id=mask_token, t_sampling="antithetic")
    torch.manual_seed(0)
    model = GPTModel(config, dlm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A learnable toy language: each row counts from a random start with a random stride.
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, mask_token, (args.batch_size, 1), generator=generator)
    stride = torch.randint(1, 8, (args.batch_size, 1), generator=generator)
    batch = (start + stride * torch.arange(args.seq_length)) % mask_token

    for iteration in range(args.steps):
        # The same rows every step, but each step draws new masks: a new key per iteration.
        key = diffusion.CorruptionKey.for_batch(dlm.seed, iteration=iteration, global_batch_size=args.batch_size,
                                                first_sample_index=iteration * args.batch_size,
                                                batch_size=args.batch_size)
        out = model.compute_loss(batch, key)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if iteration % 20 == 0 or iteration == args.steps - 1:
            print(f"iteration {iteration:5d} | {args.mode} loss: {out.loss.item():.6E}")


if __name__ == "__main__":
    main()
