"""Independent NumPy implementations of every rule, written from the rules' docstrings and the
papers without calling the library, to check the library's numbers against.

Each factory returns `step(x, g) -> u or None` (the amount subtracted from `x`; None = no move)
holding its state in a closure. They are written for clarity, not speed: float64/complex128 arrays,
explicit per-element loops where the rule is defined per element.
"""

from __future__ import annotations

import numpy as np


def _sq(g):
    """|g|² for real or complex g."""
    return (g * np.conj(g)).real


def descent(eta=0.1):
    return lambda x, g: eta * g


def momentum(eta=0.01, rho=0.9):
    v = 0.0

    def step(x, g):
        nonlocal v
        v = rho * v + eta * g
        return v

    return step


def nesterov(eta=0.001, rho=0.9):
    v = 0.0

    def step(x, g):
        nonlocal v
        u = -(rho**2) * v + (1 + rho) * eta * g
        v = rho * v - eta * g
        return u

    return step


def rmsprop(eta=0.001, rho=0.9, epsilon=1e-8, centred=False):
    s, c = 0.0, 0.0

    def step(x, g):
        nonlocal s, c
        s = rho * s + (1 - rho) * _sq(g)
        if centred:
            c = rho * c + (1 - rho) * g
        return eta * g / (np.sqrt(s - _sq(c)) + epsilon)

    return step


def rprop(eta=1e-3, ell=(0.5, 1.2), gamma=(1e-6, 50.0)):
    prev, size = None, None

    def step(x, g):
        nonlocal prev, size
        if prev is None:
            prev, size = np.zeros(g.shape), np.full(g.shape, eta)
        u = np.zeros(g.shape)
        for i in np.ndindex(g.shape):
            if prev[i] * g[i] > 0:
                size[i] = min(size[i] * ell[1], gamma[1])
                prev[i] = g[i]
            elif prev[i] * g[i] < 0:
                size[i] = max(size[i] * ell[0], gamma[0])
                prev[i] = 0.0
            else:
                prev[i] = g[i]
            u[i] = size[i] * np.sign(prev[i])
        return u

    return step


def adam(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8):
    m, v, t = 0.0, 0.0, 0
    b1, b2 = beta

    def step(x, g):
        nonlocal m, v, t
        t += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * _sq(g)
        return eta * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + epsilon)

    return step


def radam(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8):
    m, v, t = 0.0, 0.0, 0
    b1, b2 = beta
    rho_inf = 2 / (1 - b2) - 1

    def step(x, g):
        nonlocal m, v, t
        t += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * _sq(g)
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        if rho > 4:
            r = np.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            return eta * r * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + epsilon)
        return eta * m / (1 - b1**t)

    return step


def adamax(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8):
    m, w, t = 0.0, 0.0, 0
    b1, b2 = beta

    def step(x, g):
        nonlocal m, w, t
        t += 1
        m = b1 * m + (1 - b1) * g
        w = np.maximum(b2 * w, np.abs(g))
        return eta / (1 - b1**t) * m / (w + epsilon)

    return step


def oadam(eta=0.001, beta=(0.5, 0.9), epsilon=1e-8):
    adam_step = adam(eta, beta, epsilon)
    previous = 0.0

    def step(x, g):
        nonlocal previous
        current = adam_step(x, g)
        u = 2 * current - previous
        previous = current
        return u

    return step


def adagrad(eta=0.1, epsilon=1e-8):
    a = epsilon

    def step(x, g):
        nonlocal a
        a = a + _sq(g)
        return eta * g / (np.sqrt(a) + epsilon)

    return step


def adadelta(rho=0.9, epsilon=1e-8):
    a, d = 0.0, 0.0

    def step(x, g):
        nonlocal a, d
        a = rho * a + (1 - rho) * _sq(g)
        u = g * np.sqrt(d + epsilon) / np.sqrt(a + epsilon)
        d = rho * d + (1 - rho) * _sq(u)
        return u

    return step


def amsgrad(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8):
    """optax's AMSGrad: zero state, bias-corrected, maximum over the corrected v."""
    m, v, vmax, t = 0.0, 0.0, 0.0, 0
    b1, b2 = beta

    def step(x, g):
        nonlocal m, v, vmax, t
        t += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * _sq(g)
        vmax = np.maximum(vmax, v / (1 - b2**t))
        return eta * (m / (1 - b1**t)) / (np.sqrt(vmax) + epsilon)

    return step


def nadam(eta=0.001, beta=(0.9, 0.999), epsilon=1e-8):
    """Dozat (2016) as optax writes it: no β2 under the root, no momentum schedule."""
    m, v, t = 0.0, 0.0, 0
    b1, b2 = beta

    def step(x, g):
        nonlocal m, v, t
        t += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * _sq(g)
        mhat = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        return eta * mhat / (np.sqrt(v / (1 - b2**t)) + epsilon)

    return step


def adamw(eta=0.001, beta=(0.9, 0.999), lambd=0.0, epsilon=1e-8, couple=True):
    unit = adam(1.0, beta, epsilon)

    def step(x, g):
        a = unit(x, g)
        return eta * (a + lambd * x) if couple else eta * a + lambd * x

    return step


def adabelief(eta=0.001, beta=(0.9, 0.999), epsilon=1e-16):
    m, s, t = 0.0, 0.0, 0
    b1, b2 = beta

    def step(x, g):
        nonlocal m, s, t
        t += 1
        m = b1 * m + (1 - b1) * g
        s = b2 * s + (1 - b2) * _sq(g - m) + epsilon
        return eta * (m / (1 - b1**t)) / (np.sqrt(s / (1 - b2**t)) + epsilon)

    return step


