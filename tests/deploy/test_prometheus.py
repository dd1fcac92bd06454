"""docs/monitoring.md's Prometheus set-up and deploy/grafana/kvpool.json, against a real
Prometheus scraping a real master with a cluster secret.

The token file is written by the doc's own command and the scrape job is the doc's own
YAML block; only the master's address, the file's path, the user the file is handed to
and the interval (1 s, so the test waits seconds, not minutes) are changed.  With them,
every dashboard query must answer with data; the same job without its ``authorization``
lines must be ``down`` with a 401, and so must the job once its file holds another
secret's token.  Prometheus is Debian's (``scripts/setup.sh`` installs it); the test
runs its own, on a free loopback port, its config and storage in tmp_path.
"""

from __future__ import annotations

import copy
import http.client
import json
import math
import os
import pwd
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import yaml

from kvpool.client.client import Client
from kvpool.net import free_port
from kvpool.security.credentials import Credential
from kvpool.testing import lifetime
from kvpool.testing.processes import PoolProcess, start_master
from tests.deploy.doc_commands import bash, for_this_master, kvpool_on_path
from tests.deploy.grafana import dashboard, exprs
from tests.deploy.traffic import master_flags, touch_every_counter
from tests.docs.blocks import doc_block
from tests.master.auth_pool import SECRET, WRONG, secret_file
from tests.waiting import wait_until

WAIT_S = 60.0  # every wait on Prometheus; scrapes are 1 s apart, the 2-core CI is shared
SCRAPE_INTERVAL = "1s"
# Grafana's built-in variables, as a dashboard over the last hour would fill them in
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


def prometheus_path() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail(
            "prometheus is not installed; the scrape config and the dashboard are tested "
            "against a real one. Run scripts/setup.sh (it installs Debian's prometheus) "
            "or apt-get install --no-install-recommends prometheus"
        )
    return path


class Prometheus:
    """A Prometheus of our own: its config, its storage, a free loopback port; stopped by
    its own PID."""

    def __init__(self, config: Path, tmp: Path) -> None:
        executable = prometheus_path()
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log: BinaryIO = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = lifetime.popen(
            [
                executable,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(self._ready, WAIT_S, interval_s=0.2, what="prometheus /-/ready")
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"prometheus exited {self.proc.returncode}: {Path(self.log.name).read_text()}"
            )
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except (OSError, http.client.HTTPException):
            return False

    def api(self, path: str, **params: str) -> Any:
        """``/api/v1/<path>``'s ``data``; the reply's status must be ``success``."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:  # a bad query is a 400 with the reason
            body = json.load(exc)
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def target(self, job: str) -> dict[str, Any]:
        (found,) = [
            t
            for t in self.api("targets", state="active")["activeTargets"]
            if t["labels"]["job"] == job
        ]
        return found

    def wait_for_target(self, job: str, health: str, error: str = "") -> dict[str, Any]:
        """``job``'s target once its last scrape was ``health`` with ``error`` in its
        error (bounded)."""

        def reached() -> dict[str, Any] | None:
            target = self.target(job)
            met = target["health"] == health and error in target["lastError"]
            return target if met else None

        return wait_until(reached, WAIT_S, interval_s=0.2, what=f"{job} {health} {error}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


# ------------------------------------------------------------------ the doc's set-up
def documented(marker: str, lang: str) -> str:
    """docs/monitoring.md's block marked ``<!-- run: marker -->``, of language ``lang``."""
    block = doc_block(marker)
    assert block.doc == "docs/monitoring.md" and block.lang == lang, block.where
    return block.text


@dataclass
class Setup:
    """What an operator would do after reading docs/monitoring.md, for this master."""

    token_command: str  # the doc's command, writing the token to ``token_file``
    token_file: Path
    config: dict[str, Any]  # the doc's scrape job, and the same without its token

    @classmethod
    def from_doc(cls, address: str, secret: Path, tmp: Path) -> Setup:
        (command,) = [
            line
            for line in documented("monitoring.token", "sh").splitlines()
            if "kvpool secret token" in line
        ]
        doc_file = re.search(r"/\S*kvpool\.token", command)
        assert doc_file, f"{command}: writes no kvpool.token file"
        scrape = documented("monitoring.scrape", "yaml")
        assert doc_file[0] in scrape, "the scrape config reads another file than the command writes"
        token_file = tmp / "kvpool.token"
        command = for_this_master(command, address, secret).replace(doc_file[0], str(token_file))
        # the user Prometheus runs as: here, the one running the test (and its Prometheus)
        command = command.replace("-o prometheus", f"-o {pwd.getpwuid(os.geteuid()).pw_name}")
        config = yaml.safe_load(scrape.replace(doc_file[0], str(token_file)))
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [address]}]
        job["scrape_interval"] = SCRAPE_INTERVAL
        bare = copy.deepcopy(job)
        assert bare.pop("authorization", None), "the doc's job sends no token"
        bare["job_name"] = f"{job['job_name']}-no-token"
        config["scrape_configs"].append(bare)
        return cls(command, token_file, config)

    def write_token(self, env: dict[str, str]) -> None:
        """Run the doc's command (``env``: ``kvpool`` on the PATH)."""
        done = bash(self.token_command, env)
        assert done.returncode == 0, f"{self.token_command}: {done.stderr}"

    @property
    def job(self) -> str:
        return str(self.config["scrape_configs"][0]["job_name"])


