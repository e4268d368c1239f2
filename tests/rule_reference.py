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


def _schedule_free(eta, beta1, lambd, warmup, r, weight_lr_power, direction):
    """Defazio et al. 2024, Algorithm 1 with the `schedulefree` package's warm-up and weights,
    keeping the three sequences: z (base steps), x (their weighted average, the evaluation point)
    and y = (1−β₁)z + β₁x, the parameter. `direction(y, g, t)` is the base step's direction
    (decay included) at the t-th step. Returns y_old − y_new."""
    z = x = None
    t, lr_max, weight_sum = 0, 0.0, 0.0

    def step(y, g):
        nonlocal z, x, t, lr_max, weight_sum
        if z is None:
            z, x = y.copy(), y.copy()
        t += 1
        lr = eta * (min(t / warmup, 1.0) if warmup else 1.0)
        lr_max = max(lr_max, lr)
        weight = t**r * lr_max**weight_lr_power
        weight_sum += weight
        c = weight / weight_sum if weight_sum > 0 else 0.0
        z = z - lr * (direction(y, g, t) + lambd * y)
        x = (1 - c) * x + c * z
        return y - ((1 - beta1) * z + beta1 * x)

    return step


def schedule_free_sgd(eta=1.0, beta=0.9, lambd=0.0, warmup=0, r=0.0, weight_lr_power=2.0):
    return _schedule_free(eta, beta, lambd, warmup, r, weight_lr_power, lambda y, g, t: g)


def schedule_free_adamw(
    eta=2.5e-3, beta=(0.9, 0.999), epsilon=1e-8, lambd=0.0, warmup=0, r=0.0, weight_lr_power=2.0
):
    v, b2 = 0.0, beta[1]

    def rms_scaled(y, g, t):
        nonlocal v
        v = b2 * v + (1 - b2) * _sq(g)
        return g / (np.sqrt(v / (1 - b2**t)) + epsilon)

    return _schedule_free(eta, beta[0], lambd, warmup, r, weight_lr_power, rms_scaled)


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


def _along(matrix, a, axis):
    """`matrix @ a` along `axis` of `a` (that axis indexes matrix's columns)."""
    return np.moveaxis(np.tensordot(matrix, a, axes=([1], [axis])), 0, axis)


def _gram(g, axis):
    """The gradient times its transpose over every axis but `axis`: L = G Gᵀ, R = Gᵀ G."""
    flat = np.moveaxis(g, axis, 0).reshape(g.shape[axis], -1)
    return flat @ flat.T


def soap(
    eta=3e-3,
    beta=(0.95, 0.95),
    shampoo_beta=0.95,
    epsilon=1e-8,
    lambd=0.01,
    precondition_frequency=10,
    max_precond_dim=10000,
    precondition_1d=False,
):
    """SOAP as Algorithm 3 of Vyas et al. (2024) with the reference implementation's choices:
    the first call only builds the preconditioners and their eigenbases (no move); Adam runs on
    the rotated gradient with the rotated first moment (kept here in the original basis and
    rotated each step), `step_size = η·√(1−β₂ᵗ)/(1−β₁ᵗ)`, ε after the root of the uncorrected
    second moment, decay after the step; every `precondition_frequency` steps one power
    iteration with QR from the previous basis, its columns (and the second moment) sorted by
    the estimated eigenvalues first. `step.eta` may be changed between calls."""
    b1, b2 = beta
    s = {}

    def step(x, g):
        g = np.asarray(g, dtype=np.float64)
        if not s:
            rotated = g.ndim != 1 or precondition_1d
            axes = [i for i, n in enumerate(g.shape) if rotated and n <= max_precond_dim]
            s["L"] = {i: (1 - shampoo_beta) * _gram(g, i) for i in axes}
            s["Q"] = {i: np.linalg.eigh(L)[1][:, ::-1] for i, L in s["L"].items()}
            s.update(t=0, m=np.zeros_like(g), v=np.zeros_like(g))
            return None

        def rotate(a, back=False):
            for i, Q in s["Q"].items():
                a = _along(Q if back else Q.T, a, i)
            return a

        s["t"] = t = s["t"] + 1
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * rotate(g) ** 2
        direction = rotate(rotate(s["m"]) / (np.sqrt(s["v"]) + epsilon), back=True)
        lr = step.eta
        new_x = (x - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * direction) * (1 - lr * lambd)
        for i in s["L"]:
            s["L"][i] = shampoo_beta * s["L"][i] + (1 - shampoo_beta) * _gram(g, i)
        if t % precondition_frequency == 0:
            for i, L in s["L"].items():
                Q = s["Q"][i]
                order = np.argsort(-np.diag(Q.T @ L @ Q), kind="stable")
                s["v"] = np.take(s["v"], order, axis=i)
                s["Q"][i] = np.linalg.qr(L @ Q[:, order])[0]
        return x - new_x

    step.eta = eta
    return step


def _rms(a):
    return np.sqrt(np.sum(_sq(a)) / max(a.size, 1))


def adafactor(eta=1e-2, beta2_decay=-0.8, epsilon=(None, 1e-3), d=1.0, lambd=0.0):
    """Shazeer & Stern's Algorithms 4 and 5 with torch's choices: ρ = min(η, 1/√t) as the
    relative step, ε₁ as a floor (under the row sum and under the second moment), decoupled
    decay η·λ·x. Matrices of a ≥2-D array are its slices over the last two axes, each factored
    with explicit row and column sums."""
    eps2 = epsilon[1]
    t, moments = 0, None

    def factored(r, c, g2, w, eps1):
        m, n = g2.shape
        for i in range(m):
            r[i] = (1 - w) * r[i] + w * sum(g2[i, j] for j in range(n)) / n
        for j in range(n):
            c[j] = (1 - w) * c[j] + w * sum(g2[i, j] for i in range(m)) / m
        total = max(sum(r) / m, eps1)
        return np.array([[r[i] * c[j] / total for j in range(n)] for i in range(m)])

    def step(x, g):
        nonlocal t, moments
        eps1 = np.finfo(x.dtype).eps if epsilon[0] is None else epsilon[0]
        t += 1
        w = t**beta2_decay  # 1 − β₂ₜ
        g2 = _sq(g)
        if x.ndim >= 2:
            mats = g2.reshape(-1, *g2.shape[-2:])
            if moments is None:
                moments = [(np.zeros(a.shape[0]), np.zeros(a.shape[1])) for a in mats]
            v = np.stack([factored(r, c, a, w, eps1) for (r, c), a in zip(moments, mats)]).reshape(g.shape)
        else:
            moments = (1 - w) * (0.0 if moments is None else moments) + w * g2
            v = moments
        u = g / np.sqrt(np.maximum(v, eps1**2))
        u = u / max(1.0, _rms(u) / d)
        alpha = max(eps2, _rms(x)) * min(eta, 1 / np.sqrt(t))
        return alpha * u + eta * lambd * x

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
