"""`SuperOffloadOptimizer` checkpoints (engine/state_io.py): bit-exact resume after a clipped
step, reproducible CPU runs with ``gpu_tail="auto"``, saving and loading without a second
copy of the state in host memory, loading torch's AdamW state dicts (also a plain HF Trainer
checkpoint's optimizer.pt), and what load_state_dict says when a state dict does not fit.

The model, data, reference runs and tolerances are `engine_reference`'s.
"""

from __future__ import annotations

import copy
import math
import os
import re
import threading
import time

import pytest
import torch
from engine_reference import (
    RunConfig,
    TrainResult,
    assert_same_trajectory,
    assert_states_equal,
    build_model,
    clip_threshold,
    clipped_steps,
    collect_engine_result,
    engine_do_step,
    engine_state,
    make_batches,
    make_engine,
    make_reference_optimizer,
    make_scheduler,
    param_groups,
    reference_clip,
    run_reference,
    run_superoffload,
    snapshot,
    train_loop,
)

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.engine.buckets import plan_buckets
from hf_superoffload.engine.placement import (
    TailTuner,
    choose_device_buckets,
    device_headroom_bytes,
    make_tail_tuner,
)
from hf_superoffload.engine.state_io import EXTRA_KEY

BASE = RunConfig()


def _some(cfg: RunConfig) -> RunConfig:
    return cfg.replace(max_grad_norm=clip_threshold(cfg, "some"))


def _save_load(tmp_path, obj, name="checkpoint.pt", **load_kwargs):
    path = tmp_path / name
    torch.save(obj, path)
    return torch.load(path, weights_only=True, **load_kwargs)


# --- item 6: the speculation's clip coefficient travels with the checkpoint -------------------


@pytest.mark.parametrize(
    ("gpu_tail", "speculate_after_clip"),
    [(0, False), (2, False), (0, True)],
    ids=["host", "device-tail", "speculate-after-clip"],
)
def test_resume_right_after_a_clipped_step_is_bit_exact(tmp_path, gpu_tail, speculate_after_clip):
    """Save after a step that clipped and before one that clips again, load into a fresh model
    and optimizer, continue: params, masters and both moments equal the uninterrupted run's
    bit for bit. (Without the saved coefficient the resumed step speculates with 1.0 where
    the uninterrupted one did not speculate, or speculated with the last coefficient, and its
    replay rounds differently: 17-21 of the 21 tensors differed here.)"""
    cfg = _some(BASE.replace(steps=16, two_groups=True, schedule="warmup_decay"))
    options = {"gpu_tail": gpu_tail, "speculate_after_clip": speculate_after_clip}
    whole = run_superoffload(cfg, **options)
    clipped = [i for i, n in enumerate(whole.grad_norms) if n > cfg.max_grad_norm]
    # After step `at - 1` (clipped) and before step `at` (clips again), late enough that the
    # replay's rounding is not exact by luck (right after step 1 the moments come back exactly).
    at = next(i + 1 for i in clipped if i + 1 in clipped and i >= 4)
    batches = make_batches(cfg)

    first = cfg.replace(steps=at)
    model = build_model(first)
    with make_engine(model, first, **options) as opt:
        scheduler = make_scheduler(cfg, opt)
        losses1 = train_loop(first, model, opt, batches, engine_do_step(opt), scheduler=scheduler)
        coef = opt._stv.predicted_coef
        checkpoint = _save_load(
            tmp_path,
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": scheduler.state_dict(),
            },
        )
    assert 0 < coef < 1
    assert checkpoint["optimizer"][EXTRA_KEY] == {"format": 1, "predicted_coef": coef}

    model = build_model(cfg.replace(model_seed=99))
    model.load_state_dict(checkpoint["model"])
    with make_engine(model, cfg, **options) as opt:
        scheduler = make_scheduler(cfg, opt)
        opt.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        assert opt._stv.predicted_coef == coef
        losses2 = train_loop(
            cfg, model, opt, batches, engine_do_step(opt), start=at, scheduler=scheduler
        )
        state, params = snapshot(opt, model)

    assert losses1[0] + losses2[0] == whole.losses
    assert losses1[1] + losses2[1] == whole.grad_norms
    for name, st in state.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], getattr(whole, key)[name]), (key, name)
        assert torch.equal(params[name], whole.params[name]), name
        assert st["step"] == whole.state_steps[name] == cfg.steps, name


