"""The ZeRO-3 path's gathers wait for the params' CPU updates at issue when the gather reads the
partition, and at use (the handle's wait) when it only points the params at their partitions.
The equality tests of test_zero3.py run these wrappers inside DeepSpeed; here each rule is
checked on its own with stand-ins for DeepSpeed's per-param gather functions."""

from __future__ import annotations

import torch

from hf_superoffload.zero3.gather_waits import WaitsAtUse, wrap_gathers


class _Handle:
    def __init__(self, log: list):
        self.log = log

    def wait(self, **kwargs):
        self.log.append(("deepspeed wait", kwargs))


def _param(log: list, world_size: int = 1, device: str = "cpu", quantized: bool = False):
    param = torch.nn.Parameter(torch.zeros(4))
    param.ds_zero_partition_world_size = world_size
    param.ds_secondary_tensor = None
    param.ds_tensor = torch.zeros(4, device=device)
    if quantized:
        param.ds_tensor.ds_quant_scale = torch.ones(1)

    def all_gather_coalesced(params, **kwargs):
        log.append(("gather issued", len(list(params))))
        return _Handle(log)

    def all_gather(param_list=None, async_op=False, hierarchy=0):
        log.append(("sync gather", None))

    param.all_gather_coalesced = all_gather_coalesced
    param.all_gather = all_gather
    return param


def _wrapped(log: list, **options):
    param = _param(log, **options)
    wrap_gathers(param, lambda params: log.append(("waited for updates", len(params))))
    return param


def test_a_gather_that_reads_nothing_waits_when_the_module_uses_the_params():
    log: list = []
    param = _wrapped(log)
    handle = param.all_gather_coalesced([param])
    assert isinstance(handle, WaitsAtUse)
    assert log == [("gather issued", 1)]  # a prefetch does not hold the training thread
    handle.wait(handle_dependency=True)
    handle.wait()  # DeepSpeed pops the handle once per param: the updates are waited for once
    assert log == [
        ("gather issued", 1),
        ("deepspeed wait", {"handle_dependency": True}),
        ("waited for updates", 1),
        ("deepspeed wait", {}),
    ]


def test_gathers_that_read_the_partition_wait_before_they_are_issued():
    for options in ({"world_size": 2}, {"device": "meta"}, {"quantized": True}):
        log: list = []
        param = _wrapped(log, **options)
        handle = param.all_gather_coalesced([param])
        assert isinstance(handle, _Handle), options
        assert log == [("waited for updates", 1), ("gather issued", 1)], options


def test_a_synchronous_gather_waits_before_it_is_issued():
    log: list = []
    param = _wrapped(log)
    param.all_gather()
    assert log == [("waited for updates", 1), ("sync gather", None)]
