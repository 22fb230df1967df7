"""``flow.timestep_range``: training on one side of a timestep boundary (Wan 2.2's two
experts). The draw is the configured distribution (kind, shift) truncated to [low, high),
sampled by its inverse CDF: nothing falls outside, and its shape inside equals the full
distribution conditioned on the range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knapray.models.timesteps import TimestepDistribution


@pytest.mark.parametrize("kind", ["logit_normal", "uniform"])
@pytest.mark.parametrize("low, high", [(0.875, 1.0), (0.0, 0.875), (0.3, 0.6)])
def test_truncated_draw_is_the_distribution_conditioned_on_the_range(kind, low, high):
    gen = torch.Generator().manual_seed(1)
    full = TimestepDistribution(kind=kind, mean=0.2, std=1.1, shift=5.0)
    inside = full.sample(400_000, generator=gen)
    inside = inside[(inside >= low) & (inside < high)].double().numpy()
    t = TimestepDistribution(kind=kind, mean=0.2, std=1.1, shift=5.0, low=low, high=high).sample(
        100_000, generator=gen).double().numpy()
    assert t.dtype == np.float64 and t.min() >= low and t.max() < high
    qs = np.linspace(0.05, 0.95, 19)
    np.testing.assert_allclose(np.quantile(t, qs), np.quantile(inside, qs), atol=0.01)


def test_the_full_range_draws_as_before():
    """[0, 1): the untruncated path, the same numbers from the same generator."""
    a = TimestepDistribution(shift=3.0).sample(1000, generator=torch.Generator().manual_seed(5))
    b = TimestepDistribution(shift=3.0, low=0.0, high=1.0).sample(1000, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_config_reads_the_range_and_refuses_bad_ones():
    from knapray.config.run import ConfigError, load_config

    cfg = load_config(None, ["flow.timestep_range=[0.875, 1.0]", "flow.timestep_shift=5.0"])
    dist = cfg.flow.distribution()
    assert (dist.low, dist.high, dist.shift) == (0.875, 1.0, 5.0)
    for sets, words in [(["flow.timestep_range=[0.9, 0.2]"], "is empty"),
                        (["flow.timestep_range=[0, 1.5]"], "timestep_range"),
                        (["flow.timestep_range=[0.5, 1]", "flow.resolution_shift=true"], "exclude each other")]:
        with pytest.raises(ConfigError, match=words) as err:
            load_config(None, sets)
        assert "\n" not in str(err.value)