def lion(eta=0.001, beta=(0.9, 0.999)):
    """Chen et al. (2023), Algorithm 2 without weight decay."""
    m = 0.0
    b1, b2 = beta

    def step(x, g):
        nonlocal m
        c = b1 * m + (1 - b1) * g
        m = b2 * m + (1 - b2) * g
        return eta * np.sign(c)

    return step


def ademamix(eta=0.001, beta=(0.9, 0.999, 0.9999), alpha=5.0, epsilon=1e-8, lambd=0.0):
    fast, slow, v, t = 0.0, 0.0, 0.0, 0
    b1, b2, b3 = beta

    def step(x, g):
        nonlocal fast, slow, v, t
        t += 1
        fast = b1 * fast + (1 - b1) * g
        slow = b3 * slow + (1 - b3) * g  # never bias-corrected
        v = b2 * v + (1 - b2) * _sq(g)
        mix = fast / (1 - b1**t) + alpha * slow
        return eta * (mix / (np.sqrt(v / (1 - b2**t)) + epsilon) + lambd * x)

    return step


def _norm(a):
    return np.sqrt(np.sum(_sq(a)))


def _trust_ratio(x, u, trust, epsilon):
    """Per array; 1 when either norm is zero."""
    nx, nu = _norm(x), _norm(u)
    return 1.0 if nx == 0 or nu == 0 else trust * nx / (nu + epsilon)


def lamb(eta=0.001, beta=(0.9, 0.999), epsilon=1e-6, lambd=0.0):
    unit = adam(1.0, beta, epsilon)

    def step(x, g):
        u = unit(x, g) + lambd * x
        return eta * _trust_ratio(x, u, 1.0, 0.0) * u

    return step


def lars(eta=0.001, beta=0.9, lambd=0.0, trust=0.001, epsilon=0.0, nesterov=False):
    v = 0.0

    def step(x, g):
        nonlocal v
        u = g + lambd * x
        w = eta * _trust_ratio(x, u, trust, epsilon) * u
        v = beta * v + w
        return w + beta * v if nesterov else v

    return step


def _orthogonalised(u, coefficients, steps, epsilon):
    """Keller Jordan's quintic Newton–Schulz, written on the singular values: each iteration
    X ↦ aX + b(XXᵀ)X + c(XXᵀ)²X maps X = U·diag(σ)·Vᵀ to U·diag(aσ + bσ³ + cσ⁵)·Vᵀ, started from
    u divided by its Frobenius norm (at least ε). An array of more than 2 axes is the matrix
    (shape[0], the rest)."""
    matrix = np.asarray(u, np.float64).reshape(u.shape[0], -1)
    U, sigma, Vt = np.linalg.svd(matrix, full_matrices=False)
    sigma = sigma / max(np.sqrt(np.sum(sigma**2)), epsilon)
    a, b, c = coefficients
    for _ in range(steps):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return ((U * sigma) @ Vt).reshape(u.shape)


def muon(
    eta=0.001,
    beta=0.95,
    lambd=0.1,
    nesterov=True,
    ns_steps=5,
    ns_coefficients=(3.4445, -4.7750, 2.0315),
    epsilon=1e-7,
    scale="original",
):
    m = 0.0

    def step(x, g):
        nonlocal m
        m = beta * m + (1 - beta) * g
        u = (1 - beta) * g + beta * m if nesterov else m
        rows, cols = x.shape[0], x.size // x.shape[0]
        if scale == "original":
            factor = np.sqrt(max(1.0, rows / cols))
        else:  # "match_rms_adamw"
            factor = 0.2 * np.sqrt(max(rows, cols))
        return eta * factor * _orthogonalised(u, ns_coefficients, ns_steps, epsilon) + eta * lambd * x

    return step


def weight_decay(lambd=5e-4):
    return lambda x, g: g + lambd * x


def sign_decay(lambd=1e-3):
    return lambda x, g: g + lambd * np.sign(x)


def clip_grad(delta=10.0):
    return lambda x, g: np.array([min(max(v, -delta), delta) for v in g.ravel()]).reshape(g.shape)


def clip_norm(omega=10.0, p=2.0):
    def step(x, g):
        n = np.linalg.norm(g.ravel(), ord=p)
        return min(omega / n, 1.0) * g if n > 0 else g

    return step


def chain(*steps):
    """Note the early exit: members after a `None` are not called, so their state stays."""

    def step(x, g):
        for member in steps:
            g = member(x, g)
            if g is None:
                return None
        return g

    return step


def lookahead(inner, k=6, alpha=0.5):
    """Zhang et al. 2019, Algorithm 1 as one step per call: `inner` (a reference step) moves the
    fast weights; after every k-th move the slow weights go a fraction alpha towards them and the
    fast weights restart from there. A call on which `inner` does not move does not count."""
    slow, moves = None, 0

    def step(x, g):
        nonlocal slow, moves
        if slow is None:
            slow = x.copy()
        u = inner(x, g)
        if u is None:
            return None
        moves += 1
        if moves < k:
            return u
        moves = 0
        slow = slow + alpha * ((x - u) - slow)
        return x - slow

    return step


def accum_grad(n):
    total, count = 0.0, 0

    def step(x, g):
        nonlocal total, count
        total, count = total + g, count + 1
        if count < n:
            return None
        mean = total / n
        total, count = 0.0, 0
        return mean

    return step
