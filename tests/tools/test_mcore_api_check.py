"""tools/mcore_api_check.py: the project's megatron-core uses are found in its source with ast (names,
keywords, keys of **kwargs dicts traced across functions), every one exists in the installed release,
a release that renames or drops one is reported with the project line that uses it, and (slow, needs
PyPI) the newest release pyproject.toml allows passes too."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_tool():
    spec = importlib.util.spec_from_file_location("mcore_api_check", REPO / "tools" / "mcore_api_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module    # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


@pytest.fixture(scope="module")
def uses():
    return tool.Project(REPO).uses()


def _keywords(uses, path):
    return {u.keyword for u in uses if u.path == path and u.keyword}


def test_uses_come_from_the_source_with_traced_keywords(uses):
    config = _keywords(uses, "megatron.core.transformer.TransformerConfig")
    # Literal keys of the dict built in models/builder.py ...
    assert {"num_layers", "apply_rope_fusion", "gradient_accumulation_fusion", "moe_router_dtype"} <= config
    # ... and keys that reach it from workers/build.py through three functions' parameters and a
    # caller's **kwargs (_config_overrides -> build_gpt_model_chunks -> build_gpt_model -> overrides).
    assert {"moe_enable_routing_replay", "variable_seq_lengths", "recompute_granularity", "recompute_method"} <= config
    # A project subclass without __init__ (CausalGPTModel) is called with GPTModel's keywords.
    assert {"pg_collection", "vp_stage", "mtp_block_spec"} <= _keywords(uses, "megatron.core.models.gpt.GPTModel")
    # The function get_forward_backward_func returns is called with these.
    assert {"forward_step_func", "forward_only", "p2p_communicator"} <= _keywords(
        uses, "megatron.core.pipeline_parallel.get_forward_backward_func()")
    paths = {u.path for u in uses}
    assert {"megatron.core.parallel_state.initialize_model_parallel", "megatron.core.dist_checkpointing.save",
            "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu"} <= paths
    where = {u.where.split(":")[0] for u in uses}
    assert "megatron_dapo/workers/build.py" in where and "tests/models/test_cpu_compat.py" in where


def test_the_installed_megatron_core_has_every_name_and_keyword(uses):
    tree = tool.MegatronTree(tool.installed_tree())
    assert tool.check(tree, uses) == []


@pytest.fixture(scope="module")
def broken_tree(tmp_path_factory):
    """A copy of the installed megatron/core (sources only) with one field, one function, one keyword
    and one module taken away, as an upgrade might."""
    root = tmp_path_factory.mktemp("mcore")
    src = tool.installed_tree() / "megatron" / "core"
    shutil.copytree(src, root / "megatron" / "core", ignore=shutil.ignore_patterns("*.pyc", "__pycache__", "*.so"))
    core = root / "megatron" / "core"

    def edit(rel, old, new):
        path = core / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1))

    edit("transformer/transformer_config.py", "    apply_rope_fusion: bool", "    apply_rope_fusion_renamed: bool")
    edit("parallel_state.py", "def model_parallel_is_initialized(", "def model_parallel_is_ready(")
    edit("models/gpt/gpt_layer_specs.py", "def get_gpt_decoder_block_spec(", "def _old_spec(")
    edit("models/gpt/gpt_layer_specs.py", "def _old_spec(", textwrap.dedent("""\
        def get_gpt_decoder_block_spec(config, use_transformer_engine, qk_l2_norm=False,
                                       vp_stage=None, pp_rank=None):
            return None


        def _old_spec("""))
    (core / "transformer" / "torch_norm.py").unlink()
    return root


def test_a_release_without_a_name_or_keyword_is_reported_with_the_using_line(uses, broken_tree):
    problems = tool.check(tool.MegatronTree(broken_tree), uses)
    text = "\n".join(problems)
    assert re.search(r"megatron_dapo/models/builder.py:\d+: megatron.core.transformer.TransformerConfig takes no "
                     r"keyword 'apply_rope_fusion'", text)
    assert re.search(r"megatron_dapo/parallel.py:\d+: megatron.core.parallel_state."
                     r"model_parallel_is_initialized does not exist", text)
    # The replacement signature dropped `normalization=`: only that keyword is reported.
    spec = [p for p in problems if "get_gpt_decoder_block_spec" in p]
    assert len(spec) == 1 and "keyword 'normalization'" in spec[0]
    assert re.search(r"megatron_dapo/models/builder.py:\d+: megatron.core.transformer.torch_norm.WrappedTorchNorm "
                     r"does not exist", text)
    assert re.search(r"tests/models/test_builder.py:\d+: megatron.core.transformer.torch_norm", text)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_tracing_rules_on_a_small_project_and_release(tmp_path):
    """Each rule on its own: re-exports through __init__, dataclass fields of a base, **kwargs accepts
    anything, dict keys through `or`, `if`-expressions, a project function's returned dict and a
    parameter set at the call site, and an assignment to a class attribute that no longer exists."""
    mc = tmp_path / "release"
    _write(mc, "megatron/__init__.py", "")
    _write(mc, "megatron/core/__init__.py", "from .package_info import *\n")
    _write(mc, "megatron/core/package_info.py", "MAJOR = 9\nMINOR = 1\nPATCH = 0\n")
    _write(mc, "megatron/core/cfg/__init__.py", "from .impl import Config\n")
    _write(mc, "megatron/core/cfg/impl.py", """\
        from dataclasses import dataclass

        @dataclass
        class Base:
            a: int = 0

        @dataclass
        class Config(Base):
            b: int = 0
            scale: float = 1.0

        def loose(x, **kwargs):
            return x
        """)
    proj = tmp_path / "proj"
    _write(proj, "megatron_dapo/use.py", """\
        from megatron.core.cfg import Config
        from megatron.core.cfg.impl import loose, Config as C2

        def extra():
            out = {"b": 1}
            out["c"] = 2
            return out

        def build(overrides=None):
            kwargs = dict(a=1)
            kwargs.update(**({"b": 2} if overrides else {"z": 3}))
            kwargs.update(overrides or {})
            return Config(**kwargs)

        def main():
            build(overrides=extra())
            loose(1, anything=2)
            C2.scale = 2.0
            C2.gone = 1
        """)
    uses = tool.Project(proj).uses()
    assert _keywords(uses, "megatron.core.cfg.Config") == {"a", "b", "c", "z"}
    problems = tool.check(tool.MegatronTree(mc), uses)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "megatron.core.cfg.Config takes no keyword 'c'",
        "megatron.core.cfg.Config takes no keyword 'z'",
        "megatron.core.cfg.impl.Config has no attribute 'gone' to assign",
    ]
    assert tool.MegatronTree(mc).version() == "9.1.0"


def test_cli_exit_codes(tmp_path):
    ok = subprocess.run([sys.executable, str(REPO / "tools" / "mcore_api_check.py")], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert re.search(r"megatron-core 0\.16\.\d+ at .*: \d+ names, \d+ keywords used; all present", ok.stdout)
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "mcore_api_check.py"), "--tree", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no megatron/core package inside" in bad.stderr


def _allowed_spec() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("megatron-core")]
    return spec


_OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                      r"Network is unreachable|Name or service not known|ConnectTimeout|ProxyError")


@pytest.mark.slow
def test_the_newest_allowed_megatron_core_has_every_name_and_keyword(uses, tmp_path):
    """Downloads (no deps, no install) the newest megatron-core that pyproject.toml allows, for the
    Python of current NGC images (3.12: releases from 0.17 on ship cp312 wheels only), and reads it."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--python-version", "3.12", "--dest", str(tmp_path), _allowed_spec()],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and _OFFLINE.search(proc.stdout + proc.stderr):
        pytest.skip(f"no network to download {_allowed_spec()}: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("megatron_core-*.whl")
    tree = tool.MegatronTree(tool.unpack_wheel(wheel, tmp_path / "unpacked"))
    assert tool.check(tree, uses) == []
    print(f"checked {wheel.name} (megatron-core {tree.version()})")
