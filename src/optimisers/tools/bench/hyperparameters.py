"""The hyperparameters of the bench's rules: the same for every implementation of a rule (ours,
its torch.optim and optax peers, the naive formula in `naive`), chosen where the peers compute the
same steps as ours (each rule's docstring says where they differ) and with steps well above the
check's tolerance (about 1e-7 for parameters of about 0.02 and gradients of about 0.01)."""

from __future__ import annotations

LR_ADAM = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01  # AdamW: optimisers `lambd`, torch `weight_decay`, optax `weight_decay`
CLIP = 0.1  # ClipNorm's bound: the bench's gradients of 256 elements have norms of about 0.16
LR_MOMENTUM = 1e-2  # also Descent's and Nesterov's
RHO = 0.9  # torch/optax `momentum`; RMSProp's and AdaDelta's decay (torch `alpha`/`rho`)

# LAMB and LARS move each array by a fraction of its own norm (the trust ratio): these rates give
# steps of about 1e-4 and 2e-5 of parameters about 0.02, well above the check's tolerance
LR_LAMB, EPS_LAMB = 1e-2, 1e-6  # optax.lamb's default eps, and ours
LR_LARS, TRUST_LARS = 1.0, 1e-3  # optax.lars's default trust_coefficient, and ours
BETAS_ADOPT, EPS_ADOPT = (0.9, 0.9999), 1e-6  # ADOPT's (and optax.contrib.adopt's) defaults
BETAS_ADEMAMIX, ALPHA_ADEMAMIX = (0.9, 0.999, 0.9999), 5.0  # AdEMAMix's defaults (b1, b2, b3)
# Lookahead synchronises on every k-th step: k = 3 puts a synchronisation inside the check's
# three steps, and makes two of every three timed steps plain Adam steps (the median is one)
K_LOOKAHEAD, ALPHA_LOOKAHEAD = 3, 0.5

# Adafactor at torch.optim's defaults but ε₁ = 1e-30 (None means the dtype's epsilon, which would
# differ between the float32 rows and the float64 reference); optax.adafactor adds its eps = 1e-30
# to g² where ours floors with ε₁: equal for gradients far above it
LR_ADAFACTOR, DECAY_ADAFACTOR, EPS_ADAFACTOR = 1e-2, -0.8, (1e-30, 1e-3)
LR_SOAP = 3e-3
# Muon at torch.optim.Muon's defaults but Nesterov off, where optax.contrib.muon computes the same
# steps (its Nesterov term is bias-corrected); torch.optim.Muon iterates in bfloat16, 1-3% apart
LR_MUON, BETA_MUON, DECAY_MUON, NS_MUON = 2e-2, 0.95, 0.1, (3.4445, -4.7750, 2.0315)
LR_SF_ADAMW, LR_SF_SGD = 2.5e-3, 1e-2  # schedule-free: the package's AdamW default, a gentle SGD rate

# Rprop at its (and torch's) defaults: torch clamps every step size to the bounds, we only the
# changed ones, the same while the rate lies inside them
ETAS_RPROP, STEP_SIZES_RPROP = (0.5, 1.2), (1e-6, 50.0)
# AdaGrad's accumulator starts at ε (torch's initial_accumulator_value): optax puts its ε inside
# the root, so ε = 1e-10 keeps that apart by less than the check's tolerance (1e-8 does not, for
# gradients near 1e-4)
EPS_ADAGRAD = 1e-10
EPS_ADADELTA = 1e-6  # ε = 1e-8 barely moves in three steps (steps start near √ε)
# AdaMax: torch adds ε inside the maximum (u ← max(β₂u, |g| + ε), m/u), we and optax to the
# denominator (u ← max(β₂u, |g|), m/(u + ε)): the same steps for the bench's one gradient every
# step, where the maximum is |g| throughout. (Not ε = 0: S1 and S2 have gradients of exactly 0)
EPS_ADAMAX = EPS
EPS_ADABELIEF = 1e-16  # AdaBelief's default, inside the recursion and outside the root (as optax's)
BETAS_OADAM = (0.5, 0.9)  # OAdam's defaults
BETAS_LION = (0.9, 0.99)  # the paper's recommendation, and optax.lion's default
# the chain ClipGrad > WeightDecay > Adam: torch's clip_grad_value_ then Adam(weight_decay), which
# adds the decay to the clipped gradient. δ = 0.01 clips about a third of the gradients of 0.01
CLIP_VALUE, L2_DECAY = 1e-2, 5e-2
L1_DECAY = 1e-3  # SignDecay's default: λ·sign(x) next to gradients of 0.01 moves Adam's steps visibly
# the chains' Adam: its gradient g + λ·(...) is computed, and where g and the decay cancel, Adam's
# step (lr·g/(|g| + ε)) turns the float32 rows' small differences in x (~1e-9, float32's β₂) into
# differences of lr/ε times λ times that: ε = 1e-5 keeps them below the tolerance, 1e-8 and 1e-6
# do not (on a few of S1's elements)
EPS_CHAINS = 1e-5

HYPERPARAMETERS = {"adam_lr": LR_ADAM, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY,
                   "momentum_lr": LR_MOMENTUM, "rho": RHO}