def test_a_checkpoint_without_the_coefficient_still_loads_and_the_key_is_tolerated():
    """An older checkpoint (no "superoffload" key) loads and speculates with 1.0; torch's own
    Optimizer.load_state_dict ignores the extra top-level key."""
    cfg = BASE.replace(steps=3, max_grad_norm=1e-3)  # every step clips
    model = build_model(cfg)
    with make_engine(model, cfg, gpu_tail=0) as opt:
        train_loop(cfg, model, opt, make_batches(cfg), engine_do_step(opt))
        sd = opt.state_dict()
        assert 0 < sd[EXTRA_KEY]["predicted_coef"] == opt._stv.predicted_coef < 1
        old = {k: v for k, v in sd.items() if k != EXTRA_KEY}
        opt.load_state_dict(old)
        assert opt._stv.predicted_coef == 1.0
        opt.load_state_dict(sd)
        assert opt._stv.predicted_coef == sd[EXTRA_KEY]["predicted_coef"]
        with pytest.raises(ValueError, match="predicted_coef"):
            opt.load_state_dict({**sd, EXTRA_KEY: {"predicted_coef": 2.0}})
        torch.optim.AdamW(param_groups(model, cfg)).load_state_dict(sd)


def test_gpu_tail_auto_on_cpu_means_no_device_buckets_and_no_tuning():
    params = [torch.nn.Parameter(torch.zeros(100)) for _ in range(30)]
    plans = plan_buckets([{"params": params}], bucket_size=100)
    cpu = torch.device("cpu")
    assert choose_device_buckets("auto", plans, cpu) == 0
    assert choose_device_buckets(3, plans, cpu) == 3  # an explicit count still runs the tail
    assert device_headroom_bytes(cpu) == 0.0  # nothing to move onto
    assert make_tail_tuner("auto", cpu) is None
    assert make_tail_tuner(2, torch.device("cuda", 0)) is None
    assert isinstance(make_tail_tuner("auto", torch.device("cuda", 0)), TailTuner)


def test_two_runs_with_default_gpu_tail_are_bit_identical_on_cpu():
    """The default gpu_tail="auto": no bucket is ever on the device on a CPU-only run (no
    placement by timings), so two runs in one process agree to the bit."""
    cfg = _some(BASE.replace(steps=12))
    placed = []

    def probe(phase, step, model, opt):
        placed.append(opt.stats["gpu_tail_buckets"])

    model = build_model(cfg)
    with SuperOffloadOptimizer(model.parameters(), bucket_size=2_000, model=model) as opt:
        assert opt.stats["gpu_tail_buckets"] == 0  # the default, "auto", on the CPU
    a = run_superoffload(cfg, probe=probe, gpu_tail="auto")
    b = run_superoffload(cfg, probe=probe, gpu_tail="auto")
    assert placed == [0] * (4 * cfg.steps)
    assert a.stats["gpu_tail_buckets"] == b.stats["gpu_tail_buckets"] == 0
    assert a.losses == b.losses and a.grad_norms == b.grad_norms
    for key in ("params", "master", "exp_avg", "exp_avg_sq"):
        assert_states_equal(getattr(a, key), getattr(b, key), f"two 'auto' runs: {key}")
    assert_same_trajectory(a, run_reference(cfg))


# --- item 7: no second copy of the state on save or load --------------------------------------


