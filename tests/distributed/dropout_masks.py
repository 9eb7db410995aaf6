"""Which elements each dropout call zeroed, in call order, for tests comparing masks across ranks.

Every dropout here (embedding, attention probabilities under the math backend, the residual
branches) goes through `torch.nn.functional.dropout`, looked up at call time; `recorded_masks`
wraps it for the body of a `with` and puts it back after.
"""

import contextlib
from typing import Iterator, List

import torch


@contextlib.contextmanager
def recorded_masks() -> Iterator[List[torch.Tensor]]:
    """Yields a list that fills with one boolean tensor per dropout call that drops: True where
    the call zeroed a non-zero input."""
    original, masks = torch.nn.functional.dropout, []

    def recording(input, p=0.5, training=True, inplace=False):
        output = original(input, p, training, inplace)
        if training and p > 0:
            masks.append(((output == 0) & (input != 0)).detach().clone())
        return output

    torch.nn.functional.dropout = recording
    try:
        yield masks
    finally:
        torch.nn.functional.dropout = original


def shared_masks(first: List[torch.Tensor], second: List[torch.Tensor]) -> List[tuple]:
    """The (index in first, index in second) pairs of masks with one shape that are equal."""
    return [(i, j) for i, a in enumerate(first) for j, b in enumerate(second)
            if a.shape == b.shape and torch.equal(a, b)]
