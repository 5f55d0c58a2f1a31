"""A Spark standalone cluster (one master, one worker) started from the pyspark package.

Both are plain JVM processes (`spark-class ...Master` / `...Worker`) on loopback and free
ports; `close()` stops them. SPARK_LOCAL_IP keeps everything on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pyspark

from tests.support.ports import LOOPBACK, free_port
from tests.support.waiting import wait_until

SPARK_HOME = Path(pyspark.__file__).resolve().parent


def spark_env(workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": LOOPBACK,
        "SPARK_LOG_DIR": str(workdir),
        "SPARK_WORKER_DIR": str(workdir / "work"),
    }


class SparkStandalone:
    def __init__(self, *, cores: int = 1, memory: str = "1g") -> None:
        self.cores = cores
        self.memory = memory
        self.workdir = Path(tempfile.mkdtemp(prefix="relay-spark-"))
        self.port, self.ui_port, self.worker_ui_port = free_port(), free_port(), free_port()
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def master_url(self) -> str:
        return f"spark://{LOOPBACK}:{self.port}"

    def _start(self, name: str, *args: str) -> None:
        with (self.workdir / f"{name}.log").open("ab") as log:  # the child keeps its own copy
            self.processes.append(
                subprocess.Popen(
                    [str(SPARK_HOME / "bin" / "spark-class"), *args],
                    env=spark_env(self.workdir),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def start(self, timeout: float = 90.0) -> SparkStandalone:
        self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--webui-port",
            str(self.ui_port),
        )
        self._start(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            self.master_url,
            "--cores",
            str(self.cores),
            "--memory",
            self.memory,
            "--webui-port",
            str(self.worker_ui_port),
        )
        wait_until(
            lambda: self.alive_workers() >= 1,
            timeout,
            f"a Spark worker registers (logs in {self.workdir})",
            interval=0.5,
        )
        return self

    def alive_workers(self) -> int:
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{self.ui_port}/json/", timeout=2) as r:
                return int(json.load(r).get("aliveworkers", 0))
        except (OSError, ValueError):
            return 0

    def completed_apps(self) -> list[dict]:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.ui_port}/json/", timeout=5) as r:
            return list(json.load(r).get("completedapps", []))

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)
