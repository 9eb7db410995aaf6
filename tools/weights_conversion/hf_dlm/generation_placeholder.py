"""Stand-in for MegaDLMs' sampler (megatron/core/inference/generation.py), which the checkpoint
converter copies here when the framework that exported this model ships it. This export was made
without it: the model loads and runs `forward`/`dlm_forward`, but `generate` is unavailable.
Re-export with a MegaDLMs version that has megatron/core/inference/generation.py to enable it.
"""


class KVCache:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(__doc__)


def generate(*args, **kwargs):
    raise NotImplementedError(__doc__)
