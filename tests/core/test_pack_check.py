"""The pack check (bad input refused before anything moves) and the MM_BALANCE_FAULT spec: pure."""
import pytest
import torch

from megatron_mm_balance.cost.pack_check import BadPack, PackCheck, pack_problems, sample_keys
from megatron_mm_balance.runtime import faults


def pack(tiles=(2, 1), imgs=None, placeholders=None, length=300, key="a,b"):
    n = len(tiles) if placeholders is None else placeholders
    return {"__key__": [key], "tokens": torch.tensor([[5] + [9] * n + [1, 2]]),
            "imgs": torch.zeros(sum(tiles) if imgs is None else imgs, 3, 4, 4),
            "num_tiles": torch.tensor(tiles, dtype=torch.int32),
            "cu_lengths": torch.tensor([[0, length // 3, length]], dtype=torch.int32)}


def test_a_consistent_pack_and_a_text_only_batch_pass():
    assert pack_problems(pack(), max_length=1024, image_token_id=9) == []
    text_only = {"tokens": torch.tensor([[1, 2, 3]]), "imgs": torch.tensor([[0.0]]),
                 "num_tiles": torch.tensor([[0]], dtype=torch.int32), "cu_lengths": torch.tensor([[0]])}
    assert pack_problems(text_only, max_length=2, image_token_id=9) == []      # not packed: no length
    no_tiles = {**pack(tiles=(0,), placeholders=0), "imgs": torch.zeros(0, 3, 4, 4)}   # [0] and no tile
    assert pack_problems(no_tiles, max_length=1024, image_token_id=9) == []
    one_tile = pack_problems(pack(tiles=(0,), imgs=1, placeholders=0))      # [0] beside a tile: refused
    assert any("num_tiles [0] gives an image fewer than 1 tile" in p for p in one_tile), one_tile
    assert pack_problems({"input_ids": [1, 2]}, max_length=1) == []            # keys it does not know
    assert pack_problems([1, 2, 3]) == []


@pytest.mark.parametrize("bad, problem", [
    (pack(tiles=(3, 1), imgs=3), "num_tiles [3, 1] sums to 4 tiles but imgs holds 3"),
    (pack(tiles=(0, 2)), "num_tiles [0, 2] gives an image fewer than 1 tile"),
    (pack(placeholders=3), "tokens hold 3 image placeholders (token 9) but num_tiles lists 2 images"),
    (pack(placeholders=1), "tokens hold 1 image placeholders (token 9) but num_tiles lists 2 images"),
    (pack(length=1025), "the packed sample is 1025 positions long"),
    ({**pack(), "imgs": torch.tensor([[0.0]])}, "num_tiles [2, 1] lists 2 images but imgs (shape [1, 1]) holds no image tiles"),
])
def test_each_contradiction_is_named(bad, problem):
    found = pack_problems(bad, max_length=1024, image_token_id=9)
    assert len(found) == 1 and problem in found[0], found


def test_placeholders_are_not_counted_without_the_token_id_nor_the_length_without_a_maximum():
    assert pack_problems(pack(placeholders=3, length=5000)) == []


def test_pack_check_names_the_samples_and_every_problem():
    with pytest.raises(BadPack) as err:
        PackCheck(max_length=100, image_token_id=9)(pack(tiles=(3, 1), imgs=3, length=200, key="s1,s2,s3"))
    msg = str(err.value)
    assert msg.startswith("mm-balance refuses a pack of samples [s1, s2, s3]: "), msg
    assert "sums to 4 tiles" in msg and "200 positions long" in msg
    PackCheck(max_length=1024, image_token_id=9)(pack())                       # passes silently
    assert sample_keys({"__key__": ["x,y", "z"]}) == ["x", "y", "z"] and sample_keys({}) == []
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        PackCheck(max_length=0)


def test_fault_spec_parses_and_fires_once():
    f = faults.parse("raise:rank=1:iteration=3:microstep=2")
    assert (f.kind, f.rank, f.iteration, f.microstep) == ("raise", 1, 3, 2)
    assert not f.at_pull(3, 1, "global batch 2")                                # not yet
    with pytest.raises(faults.InjectedFault, match="rank 1's data source raises pulling the pack of "
                                                    "micro-step 2 at global batch 2"):
        f.at_pull(3, 2, "global batch 2")
    assert not f.at_pull(3, 2, "global batch 2")                                # at most once
    end = faults.parse("end:rank=0:iteration=1:microstep=0")
    assert end.at_pull(1, 0, "") is True and end.at_pull(1, 0, "") is False


def test_corrupt_fault_contradicts_the_first_image_and_leaves_the_source_pack_alone():
    f = faults.parse("corrupt:rank=0:iteration=2:microstep=1")
    p = pack()
    assert f.after_pull(2, 0, p) is p
    bad = f.after_pull(2, 1, p)
    assert bad["num_tiles"].tolist() == [3, 1] and p["num_tiles"].tolist() == [2, 1]
    assert "sums to 4 tiles but imgs holds 3" in pack_problems(bad)[0]
    g = faults.parse("corrupt:rank=0:iteration=1:microstep=0")
    with pytest.raises(ValueError, match="no image metadata to contradict"):
        g.after_pull(1, 0, {"tokens": torch.zeros(3)})


@pytest.mark.parametrize("spec", ["explode:rank=1:iteration=1:microstep=0", "kill:rank=1:iteration=1",
                                  "kill:rank=1:iteration=0:microstep=0", "kill:rank=x:iteration=1:microstep=0",
                                  "kill:rank=1:rank=2:iteration=1:microstep=0", "kill:step=1"])
def test_a_malformed_fault_spec_is_one_line_naming_the_variable(spec):
    with pytest.raises(ValueError, match=r"^MM_BALANCE_FAULT=") as err:
        faults.parse(spec)
    assert "\n" not in str(err.value)


def test_the_fault_is_read_for_its_rank_only(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.configured(0) is None
    monkeypatch.setenv(faults.ENV, "kill:rank=1:iteration=2:microstep=0")
    assert faults.configured(0) is None and faults.configured(1).kind == "kill"


def test_batch_names_and_context():
    from megatron_mm_balance.runtime.errors import add_context, batch_name
    assert batch_name(2) == "global batch 2" and batch_name(2, 5) == "global batch 2 (iteration 7)"
    e = add_context(ValueError("x"), "rank 1, global batch 0, micro-step 1: the data source raised")
    assert e.mm_balance_context.startswith("rank 1") and str(e) == "x"
    assert add_context(e, "other").mm_balance_context.startswith("rank 1")      # the first one stays
