"""The demo's language model, once per backend.

A character-level model in the style of Bengio et al. (2003): the previous `context` characters are
looked up in an embedding matrix `E` (vocab × width), concatenated, passed through one tanh layer,
projected back to the embedding width, and turned into logits by the *same* matrix transposed:
`logits = z @ E.T + bias`. `E` is one array at two places of the model, `embed` and
`unembed.weight`: a tied input embedding and output layer.

Every trainer takes the same initial values (NumPy arrays, PyTorch layout: `y = x @ W.T + b`) and
either keeps `E` tied or gives the output layer its own copy ("naive", the way optax sees a tree).
"""

from __future__ import annotations

import numpy as np

import optimisers as opt


def init_params(vocab: int, width: int, context: int, hidden: int, seed: int) -> dict:
    """Initial values, float32, as a nested dict in PyTorch's layout; `E` appears once here."""
    rng = np.random.default_rng(seed)

    def uniform(fan_in, shape):
        bound = 1.0 / np.sqrt(fan_in)
        return rng.uniform(-bound, bound, shape).astype(np.float32)

    return {
        "embed": (0.3 * rng.standard_normal((vocab, width))).astype(np.float32),
        "hidden": {
            "weight": uniform(context * width, (hidden, context * width)),
            "bias": uniform(context * width, (hidden,)),
        },
        "proj": {"weight": uniform(hidden, (width, hidden)), "bias": uniform(hidden, (width,))},
        "unembed": {"bias": np.zeros(vocab, np.float32)},
    }


def numpy_model(init: dict, tied: bool, dtype=np.float32) -> dict:
    """A fresh model from `init` in `dtype`: the output weight *is* the embedding (tied) or a copy."""
    E = init["embed"].astype(dtype)  # astype copies
    return {
        "embed": E,
        "hidden": {k: v.astype(dtype) for k, v in init["hidden"].items()},
        "proj": {k: v.astype(dtype) for k, v in init["proj"].items()},
        "unembed": {"weight": E if tied else E.copy(), "bias": init["unembed"]["bias"].astype(dtype)},
    }


def float32_params(params: dict) -> dict:
    """`params` (a nested dict of NumPy arrays) in float32: NumPy multiplies bfloat16 slowly."""
    return {
        k: float32_params(v) if isinstance(v, dict) else v.astype(np.float32, copy=False)
        for k, v in params.items()
    }


def logits_numpy(m: dict, ctx: np.ndarray) -> np.ndarray:
    """Logits for a batch of contexts (int array, batch × context) with NumPy parameters."""
    x = m["embed"][ctx].reshape(len(ctx), -1)
    h = np.tanh(x @ m["hidden"]["weight"].T + m["hidden"]["bias"])
    z = h @ m["proj"]["weight"].T + m["proj"]["bias"]
    return z @ m["unembed"]["weight"].T + m["unembed"]["bias"]


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean())


def _bytes(value) -> int:
    """Bytes of the arrays in one Leaf's state (a low-bit state: its codes and scales); step
    counters and other scalars count nothing."""
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    if isinstance(value, opt.Quantised):
        return _bytes(value.codes) + _bytes(value.scale)
    nbytes = getattr(value, "nbytes", None)
    if nbytes is not None and getattr(value, "ndim", 0) > 0:
        return int(nbytes)
    if hasattr(value, "element_size") and value.dim() > 0:  # torch.Tensor
        return value.element_size() * value.nelement()
    return 0


def state_bytes(state) -> int:
    """Bytes of every array in the optimiser state, each shared Leaf counted once."""
    return sum(_bytes(leaf.state) for leaf in state.leaves())


def memory_per_array(state, model) -> list[tuple[int, int, int]]:
    """`(elements, parameter bytes, state bytes)` of each distinct parameter of `model`: one
    entry per Leaf of `state`, so a tied array counts once (also under JAX, where the tied
    places may hold equal copies)."""
    seen, out = set(), []
    for path, x in opt.trainables(model, path=True):
        leaf = state
        for key in path:
            leaf = leaf[key]
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append((int(np.prod(x.shape)), _bytes(x), _bytes(leaf.state)))
    return out


