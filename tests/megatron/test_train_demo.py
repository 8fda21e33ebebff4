"""The training demo's entry point (``mm-balance demo --train``): bad input fails fast
with a one-line message, before any process starts. (Its report is tested on the
acceptance runs in ``test_cpu_e2e.py``.) Budget: < 1 s."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_mm_balance.testing.train_demo import main  # noqa: E402


@pytest.mark.parametrize("argv, msg", [
    (["--steps", "1"], "--steps must be >= 2"),
    (["--", "--steps", "1"], "--steps must be >= 2"),
    (["--img-size", "30"], "--img-size must be a positive multiple"),
    (["--vision-ms-per-tile", "-1"], "must be >= 0"),
    (["--layout", "dp8"], "invalid choice"),
    (["--mixture", "nope"], "invalid choice"),
])
def test_bad_arguments_fail_with_a_clear_message(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
