"""Packaging: every third-party import is declared, and a non-editable wheel installed into a fresh venv
carries its configs, dashboards and bundled model and runs ``pdserve demo`` outside the source tree.

The fresh venv (no pip of its own) gets pdserve from the wheel alone (``pip install --no-deps``); its
dependencies (torch, ray, ...) come from this interpreter's site-packages through a path line in a
``.pth`` file. Path lines are not processed as site dirs, so this interpreter's own (editable) pdserve
install stays invisible: ``deploy.cli`` must import from the wheel's copy, which the test checks.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = {"cluster", "workers", "transfer", "deploy", "bench", "tests"}
RUNTIME_PACKAGES = ("cluster", "workers", "transfer", "deploy")


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")

    def names(text: str) -> set[str]:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        return {importlib.metadata.Prepared.normalize(Requirement(ln).name) for ln in lines}

    extras = {k: names(v) for k, v in cfg["options.extras_require"].items()}
    return names(cfg["options"]["install_requires"]), extras


def _imports(package: str) -> tuple[set[str], set[str]]:
    """Third-party top-level modules ``package`` imports: (required, optional). Optional: imported in
    the body of a ``try`` that catches ImportError (the code works without it)."""
    found: set[str] = set()
    optional: set[str] = set()

    def modules(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Import):
            return {alias.name.split(".")[0] for alias in node.names}
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            return {node.module.split(".")[0]}
        return set()

    for path in (REPO / package).rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            found |= modules(node)
            if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers
            ):
                optional |= {m for stmt in node.body for sub in ast.walk(stmt) for m in modules(sub)}
    third_party = {m for m in found if m not in sys.stdlib_module_names and m not in PROJECT_PACKAGES}
    return third_party - optional, third_party & optional


def _distributions(modules: set[str]) -> dict[str, set[str]]:
    owners = importlib.metadata.packages_distributions()
    return {m: {importlib.metadata.Prepared.normalize(d) for d in owners.get(m, [])} for m in modules}


def test_every_imported_third_party_package_is_declared() -> None:
    required, extras = _declared()
    imported = [_imports(p) for p in RUNTIME_PACKAGES]
    runtime = set().union(*(required_ for required_, _ in imported))
    optional = set().union(*(optional_ for _, optional_ in imported))
    # NOTE: an optional import (guarded by `except ImportError`) must still be declared in some extra
    every_extra = set().union(*extras.values())
    unlisted = {m: d for m, d in _distributions(optional).items() if not d & (required | every_extra)}
    assert unlisted == {}, f"optional imports of cluster/workers/transfer/deploy in no extra: {unlisted}"
    assert {"torch", "ray", "zmq", "pydantic", "huggingface_hub", "xgrammar", "starlette"} <= runtime
    # NOTE: triton is the optional GPU attention backend's ([gpu]); everything else must be core.
    undeclared = {m: d for m, d in _distributions(runtime).items() if not d & (required | extras["gpu"])}
    assert undeclared == {}, (
        f"imported by cluster/workers/transfer/deploy but not in install_requires: {undeclared}"
    )
    # NOTE: bench/'s optional imports are peers it measures when present (other hash libraries)
    bench_required, _ = _imports("bench")
    allowed = required | extras["bench"] | extras["gpu"]
    bench = {m: d for m, d in _distributions(bench_required).items() if not d & allowed}
    assert bench == {}, f"imported by bench/ but in neither install_requires nor [bench] / [gpu]: {bench}"
    assert extras["gpu"] == {"triton"}


def _copy_sources(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "out"
    )
    return Path(shutil.copytree(REPO, dest, ignore=ignore))


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path: Path) -> None:
    src = _copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("pdserve-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "project-deps.pth").write_text("".join(f"{p}\n" for p in sorted(deps)))
    # NOTE: pip comes from the dependency path; --ignore-installed: the editable pdserve visible there is
    # neither reused nor touched (path lines are not site dirs, so it is not importable either).
    install = ["-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)]
    subprocess.run([str(python), *install], check=True, timeout=300)

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    where = subprocess.run(
        [
            str(python),
            "-c",
            "import deploy.cli, workers, importlib.metadata as m; print(deploy.cli.__file__); print(m.version('pdserve'))",
        ],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    assert where[0].startswith(purelib) and where[1] == "0.1.0"
    installed = Path(purelib)
    for data in (
        "deploy/cpu-disagg.yaml",
        "deploy/cpu-colocated.yaml",
        "deploy/gpu-disagg.yaml",
        "deploy/prometheus.yml",
        "deploy/grafana/pdserve.json",
        "workers/assets/pdserve-tiny/model.safetensors",
        "workers/assets/pdserve-tiny/tokenizer.json",
        "bench/configs/qwen3-0.6b/config.json",
    ):
        assert (installed / data).is_file(), data

    demo = subprocess.run(
        [str(venv / "bin" / "pdserve"), "demo", "--max-tokens", "8", "--stats-interval", "0"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "serving pdserve-tiny on http://127.0.0.1:" in demo.stdout
    assert "TTFT" in demo.stdout and "cluster shut down" in demo.stdout