class NumpyTrainer:
    """Hand-written gradients. Each place of `E` gets its own contribution (the lookup's gradient
    at `embed`, the output layer's at `unembed.weight`); `optimisers` adds them up."""

    def __init__(self, init: dict, tied: bool, rule, bfloat16: bool = False):
        dtype = np.float32
        if bfloat16:
            import ml_dtypes  # NumPy's bfloat16 (JAX installs it)

            dtype = ml_dtypes.bfloat16
        self.model = numpy_model(init, tied, dtype)
        self.state = opt.setup(rule, self.model)

    def step(self, ctx: np.ndarray, targets: np.ndarray) -> float:
        # computed in float32 whatever the parameters' dtype; the rule stores bfloat16 steps itself
        m = float32_params(self.model)
        E_in, E_out = m["embed"], m["unembed"]["weight"]
        W1, b1 = m["hidden"]["weight"], m["hidden"]["bias"]
        W2, b2 = m["proj"]["weight"], m["proj"]["bias"]
        n = len(ctx)

        x = E_in[ctx].reshape(n, -1)
        h = np.tanh(x @ W1.T + b1)
        z = h @ W2.T + b2
        logits = z @ E_out.T + m["unembed"]["bias"]

        shifted = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(shifted)
        p /= p.sum(axis=1, keepdims=True)
        loss = float(-np.log(p[np.arange(n), targets] + 1e-30).mean())

        dlogits = p
        dlogits[np.arange(n), targets] -= 1.0
        dlogits /= n
        dz = dlogits @ E_out
        dpre = (dz @ W2) * (1.0 - h * h)
        dx = dpre @ W1
        # the lookup's gradient: each row of dx added to the row of E it was read from
        onehot = np.zeros((ctx.size, len(E_in)), dx.dtype)
        onehot[np.arange(ctx.size), ctx.ravel()] = 1.0
        dE_in = onehot.T @ dx.reshape(ctx.size, -1)

        grads = {
            "embed": dE_in,
            "hidden": {"weight": dpre.T @ x, "bias": dpre.sum(axis=0)},
            "proj": {"weight": dz.T @ h, "bias": dz.sum(axis=0)},
            "unembed": {"weight": dlogits.T @ z, "bias": dlogits.sum(axis=0)},
        }
        self.state, self.model = opt.update_(self.state, self.model, grads)
        return loss

    def params(self) -> dict:
        return self.model

    def embeddings(self):
        return self.model["embed"], self.model["unembed"]["weight"]

    def state_bytes(self) -> int:
        return state_bytes(self.state)

    def memory_per_array(self) -> list[tuple[int, int, int]]:
        return memory_per_array(self.state, self.model)