@dataclass
class Scraped:
    master: PoolProcess
    prometheus: Prometheus
    setup: Setup
    env: dict[str, str]


def samples(prometheus: Prometheus, expr: str) -> list[float]:
    return [float(r["value"][1]) for r in prometheus.query(expr)]


LOOKUP_RATE = 'sum(rate(kvpool_lookups_total{kind="get"}[1m]))'


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    tmp = tmp_path_factory.mktemp("prometheus")
    secret = secret_file(tmp)
    env = kvpool_on_path(tmp / "bin")
    with (
        start_master(*master_flags(tmp / "ssd"), "--secret_file", str(secret)) as master,
        Client(master.address, credential=SECRET, timeout_s=30) as client,
    ):
        touch_every_counter(client, "before")
        setup = Setup.from_doc(master.address, secret, tmp)
        setup.write_token(env)
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(setup.config))
        prometheus = Prometheus(config, tmp)
        try:
            wait_until(
                lambda: samples(prometheus, "kvpool_kv_cache_blocks_total"),
                WAIT_S,
                interval_s=0.2,
                what="a scraped kvpool_kv_cache_blocks_total",
            )
            # traffic between scrapes, so that every rate() of the dashboard has a
            # change to show, not only two equal samples
            touch_every_counter(client, "between")
            wait_until(
                lambda: [v for v in samples(prometheus, LOOKUP_RATE) if v > 0],
                WAIT_S,
                interval_s=0.2,
                what="a get rate above 0",
            )
            yield Scraped(master, prometheus, setup, env)
        finally:
            prometheus.close()


# ------------------------------------------------------------------------- the tests
def for_grafana(expr: str, instance: str) -> str:
    """``expr`` as Grafana sends it: its variables filled in (the ``master`` variable
    with this master's ``instance`` label)."""
    values = {**GRAFANA_VARIABLES, "instance": instance}

    def value(match: re.Match[str]) -> str:
        assert match[1] in values, f"{expr}: no value for ${match[1]}"
        return values[match[1]]

    return re.sub(r"\$\{?(\w+)\}?", value, expr)


def test_the_documented_scrape_is_up_and_every_dashboard_query_answers(
    scraped: Scraped,
) -> None:
    target = scraped.prometheus.wait_for_target(scraped.setup.job, "up")
    assert target["lastError"] == ""
    assert scraped.setup.token_file.stat().st_mode & 0o077 == 0  # the owner's alone
    empty = []
    for title, expr in exprs():
        query = for_grafana(expr, scraped.master.address)
        values = samples(scraped.prometheus, query)  # an error fails in api()
        if not [v for v in values if not math.isnan(v)]:
            empty.append(f"{title}: {query} -> {values}")
    assert not empty, "panels with no data:\n" + "\n".join(empty)


def test_the_master_variable_lists_the_master(scraped: Scraped) -> None:
    (variable,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "instance"]
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()
    found = scraped.prometheus.api(f"label/{label}/values", **{"match[]": metric})
    assert found == [scraped.master.address]


def test_the_hit_ratio_panel_shows_the_ratio_of_its_denominator(scraped: Scraped) -> None:
    (expr,) = [
        e
        for t, e in exprs()
        if "hit ratio" in t.lower() and "[$__range]" in e and "kvpool_hits_total" in e
    ]
    (ratio,) = samples(scraped.prometheus, for_grafana(expr, scraped.master.address))
    assert 0 < ratio < 1  # both rounds hit some keys and missed "absent" and the evicted


def test_the_same_job_without_the_token_is_down_with_a_401(scraped: Scraped) -> None:
    bare = f"{scraped.setup.job}-no-token"
    target = scraped.prometheus.wait_for_target(bare, "down", "401")
    assert target["scrapeUrl"] == f"http://{scraped.master.address}/metrics"
    assert not samples(scraped.prometheus, f'kvpool_kv_cache_blocks_total{{job="{bare}"}}')


def test_a_token_file_of_another_secret_is_a_401_until_the_command_runs_again(
    scraped: Scraped,
) -> None:
    # what a rotation leaves behind: Prometheus reads the file at each scrape
    token_file = scraped.setup.token_file
    stale = token_file.with_suffix(".stale")
    stale.write_text(Credential.parse(WRONG, "k").operator_token() + "\n")
    stale.replace(token_file)
    try:
        scraped.prometheus.wait_for_target(scraped.setup.job, "down", "401")
    finally:
        scraped.setup.write_token(scraped.env)
    scraped.prometheus.wait_for_target(scraped.setup.job, "up")
