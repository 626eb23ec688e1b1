"""A while loop whose trip count is decided on the device, as one graph under every tracer we support.

``while_loop(cond_fn, body_fn, carried, invariants)`` runs ``carried = body_fn(*carried, *invariants)`` while
``cond_fn(*carried, *invariants)`` (a 0-d bool tensor) is true, and returns the final ``carried``:

- eager: a Python loop (reading the condition is a host sync -- what eager execution of any loop means);
- ``torch.compile`` / ``torch.export``: torch's ``while_loop`` higher-order op, one node in the captured graph;
- ``torch_xla`` (lazy tensors): an XLA ``While`` whose condition and body are computations of their own, so the
  trip count never leaves the device.

Why not torch_xla's own lowering of the higher-order op (``torch_xla.experimental.fori_loop``, 2.9): it traces
the condition and body on the *real* carried tensors and numbers HLO parameters by first use, which only works
when every carried input is already materialised device data. Inside a lazily traced forward the inputs are
pending computations, and the lowered condition pulls in the layer's own inputs as extra parameters (XLA then
rejects the loop: "the parameter of condition and body ... must all have the same shape"). Here, as in
``torch_xla.experimental.scan``, condition and body are traced on placeholder tensors, and each placeholder is
mapped to its HLO parameter by identity (``LoweringContext.tensor_parameter_id``), so the loop composes with
whatever computed its inputs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

CondFn = Callable[..., torch.Tensor]
BodyFn = Callable[..., Sequence[torch.Tensor]]


def _traced(t: torch.Tensor) -> bool:
    return t.device.type == "xla" or torch.compiler.is_compiling() or torch.compiler.is_exporting()


def while_loop(cond_fn: CondFn, body_fn: BodyFn, carried: Sequence[torch.Tensor],
               invariants: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, ...]:
    """Run the loop on the device ``carried`` lives on; see the module docstring.

    ``body_fn`` must return tensors with the shapes and dtypes of ``carried``; ``invariants`` are read-only
    inputs of both functions (weights, the condition vector). Neither function may mutate its arguments.
    """
    carried = tuple(carried)
    invariants = tuple(invariants)
    if carried[0].device.type == "xla":
        return _xla_while_loop(cond_fn, body_fn, carried, invariants)
    if _traced(carried[0]):
        from torch._higher_order_ops.while_loop import while_loop as torch_while_loop

        # Invariants are closed over: dynamo lifts them into the op's additional inputs.
        return tuple(torch_while_loop(lambda *c: cond_fn(*c, *invariants),
                                      lambda *c: tuple(body_fn(*c, *invariants)), carried))
    while bool(cond_fn(*carried, *invariants)):
        carried = tuple(body_fn(*carried, *invariants))
    return carried


def while_loop_into(out: torch.Tensor, cond_fn: CondFn, body_fn: BodyFn, carried: Sequence[torch.Tensor],
                    invariants: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, ...]:
    """:func:`while_loop` that also fills rows of an output buffer: ``body_fn(*carried, *invariants)`` returns
    ``(*new_carried, index, rows)`` and the loop writes ``out[index] = rows`` (dim 0). Returns
    ``(*carried, out)``; ``out`` itself is not modified.

    Eager execution writes into one copy of ``out`` in place; carried through a traced loop, the buffer would be
    copied on every iteration in eager (the loop contract forbids mutating carried tensors).
    """
    carried = tuple(carried)
    if _traced(out):
        count = len(carried)

        def cond(*args):
            return cond_fn(*args[:count], *args[count + 1:])

        def body(*args):
            *new_carried, index, rows = body_fn(*args[:count], *args[count + 1:])
            return (*new_carried, args[count].index_copy(0, index, rows))

        return while_loop(cond, body, (*carried, out), invariants)
    out = out.clone()
    while bool(cond_fn(*carried, *invariants)):
        *carried, index, rows = body_fn(*carried, *invariants)
        out.index_copy_(0, index, rows)
    return (*carried, out)


# XLA's names of the float8 types, which torch_xla 2.9's builder has no entry for (its dtype map stops at 8-bit
# integers): quantized FP8 weights enter the loop as float8 parameters under these names.
_XLA_FLOAT8_TYPES = {torch.float8_e4m3fn: "f8e4m3fn", torch.float8_e5m2: "f8e5m2"}


def _placeholder(xb, t: torch.Tensor) -> torch.Tensor:
    """A data-less XLA tensor with ``t``'s shape and dtype, to trace a loop computation on."""
    if t.dtype in _XLA_FLOAT8_TYPES:
        import torch_xla

        return torch_xla._XLAC._xla_create_placeholder_tensor(xb.mkshape(_XLA_FLOAT8_TYPES[t.dtype], t.shape).shape)
    return xb.create_placeholder_tensor(t.shape, t.dtype)


