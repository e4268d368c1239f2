"""The array backends: one module per array library, each a set of functions named by the
`Backend` protocol (`optimisers.backends.protocol`). Registering them here is what lets the core
find them; each module is imported on its first use."""

from optimisers.core import dispatch

dispatch.register("numpy", "optimisers.backends.numpy", fallback=True)
dispatch.register("torch", "optimisers.backends.torch")
dispatch.register(("jax", "jaxlib"), "optimisers.backends.jax")
dispatch.register((), "optimisers.backends.scalar", scalars=True)
