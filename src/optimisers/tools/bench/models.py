"""What the bench steps: the shapes (S1, S2, S2-tied, S3), the hyperparameters every implementation
shares, the float32 parameters and gradients they all start from, and the float64 reference they
are checked against."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Bytes of DRAM traffic per float32 parameter for one step, counted as STREAM does (each array read
#: or written once; write-allocate traffic not counted). The floor of a step is this times the number
#: of distinct parameters divided by the measured bandwidth.
BYTES_PER_PARAM = {"adam": 28, "adamw": 28, "momentum": 20}
BYTES_MODEL = {
    "adam": "read x, g, m, v; write x, m, v: 7 arrays x 4 bytes = 28",
    "adamw": "as Adam (the decay reads x, which Adam already reads): 28",
    "momentum": "read x, g, v; write x, v: 5 arrays x 4 bytes = 20",
}

# Hyperparameters shared by every implementation (torch's and optax's names in comments).
LR_ADAM = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01  # AdamW: optimisers `lambd`, torch `weight_decay`, optax `weight_decay`
LR_MOMENTUM = 1e-2
RHO = 0.9  # torch/optax `momentum`
HYPERPARAMETERS = {"adam_lr": LR_ADAM, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY,
                   "momentum_lr": LR_MOMENTUM, "rho": RHO}

CHECK_STEPS = 3  # steps run by every implementation before its result is compared
ATOL, RTOL = 1e-7, 1e-6  # float32 tolerance against the float64 reference (steps are ~1e-3)

ALL_BACKENDS = ("numpy", "torch", "jax")
ALL_SHAPES = ("S1", "S2", "S2-tied", "S3")
ALL_RULES = ("adam", "adamw", "momentum")


@dataclass
class Shape:
    name: str
    paths: list  # one path per distinct parameter, depth first
    shapes: list
    ties: dict = field(default_factory=dict)  # extra place -> index of the parameter it repeats
    layout: str = ""

    @property
    def n_params(self) -> int:
        return int(sum(int(np.prod(s)) for s in self.shapes))

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)

    @property
    def n_places(self) -> int:
        return len(self.shapes) + len(self.ties)


def _gpt_paths(d, layers, vocab, ctx):
    """GPT-2's parameter layout (Conv1D weights stored (in, out)): 12 tensors per block."""
    items = [(("wte",), (vocab, d)), (("wpe",), (ctx, d))]
    for i in range(layers):
        h = ("h", i)
        items += [
            (h + ("ln_1", "weight"), (d,)),
            (h + ("ln_1", "bias"), (d,)),
            (h + ("attn", "c_attn", "weight"), (d, 3 * d)),
            (h + ("attn", "c_attn", "bias"), (3 * d,)),
            (h + ("attn", "c_proj", "weight"), (d, d)),
            (h + ("attn", "c_proj", "bias"), (d,)),
            (h + ("ln_2", "weight"), (d,)),
            (h + ("ln_2", "bias"), (d,)),
            (h + ("mlp", "c_fc", "weight"), (d, 4 * d)),
            (h + ("mlp", "c_fc", "bias"), (4 * d,)),
            (h + ("mlp", "c_proj", "weight"), (4 * d, d)),
            (h + ("mlp", "c_proj", "bias"), (d,)),
        ]
    items += [(("ln_f", "weight"), (d,)), (("ln_f", "bias"), (d,))]
    return [p for p, _ in items], [s for _, s in items]


def make_shapes(quick: bool) -> dict[str, Shape]:
    # --quick shrinks every shape; XLA's compile time grows about quadratically with the leaf count,
    # so it also has fewer tensors (the full S3 costs optax ~45 s per compile)
    side = 2048 if quick else 4096
    d, layers = (128, 4) if quick else (320, 12)
    n_small = 100 if quick else 4000
    gpt = dict(d=d, layers=layers, vocab=4096, ctx=256)
    gpt_text = (
        f"GPT-2 layout, d_model={d}, {layers} blocks x 12 tensors (ln_1, attn.c_attn, attn.c_proj, "
        f"ln_2, mlp.c_fc, mlp.c_proj; weight+bias each), wte {gpt['vocab']}x{d}, wpe {gpt['ctx']}x{d}, "
        "ln_f"
    )
    paths, shapes = _gpt_paths(**gpt)
    return {
        "S1": Shape("S1", [("weight",)], [(side, side)], layout=f"one {side}x{side} matrix"),
        "S2": Shape("S2", paths, shapes, layout=gpt_text),
        "S2-tied": Shape(
            "S2-tied", paths, shapes, {("lm_head",): 0}, layout="S2 + lm_head, the same array as wte"
        ),
        "S3": Shape("S3", [(i,) for i in range(n_small)], [(256,)] * n_small,
                    layout=f"a list of {n_small} vectors of 256"),
    }