def _xla_while_loop(cond_fn: CondFn, body_fn: BodyFn, carried: tuple[torch.Tensor, ...],
                    invariants: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    import torch_xla
    import torch_xla.core.xla_builder as xb

    operands = carried + invariants
    placeholders = [_placeholder(xb, t) for t in operands]
    body_out = tuple(body_fn(*placeholders))
    if len(body_out) != len(carried) or any(
            (o.shape, o.dtype) != (c.shape, c.dtype) for o, c in zip(body_out, carried)):
        raise ValueError("while_loop: body_fn must return tensors with the shapes and dtypes of carried: "
                         f"{[(tuple(c.shape), c.dtype) for c in carried]}, got "
                         f"{[(tuple(o.shape), o.dtype) for o in body_out]}")
    cond_out = cond_fn(*placeholders)
    if cond_out.shape != () or cond_out.dtype != torch.bool:
        raise ValueError(f"while_loop: cond_fn must return a 0-d bool tensor, got {cond_out.dtype} "
                         f"{tuple(cond_out.shape)}")

    loop_inputs = list(operands)

    def lower(name: str, outputs: Sequence[torch.Tensor]):
        """The computation of ``outputs`` and, per HLO parameter, the index of the loop input that feeds it.
        Device data the function created itself (constants) become extra loop inputs."""
        ctx = torch_xla._XLAC.lowering.LoweringContext(name)
        ctx.build(list(outputs))
        feeds = {}
        for i, placeholder in enumerate(placeholders):
            param = ctx.tensor_parameter_id(placeholder)
            if param != -1:
                feeds[param] = i
        for param, tensor in ctx.device_parameter_id_tensor_mapping().items():
            if param not in feeds:
                feeds[param] = len(loop_inputs)
                loop_inputs.append(tensor.to(carried[0].device))
        computation = xb.computation_from_module_proto(name, ctx.hlo())
        return computation, [feeds[p] for p in range(len(feeds))]

    body_computation, body_feeds = lower("nxd_moe_while_body", body_out)
    cond_computation, cond_feeds = lower("nxd_moe_while_cond", [cond_out])

    # LoweringContext.build returns a tuple of the outputs, one element for the condition.
    def xla_cond(*params):
        return xb.Op.call(cond_computation, [params[i] for i in cond_feeds]).get_tuple_element(0)

    def xla_body(*params):
        result = xb.Op.call(body_computation, [params[i] for i in body_feeds])
        return [result.get_tuple_element(i) for i in range(len(carried))] + list(params[len(carried):])

    builder = xb.create_builder("nxd_moe_while")
    params = [xb.mkparam(builder, i, xb.tensor_shape(t)) for i, t in enumerate(loop_inputs)]
    computation = xb.Op.mkwhile(params, xla_cond, xla_body).build("nxd_moe_while")
    results = torch_xla._XLAC._xla_user_computation("xla::nxd_moe_while", loop_inputs, computation)
    return tuple(results[:len(carried)])
