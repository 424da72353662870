"""rollout.speculative.*: the auto keys and the errors that name them."""

import pytest

from megatron_dapo.config import ConfigError, load_config


def _load(*overrides):
    return load_config(None, list(overrides))


def test_auto_defaults_and_a_valid_auto_config():
    spec = _load().rollout.speculative
    assert (spec.algorithm, spec.auto, spec.auto_steps, spec.auto_start_step) == (None, False, 1, 1)
    spec = _load("rollout.engine=sglang", "rollout.speculative.algorithm=NEXTN", "rollout.speculative.auto=true",
                 "rollout.speculative.auto_steps=2", "rollout.speculative.auto_start_step=20").rollout.speculative
    assert (spec.auto, spec.auto_steps, spec.auto_start_step) == (True, 2, 20)


@pytest.mark.parametrize("overrides, key, message", [
    (["rollout.engine=sglang", "rollout.speculative.auto=true"], "rollout.speculative.auto", "needs rollout.speculative"),
    (["rollout.speculative.algorithm=EAGLE", "rollout.speculative.auto=true"], "rollout.speculative.auto",
     "rollout.engine=sglang"),
    (["rollout.engine=sglang", "rollout.sglang_urls=[http://127.0.0.1:1]", "rollout.speculative.algorithm=EAGLE",
      "rollout.speculative.auto=true"], "rollout.speculative.auto", "no rollout.sglang_urls"),
    (["rollout.speculative.auto_steps=0"], "rollout.speculative.auto_steps", ">= 1"),
    (["rollout.speculative.auto_start_step=0"], "rollout.speculative.auto_start_step", ">= 1"),
])
def test_bad_auto_settings_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as e:
        _load(*overrides)
    assert e.value.key == key
