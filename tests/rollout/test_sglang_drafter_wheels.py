"""The drafter facts of sglang_versions (which releases have an MTP drafter for Qwen3-MoE, which updates
reach it) against the release wheels themselves, read as zips (never imported). Slow: it downloads
each wheel with pip; skipped without access to the package index."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_dapo.rollout.sglang.versions import features_for

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SCHEDULER = ("sglang/srt/managers/scheduler_update_weights_mixin.py",        # to 0.5.12
             "sglang/srt/managers/scheduler_components/weight_updater.py")   # from 0.5.13
DRAFTER = "sglang/srt/models/qwen3_moe_mtp.py"


def _method(source: str, name: str) -> str:
    tree = ast.parse(source)
    found = [ast.get_source_segment(source, n) for n in ast.walk(tree)
             if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, (name, len(found))
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.5.8", "0.5.12", "0.5.13", "0.5.20", "0.5.21", "0.5.23"])
def test_the_drafter_table_is_what_the_wheel_says(tmp_path, version):
    sys.path.insert(0, str(TOOLS))
    import sglang_protocol

    try:
        wheel = sglang_protocol.download_wheel(version, tmp_path)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot download sglang=={version} with pip (no network to the package index?): {e}")
    f = features_for(version)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        read = lambda path: z.read(path).decode()  # noqa: E731
        has_drafter = DRAFTER in names
        assert has_drafter == ("qwen3_moe" in f.mtp_drafters)
        if has_drafter:  # the draft config rewrite, the names its load_weights keeps, the shared embedding / head
            assert '"Qwen3MoeForCausalLMMTP"' in read("sglang/srt/configs/model_config.py")
            loader = _method(read("sglang/srt/models/qwen3_moe.py"), "load_weights")
            for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
                assert f'"{name}"' in loader
            assert 'name.replace("mtp", "model")' in loader and 'elif "mtp" in name' in loader
            drafter = read(DRAFTER)
            assert "def set_embed_and_head" in drafter and "torch.cat((input_embeds, hidden_states)" in drafter
        (scheduler,) = [read(p) for p in SCHEDULER if p in names]
        distributed = _method(scheduler, "update_weights_from_distributed")
        reaches = "_select_runners" in distributed or "draft_worker" in distributed
        assert reaches == f.drafter_via_distributed, distributed
        tensor = _method(scheduler, "update_weights_from_tensor")
        assert "_select_runners" in tensor or "self.draft_worker or self.tp_worker" in tensor  # every release
    wheel.unlink()
