"""The streamed ZeRO-3 model save (hf_superoffload/zero3/streaming_save.py) writes, a param at a
time, the tensors DeepSpeed's gathering save writes (``_zero3_consolidated_16bit_state_dict``
and ``save_pretrained``, as the Trainer saves under ZeRO-3): same names, dtypes and values,
tied weights once, loadable with ``from_pretrained``; in shards of at most ``max_shard_bytes``,
holding no more than ``save_memory.streamed_save_host_bytes`` says.

The engine runs are spawned ranks (DeepSpeed's CPU accelerator, gloo, bf16 params as on a GPU):
a tiny Llama (untied and tied embeddings) trained a step, then saved both ways on the same
engine. The ShardWriter's cut and the memory plan's figure are checked without DeepSpeed.
"""

from __future__ import annotations

import glob
import itertools
import json
import os

import pytest
import torch
from ranks import spawn_ranks
from safetensors.torch import load_file
from safetensors.torch import save_file as save_file_of_safetensors
from zero3_reference import Zero3Case, build_model, free_port, init_rank, make_engine, train

from hf_superoffload.zero3.save_memory import STREAMED_SHARD_BYTES, streamed_save_host_bytes
from hf_superoffload.zero3.streaming_save import ShardWriter

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CASE = Zero3Case(steps=1, bf16=True)
SHARD_BYTES = 20_000  # the tiny model (45 KB in bf16) makes 3 shards
TINY_SHARD_BYTES = 100  # below every matrix: each gets a shard of its own
# The tiny Llama with its own lm_head (and a persistent buffer), with it tied to the embedding,
# and a tiny Qwen3-MoE
# (whose fused experts save_pretrained writes unfused, one tensor an expert).
MODELS = ("untied", "tied", "moe")


def _builder(name: str):
    if name == "moe":
        from test_zero3_moe import build_moe_model

        return build_moe_model
    if name == "tied":
        return lambda seed: build_model(seed, tie_word_embeddings=True)

    def with_a_persistent_buffer(seed):  # saved beside the params, as DeepSpeed's save does
        model = build_model(seed)
        model.model.register_buffer("probe", torch.arange(6.0).reshape(2, 3))
        return model

    return with_a_persistent_buffer


def _save_both_ways(rank: int, world: int, out: str, name: str) -> None:
    from hf_superoffload.zero3.streaming_save import largest_param_bytes, write_streamed_weights

    engine, _ = make_engine(CASE, True, world, model_builder=_builder(name))
    train(engine, CASE, rank, range(CASE.steps))
    writer = write_streamed_weights(engine, f"{out}/{name}/stream", rank == 0, SHARD_BYTES)
    tiny = write_streamed_weights(engine, f"{out}/{name}/tiny", rank == 0, TINY_SHARD_BYTES)
    gathered = engine._zero3_consolidated_16bit_state_dict()  # what the Trainer saves today
    if rank == 0:
        engine.module.save_pretrained(f"{out}/{name}/gather", state_dict=gathered)
        facts = {
            "peak_held": writer.peak_held_bytes,
            "tiny_peak_held": tiny.peak_held_bytes,
            "largest": largest_param_bytes(engine.module),
        }
        with open(f"{out}/{name}/facts.json", "w") as f:
            json.dump(facts, f)
    else:
        assert writer is None and tiny is None  # the other ranks write (and hold) nothing
    engine.destroy()


def _ranks_body(rank: int, world: int, port: int, out: str) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates "super_offload": true)

    for name in MODELS:
        _save_both_ways(rank, world, out, name)


