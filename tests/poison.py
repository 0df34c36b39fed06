"""Poisoned outputs for row kernels: NaN everywhere before the launch, so an element the
kernel never wrote shows as non-finite, and a comparison that says so."""

import numpy as np
import torch

from numba_kernels import interop


def poisoned(shape, dtype, offset: int = 0) -> torch.Tensor:
    """A NaN-filled tensor of `shape`, starting `offset` elements into its storage (to
    test unaligned outputs)."""
    return torch.full((int(np.prod(shape)) + offset,), float("nan"), dtype=dtype,
                      device=interop.kernel_device())[offset:].view(shape)


def check_written_and_close(got: torch.Tensor, expected: np.ndarray, tolerances: dict) -> None:
    """Every element written, and within the (rtol, atol) of `tolerances[got.dtype]`."""
    rtol, atol = tolerances[got.dtype]
    got = got.to("cpu", torch.float64).numpy()
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
