"""The golden loss file: the tiny fixed-seed run reproduces tests/assets/losses/tiny_cpu.txt exactly."""

from megatron_dapo.trainer.golden import GOLDEN, format_rows, golden_losses


def test_tiny_run_reproduces_the_golden_losses_exactly():
    expected = [line for line in open(GOLDEN).read().splitlines(keepends=True) if not line.startswith("#")]
    assert format_rows(golden_losses()) == "".join(expected), (
        "numerics changed: if deliberate, regenerate with `python -m megatron_dapo.trainer.golden --write` "
        "and say why in the commit")
