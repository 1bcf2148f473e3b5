"""The training systems compared by the benchmarks, one class each, same model and recipe:
AdamW (lr 1e-5, no weight decay), clip ``--clip``, bf16 compute, activation checkpointing.

- no_offload: fp32 params, bf16 autocast, fused AdamW on the GPU, clip_grad_norm_ (what the
  HF Trainer does without offload; fp32 master and both moments on the GPU).
- superoffload: bf16 params on the GPU, fp32 master and moments on the CPU (this package).
- deepspeed_zero_offload: DeepSpeed ZeRO-3 with offload_optimizer cpu (DeepSpeedCPUAdam).
- deepspeed_superoffload: the same with offload_optimizer.super_offload: true.
- torchao_offload: torchao's CPUOffloadOptimizer over bf16 params (bf16 optimizer state on the
  CPU and no fp32 master: cheaper, but not the same numerics).
"""

from __future__ import annotations

import os

import torch
import transformers

LR = 1e-5


def _model(config: transformers.LlamaConfig, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


class NoOffload:
    def __init__(self, config, args):
        self.model = _model(config, torch.float32)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.0, fused=True)
        self.clip = args.clip

    def step(self, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self):
        return None


class SuperOffload:
    def __init__(self, config, args):
        from hf_superoffload import SuperOffloadOptimizer

        self.model = _model(config, torch.bfloat16)
        buckets = args.gpu_buckets if args.gpu_buckets == "auto" else int(args.gpu_buckets)
        self.optimizer = SuperOffloadOptimizer(
            self.model.parameters(), lr=LR, weight_decay=0.0, max_grad_norm=args.clip,
            model=self.model, gpu_buckets=buckets, bucket_size=args.bucket_size, cast=args.cast,
        )  # fmt: skip

    def step(self, batch):
        self.model(input_ids=batch, labels=batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def still_tuning(self) -> bool:
        """gpu_buckets='auto' may still move buckets (each move synchronizes everything)."""
        return bool(self.optimizer.stats["tail_tuning"])

    def finish(self):
        self.optimizer.synchronize()
        stats = self.optimizer.stats
        self.optimizer.close()
        return stats


class DeepSpeedZeroOffload:
    super_offload = False

    def __init__(self, config, args):
        import deepspeed

        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"),
                           ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # fmt: skip
            os.environ.setdefault(key, value)
        deepspeed.init_distributed()
        model = _model(config, torch.bfloat16)
        offload = {"device": "cpu", "pin_memory": True}
        if self.super_offload:
            offload["super_offload"] = True
        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": args.clip,
            "bf16": {"enabled": True},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
            },
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": offload,
                "overlap_comm": True,
                "contiguous_gradients": True,
            },
            "steps_per_print": 10**9,
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )

    def step(self, batch):
        loss = self.engine(input_ids=batch, labels=batch).loss
        self.engine.backward(loss)
        self.engine.step()

    def finish(self):
        return None


class DeepSpeedSuperOffload(DeepSpeedZeroOffload):
    super_offload = True


class TorchaoOffload:
    def __init__(self, config, args):
        from torchao.optim import CPUOffloadOptimizer

        self.model = _model(config, torch.bfloat16)
        self.params = list(self.model.parameters())
        self.optimizer = CPUOffloadOptimizer(
            self.params, torch.optim.AdamW, offload_gradients=False, fused=True, lr=LR,
            weight_decay=0.0,
        )  # fmt: skip
        self.clip = args.clip

    def step(self, batch):
        self.model(input_ids=batch, labels=batch).loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def finish(self):
        return None


SYSTEMS = {
    "no_offload": NoOffload,
    "superoffload": SuperOffload,
    "deepspeed_zero_offload": DeepSpeedZeroOffload,
    "deepspeed_superoffload": DeepSpeedSuperOffload,
    "torchao_offload": TorchaoOffload,
}
