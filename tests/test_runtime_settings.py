"""kvtool.runtime.settings: the defaults, `use_settings` for a block (nested, restored after an error), and
the runtime reading the current value where it takes effect."""

from __future__ import annotations

import pytest
import torch

from kvtool.runtime import RuntimeSettings, current_settings, use_settings
from kvtool.runtime.layer import held_prompt


def test_the_defaults_are_what_kvtool_ships():
    assert current_settings() == RuntimeSettings(
        hold_prompt_on_host=True, fused_decode_step=True, split_victim_search=True, mixed_precision_decode=True,
        generate_loop="auto",
    )


def test_use_settings_changes_a_block_and_gives_the_settings_back():
    before = current_settings()
    with use_settings(fused_decode_step=False) as inside:
        assert inside == current_settings() and not inside.fused_decode_step and inside.hold_prompt_on_host
        with use_settings(hold_prompt_on_host=False):
            assert current_settings() == RuntimeSettings(hold_prompt_on_host=False, fused_decode_step=False)
        assert current_settings() is inside
    with pytest.raises(RuntimeError), use_settings(split_victim_search=False):
        raise RuntimeError("inside")
    assert current_settings() is before


def test_unknown_fields_and_loops_are_refused():
    with pytest.raises(TypeError), use_settings(fused=False):
        pass
    with pytest.raises(ValueError, match="generate_loop"):
        RuntimeSettings(generate_loop="graph")
    assert current_settings() == RuntimeSettings()


def test_where_a_gpu_holds_a_drafts_prompts_follows_the_settings():
    cuda = torch.device("cuda")  # only the device's type is read: no GPU needed
    assert held_prompt.held_on_host(cuda) and not held_prompt.held_on_host(torch.device("cpu"))
    with use_settings(hold_prompt_on_host=False):
        assert not held_prompt.held_on_host(cuda)
