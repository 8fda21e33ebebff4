"""One image-token convention: the runtime's default and the glue's ``make_cost_fn`` agree
on every batch shape the project produces, and the cost module imports without torch."""
import subprocess
import sys

import pytest
import torch

from megatron_mm_balance.megatron.config import MMBalanceConfig
from megatron_mm_balance.megatron.iterator import make_cost_fn
from megatron_mm_balance.cost.pack import ImageTokenCost, default_cost_fn

from test_glue_energon import Encoder, Sample

TPT = 256


def _batches():
    """(name, batch, image tokens counted by hand) for every shape we produce."""
    enc = Encoder()                                   # tokens per tile 10 in the energon tests
    per_pack = enc.encode_batch(enc.batch([Sample("a", [3, 1], 90)]))
    mbs2 = enc.encode_batch(enc.batch([Sample("a", [3, 1], 90), Sample("b", [1, 1], 40)]))
    return [
        ("scalar image_tokens", {"image_tokens": 700}, 700),
        ("0-d tensor image_tokens", {"image_tokens": torch.tensor(700)}, 700),
        ("per-pack image_tokens, mbs 2", {"image_tokens": torch.tensor([3, 4])}, 7),
        ("per-image counts list", {"image_token_counts": [100, 50, 6]}, 156),
        ("per-image counts nested list", {"image_token_counts": [[100, 50], [6]]}, 156),
        ("per-image counts tensor", {"image_token_counts": torch.tensor([100, 50])}, 150),
        ("counts win over per-pack", {"image_token_counts": [100, 50], "image_tokens": [999]}, 150),
        ("num_tiles tensor", {"num_tiles": torch.tensor([2, 1], dtype=torch.int32)}, 3 * TPT),
        ("num_tiles 2-d (mbs 2)", {"num_tiles": torch.tensor([[2, 1], [1, 0]])}, 4 * TPT),
        ("num_tiles int", {"num_tiles": 4}, 4 * TPT),
        ("imgs tensor", {"imgs": torch.zeros(6, 3, 2, 2)}, 6 * TPT),
        ("text only", {"tokens": torch.zeros(3)}, 0),
        ("energon mixin, mbs 1", per_pack, 40),
        ("energon mixin, mbs 2", mbs2, 60),
    ]


@pytest.mark.parametrize("name,batch,want", _batches(), ids=[b[0] for b in _batches()])
def test_runtime_default_and_glue_agree(name, batch, want):
    glue = make_cost_fn(MMBalanceConfig())
    assert default_cost_fn(batch) == glue(batch) == want
    assert isinstance(glue(batch), int)
    assert glue.identity == default_cost_fn.identity


def test_glue_cost_is_the_runtime_class():
    assert type(make_cost_fn(MMBalanceConfig())) is ImageTokenCost


def test_tokens_per_tile_must_be_positive():
    for bad in (0, -3, None, 2.5):
        with pytest.raises(ValueError, match="tokens_per_tile"):
            ImageTokenCost(bad)


def test_cost_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from megatron_mm_balance.cost.pack import ImageTokenCost\n"
            "import megatron_mm_balance.megatron.energon\n"
            "assert ImageTokenCost(10)({'num_tiles': [[1, 2], [3]]}) == 60\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
