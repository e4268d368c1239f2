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


def numpy_model(init: dict, tied: bool) -> dict:
    """A fresh model from `init`: the output weight *is* the embedding (tied) or a copy of it."""
    E = init["embed"].copy()
    return {
        "embed": E,
        "hidden": {k: v.copy() for k, v in init["hidden"].items()},
        "proj": {k: v.copy() for k, v in init["proj"].items()},
        "unembed": {"weight": E if tied else E.copy(), "bias": init["unembed"]["bias"].copy()},
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


def state_bytes(state) -> int:
    """Bytes of every array in the optimiser state, each shared Leaf counted once."""

    def size(value) -> int:
        if isinstance(value, (tuple, list)):
            return sum(size(v) for v in value)
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        nbytes = getattr(value, "nbytes", None)
        if nbytes is not None and getattr(value, "ndim", 0) > 0:
            return int(nbytes)
        if hasattr(value, "element_size") and value.dim() > 0:  # torch.Tensor
            return value.element_size() * value.nelement()
        return 0

    return sum(size(leaf.state) for leaf in state.leaves())


class NumpyTrainer:
    """Hand-written gradients. Each place of `E` gets its own contribution (the lookup's gradient
    at `embed`, the output layer's at `unembed.weight`); `optimisers` adds them up."""

    def __init__(self, init: dict, tied: bool, rule):
        self.model = numpy_model(init, tied)
        self.state = opt.setup(rule, self.model)

    def step(self, ctx: np.ndarray, targets: np.ndarray) -> float:
        m = self.model
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


class TorchTrainer:
    """An `nn.Module` whose LM head's weight is the embedding's Parameter (`unembed.weight =
    embed.weight`); autograd fills `.grad`, `opt.grads(module)` reads it, `update_` writes in place."""

    def __init__(self, init: dict, tied: bool, rule):
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
        self.state = opt.setup(rule, self.module)

    def step(self, ctx: np.ndarray, targets: np.ndarray) -> float:
        torch = self.torch
        self.module.zero_grad(set_to_none=True)
        logits = self.module(torch.from_numpy(ctx))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(targets))
        loss.backward()
        self.state, self.module = opt.update_(self.state, self.module, opt.grads(self.module))
        return loss.item()

    def embeddings(self):
        m = self.module
        return m.embed.weight.detach().numpy(), m.unembed.weight.detach().numpy()

    def params(self) -> dict:
        m = self.module

        def np_(t):
            return t.detach().cpu().numpy()

        return {
            "embed": np_(m.embed.weight),
            "hidden": {"weight": np_(m.hidden.weight), "bias": np_(m.hidden.bias)},
            "proj": {"weight": np_(m.proj.weight), "bias": np_(m.proj.bias)},
            "unembed": {"weight": np_(m.unembed.weight), "bias": np_(m.unembed.bias)},
        }

    def state_bytes(self) -> int:
        return state_bytes(self.state)


class JaxTrainer:
    """A dict of JAX arrays with `E` at two places; `jax.grad` gives each place its own
    contribution, and the whole step (loss, gradient, `opt.update`) runs under one `jax.jit`."""

    def __init__(self, init: dict, tied: bool, rule):
        import jax
        import jax.numpy as jnp

        E = jnp.asarray(init["embed"])
        self.model = {
            "embed": E,
            "hidden": {k: jnp.asarray(v) for k, v in init["hidden"].items()},
            "proj": {k: jnp.asarray(v) for k, v in init["proj"].items()},
            "unembed": {
                "weight": E if tied else jnp.array(init["embed"]),
                "bias": jnp.asarray(init["unembed"]["bias"]),
            },
        }
        self.state = opt.setup(rule, self.model)

        def loss_fn(m, ctx, targets):
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


TRAINERS = {"numpy": NumpyTrainer, "torch": TorchTrainer, "jax": JaxTrainer}
