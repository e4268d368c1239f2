"""Every backend module against the written contract in optimisers.backends.protocol, one class per
layer that asks something of it: each name is there, and each function takes the parameters the
protocol names."""

import importlib
import inspect

import pytest

from optimisers.backends import protocol

BACKENDS = {
    "numpy": (protocol.Backend, protocol.InPlaceEngine),
    "torch": (protocol.Backend, protocol.InPlaceEngine),
    "jax": (protocol.Backend, protocol.PytreeState),
    "scalar": (protocol.ScheduleMaths,),  # the maths of rules and of schedules on Python numbers
}
LAYERS = ("ArrayMaths", "ScheduleMaths", "TreeWalk", "HostTransfer", "Parameters")  # a Backend: all


def members(*classes):
    """The names protocol classes require, each with its signature (None for a data member)."""
    out = {}
    for klass in (k for cls in classes for k in reversed(cls.__mro__)):
        if klass in (object, protocol.Protocol) or not getattr(klass, "_is_protocol", False):
            continue
        for name in getattr(klass, "__annotations__", {}):
            out[name] = None
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                out[name] = inspect.signature(value)
    return out


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_has_every_member_of_its_protocol(name):
    module = importlib.import_module(f"optimisers.backends.{name}")
    for cls in BACKENDS[name]:
        missing = [m for m in members(cls) if not hasattr(module, m)]
        assert not missing, f"optimisers.backends.{name} lacks {missing} of {cls.__name__}"
        assert isinstance(module, cls)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_functions_take_the_protocols_parameters(name):
    module = importlib.import_module(f"optimisers.backends.{name}")
    for member, expected in members(*BACKENDS[name]).items():
        if expected is None:
            continue
        function = getattr(module, member)
        wanted = [p for p in expected.parameters if p != "self"]
        try:
            got = inspect.signature(function)
        except ValueError:  # a C function (a NumPy ufunc): its arity is what can be checked
            continue
        params = list(got.parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            continue  # a library function taking *args (torch.where): accepts what is passed
        required = [p for p in params if p.default is p.empty]
        assert len(required) <= len(wanted) <= len(params), (
            f"optimisers.backends.{name}.{member}{got} does not take {wanted}"
        )


def test_engine_backends_say_so():
    for name, classes in BACKENDS.items():
        module = importlib.import_module(f"optimisers.backends.{name}")
        if protocol.Backend in classes:
            assert module.IN_PLACE_ENGINE is (protocol.InPlaceEngine in classes), name


def test_a_backend_is_what_the_layers_ask_and_no_more():
    assert members(protocol.Backend) == members(*(getattr(protocol, name) for name in LAYERS))


def test_the_core_finds_each_backend_through_its_registry():
    import numpy as np
    import torch

    from optimisers.core import dispatch

    assert dispatch.backend(np.zeros(1)).__name__ == "optimisers.backends.numpy"
    assert dispatch.backend(torch.zeros(1)).__name__ == "optimisers.backends.torch"
    assert dispatch.backend(1.5).__name__ == "optimisers.backends.scalar"
    assert dispatch.backend(np.float64(1.5)).__name__ == "optimisers.backends.numpy"
    import jax

    assert dispatch.backend(jax.numpy.zeros(1)).__name__ == "optimisers.backends.jax"
