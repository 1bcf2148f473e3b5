"""`SuperOffloadTrainer` with ``bf16=True`` and data parallelism by replicas, on CPU: two gloo
processes, as `accelerate launch --num_processes 2` starts them.

The Trainer casts the model to bf16 in place and the optimizer starts every rank from rank 0's
params; the fp32 masters must still start from rank 0's exact fp32 values (what the plain
Trainer, with fp32 params under autocast and DDP's broadcast from rank 0, starts from), not
from their bf16 rounding. Rank 1 starts from other fp32 values on purpose.
"""

from __future__ import annotations

import pytest
import torch
from ranks import free_port, set_rank_env, spawn_ranks
from test_integration_trainer import _args, _dataset, _model, _params
from test_integration_trainer_ddp import WORLD

from hf_superoffload import SuperOffloadTrainer


def _build_on_rank(rank: int, port: int, out_dir) -> None:
    set_rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    model = _model()
    if rank == 1:  # another start: rank 0's values must win, exactly
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.full_like(param, 1e-3))
    start = _params(model)
    trainer = SuperOffloadTrainer(
        model=model,
        args=_args(out_dir, True, bf16=True, ddp_timeout=120),
        train_dataset=_dataset(),
    )
    assert trainer.accelerator.num_processes == WORLD
    optimizer = trainer.create_optimizer()
    masters = {n: optimizer.master_state(p)["master"] for n, p in model.named_parameters()}
    torch.save(
        {"start": start, "masters": masters, "params": _params(model)},
        out_dir / f"rank{rank}.pt",
    )
    optimizer.close()


@pytest.mark.slow
def test_every_rank_starts_its_masters_from_rank0s_fp32_values(tmp_path):
    spawn_ranks(_build_on_rank, (free_port(), tmp_path), WORLD, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    rank0_start = ranks[0]["start"]
    assert any(not torch.equal(t.to(torch.bfloat16).float(), t) for t in rank0_start.values())
    assert all(not torch.equal(ranks[1]["start"][n], t) for n, t in rank0_start.items())
    for rank in ranks:
        for name, master in rank["masters"].items():
            torch.testing.assert_close(master, rank0_start[name], rtol=0, atol=0, msg=name)
            param = rank["params"][name]
            assert param.dtype == torch.bfloat16, name
            torch.testing.assert_close(param, master.to(torch.bfloat16), rtol=0, atol=0)
