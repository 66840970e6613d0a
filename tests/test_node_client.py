"""examples/node: a Node.js client built from the .proto files alone, run against a real loopback target service.

Skipped when `node` or `npm` is missing, or when `npm ci` cannot fetch @grpc/grpc-js and @grpc/proto-loader
(no registry); the packages land in examples/node/node_modules (gitignored), so later runs skip the install.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from test_rpc_support import PROMPT, draft_service, one_torch_thread, pair, start, target_service  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/node"
N = 20


@pytest.fixture(scope="module")
def node_example() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node or npm is not installed")
    if not all((EXAMPLE / "node_modules/@grpc" / name).exists() for name in ("grpc-js", "proto-loader")):
        try:
            subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=EXAMPLE, check=True,
                           capture_output=True, text=True, timeout=120)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"npm could not install the example's packages: {e}")
    return EXAMPLE / "generate.js"


def test_node_client_streams_the_target_only_tokens(node_example, pair):  # noqa: F811
    reference = generate(load_model(pair[0]), PROMPT, N).token_ids
    with start(draft_service(pair[1])) as draft, start(target_service(pair[0], draft_address=draft.address)) as target:
        out = subprocess.run(["node", str(node_example), target.address, "--prompt-ids", ",".join(map(str, PROMPT)),
                              "--max-new-tokens", str(N), "--num-draft-tokens", "3"],
                             capture_output=True, text=True, timeout=60)
        refused = subprocess.run(["node", str(node_example), target.address, "--chat", "hi"],
                                 capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert (result["prompt_ids"], result["token_ids"]) == (PROMPT, reference)
    assert result["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
    assert isinstance(result["stats"]["staged_bytes"], str) and int(result["stats"]["staged_bytes"]) > 0  # uint64
    assert int(result["stats"]["drafted"]) > 0
    assert "head_version \"0\"" in out.stderr  # a uint64 arrives as a string
    assert refused.returncode == 1 and "status 9" in refused.stderr and "chat template" in refused.stderr
