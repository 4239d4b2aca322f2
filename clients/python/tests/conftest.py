"""A real `rollarc serve` for the SDK's tests: the binary from ROLLARC_BIN (default: the
workspace's target/debug/rollarc), on a free port, with its own data directory."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from rollarc import Client

ROOT = Path(__file__).resolve().parents[3]
#: The running service's data directory (set by the `service` fixture).
DATA: dict = {}


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = os.environ.get("ROLLARC_BIN", str(ROOT / "target" / "debug" / "rollarc"))
    if not Path(binary).is_file():
        pytest.fail(f"no rollarc binary at {binary} (cargo build --workspace --bins, or set ROLLARC_BIN)")
    work = tmp_path_factory.mktemp("service")
    DATA["dir"] = work / "data"
    log = open(work / "serve.log", "w+")
    proc = subprocess.Popen(
        [binary, "serve", "--addr", "127.0.0.1:0", "--data-dir", str(work / "data")],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        addr = None
        for _ in range(600):
            log.seek(0)
            m = re.search(r"addr=([0-9.:]+)", log.read())
            if m:
                addr = m.group(1)
                break
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        if addr is None:
            log.seek(0)
            pytest.fail(f"rollarc serve did not start:\n{log.read()}")
        yield f"http://{addr}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture()
def data_dir(service: str) -> Path:
    return DATA["dir"]


@pytest.fixture()
def client(service: str) -> Iterator[Client]:
    with Client(service, timeout=60) as c:
        yield c
