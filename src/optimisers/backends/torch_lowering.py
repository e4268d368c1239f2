"""A traced elementwise step (`optimisers.backends.traced.Program`) compiled by `torch.compile`
(inductor): one fused kernel over each piece of memory on devices numba cannot reach (CUDA).

The program becomes a plain function of tensors, one torch operation per node in the node's
dtype, and its outputs are copied into the arrays the caller gives (inductor fuses the whole
function into one pass). The constant slots arrive as one float64 tensor on the device, so new
hyperparameters or step counts are new data for the same compiled code, never a recompile;
lengths are dynamic, so every piece of a group shares it too. inductor caches what it compiles
on disk itself (`TORCHINDUCTOR_CACHE_DIR`).
"""

from __future__ import annotations

import torch

from optimisers.backends.traced import compared_in

_KERNELS: dict = {}  # program -> its compiled function
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "lt": "<", "le": "<=", "gt": ">",
            "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|"}
_CALLS = {"sqrt": "torch.sqrt", "abs": "torch.abs", "sign": "torch.sign", "maximum": "torch.maximum",
          "minimum": "torch.minimum"}


def kernel(program, device, aliases=()):
    """`run(tensors, consts)` (the inputs, then the outputs, all 1-D of one length) or None
    where the program or this device cannot be compiled."""
    key = (program, device, aliases)
    if key not in _KERNELS:
        source = source_of(program, aliases)
        _KERNELS[key] = None if source is None else _compiled(source, program, device, aliases)
    found = _KERNELS[key]
    if found is None:
        return None
    # (detached: views of a parameter that requires grad would each need another compile)
    return lambda tensors, consts: found(*[t.detach() for t in tensors],
                                         torch.as_tensor(consts, device=tensors[0].device))


def _name(dtype) -> str:
    return str(dtype).rpartition(".")[2]


def source_of(program, aliases=()) -> str | None:
    """The function's source (outputs `aliases` writes into inputs are not arguments), or None."""
    aliases = aliases or (-1,) * len(program.outputs)
    dtypes = [_name(d) for _, _, d in program.nodes]
    args = [f"a{k}" for k in range(len(program.inputs))] + [f"o{m}" for m, k in enumerate(aliases) if k < 0]
    lines = [f"def kernel({', '.join(args)}, c):"]
    for n, (op, operands, _) in enumerate(program.nodes):
        line = _line(op, operands, dtypes[n], dtypes)
        if line is None:
            return None
        lines.append(f"    v{n} = {line}")
    for m, (n, _) in enumerate(program.outputs):
        target = f"o{m}" if aliases[m] < 0 else f"a{aliases[m]}"
        lines.append(f"    {target}.copy_(v{n})")  # (copy_ casts to the output's dtype)
    return "\n".join(lines) + "\n"


def _operand(arg, to, dtypes) -> str:
    if arg < 0:
        return f"c[{~arg}].to(torch.{to})"
    return f"v{arg}" if dtypes[arg] == to else f"v{arg}.to(torch.{to})"


def _line(op, args, t, dtypes):
    if op == "in":
        return f"a{args[0]}"
    if op in _SYMBOLS:
        common = compared_in(args, t, dtypes)
        a, b = (_operand(a, common, dtypes) for a in args)
        return f"({a} {_SYMBOLS[op]} {b})"
    if op in _CALLS:
        return f"{_CALLS[op]}({', '.join(_operand(a, t, dtypes) for a in args)})"
    if op == "neg":
        return f"-{_operand(args[0], t, dtypes)}"
    if op == "cast":
        return _operand(args[0], t, dtypes)
    if op == "full":
        return f"torch.zeros_like({_operand(args[0], t, dtypes)}) + {_operand(args[1], t, dtypes)}"
    if op == "where":
        c = _operand(args[0], "bool", dtypes)
        a, b = (_operand(a, t, dtypes) for a in args[1:])
        return f"torch.where({c}, {a}, {b})"
    if op == "pow":
        return f"({_operand(args[0], t, dtypes)} ** {_operand(args[1], t, dtypes)})"
    if op.startswith("pow "):
        return f"({_operand(args[0], t, dtypes)} ** {float(op.split()[1])!r})"
    return None


def _compiled(source: str, program, device, aliases):
    """The compiled function, tried once on a few elements so that a device or installation
    inductor cannot compile for (no triton, no C++ compiler) is found before any step: None."""
    namespace = {"torch": torch}
    exec(compile(source, "<optimisers kernel>", "exec"), namespace)  # noqa: S102 - our own source
    fn = torch.compile(namespace["kernel"], dynamic=True, fullgraph=True)
    own = [d for (_, d), k in zip(program.outputs, aliases or [-1] * len(program.outputs)) if k < 0]
    dtypes = [*program.inputs, *own]
    try:
        trial = [torch.ones(3, dtype=d, device=device) for d in dtypes]
        consts = max((~a for _, args, _ in program.nodes for a in args if a < 0), default=-1) + 1
        fn(*trial, torch.ones(consts, dtype=torch.float64, device=device))
    except Exception:  # (inductor's errors have no common type)
        return None
    return fn