@pytest.mark.parametrize("gpu_tail", [0, 2])
def test_state_dict_views_the_live_state_and_the_file_holds_each_bucket_once(tmp_path, gpu_tail):
    """Like torch's Optimizer.state_dict: the entries are the live state (views into the
    buckets' flat buffers), so the values are the current ones and a later step changes
    them; torch.save writes each bucket's buffers once (the file is ~12 B/param)."""
    cfg = _some(BASE.replace(steps=4))
    model = build_model(cfg)
    batches = make_batches(cfg, cfg.steps + 1)
    with make_engine(model, cfg, gpu_tail=gpu_tail) as opt:
        train_loop(cfg, model, opt, batches, engine_do_step(opt))
        sd = opt.state_dict()
        copies = engine_state(opt, model)
        storages = {
            key: {getattr(b, key).untyped_storage().data_ptr() for b in opt._buckets}
            for key in ("master", "exp_avg", "exp_avg_sq")
        }
        names = [n for n, _ in model.named_parameters()]
        for i, name in enumerate(names):
            for key, ptrs in storages.items():
                assert sd["state"][i][key].untyped_storage().data_ptr() in ptrs, (name, key)
                assert torch.equal(sd["state"][i][key], copies[name][key]), (name, key)
            assert sd["state"][i]["step"] == copies[name]["step"] == cfg.steps
        path = tmp_path / "optimizer.pt"
        torch.save(sd, path)
        numel = sum(p.numel() for p in model.parameters())
        size = os.path.getsize(path)
        assert 12 * numel <= size <= 12 * numel * 1.05 + 64 * 1024, (size, 12 * numel)

        # One more step: the views follow the live state; the file keeps the saved one.
        train_loop(
            cfg.replace(steps=cfg.steps + 1),
            model,
            opt,
            batches,
            engine_do_step(opt),
            start=cfg.steps,
        )
        opt.synchronize()
        later = engine_state(opt, model)
        assert all(
            torch.equal(sd["state"][i]["master"], later[n]["master"]) for i, n in enumerate(names)
        )
        assert not torch.equal(sd["state"][0]["master"], copies[names[0]]["master"])
    saved = torch.load(path, weights_only=True)
    for i, name in enumerate(names):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][i][key], copies[name][key]), (name, key)


class _HostMemory:
    """Peak RSS over a window (VmHWM after writing "5" to /proc/self/clear_refs resets it),
    and the peak of anonymous memory (RssAnon, sampled every 0.5 ms on a thread): the file
    pages a memory-mapped load reads count into RSS as page cache the kernel may drop; anonymous
    memory is what a second copy of the state would take."""

    def __init__(self):
        self.rss = self.peak = self.anon = self.peak_anon = 0

    @staticmethod
    def status() -> dict[str, int]:
        with open("/proc/self/status") as f:
            text = f.read()
        return {
            key: 1024 * int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1))
            for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
        }

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        now = self.status()
        self.rss, self.anon, self.file = now["VmRSS"], now["RssAnon"], now["RssFile"]
        self.peak_anon = self.anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, self.status()["RssAnon"])
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        now = self.status()
        self.peak_anon = max(self.peak_anon, now["RssAnon"])
        self.peak, self.file_growth = now["VmHWM"], now["RssFile"] - self.file

    @property
    def extra(self) -> int:
        return self.peak - self.rss

    @property
    def extra_anon(self) -> int:
        return self.peak_anon - self.anon


def _linear_stack(width: int, depth: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(depth)))


def _one_linear_step(net, opt, width, seed):
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(seed))
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _can_reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM" in open("/proc/self/status").read()
    except OSError:
        return False


