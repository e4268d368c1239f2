"""`optimisers.torch.Optimizer` inside the trainers people use: HF Trainer, Lightning, accelerate
and ZeroRedundancyOptimizer, each on a tiny model with a tied weight, against torch.optim.AdamW
in the same trainer. Our AdamW (couple=True) runs torch's fused AdamW kernel on float32 CPU
tensors, so against `torch.optim.AdamW(fused=True)` the numbers agree bit for bit."""

from __future__ import annotations

import io
import socket

import pytest
import torch

import optimisers
from _hf_models import TokenDataset, tiny_gpt2
from _torch_models import batch, lm_loss, make_gpt
from optimisers.torch import Optimizer

LR, DECAY = 1e-2, 0.01

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


def ours(model):
    return Optimizer(model, optimisers.AdamW(LR, lambd=DECAY))


def torch_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY, fused=True)


def _assert_equal(a, b):
    pairs = list(zip(a.named_parameters(), b.named_parameters(), strict=True))
    assert pairs
    for (name, x), (_, y) in pairs:
        assert torch.equal(x, y), name


# --- Hugging Face Trainer -----------------------------------------------------------------------


def _hf_train(make_optimizer, output_dir, resume=None, seed=0):
    from transformers import Trainer, TrainingArguments

    model = tiny_gpt2(seed)
    args = TrainingArguments(
        output_dir=str(output_dir), report_to=[], use_cpu=True, save_strategy="steps", save_steps=2,
        max_steps=4, per_device_train_batch_size=4, learning_rate=LR, logging_strategy="no", seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    optimizer = make_optimizer(model)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), optimizers=(optimizer, None))
    trainer.train(resume_from_checkpoint=resume)
    return model, optimizer


def test_hf_trainer_equals_torch_adamw_and_resumes_bit_for_bit(tmp_path):
    model, optimizer = _hf_train(ours, tmp_path / "ours")
    reference, _ = _hf_train(torch_adamw, tmp_path / "torch")
    assert not torch.equal(model.transformer.wte.weight, tiny_gpt2().transformer.wte.weight)
    _assert_equal(model, reference)
    assert model.lm_head.weight is model.transformer.wte.weight
    # the Trainer's linear schedule reached the rule: it decays to 0 at the last step
    assert optimizer.param_groups[0]["lr"] == 0.0
    assert optimizer.optimiser_state["transformer"]["wte"]["weight"].state[2] == 4

    # from the checkpoint at step 2 (model, optimizer, scheduler, RNG) to step 4, from another init
    resumed, optimizer = _hf_train(ours, tmp_path / "ours", resume=tmp_path / "ours" / "checkpoint-2", seed=1)
    assert optimizer.optimiser_state["transformer"]["wte"]["weight"].state[2] == 4
    _assert_equal(resumed, model)


# --- Lightning ----------------------------------------------------------------------------------


def _lightning_train(make_optimizer, checkpoints=None, resume=None):
    """Fit the tiny tied model for 4 steps (2 an epoch); `checkpoints`: a folder where Lightning's
    ModelCheckpoint saves every 2 steps; `resume`: a checkpoint to start from."""
    import lightning

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_gpt()

        def training_step(self, batch, index):
            return lm_loss(self.net, *batch)

        def configure_optimizers(self):
            return make_optimizer(self.net)

    module = Module()
    inputs, targets = batch()
    data = torch.utils.data.DataLoader(list(zip(inputs, targets)), batch_size=4)
    saving = [] if checkpoints is None else [
        lightning.pytorch.callbacks.ModelCheckpoint(checkpoints, every_n_train_steps=2, save_top_k=-1)
    ]
    trainer = lightning.Trainer(
        max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=bool(saving),
        callbacks=saving, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=resume)
    return module.net, trainer


@pytest.mark.filterwarnings(r"ignore:.isinstance\(treespec, LeafSpec\). is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:The 'train_dataloader' does not have many workers")
def test_lightning_configure_optimizers_equals_torch_adamw():
    net, trainer = _lightning_train(ours)
    reference, _ = _lightning_train(torch_adamw)
    assert trainer.global_step == 4
    assert not torch.equal(net.embed.weight, make_gpt().embed.weight)
    _assert_equal(net, reference)
    assert net.head.weight is net.embed.weight


