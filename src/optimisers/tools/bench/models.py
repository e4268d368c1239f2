"""What the bench steps: the shapes (S1, S2, S2-tied, S3, S3-nested, S3-one), the float32
parameters and gradients every implementation starts from, the trees (and PyTorch modules) that
hold them, and how their results are compared with the float64 reference (the rules, their
hyperparameters and the reference itself are in `rules`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

CHECK_STEPS = 3  # steps run by every implementation before its result is compared
ATOL, RTOL = 1e-7, 1e-6  # float32 tolerance against the float64 reference (steps are ~1e-5..1e-3)

ALL_BACKENDS = ("numpy", "torch", "jax")
# S3-nested: S3's arrays nested as a model nests them (200 blocks of dicts and lists, 20 leaves a
# block; for PyTorch an nn.Module of ModuleLists and ModuleDicts); S3-one: S3's elements as one
# vector, the baseline of the per-array cost (S3 - S3-one) / arrays
ALL_SHAPES = ("S1", "S2", "S2-tied", "S3", "S3-nested", "S3-one")
# run when named (`--shapes S3-matrices`): many small matrices, for the matrix rules (Muon) and
# the chains with a norm per array (ClipNorm+AdamW)
EXTRA_SHAPES = ("S3-matrices",)


@dataclass
class Shape:
    name: str
    paths: list  # one path per distinct parameter, depth first
    shapes: list
    ties: dict = field(default_factory=dict)  # extra place -> index of the parameter it repeats
    layout: str = ""
    # PyTorch rows of `optimisers` step it as an nn.Module (`as_module`), its gradients given by
    # `optimisers.grads(module)`; otherwise as the nested dicts and lists of `nest`
    module: bool = False

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


#: One block of S3-nested: 20 vectors in dicts and lists, as a transformer block nests its
#: parameters (attention projections in a dict, an MLP and norms as lists of layers, loose leaves).
_BLOCK = (
    *((("attn", k, leaf)) for k in ("q", "k", "v", "o") for leaf in ("weight", "bias")),
    *((("mlp", i, leaf)) for i in range(2) for leaf in ("weight", "bias")),
    *((("norms", i, leaf)) for i in range(2) for leaf in ("weight", "bias")),
    ("extra", "scale"), ("extra", "shift"), ("gate", "weight"), ("gate", "bias"),
)
LEAVES_PER_BLOCK = len(_BLOCK)  # 20


def _nested_paths(n_blocks: int) -> list:
    return [("blocks", b) + leaf for b in range(n_blocks) for leaf in _BLOCK]


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
        "S3-nested": Shape(
            "S3-nested", _nested_paths(n_small // LEAVES_PER_BLOCK), [(256,)] * n_small,
            layout=f"S3's {n_small} vectors in {n_small // LEAVES_PER_BLOCK} blocks of dicts and lists, "
            f"{LEAVES_PER_BLOCK} a block (PyTorch: an nn.Module of ModuleLists/ModuleDicts)",
            module=True,
        ),
        "S3-one": Shape("S3-one", [(0,)], [(256 * n_small,)], layout="S3's elements as one vector"),
        "S3-matrices": Shape("S3-matrices", [(i,) for i in range(n_small)], [(16, 16)] * n_small,
                             layout=f"a list of {n_small} matrices of 16x16"),
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
    """The value at `path` (a tuple of keys and indices) in a nested container, or in a PyTorch
    module made by `as_module` (a ModuleList or ModuleDict is indexed, another module's
    parameters and submodules are its attributes)."""
    for k in path:
        try:
            tree = tree[k]
        except TypeError:  # a plain nn.Module: not subscriptable
            tree = getattr(tree, str(k))
    return tree


def as_module(tree):
    """The nested dicts and lists of `nest` as PyTorch modules, as a model nests them: a list of
    containers is a ModuleList, a list of parameters a ParameterList, a dict of containers a
    ModuleDict, any other dict a plain Module holding its parameters and submodules by name (a
    tied place registers the one Parameter again: `named_parameters()` lists it once)."""
    import torch

    if isinstance(tree, list):
        if all(isinstance(v, torch.nn.Parameter) for v in tree):
            return torch.nn.ParameterList(tree)
        return torch.nn.ModuleList([as_module(v) for v in tree])
    if not any(isinstance(v, torch.nn.Parameter) for v in tree.values()):
        return torch.nn.ModuleDict({str(k): as_module(v) for k, v in tree.items()})
    module = torch.nn.Module()
    for k, v in tree.items():
        if isinstance(v, torch.nn.Parameter):
            module.register_parameter(str(k), v)
        else:
            module.add_module(str(k), as_module(v))
    return module


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
        return self.tree([convert(p) for p in self.params])

    def tree(self, values):
        """The model tree of `values`, one per distinct parameter (tied places hold the same one)."""
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


def agrees(got: list, ref: list, atol: float = ATOL, rtol: float = RTOL) -> tuple[bool, float]:
    """`(every element within atol + rtol*|ref|, the largest absolute error)`."""
    ok, worst = True, 0.0
    for g, r in zip(got, ref):
        g = np.asarray(g, dtype=np.float64).reshape(r.shape)
        diff = np.abs(g - r)
        if diff.size:
            worst = max(worst, float(diff.max()))
            if not np.all(diff <= atol + rtol * np.abs(r)):
                ok = False
    return ok, worst


def agrees_but_a_few(got: list, ref: list, atol: float, rtol: float, few: float,
                     bound: float) -> tuple[bool, float]:
    """`(every element within atol + rtol*|ref| but for at most a fraction `few` of them (rounded
    up: one on a small model), each of those within `bound`; the largest absolute error)`: for
    rows whose state is rounded to a coarse grid, where an element on the other side of a
    rounding midpoint takes another value."""
    beyond, total, worst = 0, 0, 0.0
    for g, r in zip(got, ref):
        diff = np.abs(np.asarray(g, dtype=np.float64).reshape(r.shape) - r)
        if diff.size:
            worst = max(worst, float(diff.max()))
            beyond += int(np.count_nonzero(diff > atol + rtol * np.abs(r)))
            total += diff.size
    return beyond <= math.ceil(few * total) and worst <= bound, worst
