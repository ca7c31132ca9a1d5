"""Several router processes on one HTTP port (--router-workers N).

The parent process checks that the port is free (a port another program holds is refused, as with one
process), then starts N workers and does no HTTP itself. Each worker is a whole router: it binds the port
with SO_REUSEPORT (the kernel spreads new connections over the workers), connects to every node under a
routing id of its own, and streams the requests it dispatched (the nodes send each request's events to the
router that dispatched it, and their heartbeats to every router). A worker picks nodes by their heartbeats
and its own requests in flight only.

A worker's life:
1. started (spawned, not forked: no event loop or socket is inherited), it binds, connects, serves;
2. it dies (a crash, a kill): its open connections close, so its clients see their requests fail at
   once; the nodes are not told (a node does not see which router's connection closed), so those
   requests run to their end there and their tokens are dropped. The other workers go on. The parent
   starts it again, unless
   it died within START_GRACE_S of its start MAX_QUICK_DEATHS times in a row (then every worker is
   stopped and the parent exits 1: a worker that cannot start would only be restarted for ever);
3. SIGTERM or SIGINT to the parent goes on to every worker, which drains as one router does; the parent
   exits once they all have.

Metrics: every SHARE_INTERVAL_S each worker writes its metrics (Prometheus text) into a folder the parent made;
/metrics on any worker answers its own, fresh, merged with the others' last (metrics.merge_expositions: summed,
the nodes' figures taken once). A worker started again starts its counts from zero.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import wait

from pdserve.config import RouterConfig
from pdserve.process import die_with_parent

log = logging.getLogger("pdserve.router")
START_GRACE_S = 10.0
MAX_QUICK_DEATHS = 3


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """The HTTP listening socket of one worker: bound with SO_REUSEPORT, beside the other workers'."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def _worker_main(cfg: RouterConfig, index: int, log_level: int, metrics_dir: str) -> None:
    from pdserve.router.server import serve

    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s router worker {index}: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    os.setpgrp()  # a terminal's Ctrl-C reaches the parent only, which passes it on as one SIGTERM (one drain, not two)
    die_with_parent()  # no worker is left serving the port on its own
    serve(cfg, sock=reuse_port_socket(cfg.host, cfg.port), worker=index, metrics_dir=metrics_dir)


class Workers:
    """The parent: starts the workers, starts again those that die, passes its stop signals on."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.mp = multiprocessing.get_context("spawn")
        self.procs: dict[int, multiprocessing.Process] = {}
        self.started: dict[int, float] = {}
        self.quick_deaths = 0
        self.stopping = False
        self.metrics_dir = tempfile.mkdtemp(prefix="pdserve-router-metrics-")

    def _start(self, index: int) -> None:
        proc = self.mp.Process(
            target=_worker_main,
            args=(self.cfg, index, logging.getLogger().level, self.metrics_dir),
            name=f"pdserve-router-{index}",
        )
        proc.start()
        self.procs[index], self.started[index] = proc, time.monotonic()

    def _on_signal(self, *_: object) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()  # SIGTERM: the worker drains

    def run(self) -> int:
        try:
            return self._run()
        finally:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for index in range(self.cfg.router_workers):
            self._start(index)
        log.info("%d router workers on port %d", self.cfg.router_workers, self.cfg.port)
        while any(p.is_alive() for p in self.procs.values()):
            wait([p.sentinel for p in self.procs.values() if p.is_alive()], timeout=0.5)
            if not self.stopping and not self._replace_dead():
                self._on_signal()
                for proc in self.procs.values():
                    proc.join()
                return 1
        return 0

    def _replace_dead(self) -> bool:
        """Start again each worker that died; False once workers keep dying at start."""
        for index, proc in list(self.procs.items()):
            if proc.is_alive() or self.stopping:
                continue
            quick = time.monotonic() - self.started[index] < START_GRACE_S
            self.quick_deaths = self.quick_deaths + 1 if quick else 0
            log.error(
                "router worker %d (pid %d) exited with code %s; %s",
                index,
                proc.pid,
                proc.exitcode,
                "giving up" if self.quick_deaths >= MAX_QUICK_DEATHS else "starting it again",
            )
            if self.quick_deaths >= MAX_QUICK_DEATHS:
                return False
            self._start(index)
        return True