def _saved(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        for key, tensor in load_file(path).items():
            assert key not in tensors, f"{key} saved twice"
            tensors[key] = tensor
    return tensors


def _shard_sizes(directory) -> list[int]:
    sizes = []
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        sizes.append(sum(tensor.nbytes for tensor in load_file(path).values()))
    return sizes


def _run(tmp_path_factory, world: int):
    out = tmp_path_factory.mktemp(f"streaming_save_{world}")
    spawn_ranks(_ranks_body, (world, free_port(), str(out)), world=world, timeout=300)
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(tmp_path_factory, 2)


def _assert_same_files(out, name: str) -> None:
    stream, gather = _saved(out / name / "stream"), _saved(out / name / "gather")
    assert sorted(stream) == sorted(gather)
    for key, want in gather.items():
        got = stream[key]
        assert got.dtype == want.dtype, key
        assert want.dtype == (torch.float32 if key == "model.probe" else torch.bfloat16), key
        assert torch.equal(got, want), key
    # Trained: the values are the step's, not the initial weights.
    if name != "moe":  # (the MoE model's checkpoint names are not its params' names)
        initial = _builder(name)(0).state_dict()
        moved = [k for k in gather if not torch.equal(gather[k], initial[k].to(torch.bfloat16))]
        assert len(moved) > len(gather) // 2
    # The cut: shards of at most SHARD_BYTES and their index, naming every tensor once.
    sizes = _shard_sizes(out / name / "stream")
    assert len(sizes) >= 3 and max(sizes) <= SHARD_BYTES
    # A shard closes only when the next tensor would not fit beside it.
    assert all(a + b > SHARD_BYTES for a, b in itertools.pairwise(sizes))
    with open(out / name / "stream" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert sorted(index["weight_map"]) == sorted(gather)
    assert sorted(set(index["weight_map"].values())) == [
        f"model-{i:05d}-of-{len(sizes):05d}.safetensors" for i in range(1, len(sizes) + 1)
    ]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in gather.values())
    assert not os.path.exists(out / name / "stream" / "model.safetensors")
    # A shard size below one param: each matrix gets a shard of its own (save_pretrained's rule).
    tiny = _saved(out / name / "tiny")
    assert all(torch.equal(tiny[k], gather[k]) for k in gather) and sorted(tiny) == sorted(gather)
    tiny_sizes = _shard_sizes(out / name / "tiny")
    if name != "moe":  # (there a param becomes many tensors, which share its shard)
        matrices = sum(1 for t in gather.values() if t.nbytes > TINY_SHARD_BYTES)
        assert len(tiny_sizes) >= matrices
    with open(out / name / "facts.json") as f:
        assert max(tiny_sizes) == json.load(f)["largest"]


def _assert_within_the_figure(out, name: str) -> None:
    with open(out / name / "facts.json") as f:
        facts = json.load(f)
    largest = facts["largest"]
    # The embedding (and lm_head), bf16; in the MoE model its 8 experts' fused gate_up_proj.
    assert largest == (8 * 32 * 32 * 2 if name == "moe" else 64 * 32 * 2)
    # The writer held at most one shard (a param that would overflow it closes it first) ...
    assert SHARD_BYTES // 2 < facts["peak_held"] <= SHARD_BYTES
    # ... or, with shards smaller than a param, one param.
    assert facts["tiny_peak_held"] == largest
    # The figure adds the gathered param itself (host memory on DeepSpeed's CPU accelerator).
    for peak, bound in ((facts["peak_held"], SHARD_BYTES), (facts["tiny_peak_held"], 100)):
        assert peak + largest <= streamed_save_host_bytes(largest, bound)


def test_one_rank_streams_what_the_gathering_save_writes(one_rank):
    assert "model.probe" in _saved(one_rank / "untied" / "gather")
    _assert_same_files(one_rank, "untied")
    _assert_within_the_figure(one_rank, "untied")


def test_one_rank_saves_tied_embeddings_once_as_save_pretrained_does(one_rank):
    gather = _saved(one_rank / "tied" / "gather")
    assert "model.embed_tokens.weight" in gather and "lm_head.weight" not in gather
    _assert_same_files(one_rank, "tied")


def test_streamed_files_load_with_from_pretrained(one_rank):
    from transformers import AutoModelForCausalLM

    for name in MODELS:
        directory, gathered = one_rank / name / "stream", one_rank / name / "gather"
        # The config is save_pretrained's, written beside the gathered weights.
        for config_file in ("config.json", "generation_config.json"):
            (directory / config_file).write_bytes((gathered / config_file).read_bytes())
        model = AutoModelForCausalLM.from_pretrained(directory)
        want = AutoModelForCausalLM.from_pretrained(gathered).state_dict()
        loaded = model.state_dict()
        assert sorted(loaded) == sorted(want)
        for key, tensor in want.items():
            assert loaded[key].dtype == tensor.dtype == torch.bfloat16, key
            assert torch.equal(loaded[key], tensor), key
        if name == "tied":
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_one_rank_saves_a_moe_models_experts_unfused_as_save_pretrained_does(one_rank):
    gather = _saved(one_rank / "moe" / "gather")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in gather
    assert not any(key.endswith("gate_up_proj") for key in gather)
    _assert_same_files(one_rank, "moe")
    _assert_within_the_figure(one_rank, "moe")


def test_two_ranks_stream_what_the_gathering_save_writes(two_ranks):
    for name in MODELS:
        _assert_same_files(two_ranks, name)
        _assert_within_the_figure(two_ranks, name)


def test_shard_writer_cuts_before_a_param_that_would_overflow(tmp_path):
    writer = ShardWriter(str(tmp_path), 1000)
    sizes = [300, 300, 300, 300, 2500, 100]  # fp32 elements x 4 bytes: 1200 ... bytes
    for i, numel in enumerate(sizes):
        nbytes = numel * 4 // 4  # uint8: one byte an element
        writer.reserve(nbytes)
        writer.add({f"t{i}": torch.full((nbytes,), i, dtype=torch.uint8)}, reserved=nbytes)
    names = writer.finish(total_parameters=sum(sizes))
    assert names == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    contents = []
    for name in names:
        contents.append(sorted(load_file(tmp_path / name)))
    # 300+300+300 fit 1000; the fourth closes the shard; 2500 alone; 100 after it.
    assert contents == [["t0", "t1", "t2"], ["t3"], ["t4"], ["t5"]]
    assert writer.peak_held_bytes == 2500
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert index["metadata"] == {"total_parameters": sum(sizes), "total_size": sum(sizes)}
    assert not list(tmp_path.glob("*.partial"))


def test_one_shard_is_model_safetensors_and_replaces_an_earlier_sharded_save(tmp_path):
    from hf_superoffload.zero3.save_staging import publish, start_staging

    for name in ("model.safetensors.index.json", "model-00001-of-00002.safetensors", "x.json"):
        (tmp_path / name).write_text("old")
    (tmp_path / ".streaming-00001.safetensors.partial").write_text("left by an interrupted save")
    staging = start_staging(str(tmp_path))
    assert not (tmp_path / ".streaming-00001.safetensors.partial").exists()
    writer = ShardWriter(staging, 10_000)
    writer.reserve(16)
    writer.add({"w": torch.arange(4, dtype=torch.float32)}, reserved=16)
    assert writer.finish(total_parameters=4) == ["model.safetensors"]
    (tmp_path / ".streaming-save" / "config.json").write_text("new")
    publish(str(tmp_path), ["model.safetensors"])
    # The previous save's weight files go; other files stay, or are replaced by the new ones.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "x.json",
    ]
    assert (tmp_path / "config.json").read_text() == "new"
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], torch.arange(4.0))


