"""``torch_neuronx.testing.assert_close``: the tensor comparison NxD's unit tests make.

AWS's torch-neuronx release notes (2.6, "Neuron allclose") define it as ``torch.testing.assert_close`` with one
change: ``rtol`` multiplies the largest magnitude of ``expected`` rather than each element's, so an element passes
when ``|actual - expected| <= atol + rtol * max|expected|`` -- looser near zero, where hardware accumulation order
moves small outputs most. Everything else is ``torch.testing``'s: shapes and (by default) dtypes must match,
``rtol`` and ``atol`` are given together or not at all (then ``torch.testing``'s defaults for the dtype), infinities
must match exactly, NaNs only with ``equal_nan``.
"""

from __future__ import annotations

import torch

__all__ = ["assert_close"]

# torch.testing.assert_close's default (rtol, atol) per dtype; integer and bool tensors compare exactly.
_DEFAULT_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float | None = None,
                 atol: float | None = None, equal_nan: bool = False, check_dtype: bool = True,
                 msg: str | None = None) -> None:
    """Raise ``AssertionError`` unless ``|actual - expected| <= atol + rtol * max|expected|`` everywhere (see the
    module docstring). ``actual`` and ``expected``: tensors of one shape (and dtype, unless ``check_dtype=False``);
    ``msg`` replaces the message's first line."""
    for name, value in (("actual", actual), ("expected", expected)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"assert_close: {name} must be a torch.Tensor, got {type(value).__name__}")
    if (rtol is None) != (atol is None):
        raise ValueError(f"assert_close: give both rtol and atol or neither, got rtol={rtol!r} atol={atol!r}")
    if actual.shape != expected.shape:
        raise AssertionError(f"assert_close: shapes differ: actual {tuple(actual.shape)}, expected "
                             f"{tuple(expected.shape)}")
    if check_dtype and actual.dtype != expected.dtype:
        raise AssertionError(f"assert_close: dtypes differ: actual {actual.dtype}, expected {expected.dtype}")
    if rtol is None:
        defaults = [_DEFAULT_TOLERANCES.get(t.dtype, (0.0, 0.0)) for t in (actual, expected)]
        rtol, atol = max(r for r, _ in defaults), max(a for _, a in defaults)
    a = actual.detach().cpu().to(torch.float64)
    e = expected.detach().cpu().to(torch.float64)
    finite = torch.isfinite(e)
    scale = e[finite].abs().max().item() if finite.any() else 0.0
    limit = atol + rtol * scale
    diff = (a - e).abs()
    close = diff <= limit
    same_infinity = torch.isinf(a) & torch.isinf(e) & (a == e)
    close |= same_infinity
    if equal_nan:
        close |= torch.isnan(a) & torch.isnan(e)
    if bool(close.all()):
        return
    bad = ~close
    worst = torch.where(bad, diff.nan_to_num(nan=float("inf")), torch.zeros_like(diff)).argmax()
    index = tuple(int(i) for i in torch.unravel_index(worst, a.shape))
    raise AssertionError(
        f"{msg or 'Tensor-likes are not close (Neuron allclose)!'}\n"
        f"Mismatched elements: {int(bad.sum())} / {a.numel()}\n"
        f"Greatest mismatch at index {index}: actual {a[index].item()!r}, expected {e[index].item()!r} "
        f"(|difference| {diff[index].item():.3g} > atol {atol:g} + rtol {rtol:g} * max|expected| {scale:.3g})")