@pytest.mark.filterwarnings(r"ignore:.isinstance\(treespec, LeafSpec\). is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:The 'train_dataloader' does not have many workers")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resumed there
def test_lightning_checkpoint_resumes_bit_for_bit(tmp_path):
    uninterrupted, _ = _lightning_train(ours, checkpoints=tmp_path)
    half = tmp_path / "epoch=0-step=2.ckpt"
    saved = torch.load(half, weights_only=True)["optimizer_states"][0]
    assert saved["state"]  # the optimiser's state went into Lightning's checkpoint
    resumed, trainer = _lightning_train(ours, checkpoints=tmp_path, resume=half)
    assert trainer.global_step == 4
    _assert_equal(resumed, uninterrupted)
    assert resumed.head.weight is resumed.embed.weight


# --- accelerate ---------------------------------------------------------------------------------


def _accelerate_steps(accelerator, net, optimizer, steps):
    inputs, targets = batch()
    for _ in range(steps):
        optimizer.zero_grad()
        accelerator.backward(lm_loss(net, inputs, targets))
        optimizer.step()


@pytest.mark.filterwarnings("ignore:.*Removed shared tensor")
def test_accelerate_prepare_and_save_state_load_state(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net = make_gpt()
    net, optimizer = accelerator.prepare(net, ours(net))
    reference = make_gpt()
    reference_optimizer = torch_adamw(reference)
    _accelerate_steps(accelerator, net, optimizer, 3)
    accelerator.save_state(tmp_path / "checkpoint")
    saved = {k: v.clone() for k, v in optimizer.optimizer.state_dict()["state"][0].items() if k != "rule"
             and isinstance(v, torch.Tensor)}  # fmt: skip
    _accelerate_steps(accelerator, net, optimizer, 3)
    for _ in range(6):
        reference_optimizer.zero_grad()
        lm_loss(reference, *batch()).backward()
        reference_optimizer.step()
    _assert_equal(net, reference)

    # a fresh run from another init: load_state must restore the optimiser state, not only the model
    accelerator = Accelerator(cpu=True)
    other = make_gpt(seed=7)
    other, other_optimizer = accelerator.prepare(other, ours(other))
    accelerator.load_state(tmp_path / "checkpoint")
    leaf = other_optimizer.optimizer.optimiser_state["embed"]["weight"]
    assert leaf.state[2] == 3
    for key, value in saved.items():
        assert torch.equal(other_optimizer.optimizer.state_dict()["state"][0][key], value)
    _accelerate_steps(accelerator, other, other_optimizer, 3)
    _assert_equal(other, net)


# --- ZeroRedundancyOptimizer --------------------------------------------------------------------


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.(script|interface)` is deprecated:DeprecationWarning")
def test_zero_redundancy_optimizer_with_our_optimizer_class_and_its_checkpoints():
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def zero(net):
        return ZeroRedundancyOptimizer(
            net.parameters(), optimizer_class=Optimizer, rule=optimisers.AdamW(LR, lambd=DECAY)
        )

    def steps(net, optimizer, n, scheduler=None):
        for _ in range(n):
            optimizer.zero_grad()
            lm_loss(net, *batch()).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        nets = [make_gpt(), make_gpt()]
        optimizers = [zero(nets[0]), torch_adamw(nets[1])]
        for net, optimizer in zip(nets, optimizers):
            steps(
                net, optimizer, 4, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
            )
        assert isinstance(optimizers[0].optim, Optimizer)
        assert optimizers[0].optim.optimiser_state[0].rule.eta == LR / 4  # the schedule reached it
        _assert_equal(*nets)

        # ZeRO's checkpoint: consolidated from our state_dict, restored through `optim.state[p]`
        net = make_gpt()
        optimizer = zero(net)
        steps(net, optimizer, 2)
        optimizer.consolidate_state_dict(to=0)
        buffer = io.BytesIO()
        torch.save({"model": net.state_dict(), "opt": optimizer.state_dict()}, buffer)
        steps(net, optimizer, 2)
        buffer.seek(0)
        with torch.serialization.safe_globals([optimisers.AdamW]):  # ZeRO keeps the rule in its groups
            saved = torch.load(buffer, weights_only=True)
        resumed = make_gpt(seed=7)
        resumed.load_state_dict(saved["model"])
        resumed_optimizer = zero(resumed)
        resumed_optimizer.load_state_dict(saved["opt"])
        assert resumed_optimizer.optim.optimiser_state[0].state[2] == 2
        steps(resumed, resumed_optimizer, 2)
        _assert_equal(resumed, net)
    finally:
        dist.destroy_process_group()