def nest(items):
    """A nested container from (path, value) pairs; a level whose keys are 0..n-1 becomes a list."""
    root: dict = {}
    for path, value in items:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return _listify(root)


def _listify(node):
    if isinstance(node, dict):
        node = {k: _listify(v) for k, v in node.items()}
        if node and all(isinstance(k, int) for k in node):
            return [node[i] for i in range(len(node))]
    return node


def get(tree, path):
    """The value at `path` (a tuple of keys and indices) in a nested container."""
    for k in path:
        tree = tree[k]
    return tree


@dataclass
class Data:
    """The float32 parameters and gradients every implementation starts from."""

    shape: Shape
    params: list
    grads: list  # the gradient at each distinct parameter's first place
    tie_grads: dict  # extra place -> its own gradient contribution
    grads_sum: list  # per distinct parameter, summed over its places (what autograd gives peers)

    def model(self, convert):
        """The model tree (tied places hold the one converted object)."""
        values = [convert(p) for p in self.params]
        items = list(zip(self.shape.paths, values))
        items += [(path, values[i]) for path, i in self.shape.ties.items()]
        return nest(items)

    def grad_tree(self, convert):
        items = [(p, convert(g)) for p, g in zip(self.shape.paths, self.grads)]
        items += [(path, convert(g)) for path, g in self.tie_grads.items()]
        return nest(items)

    def distinct_tree(self, values):
        return nest(list(zip(self.shape.paths, values)))


def make_data(shape: Shape, seed: int = 0) -> Data:
    rng = np.random.default_rng(seed)
    params = [(rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)) for s in shape.shapes]
    grads = [(rng.standard_normal(s, dtype=np.float32) * np.float32(0.01)) for s in shape.shapes]
    tie_grads = {
        path: rng.standard_normal(shape.shapes[i], dtype=np.float32) * np.float32(0.01)
        for path, i in shape.ties.items()
    }
    grads_sum = list(grads)
    for path, i in shape.ties.items():
        grads_sum[i] = grads_sum[i] + tie_grads[path]
    return Data(shape, params, grads, tie_grads, grads_sum)


def reference(rule: str, data: Data, steps: int = CHECK_STEPS) -> list:
    """Every parameter after `steps` steps with the same gradients, in float64."""
    out = []
    for p, g in zip(data.params, data.grads_sum):
        x, g = p.astype(np.float64), g.astype(np.float64)
        m = np.zeros_like(x)
        v = np.zeros_like(x)
        for t in range(1, steps + 1):
            if rule == "momentum":
                m = RHO * m + LR_MOMENTUM * g
                x = x - m
                continue
            m = BETAS[0] * m + (1 - BETAS[0]) * g
            v = BETAS[1] * v + (1 - BETAS[1]) * g * g
            a = (m / (1 - BETAS[0] ** t)) / (np.sqrt(v / (1 - BETAS[1] ** t)) + EPS)
            x = x - LR_ADAM * (a + (WEIGHT_DECAY * x if rule == "adamw" else 0.0))
        out.append(x)
    return out


def agrees(got: list, ref: list) -> tuple[bool, float]:
    """`(every element within ATOL + RTOL*|ref|, the largest absolute error)`."""
    ok, worst = True, 0.0
    for g, r in zip(got, ref):
        g = np.asarray(g, dtype=np.float64).reshape(r.shape)
        diff = np.abs(g - r)
        if diff.size:
            worst = max(worst, float(diff.max()))
            if not np.all(diff <= ATOL + RTOL * np.abs(r)):
                ok = False
    return ok, worst
