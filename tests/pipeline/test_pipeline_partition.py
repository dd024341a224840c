"""Which layers each stage and virtual chunk holds, and clear errors for impossible splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtron.config import MeshtronConfig
from meshtron.errors import ConfigError
from meshtron.parallel.context import ParallelContext
from meshtron.pipeline import get_schedule
from meshtron.pipeline.partition import check_micro_batches, partition_layers
from meshtron.validation import layout_from_config


def test_even_split_keeps_layers_in_order():
    layout = partition_layers(8, 4)
    assert [layout.layers(p) for p in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.virtual_stages == 1
    assert layout.has_embedding(0) and not layout.has_embedding(1)
    assert layout.has_loss(3) and not layout.has_loss(2)


def test_one_stage_holds_everything():
    layout = partition_layers(5, 1)
    assert layout.layers(0) == [0, 1, 2, 3, 4]
    assert layout.has_embedding(0) and layout.has_loss(0)


@pytest.mark.parametrize("first,last,expected", [
    (1, None, [[0], [1, 2, 3, 4], [5, 6, 7, 8]]),
    (None, 2, [[0, 1, 2], [3, 4, 5], [6, 7]]),
    (3, 1, [[0, 1, 2], [3, 4], [5, 6], [7]]),
])
def test_uneven_first_and_last_stages(first, last, expected):
    layers = sum(len(x) for x in expected)
    layout = partition_layers(layers, len(expected), first=first, last=last)
    assert [layout.layers(p) for p in range(len(expected))] == expected


def test_virtual_chunks_are_round_robin_like_megatron():
    """Chunk v of stage p is model chunk v * PP + p."""
    layout = partition_layers(8, 2, virtual_size=2)
    assert layout.stage_layers(0) == [[0, 1], [4, 5]]
    assert layout.stage_layers(1) == [[2, 3], [6, 7]]
    assert layout.has_embedding(0, 0) and not layout.has_embedding(0, 1)
    assert layout.has_loss(1, 1) and not layout.has_loss(1, 0) and not layout.has_loss(0, 1)
    same = partition_layers(8, 2, layers_per_virtual=2)
    assert same == layout


def test_virtual_chunks_with_uneven_stages():
    # 10 layers, first stage 2, last stage 4, middle 4: chunks of 1, 2, 2 layers per virtual stage.
    layout = partition_layers(10, 3, first=2, last=4, virtual_size=2)
    assert layout.stage_layers(0) == [[0], [5]]
    assert layout.stage_layers(1) == [[1, 2], [6, 7]]
    assert layout.stage_layers(2) == [[3, 4], [8, 9]]
    all_layers = sorted(i for p in range(3) for chunk in layout.stage_layers(p) for i in chunk)
    assert all_layers == list(range(10))


def test_layout_from_config_reads_the_flags():
    cfg = MeshtronConfig()
    cfg.model.num_layers = 12
    cfg.parallel.pipeline_model_parallel_size = 3
    cfg.parallel.num_layers_per_virtual_pipeline_stage = 2
    layout = layout_from_config(cfg)
    assert layout.virtual_stages == 2
    assert layout.stage_layers(2) == [[4, 5], [10, 11]]


def test_accounting_slots_take_a_layer_from_the_first_and_last_chunk():
    # 28 layers + embedding + loss over 2 stages: 15 slots each, 14 layers each.
    layout = partition_layers(28, 2, embedding_slot=True, loss_slot=True)
    assert [len(c) for c in layout.chunk_layers] == [14, 14]
    # 5 layers + the loss over 2 stages: 3 + 2 layers.
    assert partition_layers(5, 2, loss_slot=True).stage_layers(1) == [[3, 4]]
    # 6 layers + both slots over 2 stages x 2 virtual stages: 2 slots per chunk.
    layout = partition_layers(6, 2, virtual_size=2, embedding_slot=True, loss_slot=True)
    assert layout.stage_layers(0) == [[0], [3, 4]] and layout.stage_layers(1) == [[1, 2], [5]]
    assert partition_layers(10, 2, layers_per_virtual=3, embedding_slot=True, loss_slot=True).virtual_stages == 2


@pytest.mark.parametrize("kwargs,flags", [
    (dict(num_layers=7, stages=2), ["--num-layers (7)", "--pipeline-model-parallel-size (2)"]),
    (dict(num_layers=8, stages=3, first=3), ["--decoder-first-pipeline-num-layers 3", "5 layers"]),
    (dict(num_layers=8, stages=2, first=3, last=4), ["--decoder-last-pipeline-num-layers 4 must add up to"]),
    (dict(num_layers=8, stages=2, first=8), ["leaves 0 layers"]),
    (dict(num_layers=8, stages=1, first=2), ["--decoder-first-pipeline-num-layers needs"]),
    (dict(num_layers=8, stages=2, first=0), ["--decoder-first-pipeline-num-layers must be >= 1"]),
    (dict(num_layers=8, stages=2, virtual_size=3), ["not divisible by 3 virtual stages"]),
    (dict(num_layers=12, stages=2, layers_per_virtual=4), ["--num-layers-per-virtual-pipeline-stage (4)"]),
    (dict(num_layers=8, stages=2, layers_per_virtual=2, virtual_size=4), ["contradicts"]),
    (dict(num_layers=8, stages=2, first=2, layers_per_virtual=1), ["cannot be combined"]),
    (dict(num_layers=8, stages=1, virtual_size=2), ["--virtual-pipeline-model-parallel-size needs"]),
    (dict(num_layers=6, stages=2, first=3, virtual_size=2), ["pipeline stage 0 has 3 layers", "not divisible"]),
    (dict(num_layers=8, stages=2, loss_slot=True), ["--account-for-loss-in-pipeline-split = 9", "(2)"]),
    (dict(num_layers=8, stages=2, last=3, loss_slot=True), ["cannot be combined with --decoder-first"]),
    (dict(num_layers=7, stages=1, embedding_slot=True), ["--account-for-embedding-in-pipeline-split needs"]),
], ids=lambda x: None)
def test_impossible_splits_name_the_flags(kwargs, flags):
    kwargs = dict(kwargs)
    with pytest.raises(ConfigError) as err:
        partition_layers(kwargs.pop("num_layers"), kwargs.pop("stages"), **kwargs)
    for text in flags:
        assert text in str(err.value), str(err.value)


def test_interleaving_needs_micro_batches_in_groups_of_stages():
    check_micro_batches(8, 4, 2)
    check_micro_batches(3, 4, 1)  # 1F1B takes any number
    with pytest.raises(ConfigError, match=r"= 6\) to be a multiple of --pipeline-model-parallel-size \(4\)"):
        check_micro_batches(6, 4, 2)


def test_get_schedule_rejects_a_micro_batch_count_interleaving_cannot_run():
    cfg = MeshtronConfig()
    cfg.model.num_layers = 4
    cfg.parallel.pipeline_model_parallel_size = 2
    cfg.parallel.virtual_pipeline_model_parallel_size = 2
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 3
    with pytest.raises(ConfigError, match="--global-batch-size"):
        get_schedule(cfg, ParallelContext(pp=2), forward_step=lambda chunk, micro_batch, hidden: (hidden, None))


# megatron-core 0.19.2's own placements (tests/fixtures/megatron/make_pipeline_layouts.py)
_MEGATRON_PLACEMENTS = json.loads((Path(__file__).parents[1] / "fixtures" / "megatron" /
                                   "pipeline_layouts.json").read_text())


@pytest.mark.parametrize("case", _MEGATRON_PLACEMENTS["layouts"], ids=lambda c: f"{c['layout']}-pp{c['pp']}")
def test_layout_strings_place_layers_as_megatron_core(case):
    table = case["layers"]
    mtp = case["layout"].count("m")
    num_layers = sum(len(chunk) for row in table for chunk in row)
    layout = partition_layers(num_layers, case["pp"], layout=case["layout"], mtp_layers=mtp)
    assert layout.virtual_stages == len(table[0])
    assert [[layout.layers(p, v) for v in range(layout.virtual_stages)] for p in range(case["pp"])] == table


@pytest.mark.parametrize("case", _MEGATRON_PLACEMENTS["slots"],
                         ids=lambda c: f"L{c['num_layers']}-pp{c['pp']}-vp{c['vp']}-e{c['embedding']:d}l{c['loss']:d}")
def test_accounting_slots_place_layers_as_megatron_core(case):
    table = case["layers"]
    layout = partition_layers(case["num_layers"], case["pp"], virtual_size=case["vp"],
                              embedding_slot=case["embedding"], loss_slot=case["loss"])
    assert [[layout.layers(p, v) for v in range(layout.virtual_stages)] for p in range(case["pp"])] == table


def test_layout_string_sets_the_virtual_stages_and_trains_its_placement():
    cfg = MeshtronConfig()
    cfg.model.num_layers = 5
    cfg.parallel.pipeline_model_parallel_size = 2
    cfg.parallel.pipeline_model_parallel_layout = "Et|tt|t|tL"
    from meshtron.validation import resolve
    resolve(cfg)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    assert layout_from_config(cfg).chunk_layers == ((0,), (1, 2), (3,), (4,))


@pytest.mark.parametrize("text,kwargs,message", [
    ("Et|tt|t|t", {}, "the embedding (E) and the loss (L) once each"),
    ("tE|tt|t|tL", {}, "must begin with the embedding"),
    ("Et|tt|t|tLx", {}, "has 'x'"),
    ("Et|tt|tL", {}, "3 model chunks, not a multiple"),
    ("Et|ttt|t|tL", {}, "names 6 transformer layers (t), but --num-layers is 5"),
    ("Et|tt|t|tmL", {}, "names 1 multi-token prediction depths (m), but --mtp-num-layers is 0"),
    ("Et|tt|tm|tL", {"mtp_layers": 1}, "(m) come after every transformer layer (t)"),
    ("Et|tt|ttm|mL", {"mtp_layers": 2}, "must all be in one model chunk, not in chunks 2, 3"),
    ("Et|tttt|m|||L", {"mtp_layers": 1}, "in the last model chunk of their pipeline stage (model chunk 2 is virtual "
                                         "stage 1 of stage 0)"),
    # megatron-core's standalone depths: refused for training, with the string that trains them beside the loss
    ("Et|tt|tt||m|L", {"mtp_layers": 1}, "meshtron computes them beside the loss, in the last model chunk: "
                                         "--pipeline-model-parallel-layout 'Et|tt|tt|||mL'"),
    ("Et|(tt|)*2,|m*2|L", {"mtp_layers": 2}, "--pipeline-model-parallel-layout 'Et|(tt|)*2,||mmL'"),
    # an m inside a repeated group: the moved string is spelled out chunk by chunk
    ("Et|tttt|(m)*2|L", {"mtp_layers": 2}, "--pipeline-model-parallel-layout 'Et|tttt||mmL'"),
    ("Et|tt|t|tL", {"virtual_size": 3}, "but --virtual-pipeline-model-parallel-size is 3"),
    ("Et|tt|t|tL", {"embedding_slot": True}, "drop --account-for-embedding-in-pipeline-split"),
    ("Et|tt|t|tL", {"first": 1}, "drop --decoder-first-pipeline-num-layers"),
])
def test_layout_string_errors_name_the_flag_and_what_is_valid(text, kwargs, message):
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-layout") as err:
        partition_layers(5, 2, layout=text, **kwargs)
    assert message in str(err.value)


def test_standalone_prediction_depths_are_read_where_megatron_places_them():
    """A Megatron-LM checkpoint saved with its depths on a chunk of their own (``--pipeline-model-parallel-layout
    "...|m|L"``) is read with that placement (``standalone_mtp``, the checkpoint reader's); the default layout keeps
    them with the loss."""
    layout = partition_layers(5, 2, layout="Et|tt|tt||m|L", mtp_layers=1, standalone_mtp=True)
    assert layout.mtp_chunk == 4 and layout.has_mtp(0, 2) and not layout.has_mtp(1, 2)
    assert layout.chunk_layers == ((0,), (1, 2), (3, 4), (), (), ())
    assert partition_layers(5, 2, layout="Et|tt|tt|||mL", mtp_layers=1).has_mtp(1, 2)
    assert partition_layers(4, 2).has_mtp(1) and not partition_layers(4, 2).has_mtp(0)


def test_chunks_may_hold_the_embedding_or_the_loss_alone_as_in_megatron():
    """megatron-core builds chunks without transformer layers; meshtron's pipeline runs them (a chunk with nothing
    passes its input on), so the split is Megatron's."""
    slots = partition_layers(2, 2, virtual_size=2, embedding_slot=True, loss_slot=True)
    assert slots.chunk_layers == ((), (0,), (1,), ())
    assert partition_layers(4, 2, layout="E|tt||ttL").stage_layers(0) == [[], []]
