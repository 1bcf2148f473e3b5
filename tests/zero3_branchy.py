"""A tiny model whose ``branch`` layer runs only in the micro-batches a schedule names, trained
under DeepSpeed ZeRO-3 with CPU offload (plain or ``"super_offload": true``), and the same
training in plain torch (``torch.optim.AdamW`` + ``clip_grad_norm_`` over every rank's
micro-batches, as ZeRO's averaged gradients see them) as the reference: a param without a
gradient in a step is skipped, as torch's AdamW skips it.

The model has a param of odd size (7 elements), so on two ranks the last rank's partition of
it ends in padding.
"""

from __future__ import annotations

import torch
from zero3_reference import Zero3Case, ds_config

VOCAB, SEQ, HIDDEN = 32, 6, 16


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.branch = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.odd = torch.nn.Parameter(torch.randn(7) * 0.1)

    def forward(self, ids, use_branch):
        hidden = torch.tanh(self.body(self.embed(ids)))
        if use_branch:
            hidden = hidden + torch.tanh(self.branch(hidden))
        hidden = hidden * (1.0 + self.odd.sum())
        logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), ids.view(-1))


def build(seed: int = 0) -> Branchy:
    torch.manual_seed(seed)
    return Branchy()


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=generator)


def branchy_case(**changes) -> Zero3Case:
    # Sub groups of a few params each, so the branch shares one with params that step.
    return Zero3Case(
        micro_batch=2, schedule=False, sub_group_size=600, persistence_threshold=10
    ).replace(**changes)


def make_engine(case: Zero3Case, super_offload: bool, world: int, config_changes=None):
    import deepspeed

    model = build()
    config = ds_config(case, super_offload, world)
    for key, value in (config_changes or {}).items():
        config[key] = value
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=case.lr, eps=case.eps, weight_decay=case.weight_decay
    )
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, optimizer


def train_engine(
    engine, schedule: list[list[bool]], rank: int, device="cpu", first_step: int = 0
) -> list[float]:
    """``schedule[step][micro]``: whether that micro-batch runs the branch (``first_step``:
    the step the schedule's first entry is, for a resumed run)."""
    losses = []
    for step, micros in enumerate(schedule, start=first_step):
        for micro, use_branch in enumerate(micros):
            loss = engine(batch(step, micro, rank).to(device), use_branch)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def train_torch(case: Zero3Case, schedule: list[list[bool]], world: int) -> dict:
    """The reference: every rank's micro-batches in one process, the gradient averaged over
    ranks and summed over micro-batches (each loss divided by the accumulation steps, as
    DeepSpeed's backward does), then clip_grad_norm_ and AdamW, which skip params without
    a gradient."""
    model = build()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=case.lr, eps=case.eps, weight_decay=case.weight_decay
    )
    for step, micros in enumerate(schedule):
        for rank in range(world):
            for micro, use_branch in enumerate(micros):
                loss = model(batch(step, micro, rank), use_branch)
                (loss / (len(micros) * world)).backward()
        if case.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})  # none for a param that never got a gradient
        out[name] = {"master": p.detach().clone(), "step": int(state.get("step", 0))}
        for key in ("exp_avg", "exp_avg_sq"):
            out[name][key] = state[key].clone() if key in state else torch.zeros_like(p)
    return out


def full_state(engine) -> dict:
    """Every param's full fp32 master and moments, through DeepSpeed's accessors (collective:
    every rank calls it in the same order)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, param in engine.module.named_parameters():
        out[name] = {
            "master": safe_get_full_fp32_param(param).detach().cpu().clone(),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg").cpu().clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").cpu().clone(),
        }
    return out
