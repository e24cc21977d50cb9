"""The image: Containerfile built with podman on a Debian root made here from Debian's packages
(debootstrap; no registry is reached), then run as a platform team runs it: the config from a
mounted file, as a non-root user, in front of a `bouncer engine` on the host, answering the openai
SDK, and draining on `podman stop` (SIGTERM)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import openai
import pytest
import yaml

from bouncer.config import key_digest
from servers import EngineProcess, free_port, wait_http_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PODMAN = shutil.which("podman")
BASE = "localhost/bouncer-test-base:bookworm"  # kept between runs: debootstrap takes a minute or two
IMAGE = "localhost/bouncer:test"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """podman as this machine needs it: rootful, runc (crun refuses its mixed cgroup v1/v2
    mounts), no default ulimits (raising RLIMIT_NPROC is not permitted here). Elsewhere plain
    `podman` or `docker` does."""
    conf = os.path.join(tempfile.gettempdir(), "bouncer-test-containers.conf")
    with open(conf, "w") as f:
        f.write("[containers]\ndefault_ulimits = []\n")
    out = subprocess.run([PODMAN, "--runtime", "runc", *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "CONTAINERS_CONF": conf})
    if check and out.returncode != 0:
        pytest.fail(f"podman {' '.join(args[:2])} failed ({out.returncode}):\n"
                    f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def debian_base() -> None:
    """A Debian bookworm root from Debian's own packages, imported as BASE (once per machine)."""
    if podman("image", "exists", BASE, check=False).returncode == 0:
        return
    debootstrap = shutil.which("debootstrap")
    assert debootstrap, "debootstrap missing: `make system-tools` installs it"
    root = tempfile.mkdtemp(prefix="bouncer-debian-")
    try:
        made = subprocess.run([debootstrap, "--variant=minbase", "bookworm", root, "http://deb.debian.org/debian"],
                              capture_output=True, text=True, timeout=900)
        assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):  # the .debs it fetched: 100 MB
            subprocess.run(["find", os.path.join(root, leftover), "-type", "f", "-delete"], check=True)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        conf = os.path.join(tempfile.gettempdir(), "bouncer-test-containers.conf")
        imported = subprocess.run([PODMAN, "import", "-", BASE], stdin=tar.stdout, capture_output=True, text=True,
                                  env={**os.environ, "CONTAINERS_CONF": conf}, timeout=600)
        tar.wait()
        assert imported.returncode == 0, imported.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_the_image_builds_runs_as_non_root_serves_and_drains(tmp_path):
    assert PODMAN, "podman missing: `make system-tools` installs Debian's podman"
    debian_base()
    build = ["build", "--network", "host", "--build-arg", f"BASE={BASE}", "-t", IMAGE, "-f", "Containerfile"]
    if os.path.exists(HOST_CA):  # this machine reaches PyPI through a TLS-inspecting proxy
        build += ["--build-arg", "PIP_CERT=/run/ca.crt", "--volume", f"{HOST_CA}:/run/ca.crt:ro"]
    podman(*build, ROOT, timeout=1200)

    # what went in: the package and its runtime dependencies, not the test extras
    pkgs = podman("run", "--rm", "--entrypoint", "/opt/bouncer/bin/pip", IMAGE, "list", "--format", "freeze").stdout
    names = {line.split("==")[0].lower() for line in pkgs.splitlines()}
    assert {"bouncer", "aiohttp", "dnspython", "grpcio"} <= names
    assert not names & {"pytest", "hypothesis", "ruff", "mkdocs", "matplotlib", "openai", "schemathesis",
                        "xds-protos"}
    assert podman("image", "inspect", "--format", "{{.Config.User}}", IMAGE).stdout.strip() == "10001:10001"
    # tracing's exporter loads, from a plain `pip install` (no package ships opentelemetry-proto's modules over it)
    podman("run", "--rm", "--entrypoint", "/opt/bouncer/bin/python", IMAGE, "-c",
           "from bouncer.gateway.tracing import protos_overwritten; assert protos_overwritten() is None; "
           "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter")

    engine = EngineProcess()
    port = free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port, "drain_s": 20},
              "tenants": [{"name": "t", "api_keys_sha256": [key_digest("t")]}],
              "models": [{"name": "demo-llm", "backends": [{"url": engine.url}]}]}
    (tmp_path / "bouncer.yaml").write_text(yaml.safe_dump(config))
    os.chmod(tmp_path, 0o755)  # readable by the container's user
    os.chmod(tmp_path / "bouncer.yaml", 0o644)
    name = f"bouncer-test-{port}"
    podman("run", "-d", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp",
           "-v", f"{tmp_path / 'bouncer.yaml'}:/etc/bouncer/bouncer.yaml:ro", IMAGE)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http_ok(base + "/ready", timeout=60)
        assert podman("exec", name, "id", "-u").stdout.strip() == "10001"
        client = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0)
        answer = client.chat.completions.create(model="demo-llm", max_tokens=8,
                                                messages=[{"role": "user", "content": "hi from outside"}])
        assert answer.choices[0].message.content
        stream = client.chat.completions.create(model="demo-llm", max_tokens=8, stream=True,
                                                messages=[{"role": "user", "content": "and streamed"}])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        podman("stop", "-t", "30", name)  # SIGTERM: nothing held, so it exits at once, with 0
        assert podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"
        logs = podman("logs", name).stdout + podman("logs", name).stderr
        assert "msg=stopped" in logs and "outcome=completed" in logs
    finally:
        podman("rm", "-f", name, check=False)
        podman("image", "prune", "-f", check=False)  # the build this one replaced: 0.5 GB a run otherwise
        engine.stop()