@pytest.mark.skipif(
    not _can_reset_peak_rss(), reason="needs Linux /proc/self/clear_refs to measure peak RSS"
)
def test_save_and_mmap_load_need_no_second_copy_of_the_state(tmp_path, record_property):
    """25M params (300 MB of state): torch.save(opt.state_dict()) and load_state_dict(
    torch.load(..., mmap=True)) each need well under a quarter of one copy of the state
    (12 B/param) of extra host memory; the old copying state_dict needed a whole one. The
    loaded state equals the saved one, bit for bit."""
    width, depth = 2048, 6
    numel = width * width * depth
    one_copy = 12 * numel
    path = tmp_path / "optimizer.pt"

    net = _linear_stack(width, depth, seed=0)
    opt = SuperOffloadOptimizer(
        net.parameters(), lr=1e-3, gpu_tail=0, bucket_size=width * width, model=net
    )
    _one_linear_step(net, opt, width, seed=1)
    _one_linear_step(net, opt, width, seed=2)
    opt.synchronize()
    with _HostMemory() as save:
        torch.save(opt.state_dict(), path)
    size = os.path.getsize(path)

    net2 = _linear_stack(width, depth, seed=3)
    opt2 = SuperOffloadOptimizer(
        net2.parameters(), lr=1e-3, gpu_tail=0, bucket_size=width * width, model=net2
    )
    with _HostMemory() as load:
        checkpoint = torch.load(path, mmap=True, weights_only=True)
        opt2.load_state_dict(checkpoint)
    del checkpoint

    record_property("save_extra_bytes", save.extra)
    record_property("load_extra_anon_bytes", load.extra_anon)
    record_property("load_extra_rss_bytes", load.extra)
    print(
        f"\nstate {one_copy / 2**20:.0f} MiB, file {size / 2**20:.1f} MiB; save: peak RSS "
        f"+{save.extra / 2**20:.1f} MiB; mmap load: peak anonymous +{load.extra_anon / 2**20:.1f} "
        f"MiB, peak RSS +{load.extra / 2**20:.1f} MiB of which file pages "
        f"{load.file_growth / 2**20:.1f} MiB"
    )
    assert one_copy <= size <= one_copy * 1.01
    assert save.extra < 0.25 * one_copy
    assert load.extra_anon < 0.25 * one_copy
    # RSS beyond that is the checkpoint's own pages (page cache, mapped while being read).
    assert load.extra < size + 0.25 * one_copy
    try:
        for p, q in zip(net.parameters(), net2.parameters(), strict=True):
            assert torch.equal(p, q)
            a, b = opt.master_state(p), opt2.master_state(q)
            for key in ("master", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
            assert a["step"] == 2
    finally:
        opt.close()
        opt2.close()


# --- item 8: torch's AdamW state dicts --------------------------------------------------------


def _adamw_prefix(cfg: RunConfig, steps: int):
    """The reference loop (engine_reference) for the first ``steps`` steps; returns the model,
    optimizer, scheduler and the per-step records."""
    model = build_model(cfg)
    optimizer = make_reference_optimizer(model, cfg)
    scheduler = make_scheduler(cfg, optimizer)

    def do_step():
        norm = reference_clip(model, cfg)
        optimizer.step()
        return norm, False

    records = train_loop(
        cfg.replace(steps=steps), model, optimizer, make_batches(cfg), do_step, scheduler=scheduler
    )
    return model, optimizer, scheduler, records


@pytest.mark.parametrize("gpu_tail", [0, 2])
def test_torch_adamw_state_dict_continues_like_adamw(tmp_path, gpu_tail):
    """AdamW 8 steps, its state dict (and the model's and scheduler's) saved; a
    SuperOffloadOptimizer built with other hyperparameters on a copy of the model loads it
    and continues 12 steps, clipping on some: everything follows AdamW continuing (the
    uninterrupted reference run), within engine_reference's tolerances."""
    cfg = _some(BASE.replace(steps=20, two_groups=True, schedule="warmup_decay"))
    k = 8
    ref_model, adamw, ref_scheduler, first = _adamw_prefix(cfg, k)
    checkpoint = _save_load(
        tmp_path,
        {
            "model": ref_model.state_dict(),
            "optimizer": adamw.state_dict(),
            "scheduler": ref_scheduler.state_dict(),
        },
    )
    assert "master" not in checkpoint["optimizer"]["state"][0]

    model = build_model(cfg.replace(model_seed=99))
    model.load_state_dict(checkpoint["model"])
    other = cfg.replace(lr=cfg.lr / 3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)
    with make_engine(model, other, gpu_tail=gpu_tail) as opt:
        scheduler = make_scheduler(cfg, opt)
        opt.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        for ours, theirs in zip(opt.param_groups, adamw.param_groups, strict=True):
            for key in ("lr", "betas", "eps", "weight_decay", "initial_lr"):
                assert ours[key] == theirs[key], key
            assert not {"amsgrad", "foreach", "fused", "maximize"} & ours.keys()
        records = train_loop(
            cfg, model, opt, make_batches(cfg), engine_do_step(opt), start=k, scheduler=scheduler
        )
        rest = collect_engine_result(opt, model, records)

    ref = run_reference(cfg)
    assert 0 < clipped_steps(rest, cfg.max_grad_norm) < cfg.steps - k
    whole = TrainResult(
        [*first[0], *rest.losses],
        [*first[1], *rest.grad_norms],
        [*first[2], *rest.skipped],
        [*first[3], *rest.lrs],
        rest.params,
        rest.master,
        rest.exp_avg,
        rest.exp_avg_sq,
        rest.state_steps,
    )
    assert_same_trajectory(whole, ref)


def test_a_param_without_adamw_state_starts_afresh(tmp_path):
    """AdamW keeps no state for a param that never got a gradient: that param loads with zero
    moments, step 0 and its current value as the master; the others as saved."""
    cfg = BASE
    ref_model, adamw, _, _ = _adamw_prefix(cfg, 3)
    sd = adamw.state_dict()
    del sd["state"][1]
    model = build_model(cfg.replace(model_seed=99))
    model.load_state_dict(ref_model.state_dict())
    with make_engine(model, cfg, gpu_tail=0) as opt:
        train_loop(cfg.replace(steps=2), model, opt, make_batches(cfg), engine_do_step(opt))
        opt.synchronize()  # the last step's params are still on their way into the model
        model.load_state_dict(ref_model.state_dict())  # the weights first, then the optimizer
        opt.load_state_dict(sd)
        state = engine_state(opt, model)
    for i, (name, p) in enumerate(ref_model.named_parameters()):
        assert torch.equal(state[name]["master"], p.detach()), name
        if i == 1:
            assert state[name]["step"] == 0
            assert not state[name]["exp_avg"].any() and not state[name]["exp_avg_sq"].any()
        else:
            assert state[name]["step"] == 3
            assert torch.equal(state[name]["exp_avg"], sd["state"][i]["exp_avg"])
            assert torch.equal(state[name]["exp_avg_sq"], sd["state"][i]["exp_avg_sq"])


def test_plain_trainer_checkpoint_optimizer_pt_loads_and_continues_like_adamw(tmp_path):
    """A plain transformers.Trainer run (its default fused AdamW, decay / no-decay groups,
    linear schedule) saves checkpoint-6; its optimizer.pt loads through
    SuperOffloadOptimizer.load_state_dict(torch.load(...)) into an optimizer built the way the
    Trainer builds its groups: the moments and steps are AdamW's to the bit, the masters are
    the checkpoint's weights, the groups' lr and weight decay the Trainer's; then 6 more steps
    (clipping on some) follow torch's AdamW continuing from the same file."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments

    from hf_superoffload.toy import build_tiny_llama, tiny_llama_config

    config = tiny_llama_config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(4, 64, (48, 16), generator=gen)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        save_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        weight_decay=0.1,
        adam_epsilon=1e-4,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=build_tiny_llama(config, seed=0),
        args=args,
        train_dataset=[{"input_ids": row, "labels": row.clone()} for row in ids],
    )
    trainer.train()
    ckpt = tmp_path / "checkpoint-6"
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    trainer_groups = trainer.optimizer.param_groups

    def fresh_model():
        model = build_tiny_llama(config, seed=99)
        model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
        model.tie_weights()
        model.train()
        return model

    def groups(model):
        named = list(model.named_parameters())
        return [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]

    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    clip = 1.145  # the continuation's norms are 1.11-1.18: some steps clip, some do not
    assert saved["param_groups"][0]["fused"] in (True, None)  # the Trainer's fused AdamW

    model = fresh_model()
    ref_model = fresh_model()
    opt = SuperOffloadOptimizer(
        groups(model), lr=5e-2, eps=1e-4, max_grad_norm=clip, bucket_size=1 << 12,
        gpu_tail=0, model=model,
    )  # fmt: skip
    reference = torch.optim.AdamW(groups(ref_model), lr=5e-2, eps=1e-4, fused=False)
    with opt:
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        reference.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        for group in reference.param_groups:
            group["fused"], group["foreach"] = False, False  # torch's default arithmetic
        for ours, theirs, trained in zip(
            opt.param_groups, reference.param_groups, trainer_groups, strict=True
        ):
            for key in ("lr", "betas", "eps", "weight_decay"):
                assert ours[key] == theirs[key] == trained[key], key
        state = engine_state(opt, model)
        names = [n for g in groups(model) for n in _names(model, g["params"])]
        for i, name in enumerate(names):
            entry = saved["state"][i]
            assert torch.equal(state[name]["exp_avg"], entry["exp_avg"]), name
            assert torch.equal(state[name]["exp_avg_sq"], entry["exp_avg_sq"]), name
            assert state[name]["step"] == int(entry["step"]) == 6, name
            assert torch.equal(state[name]["master"], dict(model.named_parameters())[name])

        norms, ref_norms = [], []
        for step in range(6):
            x = ids[(6 + step) * 4 : (7 + step) * 4]
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            norms.append(opt.global_grad_norm)
            ref_model(input_ids=x, labels=x).loss.backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)))
            reference.step()
            reference.zero_grad()
        opt.synchronize()
        final = engine_state(opt, model)
    assert 0 < sum(n > clip for n in ref_norms) < 6, ref_norms
    torch.testing.assert_close(norms, ref_norms, rtol=1e-4, atol=0)
    for name, p in ref_model.named_parameters():
        st = reference.state[p]
        torch.testing.assert_close(final[name]["master"], p.detach(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(final[name]["exp_avg"], st["exp_avg"], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(
            final[name]["exp_avg_sq"], st["exp_avg_sq"], rtol=1e-4, atol=1e-10
        )
        assert final[name]["step"] == int(st["step"]) == 12


def _names(model, params) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


# --- what load_state_dict says when a state dict does not fit ---------------------------------


def _trained(cfg: RunConfig, steps: int = 2, **options):
    """A model and engine after ``steps`` steps (the caller closes the engine)."""
    model = build_model(cfg)
    opt = make_engine(model, cfg, gpu_tail=0, **options)
    train_loop(cfg.replace(steps=steps), model, opt, make_batches(cfg), engine_do_step(opt))
    return model, opt


def _trainable_state(opt, model) -> dict:
    opt.synchronize()
    return {n: opt.master_state(p) for n, p in model.named_parameters() if p.requires_grad}


def _refused(opt, model, sd, match: str) -> None:
    """load_state_dict raises ValueError matching ``match`` and leaves the state as it was."""
    before = _trainable_state(opt, model)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_states_equal(_trainable_state(opt, model), before, "after a refused load")
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


def test_load_error_names_the_group_counts_and_says_what_to_build():
    cfg = BASE.replace(two_groups=True)
    _, opt = _trained(cfg)
    sd = opt.state_dict()
    opt.close()
    one = BASE
    model1, opt1 = _trained(one)
    with opt1:
        _refused(
            opt1,
            model1,
            sd,
            r"state_dict has 2 param groups, this optimizer has 1\. Params per group: "
            r"state_dict \[16, 5\] \(21 in all\), this optimizer \[21\] \(21 in all\)\. Build "
            r"SuperOffloadOptimizer with the same param groups",
        )


def test_load_error_names_the_groups_whose_sizes_differ():
    cfg = BASE.replace(two_groups=True)
    model, opt = _trained(cfg)
    with opt:
        sd = opt.state_dict()
        moved = sd["param_groups"][0]["params"].pop()
        sd["param_groups"][1]["params"].insert(0, moved)
        _refused(opt, model, sd, r"group 0: 15 vs 16 here; group 1: 6 vs 5 here")


def test_load_error_names_the_param_counts():
    small = BASE.replace(num_layers=1)
    _, opt = _trained(small)
    sd = opt.state_dict()
    opt.close()
    model2, opt2 = _trained(BASE)
    with opt2:
        _refused(opt2, model2, sd, r"state_dict \[12\] \(12 in all\), this optimizer \[21\]")


def test_load_error_names_the_entry_and_both_shapes():
    narrow = BASE.replace(intermediate_size=48)
    model, opt = _trained(narrow)
    sd = opt.state_dict()
    opt.close()
    model2, opt2 = _trained(BASE)
    with opt2:
        # the first entry whose shape differs: layer 0's gate_proj (index 5 in this Llama)
        names = [n for n, _ in model2.named_parameters()]
        i = names.index("model.layers.0.mlp.gate_proj.weight")
        _refused(
            opt2,
            model2,
            sd,
            rf"state_dict entry {i} \(param group 0, param {i}\): master has shape \(48, 32\), "
            r"the param here has \(64, 32\); load into the same model",
        )
        torch_sd = torch.optim.AdamW(model.parameters()).state_dict()  # no state: loads
        opt2.load_state_dict(torch_sd)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad=True; SuperOffloadOptimizer"),
        (lambda ps: torch.optim.AdamW(ps, maximize=True), "maximize=True"),
        (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "L2 penalty"),
    ],
    ids=["amsgrad", "maximize", "adam-l2"],
)
def test_torch_adam_switches_we_cannot_honour_are_refused(make, match):
    cfg = BASE
    ref_model = build_model(cfg)
    torch_opt = make(ref_model.parameters())
    x = make_batches(cfg, 1)[0]
    ref_model(input_ids=x, labels=x).loss.backward()
    torch_opt.step()
    model, opt = _trained(cfg)
    with opt:
        _refused(opt, model, torch_opt.state_dict(), match)


def test_torch_adam_without_weight_decay_loads():
    """Adam with weight_decay=0 is AdamW with weight_decay=0: nothing to refuse."""
    cfg = BASE
    ref_model = build_model(cfg)
    adam = torch.optim.Adam(ref_model.parameters(), lr=2e-3, weight_decay=0.0)
    x = make_batches(cfg, 1)[0]
    ref_model(input_ids=x, labels=x).loss.backward()
    adam.step()
    model, opt = _trained(cfg)
    with opt:
        model.load_state_dict(ref_model.state_dict())
        opt.load_state_dict(adam.state_dict())
        assert opt.param_groups[0]["lr"] == 2e-3 and opt.param_groups[0]["weight_decay"] == 0.0
        assert "decoupled_weight_decay" not in opt.param_groups[0]
        state = engine_state(opt, model)
        p = next(ref_model.parameters())
        name = next(n for n, _ in ref_model.named_parameters())
        assert torch.equal(state[name]["exp_avg"], adam.state[p]["exp_avg"])
        assert state[name]["step"] == 1


def test_state_for_a_frozen_param_and_a_non_state_dict_are_refused():
    cfg = BASE
    _, opt = _trained(cfg)
    sd = opt.state_dict()
    opt.close()
    model2 = build_model(cfg)
    model2.model.norm.weight.requires_grad_(False)
    with make_engine(model2, cfg, gpu_tail=0) as opt2:
        names = [n for n, _ in model2.named_parameters()]
        _refused(
            opt2, model2, sd, rf"entry {names.index('model.norm.weight')} .*does not require grad"
        )
        _refused(opt2, model2, {"state": {}}, "with 'state' and 'param_groups'")
        bad = {**sd, "state": {**sd["state"], 0: {"exp_avg": sd["state"][0]["exp_avg"]}}}
        _refused(opt2, model2, bad, r"entry 0 .*lacks \['exp_avg_sq', 'step'\]")


def test_hyperparameters_we_refuse_are_refused_on_load():
    cfg = BASE
    model, opt = _trained(cfg)
    with opt:
        sd = opt.state_dict()
        bad = {**sd, "param_groups": [{**sd["param_groups"][0], "betas": (0.9, 1.0)}]}
        _refused(opt, model, bad, "param group 0: betas must be in")


def test_loading_keeps_training_on_the_loaded_lr():
    """The loaded groups' lr drives the next step (not the constructor's)."""
    cfg = BASE
    model, opt = _trained(cfg)
    with opt:
        sd = opt.state_dict()
        sd["param_groups"][0]["lr"] = 0.0
        opt.load_state_dict(sd)
        before = engine_state(opt, model)
        x = make_batches(cfg, 3)[2]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.synchronize()
        after = engine_state(opt, model)
    name = next(iter(before))
    assert torch.equal(after[name]["master"], before[name]["master"])  # lr 0: no update
    assert not torch.equal(after[name]["exp_avg"], before[name]["exp_avg"])
    assert math.isclose(opt.param_groups[0]["lr"], 0.0)


# --- on a GPU (pytest -m gpu) -----------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_state_dict_copies_only_the_tail_and_an_integer_gpu_tail_resumes_bit_exact(
    tmp_path,
):
    """On a GPU: host buckets' entries view their page-locked buffers, tail buckets' entries
    are host copies; the file is ~12 B/param; and with an integer gpu_tail a run resumed
    (memory-mapped) right after a clipped step equals the uninterrupted one bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = "cuda"
    cfg = _some(BASE.replace(steps=16, two_groups=True, schedule="warmup_decay"))
    whole = run_superoffload(cfg, device, gpu_tail=2)
    assert whole.stats["gpu_tail_buckets"] == 2
    clipped = [i for i, n in enumerate(whole.grad_norms) if n > cfg.max_grad_norm]
    at = next(i + 1 for i in clipped if i + 1 in clipped and i >= 4)
    batches = make_batches(cfg, device=device)

    first = cfg.replace(steps=at)
    model = build_model(first, device)
    with make_engine(model, first, gpu_tail=2) as opt:
        scheduler = make_scheduler(cfg, opt)
        train_loop(first, model, opt, batches, engine_do_step(opt), scheduler=scheduler)
        sd = opt.state_dict()
        for i, param in enumerate(p for g in opt.param_groups for p in g["params"]):
            bucket, _ = opt._slot[id(param)]
            entry = sd["state"][i]
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert entry[key].device.type == "cpu"
                shares = entry[key].untyped_storage().data_ptr() == (
                    getattr(bucket, key).untyped_storage().data_ptr()
                )
                assert shares == (not bucket.on_device), (i, key, bucket.on_device)
        torch.save(
            {"model": model.state_dict(), "optimizer": sd, "scheduler": scheduler.state_dict()},
            tmp_path / "checkpoint.pt",
        )
        numel = sum(p.numel() for p in model.parameters())
    size = os.path.getsize(tmp_path / "checkpoint.pt") - 4 * numel  # minus the model
    assert 12 * numel <= size <= 12 * numel * 1.05 + 128 * 1024, (size, 12 * numel)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True, mmap=True)

    model = build_model(cfg.replace(model_seed=99), device)
    model.load_state_dict(checkpoint["model"])
    with make_engine(model, cfg, gpu_tail=2) as opt:
        scheduler = make_scheduler(cfg, opt)
        opt.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        train_loop(cfg, model, opt, batches, engine_do_step(opt), start=at, scheduler=scheduler)
        state, params = snapshot(opt, model)
    for name, st in state.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], getattr(whole, key)[name]), (key, name)
        assert torch.equal(params[name], whole.params[name]), name


def test_a_superoffload_state_dict_continues_in_torch_adamw():
    """Switching back: torch.optim.AdamW loads our state dict (the extra 'master' entries and
    our format record are ignored by it) and continues as our optimizer does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    data = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(3))
    options = {"lr": 1e-2, "weight_decay": 0.01}
    with SuperOffloadOptimizer(
        model.parameters(), max_grad_norm=0.0, gpu_tail=0, **options
    ) as ours:
        for step in range(3):
            model(data[step]).pow(2).mean().backward()
            ours.step()
            ours.zero_grad()
        twin = copy.deepcopy(model)
        adamw = torch.optim.AdamW(twin.parameters(), **options)
        adamw.load_state_dict(copy.deepcopy(ours.state_dict()))
        for step in range(3, 5):
            for net, opt in ((model, ours), (twin, adamw)):
                net(data[step]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        ours.synchronize()
        for (name, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
        assert all(int(s["step"]) == 5 for s in adamw.state_dict()["state"].values())
