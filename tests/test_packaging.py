"""The wheel a user installs: one `deltaspec` namespace, nothing named `shared` in site-packages.

A wheel built with `python -m build` goes into a fresh virtualenv and runs `deltaspec generate` and
`deltaspec serve-target` from a directory outside the repository. The fresh venv borrows its dependencies
(torch, grpcio, ...) from the test venv through a path file, so the test installs the wheel alone instead of
a gigabyte of wheels; the editable install's finder is not imported there, so only the wheel can answer
`import deltaspec`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"shared": "deltaspec.shared", "draft_service": "deltaspec.draft_service",
           "target_service": "deltaspec.target_service", "openai_service": "deltaspec.openai_service"}


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"deltaspec", "deltaspec.v1"}
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            on_disk.add(".".join([name, *init.parent.relative_to(ROOT / folder).parts]))
    assert listed == on_disk


def test_code_imports_the_folders_only_through_the_namespace():
    """From the repository root `import shared` would also work, and load a second copy of every module."""
    bare = re.compile(r"^\s*(from|import) (shared|draft_service|target_service|openai_service)\b"
                      r"|-m\W+(shared|draft_service)\.", re.M)
    offenders = [str(p.relative_to(ROOT)) for folder in (*FOLDERS, "benchmarks", "tests", "scripts")
                 for p in (ROOT / folder).rglob("*.py") if bare.search(p.read_text())]
    assert not offenders


def test_the_state_layer_imports_nothing_of_the_model_package():
    """The state takes its shapes from the state spec a family declares (`StateSpec`): the state imports nothing of
    the model package, so a new model family touches no state code."""
    offenders = [p.name for p in (ROOT / "shared" / "state").glob("*.py") if "deltaspec.shared.model" in
                 re.sub(r'""".*?"""|#.*', "", p.read_text(), flags=re.S)]
    assert not offenders


def test_the_package_root_exports_the_client_without_loading_torch():
    """`from deltaspec import Client` is the public name; `import deltaspec.v1` (the gRPC code) stays light."""
    code = ("import sys, deltaspec, deltaspec.v1.target_service_pb2; assert 'torch' not in sys.modules; "
            "from deltaspec import AsyncClient, Client, DeltaspecRpcError, InvalidArgumentError; "
            "import deltaspec.shared.client as c; "
            "assert (Client, AsyncClient, DeltaspecRpcError) == (c.Client, c.AsyncClient, c.DeltaspecRpcError); "
            "assert issubclass(InvalidArgumentError, DeltaspecRpcError); "
            "assert set(deltaspec.__all__) == set(c.__all__); "
            "assert not hasattr(deltaspec, 'Nothing')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_the_package_root_is_committed_and_only_v1_is_generated():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/deltaspec/v1/" in ignored and "/deltaspec/" not in ignored
    assert (ROOT / "deltaspec" / "__init__.py").is_file() and (ROOT / "deltaspec" / "cli.py").is_file()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"deltaspec": "deltaspec.cli:main"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with only the built wheel installed; returns its bin directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: an in-tree build leaves build/lib behind, whose stale modules a later wheel would carry.
    source = shutil.copytree(ROOT, tmp / "source", ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "site", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache", "node_modules"))
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("deltaspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"deltaspec"}, tops
    sources = {str(p.relative_to(ROOT / folder)) for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    packed = {n.split("/", 2)[2] for n in names if n.startswith(tuple(f"deltaspec/{folder}/" for folder in FOLDERS))}
    assert sources <= packed, sources - packed  # every module made it into the wheel
    assert "deltaspec/shared/assets/models/target/model.safetensors" in names
    assert {"deltaspec/__init__.py", "deltaspec/cli.py", "deltaspec/v1/target_service_pb2.py"} <= set(names)
    measurement = [n for n in names if re.search(r"(^|/)bench(marks)?(/|\.py$)|proxy|overhead", n)]
    assert not measurement, measurement  # the benchmarks, the fault proxy and the overhead probes stay in the checkout

    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    fresh_site = Path(subprocess.check_output(
        [str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        text=True).strip())
    (fresh_site / "borrowed_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    installed_tops = {p.name for p in fresh_site.iterdir()}
    assert "deltaspec" in installed_tops
    assert not installed_tops & set(FOLDERS), installed_tops & set(FOLDERS)
    return env_dir / "bin"


def run_outside(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"},
                          **kwargs)


def test_wheel_generates_and_serves_outside_the_repository(installed, tmp_path):
    where = run_outside([str(installed / "python"), "-c", "import deltaspec.shared, sys; "
                         "print(deltaspec.shared.__file__); print('shared' in sys.modules)"], cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    path, bare = where.stdout.split()
    assert not Path(path).is_relative_to(ROOT) and bare == "False"
    models = run_outside([str(installed / "python"), "-m", "deltaspec.cli", "models", "--json"], cwd=tmp_path)
    assert models.returncode == 0 and set(json.loads(models.stdout)) == {"target", "draft"}, models.stderr

    generate = [str(installed / "deltaspec"), "generate", "--prompt", "def main():", "--max-new-tokens", "12",
                "--json"]
    local = run_outside(generate, cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    tokens = json.loads(local.stdout.strip().splitlines()[-1])["token_ids"]
    assert len(tokens) == 12

    server = subprocess.Popen([str(installed / "deltaspec"), "serve-target", "--port", "0", "--draft", "ngram"],
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ,
                                                                                     "OMP_NUM_THREADS": "1"})
    try:
        address = None
        for line in server.stderr:  # type: ignore[union-attr]
            if line.startswith("listening on"):
                address = line.split()[-1]
            if line.startswith("serving"):
                break
        assert address, f"serve-target exited with {server.poll()} before serving"
        remote = run_outside(generate + ["--target-addr", address], cwd=tmp_path)
        assert remote.returncode == 0, remote.stderr
        assert json.loads(remote.stdout.strip().splitlines()[-1])["token_ids"] == tokens
    finally:
        server.kill()
        server.wait()


def test_wheel_refuses_the_bench_commands_in_one_line(installed, tmp_path):
    """`deltaspec bench|study|soak` need the checkout's benchmarks/, which the wheel does not hold."""
    for command in ("bench", "study", "soak"):
        out = run_outside([str(installed / "deltaspec"), command], cwd=tmp_path)
        assert out.returncode == 2, (command, out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1 and "from a source checkout" in out.stderr, out.stderr
        assert f"deltaspec {command}" in out.stderr and "Traceback" not in out.stderr