@pytest.mark.parametrize("bad", [0, -1, 1.5, "5GB"])
def test_a_shard_size_that_is_not_a_positive_byte_count_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="max_shard_size must be a positive number of bytes"):
        ShardWriter(str(tmp_path), bad)


def test_the_plan_counts_the_streamed_save():
    from transformers import AutoConfig

    from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan
    from hf_superoffload.zero3.model_shape import ModelShape

    config_path = os.path.join(
        os.path.dirname(__file__), "..", "hf_superoffload", "model_configs", "llama-3.3-70b.json"
    )
    with open(config_path) as f:
        values = json.load(f)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    shape = ModelShape.of(config)
    plan = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, ranks=4), shape)
    embedding = 2 * 128256 * 8192  # the largest param, bf16
    assert 2 * shape.largest_param == embedding
    assert plan.host_save - plan.host_training == STREAMED_SHARD_BYTES + embedding
    # Not the whole model's 16 bits (141 GB) that DeepSpeed's gathering save holds.
    assert plan.host_save - plan.host_training < 2 * shape.params / 10


def test_a_checkpoint_format_made_from_several_params_is_refused_before_anything_is_written():
    """A model whose checkpoint splits one tensor into several params on load (here one fused
    "qkv" into q, k and v) saves them joined again: a param at a time cannot, so it is refused,
    naming what to do, before any file is written (and, under the Trainer, before training)."""
    from transformers.core_model_loading import Chunk, WeightConverter

    from hf_superoffload.zero3.streaming_save import _weight_conversions

    model = build_model(0)
    model._weight_conversions = [
        WeightConverter(
            source_patterns="self_attn.qkv.weight",
            target_patterns=["self_attn.q.weight", "self_attn.k.weight", "self_attn.v.weight"],
            operations=[Chunk(dim=0)],
        )
    ]
    with pytest.raises(NotImplementedError, match="--save_model false --save_strategy no"):
        _weight_conversions(model)
    model._weight_conversions = []  # loaded without any conversion: nothing to revert
    assert _weight_conversions(model) is None


# A failure on the writing rank mid-save: every rank raises (rank 0 its own error, the others
# one naming it) instead of the others waiting in the next gather.
FAILURES = ("shard_write", "prologue")


def _fail_on_rank_zero(rank: int, world: int, port: int, out: str) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401
    import hf_superoffload.zero3.streaming_save as streaming_save

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    engine, _ = make_engine(CASE, True, world, model_builder=_builder("untied"))
    for failure in FAILURES:
        if rank == 0 and failure == "shard_write":
            streaming_save.save_file = disk_full
        extra = {}
        if failure == "prologue":  # rank 0's _save (the Trainer's) fails before any gather
            extra["prologue"] = disk_full if rank == 0 else (lambda directory: None)
        try:
            streaming_save.write_streamed_weights(
                engine, f"{out}/{failure}", rank == 0, SHARD_BYTES, **extra
            )
            outcome = "returned"
        except Exception as error:  # what each rank raised is what the test checks
            outcome = f"{type(error).__name__}: {error}"
        with open(f"{out}/{failure}-rank{rank}.txt", "w") as f:
            f.write(outcome)
        streaming_save.save_file = save_file_of_safetensors
    engine.destroy()


def test_a_write_failure_on_rank_zero_raises_on_every_rank(tmp_path):
    spawn_ranks(_fail_on_rank_zero, (2, free_port(), str(tmp_path)), world=2, timeout=120)
    for failure in FAILURES:
        own = (tmp_path / f"{failure}-rank0.txt").read_text()
        other = (tmp_path / f"{failure}-rank1.txt").read_text()
        assert own == "OSError: No space left on device", failure
        assert other.startswith("RuntimeError:"), (failure, other)
        assert "rank 0" in other and "No space left on device" in other, (failure, other)
        leftovers = [p.name for p in (tmp_path / failure).iterdir()]
        assert leftovers == [], (failure, leftovers)  # nothing half-written stays
