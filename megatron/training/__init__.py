"""The training side: flags, the loop, logging. megatron/core never imports from here."""


def pretrain(*args, **kwargs):
    # Imported lazily so `megatron.training.tokenizer` stays light (no torch.distributed import).
    from megatron.training.training import pretrain as _pretrain

    return _pretrain(*args, **kwargs)


__all__ = ["pretrain"]
