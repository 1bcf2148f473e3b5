"""What a decoder without activation checkpointing keeps for backward: the bytes
``activation_memory.decoder_saved_bytes`` counts (and the memory plan plans, one function for
both) against what torch's autograd saves, measured with ``saved_tensors_hooks`` in a training
forward of tiny Llama, Qwen2 and Qwen3 models with sdpa attention on the CPU, in bf16 and fp32
(and on a GPU in bf16, the ``gpu`` tier); and the refusal of the decoders it does not count."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_superoffload.zero3.activation_memory import (
    DecoderWidths,
    decoder_saved_bytes,
    layer_saved_bytes,
)
from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

BATCH, SEQ, VOCAB = 2, 40, 96
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 3}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, num_attention_heads=4),
    "llama-gqa": lambda: transformers.LlamaConfig(
        **SMALL, num_attention_heads=8, num_key_value_heads=2, head_dim=16
    ),
    "qwen2-gqa-bias": lambda: transformers.Qwen2Config(
        **SMALL, num_attention_heads=4, num_key_value_heads=2
    ),
    # q/k norms, and heads x head_dim wider than the hidden size (as Qwen3-30B-A3B's).
    "qwen3": lambda: transformers.Qwen3Config(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=24
    ),
}


def _measured(config, dtype: torch.dtype, device: str = "cpu") -> tuple[int, list[int]]:
    """Bytes of the distinct storages autograd saves in a training forward (the params apart):
    in all, and by decoder layer (each storage counted in the first layer that saves it)."""
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to(device, dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = model.model.layers
    where, saved = ["outside"], {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), (where[0], storage.nbytes()))
        return tensor

    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=index: where.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "outside"))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ)  # a row a sequence, as TRL
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=ids, position_ids=positions).logits
    assert logits.requires_grad
    per_layer = [sum(n for at, n in saved.values() if at == i) for i in range(len(layers))]
    return sum(n for _, n in saved.values()), per_layer


CASES = [
    ("cpu", torch.bfloat16), ("cpu", torch.float32),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),  # sdpa's flash kernel
]  # fmt: skip


@pytest.mark.parametrize(("device", "dtype"), CASES, ids=["cpu-bf16", "cpu-fp32", "cuda-bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_counted_bytes_are_what_autograd_saves(name, device, dtype):
    config = CONFIGS[name]()
    total, per_layer = _measured(config, dtype, device)
    widths = DecoderWidths.of(config)
    low = torch.finfo(dtype).bits // 8
    # The last layer saves nothing shared with another (the rotary cos and sin go to the first).
    cuda = device == "cuda"
    assert per_layer[-1] == layer_saved_bytes(widths, BATCH * SEQ, low, cuda)
    assert total == decoder_saved_bytes(widths, BATCH, SEQ, low, cuda)


def test_the_plan_counts_every_layers_saved_tensors_without_checkpointing():
    """Llama-3.1-8B, seq 4096 x batch 4: the plan's activations are decoder_saved_bytes (the
    function the measurement above checks), far above a checkpointed run's."""
    from hf_superoffload.cli import model_source

    config = model_source.resolve("llama-3.1-8b").config
    checkpointed = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4))
    plan = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, activation_checkpointing=False))
    widths = DecoderWidths.of(config)
    assert plan.gpu["layer_activations"] == decoder_saved_bytes(widths, 4, 4096, 2)
    assert "layer_inputs" not in plan.gpu and "layer_recompute" not in plan.gpu
    assert plan.gpu["layer_backward"] == checkpointed.gpu["layer_recompute"]
    # 32 layers of 200840 B a token (norms 2 x 32772, attention 20608, MLP 114688) and 33292
    # B a token outside them, 16384 tokens: 98.6 GiB, against 4 GiB of checkpointed inputs.
    assert plan.gpu["layer_activations"] == (32 * 200840 + 33292) * 16384 + 32 * 16
    assert checkpointed.gpu["layer_inputs"] == 4 * 2**30
    assert plan.host == checkpointed.host  # nothing of it on the host
    assert plan.shortfalls(80 * 2**30, 10**13)[0].startswith("GPU: needs")  # nor on an H100


@pytest.mark.parametrize(
    ("shipped", "reason"),
    [
        ("phi-4", "'phi3' layers save other tensors"),
        ("qwen3-30b-a3b", "'qwen3_moe' layers save other tensors"),
        ("gpt-oss-20b", "'gpt_oss' layers save other tensors"),
        ("seed-oss-36b", "'seed_oss' layers save other tensors"),
    ],
)
def test_a_decoder_it_does_not_count_is_refused_without_checkpointing(shipped, reason):
    from hf_superoffload.cli import model_source

    config = model_source.resolve(shipped).config
    zero3_memory_plan(config, Zero3Run(seq=16, batch=1))  # checkpointed: planned
    with pytest.raises(ValueError, match="turn activation checkpointing on") as refusal:
        zero3_memory_plan(config, Zero3Run(seq=16, batch=1, activation_checkpointing=False))
    assert reason in str(refusal.value)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"attention_dropout": 0.1}, "attention dropout keeps its masks"),
        ({"hidden_act": "gelu"}, "'gelu' is not SiLU"),
        ({"head_dim": 512}, "head dim above 256"),
    ],
)
def test_layers_that_save_more_are_refused(change, reason):
    config = transformers.LlamaConfig(**SMALL, num_attention_heads=4, **change)
    with pytest.raises(ValueError, match=reason):
        DecoderWidths.of(config)


def test_a_sliding_window_is_refused():
    config = transformers.Qwen2Config(
        **SMALL, num_attention_heads=4, use_sliding_window=True, sliding_window=16
    )
    with pytest.raises(ValueError, match="sliding-window layers attend through a mask"):
        DecoderWidths.of(config)


def test_offload_without_checkpointing_is_refused():
    config = CONFIGS["llama"]()
    run = Zero3Run(
        seq=16, batch=1, activation_checkpointing=False, activation_checkpoint_offload=True
    )
    with pytest.raises(ValueError, match="activation checkpointing is off"):
        zero3_memory_plan(config, run)
