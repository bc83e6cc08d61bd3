"""Fixtures: a real S3-compatible server (a single-node Garage on loopback), as the Rust tests
start one (tests/integration/common/garage.rs).

The `garage` binary is found on PATH or in ~/.cargo/bin (`.ci/run` installs it). Where it is
absent the S3 tests are skipped with a message, unless SAVER_REQUIRE_GARAGE=1 (set by `.ci/run`),
which makes its absence a failure.
"""

import ctypes
import os
import secrets
import shutil
import socket
import subprocess
import time

import pytest


def _garage_bin():
    path = os.environ.get("SAVER_GARAGE_BIN") or shutil.which("garage")
    if path is None:
        candidate = os.path.expanduser("~/.cargo/bin/garage")
        path = candidate if os.path.isfile(candidate) else None
    return path


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    # The server dies with the test process, even one that is killed.
    ctypes.CDLL("libc.so.6").prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


@pytest.fixture(scope="session")
def garage(tmp_path_factory):
    """A running Garage with bucket `saver-test`; its credentials are set in this process's
    environment (`AWS_*`), where the native library reads them. Yields `s3://saver-test`."""
    bin = _garage_bin()
    if bin is None:
        if os.environ.get("SAVER_REQUIRE_GARAGE") == "1":
            pytest.fail("SAVER_REQUIRE_GARAGE=1 but no garage binary on PATH or in ~/.cargo/bin")
        pytest.skip("no garage binary (cargo install --locked garage --version 2.5.0)")
    d = tmp_path_factory.mktemp("garage")
    s3, rpc, admin = _free_port(), _free_port(), _free_port()
    config = d / "garage.toml"
    config.write_text(
        f'''metadata_dir = "{d}/meta"
data_dir = "{d}/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:{rpc}"
rpc_public_addr = "127.0.0.1:{rpc}"
rpc_secret = "{secrets.token_hex(32)}"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:{s3}"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:{admin}"
admin_token = "saver-test-admin"
'''
    )
    env = dict(os.environ, RUST_LOG="warn")
    log = open(d / "garage.log", "w")
    server = subprocess.Popen(
        [bin, "-c", str(config), "server"], stdout=log, stderr=log, env=env, preexec_fn=_die_with_parent
    )

    def cli(*args):
        return subprocess.run([bin, "-c", str(config), *args], check=True, capture_output=True, text=True, env=env).stdout

    try:
        deadline = time.monotonic() + 30
        while subprocess.run([bin, "-c", str(config), "status"], capture_output=True, env=env).returncode != 0:
            assert time.monotonic() < deadline, (d / "garage.log").read_text()
            time.sleep(0.1)
        node = cli("node", "id", "-q").strip().split("@")[0]
        cli("layout", "assign", "-z", "dc1", "-c", "1G", node)
        cli("layout", "apply", "--version", "1")
        cli("bucket", "create", "saver-test")
        key = dict(
            (k.strip(), v.strip())
            for k, v in (line.split(":", 1) for line in cli("key", "create", "saver-test-key").splitlines() if ":" in line)
        )
        cli("bucket", "allow", "--read", "--write", "--owner", "saver-test", "--key", "saver-test-key")
        while True:
            try:
                socket.create_connection(("127.0.0.1", s3), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "no S3 port"
                time.sleep(0.05)
        os.environ.update(
            AWS_ACCESS_KEY_ID=key["Key ID"],
            AWS_SECRET_ACCESS_KEY=key["Secret key"],
            AWS_REGION="garage",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3}",
        )
        yield "s3://saver-test"
    finally:
        server.kill()
        server.wait()
        log.close()
