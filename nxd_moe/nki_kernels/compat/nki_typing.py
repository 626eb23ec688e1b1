"""``nki.typing``: type names for annotating kernel parameters -- ``nt.tensor`` / ``nt.tensor[128, 512]`` (an
input tensor, optionally with its shape) and ``nt.mutable_tensor`` (a tensor the kernel writes, e.g. an output the
caller allocates, as nki-library's ``router_topk`` takes). Annotations do not change the simulation; ``isinstance``
against them is ``isinstance(x, NkiTensor)``."""

from __future__ import annotations

from nxd_moe.nki_kernels.tensor import NkiTensor


class _TensorAnnotation(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, NkiTensor)

    def __getitem__(cls, shape):
        """``nt.tensor[128, 512]``: the annotation with a shape (kept in ``.shape``)."""
        shape = tuple(shape) if isinstance(shape, tuple) else (shape,)
        return _TensorAnnotation(f"{cls.__name__}[{', '.join(map(str, shape))}]", (cls,), {"shape": shape})

    def __repr__(cls) -> str:
        return f"nt.{cls.__name__}"


class tensor(metaclass=_TensorAnnotation):  # noqa: N801 -- NKI's name
    """A kernel's tensor parameter."""

    shape: tuple | None = None


class mutable_tensor(tensor):  # noqa: N801 -- NKI's name
    """A tensor parameter the kernel writes."""


__all__ = ["tensor", "mutable_tensor", "NkiTensor"]
