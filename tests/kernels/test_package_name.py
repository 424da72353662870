"""No regular top-level `kernels` package in the repo: from the repo root (the working directory of the
README's commands, the SLURM script, the Docker image and the SGLang servers) `import kernels` must reach
the PyPI package of that name, which transformers 5.25+ depends on and imports; the Triton sources stay in
kernels/ and are imported as `megatron_dapo.kernels`."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_kernels_from_the_repo_root_reaches_the_installed_package(tmp_path):
    # Stands for the PyPI `kernels`, installed after the repo root on sys.path (site-packages is).
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHO = 'the installed kernels package'\n")
    r = subprocess.run([sys.executable, "-c", "import kernels, sys; print(sys.path[0] == '', kernels.WHO, "
                        "kernels.__file__)"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:5] == ["True", "the", "installed", "kernels", "package"]
    assert r.stdout.split()[5] == str(tmp_path / "kernels" / "__init__.py")


def test_the_triton_sources_in_kernels_are_the_modules_of_megatron_dapo_kernels():
    import megatron_dapo.kernels as package
    from megatron_dapo.kernels import clipped_loss, logprob_entropy

    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert pathlib.Path(package.__file__).parent == ROOT / "megatron_dapo" / "kernels"
    for module in (clipped_loss, logprob_entropy):
        source = ROOT / "kernels" / pathlib.Path(module.__file__).name
        assert pathlib.Path(module.__file__).resolve() == source.resolve()
    assert package.fused_logprob_stats is logprob_entropy.fused_logprob_stats
