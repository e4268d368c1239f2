"""A tiny Hugging Face GPT-2 with its LM head tied to the token embedding, and a token dataset,
shared by the torch integration tests (not a test module; imports transformers lazily)."""

from __future__ import annotations

import torch


def tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 50, (16, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