class TorchTrainer:
    """An `nn.Module` whose LM head's weight is the embedding's Parameter (`unembed.weight =
    embed.weight`); autograd fills `.grad`, `opt.grads(module)` reads it, `update_` writes in place."""

    def __init__(self, init: dict, tied: bool, rule, bfloat16: bool = False):
        import torch
        from torch import nn

        self.torch = torch
        vocab, width = init["embed"].shape
        hidden, inputs = init["hidden"]["weight"].shape

        class TinyLM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, width)
                self.hidden = nn.Linear(inputs, hidden)
                self.proj = nn.Linear(hidden, width)
                self.unembed = nn.Linear(width, vocab)
                if tied:
                    self.unembed.weight = self.embed.weight

            def forward(self, ctx):
                x = self.embed(ctx).flatten(1)
                z = self.proj(torch.tanh(self.hidden(x)))
                return self.unembed(z)

        torch.manual_seed(0)
        self.module = TinyLM()
        with torch.no_grad():
            self.module.embed.weight.copy_(torch.from_numpy(init["embed"]))
            if not tied:
                self.module.unembed.weight.copy_(torch.from_numpy(init["embed"]))
            for name in ("hidden", "proj"):
                layer = getattr(self.module, name)
                layer.weight.copy_(torch.from_numpy(init[name]["weight"]))
                layer.bias.copy_(torch.from_numpy(init[name]["bias"]))
            self.module.unembed.bias.copy_(torch.from_numpy(init["unembed"]["bias"]))
        if bfloat16:  # the forward and backward then run in bfloat16 too, as a torch user's would
            self.module.to(torch.bfloat16)
        self.state = opt.setup(rule, self.module)

    def step(self, ctx: np.ndarray, targets: np.ndarray) -> float:
        torch = self.torch
        self.module.zero_grad(set_to_none=True)
        logits = self.module(torch.from_numpy(ctx)).float()  # the loss in float32 (bf16-sr)
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(targets))
        loss.backward()
        self.state, self.module = opt.update_(self.state, self.module, opt.grads(self.module))
        return loss.item()

    def embeddings(self):
        m = self.module
        return m.embed.weight.detach().float().numpy(), m.unembed.weight.detach().float().numpy()

    def params(self) -> dict:
        m = self.module

        def np_(t):
            return t.detach().float().cpu().numpy()

        return {
            "embed": np_(m.embed.weight),
            "hidden": {"weight": np_(m.hidden.weight), "bias": np_(m.hidden.bias)},
            "proj": {"weight": np_(m.proj.weight), "bias": np_(m.proj.bias)},
            "unembed": {"weight": np_(m.unembed.weight), "bias": np_(m.unembed.bias)},
        }

    def state_bytes(self) -> int:
        return state_bytes(self.state)

    def memory_per_array(self) -> list[tuple[int, int, int]]:
        return memory_per_array(self.state, self.module)


class JaxTrainer:
    """A dict of JAX arrays with `E` at two places; `jax.grad` gives each place its own
    contribution, and the whole step (loss, gradient, `opt.update`) runs under one `jax.jit`."""

    def __init__(self, init: dict, tied: bool, rule, bfloat16: bool = False):
        import jax
        import jax.numpy as jnp

        dtype = jnp.bfloat16 if bfloat16 else jnp.float32
        E = jnp.asarray(init["embed"], dtype)
        self.model = {
            "embed": E,
            "hidden": {k: jnp.asarray(v, dtype) for k, v in init["hidden"].items()},
            "proj": {k: jnp.asarray(v, dtype) for k, v in init["proj"].items()},
            "unembed": {
                "weight": E if tied else jnp.array(init["embed"], dtype),
                "bias": jnp.asarray(init["unembed"]["bias"], dtype),
            },
        }
        self.state = opt.setup(rule, self.model)

        def loss_fn(m, ctx, targets):
            if bfloat16:  # computed in float32, as the NumPy trainer does
                m = jax.tree.map(lambda a: a.astype(jnp.float32), m)
            x = m["embed"][ctx].reshape(ctx.shape[0], -1)
            h = jnp.tanh(x @ m["hidden"]["weight"].T + m["hidden"]["bias"])
            z = h @ m["proj"]["weight"].T + m["proj"]["bias"]
            logits = z @ m["unembed"]["weight"].T + m["unembed"]["bias"]
            logp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(logp, targets[:, None], axis=1).mean()

        @jax.jit
        def train_step(state, model, ctx, targets):
            loss, grads = jax.value_and_grad(loss_fn)(model, ctx, targets)
            state, model = opt.update(state, model, grads)
            return state, model, loss

        self._step = train_step

    def step(self, ctx: np.ndarray, targets: np.ndarray) -> float:
        self.state, self.model, loss = self._step(self.state, self.model, ctx, targets)
        return float(loss)

    def embeddings(self):
        return np.asarray(self.model["embed"]), np.asarray(self.model["unembed"]["weight"])

    def params(self) -> dict:
        return {
            k: ({kk: np.asarray(vv) for kk, vv in v.items()} if isinstance(v, dict) else np.asarray(v))
            for k, v in self.model.items()
        }

    def state_bytes(self) -> int:
        return state_bytes(self.state)

    def memory_per_array(self) -> list[tuple[int, int, int]]:
        return memory_per_array(self.state, self.model)


TRAINERS = {"numpy": NumpyTrainer, "torch": TorchTrainer, "jax": JaxTrainer}
