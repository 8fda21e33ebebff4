"""megatron/checkpoints.py and ``mm-balance compare-checkpoints``: torch_dist checkpoints
(``torch.distributed.checkpoint`` directories, as Megatron-LM and Megatron-Bridge write them)
compared bit for bit. The real ones are compared by the Bridge fp32 off-vs-on test."""
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_mm_balance.megatron import checkpoints

#: slow: multi-process runs of Megatron-LM's or Megatron-Bridge's own code (the fast subset,
#: -m "not realpath", leaves them to the whole suite)
pytestmark = pytest.mark.realpath

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _save(path, state, iteration=6):
    """A save directory as Megatron lays it out: iter_NNNNNNN/ and the tracker file."""
    ckpt = path / f"iter_{iteration:07d}"
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    (path / checkpoints.TRACKER).write_text(str(iteration))
    return ckpt


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"decoder.weight": torch.randn(8, 4, generator=g), "decoder.bias": torch.randn(4, generator=g),
            "optimizer.exp_avg": torch.randn(8, 4, generator=g, dtype=torch.float64),
            "step": torch.tensor(6), "mask": torch.tensor([True, False])}


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "compare-checkpoints",
                           *map(str, argv)], capture_output=True, text=True, timeout=120, cwd=str(ROOT))


def test_identical_checkpoints_compare_identical(tmp_path):
    a, b = _save(tmp_path / "a", _state()), _save(tmp_path / "b", _state())
    cmp = checkpoints.compare_checkpoints(str(tmp_path / "a"), str(b))   # save dir or iter dir
    assert cmp.identical and len(cmp.same) == 4 and cmp.summary().endswith("IDENTICAL")   # the model's
    assert len(checkpoints.compare_checkpoints(str(a), str(b), everything=True).same) == 5  # + optimizer
    loaded = checkpoints.load_tensors(str(a))
    assert torch.equal(loaded["decoder.weight"], _state()["decoder.weight"])
    r = _cli(tmp_path / "a", tmp_path / "b")
    assert r.returncode == 0 and "4 tensors bit-identical" in r.stdout, r.stdout + r.stderr
    assert "5 tensors bit-identical" in _cli(tmp_path / "a", tmp_path / "b", "--optimizer").stdout


def test_one_ulp_is_a_difference(tmp_path):
    """The smallest change a float can take (one unit in the last place) is seen."""
    other = _state()
    w = other["decoder.weight"]
    w[3, 1] = torch.nextafter(w[3, 1], torch.tensor(float("inf")))
    _save(tmp_path / "a", _state())
    _save(tmp_path / "b", other)
    cmp = checkpoints.compare_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not cmp.identical and list(cmp.different) == ["decoder.weight"] and len(cmp.same) == 3
    ulp = (w[3, 1] - _state()["decoder.weight"][3, 1]).abs().item() / _state()["decoder.weight"].abs().max().item()
    assert cmp.max_relative_difference == pytest.approx(ulp) and 0 < ulp < 1e-6
    ref = _state()
    norm = sum(float(ref[k].double().pow(2).sum()) for k in ("decoder.weight", "decoder.bias")) ** 0.5
    step = (w[3, 1].double() - ref["decoder.weight"][3, 1].double()).abs().item()
    assert cmp.norm_relative_difference == pytest.approx(step / norm)
    r = _cli(tmp_path / "a", tmp_path / "b", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and list(out["different"]) == ["decoder.weight"]
    assert out["norm_relative_difference"] == pytest.approx(cmp.norm_relative_difference)


def test_missing_tensor_and_bad_paths(tmp_path):
    fewer = _state()
    del fewer["mask"]
    _save(tmp_path / "a", _state())
    _save(tmp_path / "b", fewer)
    cmp = checkpoints.compare_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"))
    assert cmp.only_a == ["mask"] and not cmp.identical
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoints.CheckpointError, match="not a torch_dist checkpoint"):
        checkpoints.checkpoint_dir(str(tmp_path / "empty"))
    r = _cli(tmp_path / "empty", tmp_path / "a")
    assert r.returncode == 2 and "not a torch_dist checkpoint" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
